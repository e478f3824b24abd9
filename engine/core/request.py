"""A request as the scheduler sees it: token ids and progress counters, no tensors.

    all_token_ids:  [ prompt ............ | outputs ...... ]
    computed:       [ KV in cache ......... )                  num_computed_tokens
    to schedule:                          [ ...... )( drafts )  num_tokens - num_computed (+ spec)
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.core.sampling_params import SamplingParams
from engine.kv.hashing import block_hashes


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"  # decode side: KV is being pulled from a prefill engine
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclass
class Request:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    return_prompt_logits: bool = False
    # Prefill service: keep the KV after finishing, for a decode engine to pull.
    hold_kv_on_finish: bool = False
    # Decode service: the prompt's KV arrives from outside (status WAITING_FOR_KV until kv_ready).
    remote_kv: bool = False

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first scheduling (-1: not yet looked up)
    spec_token_ids: list[int] = field(default_factory=list)  # drafts to verify in the next step
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    # the newest chunk scheduled whose result has not been applied yet (a ScheduledChunk): with async
    # scheduling the next step is planned while this one runs (engine/core/async_scheduler.py)
    inflight: object | None = None
    _hashes: list[bytes] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def block_hashes(self, block_size: int) -> list[bytes]:
        """Chained hashes of every full block of the current tokens (extended incrementally)."""
        n_full = self.num_tokens // block_size
        if len(self._hashes) < n_full:
            parent = self._hashes[-1] if self._hashes else None
            self._hashes.extend(block_hashes(self.all_token_ids, block_size, self.cache_salt, parent=parent,
                                             start_block=len(self._hashes)))
        return self._hashes[:n_full]
