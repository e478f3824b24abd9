"""Projections of one input as one GEMM: `pack_projections` and `project`.

MLA reads the hidden states x three times (q_a_proj, kv_a_proj_with_mqa and the indexer's wk) and the
query residual twice (q_b_proj and the indexer's wq_b); a gated MLP (the dense layers' and the MoE's shared
expert) reads its input twice (gate_proj, up_proj). Packed, their weights are rows of one [N, K] matrix
(each module's `weight`, and `weight_scale_inv` for FP8, becomes a view of it), so each input is read,
quantized (FP8) and multiplied once: one launch instead of two or three at decode, where these small
projections are latency-bound (q_a_proj, kv_a_proj and wk stream 12.6 + 3.5 + 0.8 MB of GLM-5.3 FP8
weights), and one activation quantization instead of one per projection in prefill. The arithmetic of each
output column is that of its own projection (same rows, same scales, same K blocks).

FP8 rows come in 128-row scale blocks: every member but the last must have a multiple of 128 rows, so its
blocks do not straddle the next member's. Members are ordered aligned first; a second unaligned member stays
on its own (tiny-code's 32-row wk). Packing happens once the model holds its weights on its device (the
runner does it after loading); moving the model afterwards would separate the views from the packed matrix.
Loading into a packed model still works (the loader copies into the views).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.fp8 import Fp8Linear, fp8_linear
from kernels import fp8_cublas
from kernels.fp8_quant import BLOCK


@runtime_checkable
class HasProjectionGroups(Protocol):
    """A layer that reads some inputs several times: it names, per input, the projections of it (None for one
    it lacks), and runs each input through its pack where it has one. The layer knows its groups; this module only
    packs them, so it never needs to import the layer (engine.model.mla.MLAttention, engine.model.layers.GatedMLP)."""

    def projection_groups(self) -> list[list[nn.Module | None]]: ...


class Pack:
    """Several projections of one input as the rows of one weight. Not an nn.Module: its matrix is the
    storage the members' parameters view, so parameters (and weight bytes) are counted once, by member."""

    def __init__(self, members: list[nn.Module]):
        first = members[0]
        self.fp8 = isinstance(first, Fp8Linear)
        self.members = list(members)
        self.in_features = first.in_features
        self.ranges: dict[int, tuple[int, int]] = {}
        lo = 0
        for m in members:
            self.ranges[id(m)] = (lo, lo + m.out_features)
            lo += m.out_features
        self.out_features = lo
        w0 = first.weight
        with torch.no_grad():
            self.weight = torch.empty((lo, self.in_features), dtype=w0.dtype, device=w0.device)
            for m in members:
                a, b = self.ranges[id(m)]
                self.weight[a:b].copy_(m.weight)
            if self.fp8:
                self.weight_scale_inv = torch.cat([m.weight_scale_inv for m in members], 0)
        for m in members:
            a, b = self.ranges[id(m)]
            m.weight = nn.Parameter(self.weight[a:b], requires_grad=False)
            if self.fp8:
                m.weight_scale_inv = nn.Parameter(
                    self.weight_scale_inv[a // BLOCK: a // BLOCK + m.weight_scale_inv.shape[0]], requires_grad=False)
            m.pack = self

    def __call__(self, x: torch.Tensor, x_quant: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x [..., K] -> [..., N] (every member's output side by side); x_quant: x's FP8 codes and scales made
        with x (an FP8 pack takes them in place of its own quantization; a bf16 one ignores them)."""
        return fp8_linear(x, self.weight, self.weight_scale_inv, x_quant) if self.fp8 else F.linear(x, self.weight)

    def part(self, y: torch.Tensor, m: nn.Module) -> torch.Tensor:
        """Member m's columns of the packed output y (a view: rows keep the packed stride)."""
        a, b = self.ranges[id(m)]
        return y[..., a:b]


def _packable(mods: list[nn.Module]) -> list[list[nn.Module]]:
    """The packs `mods` can make, each in packed order: members of one kind (Fp8Linear, or bias-free
    nn.Linear), one input width, dtype and device, at least two; for FP8 the 128-row-aligned members first
    and at most one other, last (the largest)."""
    mods = [m for m in mods if type(m) in (Fp8Linear, nn.Linear) and getattr(m, "pack", None) is None
            and not m.weight.is_meta and not (type(m) is nn.Linear and m.bias is not None)]
    groups: dict[tuple, list[nn.Module]] = {}
    for m in mods:
        groups.setdefault((type(m), m.in_features, m.weight.dtype, m.weight.device), []).append(m)
    packs = []
    for (kind, *_), group in groups.items():
        if kind is Fp8Linear:
            other = sorted((m for m in group if m.out_features % BLOCK), key=lambda m: -m.out_features)
            group = [m for m in group if m.out_features % BLOCK == 0] + other[:1]
        if len(group) >= 2:
            packs.append(group)
    return packs


def pack_projections(model: nn.Module) -> int:
    """Pack the projection groups of every layer that names them (`HasProjectionGroups`: each MLA layer's
    projections of x and of the query residual). Returns the number of packs made. Always done by the runner;
    a model left unpacked computes the same (tests/engine/model/test_projections.py compares the two)."""
    made = 0
    for m in model.modules():
        if not isinstance(m, HasProjectionGroups):
            continue
        for group in m.projection_groups():
            for members in _packable([p for p in group if p is not None]):
                Pack(members)
                made += 1
    return made


def project(x: torch.Tensor, *mods: nn.Module,
            x_quant: tuple[torch.Tensor, torch.Tensor] | None = None) -> list[torch.Tensor]:
    """[mod(x) for mod in mods] (None for a None mod), with as few GEMMs and quantizations as it can: one
    per pack whose members are all asked for (views of its output), and, for the others, x quantized once
    when every one is an Fp8Linear that cuBLAS serves at this size (kernels.fp8_cublas). x_quant: x's FP8
    codes and scales made with x (RMSNorm.forward_quant), which every FP8 GEMM here takes in place of its own."""
    outs: list[torch.Tensor | None] = [None] * len(mods)
    asked = {id(m) for m in mods if m is not None}
    for i, m in enumerate(mods):
        pk = getattr(m, "pack", None)
        if outs[i] is not None or pk is None or any(id(o) not in asked for o in pk.members):
            continue
        y = pk(x, x_quant)
        for j, o in enumerate(mods):
            if o is not None and getattr(o, "pack", None) is pk:
                outs[j] = pk.part(y, o)
    rest = [i for i, m in enumerate(mods) if m is not None and outs[i] is None]
    x2 = x.reshape(-1, x.shape[-1])
    M, K = x2.shape
    if len(rest) >= 2 and x2.is_cuda and M > 0 and all(
            isinstance(mods[i], Fp8Linear)
            and fp8_cublas.use_dense(M, mods[i].out_features, K, x.dtype, x.device) for i in rest):
        quantized = fp8_cublas.quantize_input(x2)
        for i in rest:
            m = mods[i]
            outs[i] = fp8_cublas.dense_mm(x2, m.weight, m.weight_scale_inv, quantized).view(
                *x.shape[:-1], m.out_features)
    else:
        for i in rest:
            m = mods[i]
            outs[i] = m(x, x_quant=x_quant) if x_quant is not None and isinstance(m, Fp8Linear) else m(x)
    return outs
