"""Sampling parameters, with vLLM's names and meanings; validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.structured.spec import StructuredOutputSpec

MAX_LOGPROBS = 20
# A temperature in (0, MIN_TEMPERATURE) is raised to it (vLLM does the same): dividing float32 logits by a
# smaller one overflows to inf and the softmax to NaN.
MIN_TEMPERATURE = 1e-2


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-n logprobs per generated token (plus the sampled token's)
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_tokens: int = 0
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputSpec | None = None  # the output must match this grammar

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1,
               f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        _check(all(math.isfinite(v) for v in (self.temperature, self.top_p, self.min_p, self.repetition_penalty,
                                              self.frequency_penalty, self.presence_penalty)),
               "temperature, top_p, min_p and the penalties must be finite numbers")
        _check(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}")
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 0),
               f"top_k must be -1 (off) or >= 0, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
               f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        _check(self.repetition_penalty > 0.0, f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        _check(-2.0 <= self.frequency_penalty <= 2.0,
               f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        _check(-2.0 <= self.presence_penalty <= 2.0,
               f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        _check(0 <= self.min_tokens <= self.max_tokens, f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids must be ints >= 0")
        _check(self.seed is None or isinstance(self.seed, int), f"seed must be an integer, got {self.seed!r}")
        _check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputSpec),
               "structured_outputs must be a StructuredOutputSpec")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)
