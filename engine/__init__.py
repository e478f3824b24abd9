"""pdserve's model runtime: config, model, paged KV, scheduler, runner, offline and async APIs."""

from __future__ import annotations

__all__ = ["LLM", "SamplingParams", "RequestOutput", "AsyncEngine"]


def __getattr__(name: str):
    # Lazy so that `import engine.config.model` (planners, tools) does not build the whole runtime.
    if name in ("LLM",):
        from engine.frontend.llm import LLM
        return LLM
    if name in ("SamplingParams",):
        from engine.core.sampling_params import SamplingParams
        return SamplingParams
    if name in ("RequestOutput",):
        from engine.frontend.outputs import RequestOutput
        return RequestOutput
    if name in ("AsyncEngine",):
        from engine.frontend.async_engine import AsyncEngine
        return AsyncEngine
    raise AttributeError(name)
