"""The KV export hook: where a request's KV lives across the ranks (used by the prefill service's
NIXL transfer). Pure arithmetic over the request's block ids — the ranks need not be asked.

Block ids are *virtual* under DCP = N: id b is local block b on every rank, holding that rank's share of
64·N tokens. Token i lives on rank (i // I) % N at local slot block_ids[j // 64]·64 + j % 64 with
j = (i // (I·N))·I + i % I. With DCP = 1 every rank holds a full replica (PCP writes all rows
everywhere); the map then names rank 0 and `replicated` is True.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.parallel.dcp import token_locations


@dataclass(frozen=True)
class KVPageMap:
    req_id: str
    num_tokens: int  # tokens with KV in the cache (the computed ones)
    block_ids: tuple[int, ...]  # local block ids, the same on every rank
    block_size: int
    dcp_size: int
    interleave: int
    world_size: int

    @property
    def replicated(self) -> bool:
        return self.dcp_size == 1 and self.world_size > 1

    def token_locations(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(rank [L], local slot [L]) of every token, int64."""
        return token_locations(self.num_tokens, list(self.block_ids), self.dcp_size, self.interleave,
                               self.block_size)

    def rank_tokens(self, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(global positions, local slots) of the tokens `rank` holds, ascending."""
        ranks, slots = self.token_locations()
        mine = torch.ones_like(ranks, dtype=torch.bool) if self.replicated else ranks == rank
        return torch.nonzero(mine).flatten(), slots[mine]

    def rank_blocks(self, rank: int) -> list[int]:
        """Local block ids on `rank` that hold at least one of the request's tokens."""
        _, slots = self.rank_tokens(rank)
        return sorted(set((slots // self.block_size).tolist()))
