"""Mixture of experts: fp32 sigmoid routing with a correction bias, routed experts and a shared expert."""

from __future__ import annotations

import torch
from torch import nn

from engine.config.model_config import ModelConfig
from engine.model.layers import GatedMLP
from kernels.fp8_moe import fused_moe_fp8, fused_moe_fp8_ref
from kernels.moe import fused_moe_ref
from kernels.moe_routing import route, route_ref


class MoEGate(nn.Module):
    """fp32 logits (x . w in fp32, the reference's precision) -> sigmoid routing (kernels.moe_routing.route_ref).

    fused (CUDA, engine.loading.loader.use_kernels): bf16 x and w multiply into fp32 logits in one GEMM (a
    product of two bf16 values is exact in fp32, so this is the fp32 GEMM up to the order of its sums,
    without the fp32 copies of x and w), and the routing is one launch (kernels.moe_routing.route)."""

    fused = False

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.n_group = cfg.n_group
        self.topk_group = cfg.topk_group
        self.normalize = cfg.norm_topk_prob
        self.scaling = cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        # a buffer, as in HF: it steers selection and is not a trained parameter of the forward
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused and x.is_cuda and x.dtype == self.weight.dtype == torch.bfloat16:
            logits = torch.mm(x, self.weight.t(), out_dtype=torch.float32)
        else:
            logits = x.float() @ self.weight.float().t()
        return (route if self.fused else route_ref)(logits, self.e_score_correction_bias, self.top_k,
                                                    n_group=self.n_group, topk_group=self.topk_group,
                                                    normalize=self.normalize, scaling=self.scaling)


class Experts(nn.Module):
    """The routed experts held by this rank: ids [offset, offset + num_local) of n_routed_experts.

    fp8=True: w13 / w2 are float8_e4m3fn with 128x128 block scales w13_scale_inv [n, 2 ceil(I/128),
    ceil(H/128)] (gate's scale rows, then up's) and w2_scale_inv [n, ceil(H/128), ceil(I/128)]."""

    def __init__(self, cfg: ModelConfig, num_local: int | None = None, offset: int = 0, fp8: bool = False):
        super().__init__()
        n = cfg.n_routed_experts if num_local is None else num_local
        H, inner = cfg.hidden_size, cfg.moe_intermediate_size
        self.offset = offset
        self.fp8 = fp8
        dtype = torch.float8_e4m3fn if fp8 else None
        self.w13 = nn.Parameter(torch.empty(n, 2 * inner, H, dtype=dtype), requires_grad=not fp8)
        self.w2 = nn.Parameter(torch.empty(n, H, inner, dtype=dtype), requires_grad=not fp8)
        if fp8:
            ib, hb = -(-inner // 128), -(-H // 128)
            self.w13_scale_inv = nn.Parameter(torch.empty(n, 2 * ib, hb), requires_grad=False)
            self.w2_scale_inv = nn.Parameter(torch.empty(n, hb, ib), requires_grad=False)
        self.impl = fused_moe_fp8_ref if fp8 else fused_moe_ref  # the Triton grouped GEMM on CUDA

    @property
    def takes_fp8_rows(self) -> bool:
        """Whether `forward` takes rows quantized elsewhere (`x_quantized`): FP8 experts on the Triton kernel."""
        return self.fp8 and getattr(self.impl, "func", self.impl) is fused_moe_fp8

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                assignments: int | None = None, x_quantized: tuple | None = None) -> torch.Tensor:
        """assignments: how many of ids' entries are this rank's, as far as the caller knows (the kernels'
        tile choice; default: all of them). x_quantized: x's FP8 codes and scales, made by the caller (only
        where `takes_fp8_rows`; kernels.fp8_moe.fused_moe_fp8)."""
        if self.fp8:
            kw = {"x_quantized": x_quantized} if x_quantized is not None else {}
            return self.impl(x, self.w13, self.w13_scale_inv, self.w2, self.w2_scale_inv, weights, ids, self.offset,
                             assignments=assignments, **kw)
        return self.impl(x, self.w13, self.w2, weights, ids, self.offset, assignments=assignments)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = MoEGate(cfg)
        self.experts = Experts(cfg)
        self.shared_experts = (GatedMLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)
                               if cfg.n_shared_experts else None)
        self.dispatcher = None  # set by expert parallelism: moves tokens to the ranks owning their experts

    def forward(self, x: torch.Tensor, x_quant: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x_quant: x's FP8 codes and scales made with x (RMSNorm.forward_quant): the shared expert's projections
        and experts on the Triton kernel take them (an EP dispatcher quantizes what it sends itself)."""
        weights, ids = self.gate(x)
        if self.dispatcher is not None:
            routed = self.dispatcher(x, weights, ids, self.experts)
        elif x_quant is not None and self.experts.takes_fp8_rows:
            routed = self.experts(x, weights, ids, x_quantized=x_quant)
        else:
            routed = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            routed = routed + self.shared_experts(x, x_quant)
        return routed
