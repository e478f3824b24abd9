"""The lightning indexer: storing its keys and selecting each query's top-k past tokens.

Key cache view: [num_blocks, block_size, D + 4] uint8 (fp8 e4m3 values + fp32 power-of-two scale) or
[num_blocks, block_size, D] float32 (the exact reference mode).

Score of query row t (position p, request b) against past position s <= p:
    I[t, s] = sum_h w[t, h] * ReLU(q[t, h] . k[s]) * k_scale[s]
where `w` already holds weights_proj(x)/sqrt(H), the 1/sqrt(D) softmax scale and the per-(token, head)
query scale (all positive, so they fold through the ReLU). Top-k is exact for the computed scores; ties
go to the lower position. Rows with fewer than k candidates are padded with -1.
"""

from __future__ import annotations

import torch

from kernels.formats import dequantize_index_rows_ref, quantize_index_rows_ref


def store_index_k_ref(k: torch.Tensor, index_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k [T, D] -> rows at `slot_mapping` [T] (slot -1: not written)."""
    if index_cache.dim() != 3:
        raise ValueError(f"index_cache must be [num_blocks, block_size, row], got {tuple(index_cache.shape)}")
    keep = slot_mapping >= 0
    if not bool(keep.any()):
        return
    slots = slot_mapping[keep]
    bs = index_cache.shape[1]
    if index_cache.dtype == torch.uint8:
        rows = quantize_index_rows_ref(k[keep])
    else:
        rows = k[keep].float()
    if rows.shape[1] != index_cache.shape[2]:
        raise ValueError(f"key row width {rows.shape[1]} does not match the cache row {index_cache.shape[2]}")
    index_cache[slots // bs, slots % bs] = rows


def gather_index_k_ref(index_cache: torch.Tensor, slots: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows at `slots` -> (values [n, D] float32, scales [n] float32); fp32 caches give scale 1."""
    bs = index_cache.shape[1]
    slots = slots.long()
    rows = index_cache[slots // bs, slots % bs]
    if index_cache.dtype == torch.uint8:
        vals = rows[:, :head_dim].contiguous().view(torch.float8_e4m3fn).float()
        scale = rows[:, head_dim: head_dim + 4].contiguous().view(torch.float32).reshape(-1)
        return vals, scale
    return rows.float(), torch.ones(rows.shape[0], dtype=torch.float32, device=rows.device)


def index_scores_ref(q: torch.Tensor, weights: torch.Tensor, k_vals: torch.Tensor,
                     k_scale: torch.Tensor) -> torch.Tensor:
    """q [Tq, H, D] (fp8 or float), weights [Tq, H], keys [S, D] + scales [S] -> scores [Tq, S] fp32."""
    logits = torch.einsum("thd,sd->ths", q.float(), k_vals.float())
    return torch.einsum("ths,th->ts", logits.clamp_min(0), weights.float()) * k_scale[None, :]


def topk_positions_ref(scores: torch.Tensor, positions: torch.Tensor, topk: int) -> torch.Tensor:
    """Causal top-k of scores [Tq, S] for queries at `positions` [Tq] -> int32 [Tq, topk], -1 padded.

    Ties go to the lower position (stable sort), so every implementation selects the same set.
    """
    Tq, S = scores.shape
    cols = torch.arange(S, device=scores.device)
    causal = cols[None, :] <= positions[:, None]
    masked = torch.where(causal, scores, torch.full_like(scores, float("-inf")))
    k = min(topk, S)
    order = torch.sort(masked, dim=1, descending=True, stable=True).indices[:, :k]
    picked_ok = torch.gather(causal, 1, order)
    out = torch.full((Tq, topk), -1, dtype=torch.int32, device=scores.device)
    out[:, :k] = torch.where(picked_ok, order, torch.full_like(order, -1)).to(torch.int32)
    return out


def indexer_topk_ref(q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor, block_table: torch.Tensor,
                     token_req_idx: torch.Tensor, positions: torch.Tensor, topk: int,
                     q_scale: torch.Tensor | None = None, head_dim: int | None = None,
                     return_slots: bool = True) -> torch.Tensor:
    """Top-k past tokens of every query row -> int32 [T, topk] global slots (or positions), -1 padded.

    q [T, H, D] fp8 (with `q_scale` [T, H]) or float; weights [T, H] fp32; block_table [B, max_blocks];
    token_req_idx [T] and positions [T] place each row in its request.
    """
    D = head_dim or q.shape[-1]
    bs = index_cache.shape[1]
    w = weights.float() * (q_scale.float() if q_scale is not None else 1.0)
    out = torch.full((q.shape[0], topk), -1, dtype=torch.int32, device=q.device)
    for b in torch.unique(token_req_idx).tolist():
        rows = (token_req_idx == b).nonzero().flatten()
        S = int(positions[rows].max()) + 1
        pos = torch.arange(S, device=q.device)
        slots = block_table[b].long()[pos // bs] * bs + pos % bs
        k_vals, k_scale = gather_index_k_ref(index_cache, slots, D)
        scores = index_scores_ref(q[rows], w[rows], k_vals, k_scale)
        sel = topk_positions_ref(scores, positions[rows], topk)
        if return_slots:
            sel_slots = slots[sel.clamp(min=0).long()].to(torch.int32)
            sel = torch.where(sel >= 0, sel_slots, sel)
        out[rows] = sel
    return out
