"""FP8 block-scaled parameters: `Fp8Linear`, and turning a model built on `meta` into its FP8 form.

A quantized projection stores `weight` float8_e4m3fn [N, K] and `weight_scale_inv` fp32
[ceil(N/128), ceil(K/128)] (the checkpoint's own tensors, on every device: CPU memory holds the same
bytes as the GPU's). The forward quantizes activations per token per 128 channels and runs the w8a8
block-scaled GEMM (Triton on CUDA, the fp32 reference elsewhere). Routed experts get the same format
(`Experts(fp8=True)`).

Which modules: those the checkpoint stores in FP8. A config that lists the unquantized modules
(quantization_config's `modules_to_not_convert` / `ignored_layers`) says it by name: every nn.Linear whose
(checkpoint) name matches no entry. DeepSeek-V3-style configs carry no list, and then the tensors say it:
a module is FP8 when its weight is (`fp8_modules` over the safetensors headers). Without a checkpoint to
read (a model built on `meta` for planning, a random or quantize-at-load model) `DEFAULT_NOT_CONVERT`
applies, the GLM-5-FP8 / DeepSeek-V3 convention: embeddings, lm_head, norms, the router gate, the
indexer's weights_proj, and the MTP layer's eh_proj and shared_head stay in the model dtype (serving
engines build eh_proj as a plain unquantized linear, so the released FP8 checkpoints store it in bf16).

kv_b_proj is stored in FP8 too, by measurement. The absorbed MLA path uses its rows as two per-head
matrices (W_UK [H, nope, R] applied to q_nope, W_UV [H, v, R] to the attention output) whose head
boundaries (nope + v = 448 rows) cut across the 128-row scale blocks. Dequantized to bf16 once at load it
would cost 1.08 GiB per GLM-5.3 rank (79 layers x 14.7 MB) and put a PCP8 x EP8 prefill rank at
106.17 GiB, over the 106 GiB that leaves 15 GiB of KV; stored in FP8 the rank is at 105.09 GiB
(`pdserve plan`). Reading FP8 inside a weight-only batched kernel was measured on the H200 at 106 + 56 us
per layer for 64 decode tokens against 18 + 19 us for the bf16 einsums (BENCHMARKS.md, FP8 weights), so the
forward dequantizes kv_b_proj (one bandwidth-bound pass over 14.7 MB, kernels.fp8_absorbed) right before
the same bf16 einsums.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config.model_config import ModelConfig, hf_name
from engine.model.moe import Experts
from kernels.fp8_gemm import w8a8_block_fp8_matmul, w8a8_block_fp8_matmul_ref
from kernels.fp8_quant import BLOCK

DEFAULT_NOT_CONVERT = ("embed_tokens", "lm_head", "norm", "mlp.gate", "weights_proj", "eh_proj", "shared_head")
SCALE_SUFFIX = "_scale_inv"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
               x_quant: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [..., K] @ (weight * block scales)^T -> [..., N] in x's dtype: the w8a8 GEMM on CUDA (with `x_quant`, x's
    codes and scales made with x, in place of its own quantization), its fp32 reference elsewhere (which takes
    `x_quant` too: the CPU tests check what a model passes)."""
    x2 = x.reshape(-1, weight.shape[1])
    if not x2.is_cuda:
        return w8a8_block_fp8_matmul_ref(x2, weight, weight_scale_inv, x.dtype, x_quant=x_quant).view(
            *x.shape[:-1], weight.shape[0])
    return w8a8_block_fp8_matmul(x2, weight, weight_scale_inv, x.dtype, x_quant=x_quant).view(
        *x.shape[:-1], weight.shape[0])


class Fp8Linear(nn.Module):
    """y = x @ (weight * block scales)^T (no bias: the checkpoint's quantized projections have none)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn),
                                   requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.empty(cdiv(out_features, BLOCK), cdiv(in_features, BLOCK),
                                                         dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor, x_quant: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale_inv, x_quant)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 block 128x128"


def not_convert_list(cfg: ModelConfig) -> tuple[str, ...]:
    return cfg.modules_to_not_convert if cfg.modules_to_not_convert is not None else DEFAULT_NOT_CONVERT


def is_quantized_name(name: str, not_convert: tuple[str, ...]) -> bool:
    """Whether module `name` (checkpoint naming) is quantized: no listed pattern matches a run of its
    dotted components ("mlp.gate" names the router, not "mlp.gate_proj"; "lm_head" or a full name)."""
    dotted = f".{name}."
    return not any(f".{p.strip('.')}." in dotted for p in not_convert)


def convert_to_fp8(model: nn.Module, cfg: ModelConfig, stored_fp8: set[str] | None = None) -> list[str]:
    """Swap the quantized nn.Linear modules of a model on `meta` for Fp8Linear and the routed experts for
    their FP8 form. `stored_fp8`: the checkpoint's FP8 module names (`fp8_modules`), which decide when the
    config lists no unquantized modules. Returns the converted module names."""
    skip = not_convert_list(cfg)
    by_checkpoint = stored_fp8 is not None and cfg.modules_to_not_convert is None
    done = []
    for name, mod in list(model.named_modules()):
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        hf = hf_name(name, cfg)
        quantized = hf in stored_fp8 if by_checkpoint else is_quantized_name(hf, skip)
        if isinstance(mod, nn.Linear) and quantized:
            if mod.bias is not None:
                raise ValueError(f"{name} has a bias; FP8 projections here have none: add it to modules_to_not_convert")
            setattr(parent, attr, Fp8Linear(mod.in_features, mod.out_features))
            done.append(name)
        elif isinstance(mod, Experts) and quantized:
            setattr(parent, attr, Experts(cfg, num_local=mod.w13.shape[0], offset=mod.offset, fp8=True))
            done.append(name)
    return done
