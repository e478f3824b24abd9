"""The two contracts between scheduler and runner (docs/conventions.md, "Architecture"): plain data, no tensors.

A request is sent in full the first time it is scheduled (or after a preemption); afterwards only
its diffs: new block ids and the tokens to compute in this step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.sampling_params import SamplingParams
from engine.kv.offload import KVCopy


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty after a preemption (recompute keeps what was generated)
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # prefix-cache hit (or imported KV)
    return_prompt_logits: bool = False


@dataclass
class ScheduledChunk:
    """What to compute for one request in this step."""

    req_id: str
    start: int  # position of the first token computed now (== num_computed_tokens)
    token_ids: list[int]  # tokens at positions [start, start + len): prompt/outputs, then drafts
    num_draft_tokens: int  # how many of token_ids are speculative drafts to verify
    sample: bool  # the chunk reaches the end of the known tokens: sample (and verify drafts)
    new_block_ids: list[int] = field(default_factory=list)
    # for MTP: the token that follows the chunk when it is known (prompt continues), else None
    next_token_id: int | None = None
    # how many drafts to propose for the next step (0: no room left, not speculating, or mid-prompt)
    max_drafts: int = 0
    # async scheduling: the previous step, still running, decides this chunk's tokens (its last sampled
    # token, then its drafts) and where it starts. token_ids are then -1 (their number is known) and `start`
    # is an upper bound; the runner takes both from that step's outputs (docs/async_scheduling.md)
    placeholder: bool = False


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    chunks: list[ScheduledChunk] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)  # runner drops their state
    preempted_req_ids: list[str] = field(default_factory=list)
    # KV offload tier copies (engine/kv/offload.py), in order, run before anything else in the step
    kv_copies: list[KVCopy] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass
class SampledOutput:
    token_ids: list[int]  # accepted drafts + one sampled token (empty for a partial prefill chunk)
    logprobs: list[dict[int, float]] | None = None  # per emitted token: id -> logprob (top-n + sampled)
    num_drafts: int = 0
    num_accepted: int = 0
    grammar_terminated: bool = False  # the structured output is complete: the request stops


@dataclass
class RunnerOutput:
    sampled: dict[str, SampledOutput] = field(default_factory=dict)
    drafts: dict[str, list[int]] = field(default_factory=dict)  # MTP proposals for the next step
    prompt_logits: dict[str, object] = field(default_factory=dict)  # req_id -> [n, vocab] tensor chunk
