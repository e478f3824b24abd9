"""Build a model for a checkpoint on a device: construct on `meta`, allocate, load, verify."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from engine.config.model_config import ModelConfig
from engine.loading.weight_reader import read_index
from engine.loading.weights import FP32_PARAMS, fp8_modules, load_weights
from engine.model import GlmDsaForCausalLM
from engine.model.fp8 import convert_to_fp8
from engine.model.layers import GatedMLP, RMSNorm
from engine.model.mla import Indexer, MLAttention
from engine.model.moe import Experts, MoE, MoEGate
from kernels.fp8_moe import fused_moe_fp8, fused_moe_fp8_ref
from kernels.moe import fused_moe, fused_moe_ref


def build_model(cfg: ModelConfig, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                with_mtp: bool = True, checkpoint: str | Path | None = None,
                expert_shard: tuple[int, int] | None = None) -> GlmDsaForCausalLM:
    """Without a checkpoint the weights are left uninitialised (callers fill them, e.g. random init).

    `expert_shard` (offset, num_local): keep only those routed experts (expert parallelism); the others
    are never allocated and the loader skips their tensors.
    """
    with torch.device("meta"):
        model = GlmDsaForCausalLM(cfg, with_mtp=with_mtp)
        if expert_shard is not None:
            for m in list(model.modules()):
                if isinstance(m, MoE):
                    m.experts = Experts(cfg, num_local=expert_shard[1], offset=expert_shard[0])
        if cfg.quantization == "fp8":
            # which modules are FP8: the config's list, else the checkpoint's tensors (engine/model/fp8.py)
            from_ckpt = checkpoint is not None and not cfg.quantize_at_load
            convert_to_fp8(model, cfg, fp8_modules(read_index(checkpoint)) if from_ckpt else None)
        # set dtypes while nothing is allocated: materialising fp32 first would double the peak memory
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            want = torch.float32 if name.endswith(FP32_PARAMS) else dtype
            if p.is_floating_point() and p.dtype != want and p.dtype != torch.float8_e4m3fn:
                p.data = p.data.to(want)
    model = model.to_empty(device=device)
    model.load_report = None
    if checkpoint is not None:
        model.load_report = load_weights(model, checkpoint, cfg)
    return model.eval().requires_grad_(False)


def dummy_init(model: GlmDsaForCausalLM, seed: int = 0, std: float = 0.02) -> None:
    """`--load-format dummy`: random weights drawn on the model's device (benchmarks of real shapes
    without a checkpoint). Norm weights are 1, biases 0, the routing bias small and random.

    Routed experts are drawn one expert at a time, seeded by their global id, so an expert-parallel rank
    holding experts [offset, offset + n) gets the same weights as one rank holding them all (the
    multi-GPU benchmarks compare the two)."""
    expert_offset = {id(p): m.offset for m in model.modules() if isinstance(m, Experts)
                     for p in (m.w13, m.w2)}
    with torch.no_grad():
        for i, (name, p) in enumerate(sorted(list(model.named_parameters()) + list(model.named_buffers()))):
            g = torch.Generator(device=p.device)
            g.manual_seed(seed * 100003 + i)
            if name.endswith("_scale_inv"):
                p.fill_(std)  # FP8 codes are drawn N(0, 1): weight = code x scale ~ N(0, std)
            elif id(p) in expert_offset:
                for e in range(p.shape[0]):
                    g.manual_seed((seed * 100003 + i) * 4099 + expert_offset[id(p)] + e)
                    _normal(p[e], 1.0 if p.dtype == torch.float8_e4m3fn else std, g)
            elif name.endswith(("norm.weight", "layernorm.weight")):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            elif name.endswith("e_score_correction_bias"):
                p.normal_(0.0, 0.01, generator=g)
            else:
                _normal(p, 1.0 if p.dtype == torch.float8_e4m3fn else std, g)


def _normal(t: torch.Tensor, std: float, g: torch.Generator) -> None:
    if t.dtype == torch.float8_e4m3fn:  # no RNG for fp8: draw in fp32, one tensor (or expert) at a time
        t.copy_(torch.empty(t.shape, device=t.device).normal_(0.0, std, generator=g))
    else:
        t.normal_(0.0, std, generator=g)


def use_kernels(model: GlmDsaForCausalLM, on: bool, fused: bool = True) -> None:
    """Route every MoE layer through the Triton grouped GEMM and, with `fused`, the norms, RoPE and routing
    through their one-launch kernels (on: CUDA), or everything through the torch references (off).
    on with fused=False keeps the eager small ops beside the kernels: the engine always fuses; the eager ops
    are the reference tests/engine/model/test_fused_ops.py compares the fused ones against."""
    small = on and fused
    for m in model.modules():
        if isinstance(m, Experts):
            kernel = fused_moe_fp8 if m.fp8 else fused_moe
            m.impl = (kernel if small else partial(kernel, small_routing=False)) if on else (
                fused_moe_fp8_ref if m.fp8 else fused_moe_ref)
        elif isinstance(m, (RMSNorm, MLAttention, Indexer, MoEGate, GatedMLP)):
            m.fused = small
