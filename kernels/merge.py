"""Exact merge of partial attention results (DCP shards, split-K chunks).

    lse = log sum_r exp(lse_r),   out = sum_r exp(lse_r - lse) * out_r
A shard with lse_r = -inf contributes nothing; if every shard is -inf the result is out = 0, lse = -inf.
"""

from __future__ import annotations

import torch


def merge_attn_states_ref(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """outs [N, ..., D], lses [N, ...] -> (out [..., D] in outs' dtype, lse [...] fp32)."""
    if outs.shape[:-1] != lses.shape:
        raise ValueError(f"outs {tuple(outs.shape)} and lses {tuple(lses.shape)} disagree")
    lses = lses.float()
    m = lses.max(dim=0).values
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp(lses - m_safe)  # exp(-inf) = 0 for empty shards
    total = w.sum(dim=0)
    lse = torch.where(total > 0, torch.log(total) + m_safe, torch.full_like(m, float("-inf")))
    scale = torch.where(total[None] > 0, w / total.clamp(min=1e-30)[None], torch.zeros_like(w))
    out = (outs.float() * scale[..., None]).sum(dim=0)
    return out.to(outs.dtype), lse
