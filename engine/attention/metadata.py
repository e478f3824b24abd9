"""What one forward step tells the attention layers about its tokens (built by the ModelRunner).

Tokens of all scheduled requests are flattened into one batch of T rows:

    request:        r0            r1                 r2
    rows:       [ q q q q | q | q q q ]           query_start_loc = [0, 4, 5, 8]
    context:    r0 has seq_lens[0] tokens in the cache after this step; its rows are the queries at
                `positions` (not necessarily the last ones: PCP ranks own two chunks of a prompt).

`slot_mapping[t]` is where row t's KV is written (global slot = block * block_size + offset; -1: don't
write). `block_table[b]` lists request b's blocks; position p of request b lives in slot
`block_table[b, p // block_size] * block_size + p % block_size`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch

T = TypeVar("T")


@dataclass
class AttnMetadata:
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_table: torch.Tensor  # [B, max_blocks] int32
    token_req_idx: torch.Tensor  # [T] int32: which request each row belongs to
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    block_size: int
    req_ids: list[str] | None = None  # the batch's request ids (backends keeping per-request state)
    # the wrapping backends' per-forward state, each under its own typed key (ForwardSlot), set by the
    # backend's metadata builder or begin_forward: attention itself names no backend
    backend_state: dict[str, object] = field(default_factory=dict)
    # graph-captured steps: launches must not depend on this step's host lists; a backend that can
    # (graph_safe) sizes its work by this bound on every seq len instead (None: use the lists)
    max_seq_len_bound: int | None = None

    def __post_init__(self):
        # a copy (dataclasses.replace) starts with the same slots but sets its own, as a field would
        self.backend_state = dict(self.backend_state)

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)

    def context_slots(self, req_idx: int, length: int | None = None) -> torch.Tensor:
        """Slots of positions [0, length) of one request (length defaults to its seq_len)."""
        n = self.seq_lens_cpu[req_idx] if length is None else length
        pos = torch.arange(n, device=self.block_table.device)
        return positions_to_slots(self.block_table[req_idx], pos, self.block_size)


class ForwardSlot(Generic[T]):
    """A wrapping backend's typed place on a forward's metadata: the backend that owns it declares one
    (`STEP = ForwardSlot[CPStep]("cp")`) and reads back what its builder or begin_forward put there.
    A copy of the metadata (`dataclasses.replace`) starts with the same values; setting one on either
    does not change the other, as with an ordinary field."""

    def __init__(self, name: str):
        self.name = name

    def get(self, meta: AttnMetadata) -> T | None:
        return meta.backend_state.get(self.name)  # type: ignore[return-value]

    def put(self, meta: AttnMetadata, value: T | None) -> None:
        meta.backend_state[self.name] = value

    def __repr__(self) -> str:
        return f"ForwardSlot({self.name!r})"


def positions_to_slots(block_row: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Request-local positions (any shape, -1 = none) -> global slots (-1 kept)."""
    valid = positions >= 0
    p = positions.clamp(min=0).long()
    slots = block_row.long()[p // block_size] * block_size + p % block_size
    return torch.where(valid, slots, torch.full_like(slots, -1))


def build_metadata(*, positions: list[int], slot_mapping: list[int], query_lens: list[int], seq_lens: list[int],
                   block_tables: list[list[int]], block_size: int, device: torch.device | str) -> AttnMetadata:
    """Host lists -> device tensors. Used by the runner and by tests."""
    meta, _ = pack_metadata(positions=positions, slot_mapping=slot_mapping, query_lens=query_lens,
                            seq_lens=seq_lens, block_tables=block_tables, block_size=block_size, device=device)
    return meta


def pack_metadata(*, positions: list[int], slot_mapping: list[int], query_lens: list[int], seq_lens: list[int],
                  block_tables: list[list[int]], block_size: int, device: torch.device | str,
                  extras: tuple[list[int], ...] = ()) -> tuple[AttnMetadata, list[torch.Tensor]]:
    """Host lists (and `extras`, int lists returned as device int64 tensors) -> device tensors through one
    host buffer, pinned on CUDA, in one non-blocking copy: a prefill step's metadata never waits for the
    GPU (a pageable copy would wait for everything queued before it)."""
    device = torch.device(device)
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    width = max((len(b) for b in block_tables), default=1) or 1
    table = [x for row in block_tables for x in list(row) + [0] * (width - len(row))]
    req_idx = [b for b, n in enumerate(query_lens) for _ in range(n)]
    parts = [positions, slot_mapping, qsl, list(seq_lens), table, req_idx, *extras]
    host = torch.tensor([x for part in parts for x in part], dtype=torch.int64)
    if device.type == "cuda":
        host = host.pin_memory()
    flat = host.to(device, non_blocking=True)
    views, at = [], 0
    for part in parts:
        views.append(flat[at: at + len(part)])
        at += len(part)
    pos, slots, qsl_t, lens_t, table_t, req_t, *extra_t = views
    i32 = torch.int32
    meta = AttnMetadata(positions=pos, slot_mapping=slots, query_start_loc=qsl_t.to(i32), seq_lens=lens_t.to(i32),
                        block_table=table_t.view(len(block_tables), width).to(i32), token_req_idx=req_t.to(i32),
                        query_start_loc_cpu=qsl, seq_lens_cpu=list(seq_lens), block_size=block_size)
    return meta, extra_t
