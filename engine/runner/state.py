"""What the runner remembers about each request between steps (it receives only diffs)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.core.sampling_params import SamplingParams
from engine.core.scheduler_output import NewRequestData


@dataclass
class RunnerRequest:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    return_prompt_logits: bool
    draft_probs: torch.Tensor | None = None  # [k, vocab] distribution each pending draft was drawn from
    grammar: object | None = None  # engine.structured.RequestGrammar when the output is constrained
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_new(cls, d: NewRequestData, device: torch.device) -> RunnerRequest:
        """(A seeded request needs no state of its own to sample reproducibly: its draws are keyed on the
        seed and the position, engine/runner/sampler.py.)"""
        return cls(req_id=d.req_id, prompt_token_ids=list(d.prompt_token_ids),
                   output_token_ids=list(d.output_token_ids), sampling_params=d.sampling_params,
                   block_ids=list(d.block_ids), return_prompt_logits=d.return_prompt_logits)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids
