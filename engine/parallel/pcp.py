"""Prefill context parallelism: which query rows each rank computes (DualChunkSwap; docs/parallelism.md, "PCP").

A request's new tokens in a step are cut into 2N chunks of ceil(n / 2N) rows; rank r computes chunks
r and 2N-1-r, so every rank gets one early (cheap, short causal context) and one late (expensive)
chunk and the causal work is balanced:

    new tokens:  | c0 | c1 | c2 | c3 |        N = 2 (the last chunks may be short or empty)
    rank 0:        c0             c3
    rank 1:             c1   c2

Positions stay global. Rows of all requests of a step are flattened in request order ("step rows");
a rank computes its own rows (ascending) and the gathers below put every rank's rows back in step
order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.parallel.dist import RankComm


def dualchunk_ranges(num_tokens: int, pcp_size: int, rank: int) -> list[tuple[int, int]]:
    """Row ranges [lo, hi) of a request's `num_tokens` new tokens that `rank` computes (non-empty only)."""
    if not 0 <= rank < pcp_size:
        raise ValueError(f"rank {rank} outside PCP size {pcp_size}")
    size = -(-num_tokens // (2 * pcp_size))
    out = []
    for k in (rank, 2 * pcp_size - 1 - rank):
        lo, hi = min(k * size, num_tokens), min((k + 1) * size, num_tokens)
        if hi > lo:
            out.append((lo, hi))
    return out


@dataclass
class RowPlan:
    """Rows of one forward pass split over the ranks.

    `rows_of_rank[k]` are the step rows rank k computes, ascending. A gather of every rank's rows padded
    to `max_rows` gives [world * max_rows, ...]; `gather_index[i]` is where step row i sits in it.
    """

    rank: int
    num_rows: int
    rows_of_rank: list[list[int]]
    max_rows: int
    gather_index: torch.Tensor  # [num_rows] int64

    @property
    def own_rows(self) -> list[int]:
        return self.rows_of_rank[self.rank]

    @property
    def num_own(self) -> int:
        return len(self.rows_of_rank[self.rank])

    @classmethod
    def from_owners(cls, rows_of_rank: list[list[int]], rank: int, device: torch.device | str) -> RowPlan:
        max_rows = max((len(r) for r in rows_of_rank), default=0)
        num_rows = sum(len(r) for r in rows_of_rank)
        index = [0] * num_rows
        for k, rows in enumerate(rows_of_rank):
            for j, row in enumerate(rows):
                index[row] = k * max_rows + j
        return cls(rank, num_rows, rows_of_rank, max_rows, torch.tensor(index, dtype=torch.int64, device=device))

    def subset(self, rows: list[int]) -> RowPlan:
        """The plan of a subset of step rows (given ascending), renumbered 0..len(rows)-1."""
        new_id = {row: i for i, row in enumerate(rows)}
        owners = [[new_id[r] for r in mine if r in new_id] for mine in self.rows_of_rank]
        return RowPlan.from_owners(owners, self.rank, self.gather_index.device)

    def gather(self, comm: RankComm, own: torch.Tensor, tag: str) -> torch.Tensor:
        """This rank's rows [num_own, ...] -> every row in step order [num_rows, ...] (same on all ranks)."""
        assert own.shape[0] == self.num_own, f"expected {self.num_own} own rows, got {own.shape[0]}"
        if self.max_rows == 0:
            return own.new_empty((0, *own.shape[1:]))
        gathered = comm.all_gather_padded(own, self.max_rows, tag)
        return gathered.flatten(0, 1)[self.gather_index]


def plan_step_rows(rows_per_request: list[int], pcp_size: int, rank: int, device: torch.device | str) -> RowPlan:
    """DualChunkSwap of every request's rows of one forward (requests in step order)."""
    owners: list[list[int]] = [[] for _ in range(pcp_size)]
    base = 0
    for n in rows_per_request:
        for k in range(pcp_size):
            for lo, hi in dualchunk_ranges(n, pcp_size, k):
                owners[k].extend(range(base + lo, base + hi))
        base += n
    for rows in owners:
        rows.sort()
    return RowPlan.from_owners(owners, rank, device)
