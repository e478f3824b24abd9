"""Small building blocks: RMSNorm, RoPE (interleaved and half-split), the gated MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """y = w · x / rms(x), computed in fp32 and cast back before the weight (HF's order of operations)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def rope_inv_freq(rope_dim: int, theta: float, device: torch.device | str | None = None) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32, device=device) / rope_dim))


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T] positions -> cos, sin of [T, rope_dim/2], angles in fp32 (the reference's precision)."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotate the last dim of x [T, ..., d] by per-token angles cos/sin [T, d/2].

    interleave=True rotates pairs (2i, 2i+1) in place (GLM / DeepSeek MLA layout, what the cache stores);
    interleave=False rotates (i, i + d/2) (the half-split layout of DeepSeek-V3.2's indexer).
    """
    shape = [x.shape[0]] + [1] * (x.dim() - 2) + [cos.shape[-1]]
    c = cos.view(shape).to(x.dtype)
    s = sin.view(shape).to(x.dtype)
    if interleave:
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x0 * c - x1 * s, x1 * c + x0 * s), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    x0, x1 = x[..., :half], x[..., half:]
    return torch.cat((x0 * c - x1 * s, x1 * c + x0 * s), dim=-1)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) — the dense layers and the shared expert."""

    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
