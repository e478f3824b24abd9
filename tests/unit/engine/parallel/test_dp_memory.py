"""A GLM-5.3 decode rank of a DP8 x EP group, built on the meta device by the engine's own rank builder:
it holds 1/8 of the routed experts and every other weight whole."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from engine.config.engine import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from engine.config.presets import preset
from engine.model.moe import Experts
from engine.parallel.dp_runner import build_rank_model

GIB = 1 << 30


def _cfg(dp: int, ep: bool) -> EngineConfig:
    return EngineConfig(model_path=Path("glm-5.3"), model=preset("glm-5.3"), cache=CacheConfig(),
                        scheduler=SchedulerConfig(max_model_len=4096),
                        parallel=ParallelConfig(data_parallel_size=dp, enable_expert_parallel=ep),
                        dtype="bfloat16", load_format="dummy")


def _split(model) -> tuple[int, int]:
    """(routed-expert parameters, every other parameter)."""
    routed = sum(p.numel() for m in model.modules() if isinstance(m, Experts) for p in m.parameters())
    return routed, sum(p.numel() for p in model.parameters()) - routed


def test_glm53_decode_rank_holds_one_eighth_of_the_routed_experts():
    meta = torch.device("meta")
    whole_routed, whole_rest = _split(build_rank_model(_cfg(8, False), 0, meta))  # replicated experts
    mc = preset("glm-5.3")
    moe_layers = sum(t == "sparse" for t in mc.mlp_layer_types) + 1  # + the MTP layer's MoE
    assert whole_routed == moe_layers * mc.n_routed_experts * 3 * mc.hidden_size * mc.moe_intermediate_size
    for rank in (0, 7):
        model = build_rank_model(_cfg(8, True), rank, meta)
        routed, rest = _split(model)
        assert routed * 8 == whole_routed and rest == whole_rest
        offsets = {m.offset for m in model.modules() if isinstance(m, Experts)}
        assert offsets == {rank * mc.n_routed_experts // 8}
    per_rank_gib = (whole_routed / 8 + whole_rest) * 2 / GIB  # bf16 (the router's fp32 gate is negligible)
    assert 150 < whole_routed / 8 * 2 / GIB < 180 and 25 < whole_rest * 2 / GIB < 40, per_rank_gib
    print(f"\nGLM-5.3 DP8 x EP decode rank, bf16: {per_rank_gib:.1f} GiB "
          f"({whole_routed / 8 * 2 / GIB:.1f} routed experts + {whole_rest * 2 / GIB:.1f} replicated)")


def test_glm53_decode_rank_in_fp8_fits_its_budget():
    """FP8 block-scaled weights (embeddings, lm_head and the router stay bf16/fp32): <= 106 GiB per rank."""
    from engine.loading.weight_stats import weight_bytes_by_dtype

    def rank_bytes(ep: bool) -> int:
        cfg = _cfg(8, ep)
        mc = dataclasses.replace(cfg.model, quantization="fp8", weight_block_size=(128, 128))
        model = build_rank_model(dataclasses.replace(cfg, model=mc), 3, torch.device("meta"))
        return sum(weight_bytes_by_dtype(model).values())

    ep_rank, replicated = rank_bytes(True), rank_bytes(False)
    routed = (replicated - ep_rank) * 8 / 7  # what the other 7/8 of the experts took
    assert ep_rank <= 106 * GIB and 80 * GIB < routed / 8 < 90 * GIB, (ep_rank / GIB, routed / 8 / GIB)
