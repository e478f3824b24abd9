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
    generator: torch.Generator | None  # seeded requests: reproducible, independent of the batch
    draft_generator: torch.Generator | None
    draft_probs: torch.Tensor | None = None  # [k, vocab] distribution each pending draft was drawn from
    grammar: object | None = None  # engine.structured.RequestGrammar when the output is constrained
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_new(cls, d: NewRequestData, device: torch.device) -> RunnerRequest:
        seed = d.sampling_params.seed
        gen = dgen = None
        if seed is not None:
            gen = torch.Generator(device=device)
            gen.manual_seed(seed)
            dgen = torch.Generator(device=device)
            dgen.manual_seed(seed ^ 0x5EED)
        return cls(req_id=d.req_id, prompt_token_ids=list(d.prompt_token_ids),
                   output_token_ids=list(d.output_token_ids), sampling_params=d.sampling_params,
                   block_ids=list(d.block_ids), return_prompt_logits=d.return_prompt_logits,
                   generator=gen, draft_generator=dgen)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids
