"""Decode context parallelism: where a token's KV lives, and the exact merge of per-rank attention.

Token i of a request lives on rank (i // I) % N at local index (i // (I·N))·I + i % I (docs/parallelism.md, "DCP:
which rank holds token i"; interleave I divides the block size). The KV manager hands out *virtual* blocks of
64·N tokens: block id b names local block b on every rank, and the local index space of a request is an ordinary
paged sequence over its block table (local index j -> slot block_ids[j // 64]·64 + j % 64):

    positions:   0 1 2 3 4 5 6 7 ...        N = 2, I = 2
    rank:        0 0 1 1 0 0 1 1
    local index: 0 1 0 1 2 3 2 3

Merge of per-rank partial attention (out_r, lse_r) over disjoint key sets:
    lse = log Σ_r exp(lse_r),  out = Σ_r exp(lse_r − lse)·out_r     (lse_r = −inf: empty shard)
`ag_rs`: all-gather the LSEs, scale the local partial, reduce-scatter the rows to their owners.
`a2a`:   one all-to-all of the partials with the LSE packed as one extra column; owners merge.
The scatter dimension is query rows, not heads as under TP: a PCP rank owns whole rows (all heads).
"""

from __future__ import annotations

import torch

from engine.parallel.dist import RankComm
from kernels import merge as merge_kernels
from kernels.merge import merge_attn_states_ref


# ---- arithmetic ------------------------------------------------------------------------------------
def owner_rank(pos, dcp_size: int, interleave: int):
    """Rank holding position `pos` (int or tensor)."""
    return (pos // interleave) % dcp_size


def local_index(pos, dcp_size: int, interleave: int):
    """Index of position `pos` in its owner's local sequence (int or tensor)."""
    return (pos // (interleave * dcp_size)) * interleave + pos % interleave


def global_position(local_idx, rank: int, dcp_size: int, interleave: int):
    """Inverse of `local_index` on `rank`."""
    return ((local_idx // interleave) * dcp_size + rank) * interleave + local_idx % interleave


def num_local(num_tokens: int, rank: int, dcp_size: int, interleave: int) -> int:
    """How many of positions [0, num_tokens) live on `rank`."""
    cycle = interleave * dcp_size
    rem = num_tokens % cycle
    return (num_tokens // cycle) * interleave + min(max(rem - rank * interleave, 0), interleave)


def dcp_slot_fn(rank: int, dcp_size: int, interleave: int):
    """`runner.slot_fn` for one rank: the local slot of each position it owns, -1 for the others."""
    def slot_fn(block_ids: list[int], positions, block_size: int) -> list[int]:
        out = []
        for p in positions:
            if (p // interleave) % dcp_size != rank:
                out.append(-1)
                continue
            j = (p // (interleave * dcp_size)) * interleave + p % interleave
            out.append(block_ids[j // block_size] * block_size + j % block_size)
        return out
    return slot_fn


def token_locations(num_tokens: int, block_ids: list[int], dcp_size: int, interleave: int,
                    block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global tokens [0, num_tokens) -> (rank [L] int64, local slot [L] int64) under DCP."""
    pos = torch.arange(num_tokens, dtype=torch.int64)
    j = local_index(pos, dcp_size, interleave)
    table = torch.tensor(block_ids, dtype=torch.int64)
    if num_tokens and int(j.max()) // block_size >= len(block_ids):
        raise ValueError(f"{num_tokens} tokens need more than the request's {len(block_ids)} blocks")
    slots = table[j // block_size] * block_size + j % block_size if num_tokens else pos
    return owner_rank(pos, dcp_size, interleave), slots


# ---- merges ----------------------------------------------------------------------------------------
def merge_scales(lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """lses [N, ...] -> (scale [N, ...] with out = Σ_r scale_r·out_r, lse [...]); the weights of
    `merge_attn_states_ref`, so a distributed sum of scaled partials equals the reference merge."""
    lses = lses.float()
    m = lses.max(dim=0).values
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp(lses - m_safe)
    total = w.sum(dim=0)
    lse = torch.where(total > 0, torch.log(total) + m_safe, torch.full_like(m, float("-inf")))
    scale = torch.where(total[None] > 0, w / total.clamp(min=1e-30)[None], torch.zeros_like(w))
    return scale, lse


def merge_states(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact merge: the Triton kernel on CUDA when the kernels package has it, else the reference."""
    fast = getattr(merge_kernels, "merge_attn_states", None)
    if fast is not None and outs.is_cuda:
        return fast(outs, lses)
    return merge_attn_states_ref(outs, lses)


def merge_a2a(comm: RankComm, out: torch.Tensor, lse: torch.Tensor, max_rows: int,
              num_own: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Partials of every rank's rows, rank-major [world * max_rows, H, R] + lse [world * max_rows, H]
    -> this rank's rows merged over the ranks: (out [num_own, H, R] fp32, lse [num_own, H])."""
    world = comm.world_size
    packed = torch.cat([out.float(), lse.float()[..., None]], dim=-1)
    recv = comm.all_to_all(packed, [max_rows] * world, [max_rows] * world, "dcp_merge")
    recv = recv.view(world, max_rows, *packed.shape[1:])[:, :num_own]
    return merge_states(recv[..., :-1], recv[..., -1])


def merge_ag_rs(comm: RankComm, out: torch.Tensor, lse: torch.Tensor, max_rows: int,
                num_own: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `merge_a2a`: all-gather LSEs, scale this rank's partial, reduce-scatter rows."""
    world = comm.world_size
    all_lse = comm.all_gather(lse.float(), "dcp_merge").view(world, *lse.shape)
    scale, merged_lse = merge_scales(all_lse)
    scaled = out.float() * scale[comm.rank][..., None]
    mine = comm.reduce_scatter(scaled, "dcp_merge")[:num_own]
    lo = comm.rank * max_rows
    return mine, merged_lse[lo: lo + num_own]


MERGES = {"ag_rs": merge_ag_rs, "a2a": merge_a2a}


# ---- global top-k from per-rank candidates ---------------------------------------------------------
def local_topk_candidates(scores: torch.Tensor, positions: torch.Tensor,
                          topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [Tq, S] (−inf = not allowed) of keys at ascending global `positions` [S]
    -> (scores [Tq, topk], positions [Tq, topk] int64, −inf / −1 padded), best first, ties to the
    lower position (the order of a single-rank stable sort)."""
    Tq, S = scores.shape
    out_s = torch.full((Tq, topk), float("-inf"), dtype=torch.float32, device=scores.device)
    out_p = torch.full((Tq, topk), -1, dtype=torch.int64, device=scores.device)
    k = min(topk, S)
    if k == 0:
        return out_s, out_p
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]
    picked = scores.gather(1, order).float()
    out_s[:, :k] = picked
    out_p[:, :k] = torch.where(torch.isinf(picked), torch.full_like(order, -1), positions.long()[order])
    return out_s, out_p


def merge_topk_candidates(scores: torch.Tensor, positions: torch.Tensor, topk: int) -> torch.Tensor:
    """Candidates of N ranks, scores/positions [N, T, K] -> global top-k positions [T, topk] int32.

    Sorted by (score desc, position asc) — the total order of the single-rank selection — so the result
    is the set the single-rank indexer picks: each member is in its own rank's local top-k.
    """
    N, T, K = scores.shape
    s = scores.permute(1, 0, 2).reshape(T, N * K)
    p = positions.permute(1, 0, 2).reshape(T, N * K).long()
    big = torch.iinfo(torch.int64).max
    by_pos = torch.sort(torch.where(p < 0, torch.full_like(p, big), p), dim=1, stable=True).indices
    s, p = s.gather(1, by_pos), p.gather(1, by_pos)
    by_score = torch.sort(s, dim=1, descending=True, stable=True).indices[:, :topk]
    top_s, top_p = s.gather(1, by_score), p.gather(1, by_score)
    out = torch.full((T, topk), -1, dtype=torch.int32, device=scores.device)
    out[:, : top_p.shape[1]] = torch.where(torch.isinf(top_s), torch.full_like(top_p, -1), top_p).to(torch.int32)
    return out
