"""Where a request's KV lives across the ranks of a multi-rank engine, worked out independently of the
ranks (pure arithmetic over the request's block ids), and each rank's raw cache rows: the CP tests compare
the two, and the rows with the single-rank engine's.

Block ids are *virtual* under DCP = N: id b is local block b on every rank, holding that rank's share of
64·N tokens. Token i lives on rank (i // I) % N at local slot block_ids[j // 64]·64 + j % 64 with
j = (i // (I·N))·I + i % I. With DCP = 1 every rank holds a full replica (PCP writes all rows
everywhere); the map then names rank 0 and `replicated` is True.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.parallel.dcp import token_locations
from kernels.formats import read_index_rows


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


def kv_page_map(core, req_id: str) -> KVPageMap:
    """The map of a held (or running) request of a MultiRankEngineCore."""
    req = core.scheduler.held.get(req_id) or core.scheduler.requests.get(req_id)
    if req is None:
        raise KeyError(f"request {req_id!r} is neither held nor running")
    pc = core.cfg.parallel
    return KVPageMap(req_id, req.num_computed_tokens, tuple(core.kv.block_ids(req_id)), core.cfg.cache.block_size,
                     pc.decode_context_parallel_size, pc.cp_kv_cache_interleave_size, pc.world_size)


def read_kv_rows(runner, block_ids: list[int], num_tokens: int) -> dict:
    """On every rank (collective_rpc): the rank's part of a request's KV as the rank itself places it,
    {rank, block_ids (local blocks holding any of its tokens), positions [n] (global tokens held here,
    ascending), slots [n]}, plus the raw cache rows at those slots: mla [n, mla layers, row] and
    index [n, index layers, row] (each token's logical key row; CPU tensors)."""
    ranks, slots = token_locations(num_tokens, block_ids, runner.dcp_size, runner.interleave, runner.block_size)
    mine = (ranks == runner.rank) if runner.dcp_size > 1 else torch.ones_like(ranks, dtype=torch.bool)
    pos, slots = torch.nonzero(mine).flatten(), slots[mine]
    bs = runner.block_size
    s = slots.to(runner.kv_cache.device)
    return {"rank": runner.rank, "block_ids": sorted(set((slots // bs).tolist())), "positions": pos.tolist(),
            "slots": slots.tolist(), "mla": runner.kv_cache.mla[s // bs, :, s % bs].cpu(),
            "index": read_index_rows(runner.kv_cache.index, s // bs, s % bs).cpu()}


def rank_kv_rows(core, req_id: str) -> list[dict]:
    """Every rank's `read_kv_rows` of a request, by rank."""
    m = kv_page_map(core, req_id)
    return core.collective_rpc(read_kv_rows, list(m.block_ids), m.num_tokens)


def write_kv_blocks(runner, rank: int, block_ids: list[int], mla: torch.Tensor, index: torch.Tensor) -> bool:
    """On every rank (collective_rpc): rank `rank` copies whole blocks (mla [n, ...], index [n, ...], as
    `PagedKVCache` lays them out) into its cache at `block_ids`, as a KV pull would; True where it did."""
    if runner.rank != rank:
        return False
    cache = runner.kv_cache
    ids = torch.tensor(block_ids, dtype=torch.long)
    cache.mla[ids.to(cache.mla.device)] = mla.to(cache.mla.device)
    cache.index[ids.to(cache.index.device)] = index.to(cache.index.device)
    return True


def read_kv_blocks(runner, rank: int, block_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """On every rank (collective_rpc): rank `rank`'s whole blocks (mla, index; CPU copies), None elsewhere."""
    if runner.rank != rank:
        return None
    cache = runner.kv_cache
    return cache.mla[block_ids].cpu(), cache.index[block_ids].cpu()
