"""Routed experts: route tokens (sigmoid + correction bias, group-limited top-k) and run the experts.

Expert weights: w13 [E, 2I, H] (gate rows then up rows, HF's gate_up_proj layout), w2 [E, H, I].
y[t] = sum_j weights[t, j] * w2[e] (silu(w13[e, :I] x) * (w13[e, I:] x)),  e = ids[t, j].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route_ref(router_logits: torch.Tensor, correction_bias: torch.Tensor | None, top_k: int, *, n_group: int = 1,
              topk_group: int = 1, normalize: bool = True, scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] fp32 -> (weights [T, k] fp32, ids [T, k] int64). No host synchronisation.

    The bias only steers *which* experts are chosen; the weights come from the unbiased sigmoid scores.
    """
    scores = router_logits.float().sigmoid()
    choice = scores + correction_bias.float() if correction_bias is not None else scores
    T, E = choice.shape
    if n_group > 1:
        grouped = choice.view(T, n_group, E // n_group)
        group_scores = grouped.topk(min(2, E // n_group), dim=-1).values.sum(dim=-1)
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(topk_group, dim=-1).indices, 1.0)
        mask = keep[:, :, None].expand(T, n_group, E // n_group).reshape(T, E).bool()
        choice = choice.masked_fill(~mask, float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor, expert_offset: int = 0) -> torch.Tensor:
    """x [T, H]; ids [T, k] global expert ids (ids outside [offset, offset + E_local) are skipped, for EP).

    Vectorised over experts: assignments are sorted by expert into a padded [E, max_count, H] batch and
    run as two batched matmuls (no Python loop over tokens or experts).
    """
    T, H = x.shape
    E, two_i, _ = w13.shape
    inner = two_i // 2
    out = torch.zeros((T, H), dtype=torch.float32, device=x.device)
    flat_e = ids.reshape(-1) - expert_offset
    local = (flat_e >= 0) & (flat_e < E)
    tok = torch.arange(T, device=x.device).repeat_interleave(ids.shape[1])[local]
    e = flat_e[local]
    w = weights.reshape(-1)[local].float()
    if e.numel() == 0:
        return out.to(x.dtype)
    order = torch.argsort(e, stable=True)
    e, tok, w = e[order], tok[order], w[order]
    counts = torch.bincount(e, minlength=E)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(e.numel(), device=x.device) - starts[e]
    batch = torch.zeros((E, int(counts.max()), H), dtype=x.dtype, device=x.device)
    batch[e, slot] = x[tok]
    h = torch.bmm(batch, w13.transpose(1, 2))
    h = F.silu(h[..., :inner]) * h[..., inner:]
    y = torch.bmm(h, w2.transpose(1, 2))[e, slot]
    out.index_add_(0, tok, y.float() * w[:, None])
    return out.to(x.dtype)
