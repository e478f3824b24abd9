"""Sparse MLA attention in the absorbed (MQA) form over selected cache rows.

For query row t and head h, with q = [q_lat (R) ; q_rope (P)] and the selected rows c_s = [latent ; rope]:
    z[t, h, s] = sm_scale * q[t, h] . c_s          (s over the row's indices, -1 = skipped)
    out[t, h]  = sum_s softmax(z[t, h])_s * latent_s      [R]
    lse[t, h]  = log sum_s exp(z[t, h, s])                (natural log; -inf when nothing is selected)
A row with no valid index returns out = 0 and lse = -inf (so a DCP merge ignores it).
"""

from __future__ import annotations

import torch

from kernels.store_kv import gather_kv_ref


def attend_rows_ref(q: torch.Tensor, kv: torch.Tensor, allowed: torch.Tensor, sm_scale: float,
                    latent_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [Tq, H, R+P], kv [S, R+P] float, allowed [Tq, S] bool -> out [Tq, H, R] fp32, lse [Tq, H] fp32."""
    z = torch.einsum("thd,sd->ths", q.float(), kv.float()) * sm_scale
    z = z.masked_fill(~allowed[:, None, :], float("-inf"))
    lse = torch.logsumexp(z, dim=-1)
    p = torch.exp(z - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    out = torch.einsum("ths,sr->thr", p, kv[:, :latent_dim].float())
    return out, lse


def sparse_mla_ref(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                   latent_dim: int, rope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [..., H, R+P]; kv_cache a paged layer view [num_blocks, block_size, row] (indices are global
    slots) or a workspace [S, R+P] (indices are rows); indices [..., K] int32 with -1 padding.
    Returns (out [..., H, R] in q's dtype, lse [..., H] fp32)."""
    lead = q.shape[:-2]
    H, D = q.shape[-2:]
    if q.numel() == 0:
        return (torch.zeros(*lead, H, latent_dim, dtype=q.dtype, device=q.device),
                torch.full((*lead, H), float("-inf"), dtype=torch.float32, device=q.device))
    qf = q.reshape(-1, H, D)
    idx = indices.reshape(-1, indices.shape[-1]).long()
    valid = idx >= 0
    flat = idx.clamp(min=0).reshape(-1)
    if kv_cache.dim() == 3:
        rows = gather_kv_ref(kv_cache, flat, latent_dim, rope_dim)
    else:
        rows = kv_cache[flat].float()
    rows = rows.reshape(idx.shape[0], idx.shape[1], -1)
    z = torch.einsum("thd,tkd->thk", qf.float(), rows) * sm_scale
    z = z.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(z, dim=-1)
    p = torch.exp(z - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    out = torch.einsum("thk,tkr->thr", p, rows[..., :latent_dim])
    return out.to(q.dtype).reshape(*lead, H, latent_dim), lse.reshape(*lead, H)
