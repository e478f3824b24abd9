"""What users get back: a RequestOutput per request (cumulative) with the latest delta."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_generated: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        if self.finished_time is None or self.first_token_time is None or self.num_generated < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.num_generated - 1)


@dataclass
class RequestOutput:
    req_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_text: str = ""
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    prompt_logits: object | None = None  # [len, vocab] tensor when asked for (LLM.prompt_logits)
    step_time: float | None = None  # AsyncEngine: when the engine step that produced this delta returned (monotonic)
    # AsyncEngine, on a finished request whose KV the engine holds for export: its ranks and blocks (KVExport),
    # read in the step that finished it
    kv_exports: list | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
