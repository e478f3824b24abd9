"""Small building blocks: RMSNorm, RoPE (interleaved and half-split), the gated MLP.

Modules with a `fused` switch run one Triton launch in place of their eager ops when it is on (CUDA: set
by `engine.loading.loader.use_kernels`); their arithmetic is the eager one (kernels/norm.py, kernels/rope.py).
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import fp8_cublas
from kernels.act import silu_mul, silu_mul_ref
from kernels.norm import rms_norm, rms_norm_quant, rms_norm_ref
from kernels.rope import rope_ref


class RMSNorm(nn.Module):
    """y = w · x / rms(x), computed in fp32 and cast back before the weight (HF's order of operations).

    `quantize` (a class switch, on): a fused norm whose output feeds FP8 projections on their Triton path also
    writes that output's FP8 activation quantization in its launch (`forward_quant`), and the projections take it
    in place of their own quantization launch."""

    fused = False
    quantize = True

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (rms_norm if self.fused else rms_norm_ref)(x, self.weight, self.eps)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual add and the norm after it, one launch when fused."""
        return (rms_norm if self.fused else rms_norm_ref)(x, self.weight, self.eps, residual=residual)

    def forward_quant(self, x: torch.Tensor, residual: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, torch.Tensor]]:
        """(norm(s), s or None, s's norm as FP8 codes and per-128-channel scales), s = x (+ residual), in one
        launch (kernels.norm.rms_norm_quant; the fused kernels only: CUDA, or Triton's interpreter)."""
        if not self.fused:
            raise RuntimeError("RMSNorm.forward_quant runs the fused kernel: the module's `fused` is off")
        if residual is None:
            y, quant = rms_norm_quant(x, self.weight, self.eps)
            return y, None, quant
        return rms_norm_quant(x, self.weight, self.eps, residual)


def rope_inv_freq(rope_dim: int, theta: float, device: torch.device | str | None = None) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32, device=device) / rope_dim))


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T] positions -> cos, sin of [T, rope_dim/2], angles in fp32 (the reference's precision)."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotate the last dim of x [T, ..., d] by per-token angles cos/sin [T, d/2] (eager ops: kernels.rope.rope_ref).

    interleave=True rotates pairs (2i, 2i+1) in place (GLM / DeepSeek MLA layout, what the cache stores);
    interleave=False rotates (i, i + d/2) (the half-split layout of DeepSeek-V3.2's indexer).
    """
    return rope_ref(x, cos, sin, interleave)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) — the dense layers and the shared expert. Fused (CUDA, set by
    engine.loading.loader.use_kernels): the activation is one launch (kernels.act), which also quantizes its output
    for an FP8 down projection. `fused_activation` (a class switch, on) lets a benchmark time the step without it
    (`python -m bench.decode_step --switch-variants`)."""

    fused = False
    fused_activation = True

    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def projection_groups(self) -> list[list[nn.Module | None]]:
        """x's two projections: the runner packs them into one GEMM (engine.model.projections), one launch and one
        activation quantization (FP8) instead of two each."""
        return [[self.gate_proj, self.up_proj]]

    def forward(self, x: torch.Tensor, x_quant: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x_quant: x's FP8 codes and scales, made with x (RMSNorm.forward_quant), for FP8 projections of x."""
        pack = getattr(self.gate_proj, "pack", None)
        if pack is not None and getattr(self.up_proj, "pack", None) is pack:
            y = pack(x, x_quant)
            gate, up = pack.part(y, self.gate_proj), pack.part(y, self.up_proj)
        elif x_quant is not None and getattr(self.gate_proj, "weight_scale_inv", None) is not None:  # FP8
            gate, up = self.gate_proj(x, x_quant=x_quant), self.up_proj(x, x_quant=x_quant)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        if not (self.fused and self.fused_activation):
            return self.down_proj(silu_mul_ref(gate, up))
        shape, gate, up = gate.shape, gate.reshape(-1, gate.shape[-1]), up.reshape(-1, up.shape[-1])
        down = self.down_proj
        # the activation's FP8 quantization with it, where the down projection is FP8 on the Triton path (cuBLAS,
        # at prefill sizes, lays its scales out its own way and quantizes itself)
        if getattr(down, "weight_scale_inv", None) is not None and gate.is_cuda and not fp8_cublas.use_dense(
                gate.shape[0], down.out_features, down.in_features, gate.dtype, gate.device):
            h, quant = silu_mul(gate, up, quant=True)
            return down(h, x_quant=quant).view(*shape[:-1], down.out_features)
        return down(silu_mul(gate, up)).view(*shape[:-1], down.out_features)
