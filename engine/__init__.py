"""pdserve's model runtime: config, model, paged KV, scheduler, runner, offline and async APIs."""

from __future__ import annotations

__all__ = ["LLM", "SamplingParams", "RequestOutput", "AsyncEngine"]


def __getattr__(name: str):
    # Lazy so that `import engine.config` (planners, tools) does not build the whole runtime.
    if name in ("LLM",):
        from engine.llm import LLM
        return LLM
    if name in ("SamplingParams",):
        from engine.sampling_params import SamplingParams
        return SamplingParams
    if name in ("RequestOutput",):
        from engine.outputs import RequestOutput
        return RequestOutput
    if name in ("AsyncEngine",):
        from engine.async_engine import AsyncEngine
        return AsyncEngine
    raise AttributeError(name)
