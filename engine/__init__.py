"""pdserve's model runtime: config, model, paged KV, scheduler, runner, offline and async APIs."""

from __future__ import annotations

__all__ = ["LLM", "SamplingParams", "RequestOutput", "AsyncEngine"]


def __getattr__(name: str):
    # Lazy, each of them: `import engine.settings` (the kernels) or `engine.config.model_config` (planners, tools)
    # must not build the whole runtime, and `from engine import LLM` builds only what LLM needs.
    if name == "LLM":
        from engine.frontend.llm import LLM  # lazy: above
        return LLM
    if name == "SamplingParams":
        from engine.core.sampling_params import SamplingParams  # lazy: above
        return SamplingParams
    if name == "RequestOutput":
        from engine.frontend.outputs import RequestOutput  # lazy: above
        return RequestOutput
    if name == "AsyncEngine":
        from engine.frontend.async_engine import AsyncEngine  # lazy: above
        return AsyncEngine
    raise AttributeError(name)
