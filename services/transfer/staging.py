"""KV through rank 0: whole 64-token blocks (what a kvstore holds) to and from DCP-sharded ranks.

With DCP = N every rank holds its share of each virtual block (`engine.parallel.dcp.token_locations`); a
kvstore block is the 64 tokens of one block, whole. Rank 0 keeps a staging cache of whole blocks (the
prefill's NIXL agent registers it, services/transfer/prefix.py):

    gather   tokens [first, first + n) of a request, from the ranks holding them -> staging blocks 0..n/64-1
    scatter  staging blocks 0..n/64-1 -> tokens [first, first + n) of a request, on the ranks holding them

These run on every rank of the engine (`collective_rpc(gather, ...)`) over the data group.
Every rank computes the same token -> (rank, slot) map, so the collectives' shapes agree without an
exchange. Rows move as bytes: any cache dtype, any backend. Index keys are block-major inside a block
(docs/kv-formats.md), so a token's key is read and written through `kernels.formats`, never as the
[block, :, token] entry.
"""

from __future__ import annotations

import torch

from engine.kv.cache import PagedKVCache
from engine.parallel.dcp import token_locations
from kernels.formats import read_index_rows, write_index_rows


def ensure(runner, num_blocks: int) -> int:
    """Rank 0: a staging cache of `num_blocks` whole blocks (`runner.kv_staging`); other ranks hold none."""
    if runner.comm.world_size != runner.dcp_size:
        raise RuntimeError(f"KV staging needs one DCP rank per engine rank (world {runner.comm.world_size}, "
                           f"DCP {runner.dcp_size})")
    staging = getattr(runner, "kv_staging", None)
    if runner.rank == 0 and (staging is None or staging.num_blocks != num_blocks):
        runner.kv_staging = PagedKVCache(runner.spec, num_blocks, runner.kv_cache.device)
    return num_blocks


def _read(cache: torch.Tensor, name: str, slots: torch.Tensor, bs: int) -> torch.Tensor:
    """Token rows [n, layers, row] of `cache` ("mla" or "index") at slots."""
    if name == "index":
        return read_index_rows(cache, slots // bs, slots % bs)
    return cache[slots // bs, :, slots % bs]


def _write(cache: torch.Tensor, name: str, slots: torch.Tensor, bs: int, rows: torch.Tensor) -> None:
    if name == "index":
        write_index_rows(cache, slots // bs, slots % bs, rows)
    else:
        cache[slots // bs, :, slots % bs] = rows


def _locations(runner, block_ids: list[int], first: int, num_tokens: int):
    bs = runner.block_size
    if first % bs or num_tokens % bs:
        raise ValueError(f"staged KV moves whole blocks: first {first} and {num_tokens} tokens must be multiples "
                         f"of {bs}")
    staging = getattr(runner, "kv_staging", None)
    if runner.rank == 0 and (staging is None or staging.num_blocks * bs < num_tokens):
        raise ValueError(f"{num_tokens} tokens exceed the staging cache: call ensure() with more blocks")
    ranks, slots = token_locations(first + num_tokens, list(block_ids), runner.dcp_size, runner.interleave, bs)
    return ranks[first:], slots[first:]


def gather(runner, block_ids: list[int], first: int, num_tokens: int) -> int:
    """Tokens [first, first + num_tokens) of the request holding `block_ids` -> rank 0's staging, in order."""
    ranks, slots = _locations(runner, block_ids, first, num_tokens)
    if num_tokens == 0:
        return 0
    bs, dev = runner.block_size, runner.kv_cache.device
    per_rank = [torch.nonzero(ranks == r).flatten() for r in range(runner.comm.world_size)]
    max_rows = max(len(t) for t in per_rank)
    mine = slots[per_rank[runner.rank]].to(dev)
    for name in ("mla", "index"):
        cache = getattr(runner.kv_cache, name)
        rows = _read(cache, name, mine, bs).contiguous()
        got = runner.comm.all_gather_padded(rows.view(torch.uint8), max_rows, "kv_stage")
        if runner.rank == 0:
            out = getattr(runner.kv_staging, name)
            for r, tok in enumerate(per_rank):
                _write(out, name, tok.to(dev), bs, got[r, : len(tok)].view(cache.dtype))
    return num_tokens


def scatter(runner, block_ids: list[int], first: int, num_tokens: int) -> int:
    """Rank 0's staging blocks -> tokens [first, first + num_tokens) of the request holding `block_ids`."""
    ranks, slots = _locations(runner, block_ids, first, num_tokens)
    if num_tokens == 0:
        return 0
    bs, dev = runner.block_size, runner.kv_cache.device
    mine = torch.nonzero(ranks == runner.rank).flatten()
    t, s = mine.to(dev), slots[mine].to(dev)
    for name in ("mla", "index"):
        cache = getattr(runner.kv_cache, name)
        shape = (num_tokens, cache.shape[1], cache.shape[3] * cache.element_size())
        if runner.rank == 0:  # staged blocks 0.. hold the tokens in order
            staged = getattr(runner.kv_staging, name)
            payload = _read(staged, name, torch.arange(num_tokens, device=dev), bs).contiguous().view(torch.uint8)
        else:
            payload = torch.empty(shape, dtype=torch.uint8, device=dev)
        runner.comm.broadcast(payload, "kv_stage")
        _write(cache, name, s, bs, payload.view(cache.dtype)[t])
    return num_tokens
