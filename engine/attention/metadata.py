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

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.hisparse.forward import ForwardState
    from engine.parallel.step import CPStep


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
    # per-forward state of the wrapping backends, typed (set by the builder / begin_forward)
    req_ids: list[str] | None = None  # the batch's request ids (backends keeping per-request state)
    hisparse: ForwardState | None = None  # HiSparse: this forward's routing, plans and copies
    cp: CPStep | None = None  # context parallelism: this rank's plan of the step
    # graph-captured steps: launches must not depend on this step's host lists; a backend that can
    # (graph_safe) sizes its work by this bound on every seq len instead (None: use the lists)
    max_seq_len_bound: int | None = None

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


def positions_to_slots(block_row: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Request-local positions (any shape, -1 = none) -> global slots (-1 kept)."""
    valid = positions >= 0
    p = positions.clamp(min=0).long()
    slots = block_row.long()[p // block_size] * block_size + p % block_size
    return torch.where(valid, slots, torch.full_like(slots, -1))


def build_metadata(*, positions: list[int], slot_mapping: list[int], query_lens: list[int], seq_lens: list[int],
                   block_tables: list[list[int]], block_size: int, device: torch.device | str) -> AttnMetadata:
    """Host lists -> device tensors (one copy each). Used by the runner and by tests."""
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    width = max((len(b) for b in block_tables), default=1) or 1
    table = torch.zeros((len(block_tables), width), dtype=torch.int32)
    for i, row in enumerate(block_tables):
        if row:
            table[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
    req_idx = torch.repeat_interleave(torch.arange(len(query_lens), dtype=torch.int32),
                                      torch.tensor(query_lens, dtype=torch.int64))
    return AttnMetadata(
        positions=torch.tensor(positions, dtype=torch.int64).to(device),
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64).to(device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32).to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device),
        block_table=table.to(device),
        token_req_idx=req_idx.to(device),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=list(seq_lens),
        block_size=block_size,
    )
