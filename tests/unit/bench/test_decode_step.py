"""bench.decode_step at CPU scale: every mode (async scheduling included) and engine reports a row, the
floor's parts add up, and the GPU busy time is the union of kernel intervals (overlaps counted once)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from bench.decode_step import busy_seconds, main


def test_busy_time_is_the_union_of_kernel_intervals():
    cuda = torch.autograd.DeviceType.CUDA

    def ev(a, b, dev=cuda):
        return SimpleNamespace(device_type=dev, time_range=SimpleNamespace(start=a, end=b))

    prof = SimpleNamespace(events=lambda: [ev(0, 10), ev(5, 12), ev(20, 30), ev(21, 25), ev(0, 100, dev=None)])
    assert busy_seconds(prof) == (12 + 10) / 1e6


def test_modes_and_floor_on_cpu(tiny_code, tmp_path):
    res = main(["--model", str(tiny_code), "--batches", "1,3", "--steps", "2", "--warmup", "1", "--prompt-len", "40",
                "--num-blocks", "600", "--hisparse-pool-gib", "0.05", "--hisparse-batches", "2",
                "--async-scheduling", "--out", str(tmp_path / "d.json")])
    got = [(r["engine"], r["mode"], r["batch"]) for r in res["rows"]]
    assert got == [("resident", "eager", 1), ("resident", "eager", 3), ("resident", "graphs", 1),
                   ("resident", "graphs", 3), ("resident", "async", 1), ("resident", "async", 3),
                   ("hisparse", "eager", 2), ("hisparse", "static", 2), ("hisparse", "async", 2)]
    for r in res["rows"]:
        fb = r["floor_bytes"]
        assert r["wall_ms"] > 0 and r["tokens_per_step"] >= r["batch"]
        assert r["decoding_requests"] == [r["batch"]] * 2 and r["preemptions"] == 0 and r["waiting_requests"] == 0
        assert fb["target_weights"] > 0 and fb["mtp_weights"] > 0 and fb["kv"] > 0
        assert abs(fb["total"] - fb["target_weights"] - fb["mtp_weights"] - fb["kv"]) < 1
    one, three = res["rows"][0]["floor_bytes"], res["rows"][1]["floor_bytes"]
    assert three["kv"] == 3 * one["kv"] and three["target_weights"] >= one["target_weights"]
    assert (tmp_path / "d.json").exists()


def test_roofline_counts_compute_where_it_binds(tiny_code):
    """bench.decode_step.roofline_ms on tiny-code's model (built on meta): with unlimited bandwidth every part
    is its FLOPs over the rate (attention as written out here), with unlimited compute its bytes, and the
    verify pass's parts grow with the batch."""
    from bench.decode_step import roofline_ms
    from engine.config.arg_utils import EngineArgs
    from engine.kv.cache import KVCacheSpec
    from engine.loading.loader import build_model

    cfg = EngineArgs(model=str(tiny_code), device="cpu", num_blocks=8,
                     speculative_config={"method": "mtp", "num_speculative_tokens": 3}).create_engine_config()
    mc = cfg.model
    model = build_model(mc, device=torch.device("meta"), with_mtp=True)
    spec = KVCacheSpec.from_model(mc, block_size=cfg.cache.block_size, kv_cache_dtype=cfg.cache.kv_cache_dtype,
                                  indexer_precision=cfg.cache.indexer_precision, with_mtp=True)
    core = SimpleNamespace(runner=SimpleNamespace(model=model, spec=spec), cfg=cfg)
    B, ctx, rate = 8, 3000, 1.0  # TFLOP/s
    compute = roofline_ms(core, B, ctx, 1e9, rate)
    layers = len(model.model.layers)
    n_idx = sum(layer.self_attn.indexer is not None for layer in model.model.layers)
    rows, n = B * 4, min(ctx, mc.index_topk)
    flops = layers * rows * mc.num_attention_heads * n * 2 * (2 * mc.kv_lora_rank + mc.qk_rope_head_dim)
    idx = n_idx * rows * mc.index_n_heads * mc.index_head_dim * 2 * ctx
    assert abs(compute["target_attention"] - 1e3 * (flops / 1e12 + idx / 2e12)) < 1e-9
    memory = roofline_ms(core, B, ctx, 1e-6, 1e9)
    assert memory["target_attention"] > 0 and memory["target_weights"] > 0 and memory["mtp"] > 0
    for r in (compute, memory):
        assert abs(r["total"] - r["target_weights"] - r["target_attention"] - r["mtp"]) < 1e-9
    assert roofline_ms(core, 2 * B, ctx, 1e9, rate)["target_weights"] > 1.9 * compute["target_weights"]


def test_standin_roofline_without_a_gpu(tmp_path):
    """--standin --roofline-only: GLM-5.3's one-rank model on meta; at batch 64 with MTP3 and a 4K context the
    verify pass's attention is compute-bound (over its KV bytes), so the roofline exceeds the memory floor."""
    res = main(["--standin", "--roofline-only", "4.27,679", "--contexts", "320,4096", "--batches", "64",
                "--out", str(tmp_path / "r.json")])
    short, long = res["roofline"]
    assert (short["context"], long["context"]) == (320, 4096) and (tmp_path / "r.json").exists()
    assert 25 < short["floor_ms"] < 32  # 105 GiB of FP8 weights, experts at their touched share, at 4.27 TB/s
    assert long["roofline_ms"]["target_attention"] > 5 * short["roofline_ms"]["target_attention"]
    assert long["roofline_ms"]["total"] > long["floor_ms"]


def test_switch_variants_time_one_engine_each(tiny_code, monkeypatch):
    """--switch-variants: each variant's rows carry the switches they ran under, set before its engine was built;
    an unknown switch is refused with the known ones named."""
    from engine.model.layers import GatedMLP, RMSNorm
    from engine.model.mla import MLAttention

    # the variants set the class switches: restored after the test
    monkeypatch.setattr(GatedMLP, "fused_activation", True)
    monkeypatch.setattr(RMSNorm, "quantize", True)
    monkeypatch.setattr(MLAttention, "absorbed_in_place", True)
    res = main(["--model", str(tiny_code), "--batches", "1", "--steps", "1", "--warmup", "1", "--prompt-len", "16",
                "--num-blocks", "64", "--modes", "eager", "--switch-variants", "none,norm_quant"])
    assert [r["switches"] for r in res["rows"]] == [
        {"fused_activation": False, "norm_quant": False, "absorbed_in_place": False},
        {"fused_activation": False, "norm_quant": True, "absorbed_in_place": False}]
    with pytest.raises(SystemExit, match="known: .*fused_activation"):
        main(["--model", str(tiny_code), "--switch-variants", "none,fast"])
