"""`pdserve plan` against numbers derived by hand from the glm-5.3 config (docs/model.md, docs/kv-formats.md,
docs/deployment.md).

glm-5.3: hidden 6144, 78 layers (first 3 dense), 64 heads, q_lora 2048, kv_lora 512, qk_nope 192,
qk_rope 64, v 256, 256 experts (top-8, one shared, width 2048), indexer 32 heads x 128, top-k 2048,
full indexer layers 0, 1, 2, 6, 10, ..., 74 (3 + 18 = 21), vocab 154,880, one MTP layer.

    fp8_ds_mla row  = 512 fp8 + 4 scales x 4 B + 64 rope x 2 B = 656 B;   indexer row = 128 + 4 = 132 B
    KV per token    = 78 x 656 + 21 x 132 + (656 + 132) = 51,168 + 2,772 + 788 = 54,728 B
    one 64-token block = 79 x 64 x 656 (3,316,736 MLA) + 22 x 64 x 132 (185,856 indexer) = 3,502,592 B
"""

from __future__ import annotations

import json
import math

import pytest

from engine.config.presets import preset
from planner import cli as plan_cli
from planner.capacity import GIB, Deployment, capacity, kv_components, kv_spec, request_kv, tokens_on_rank, weight_bytes
from planner.roofline import active_params, indexer_crossover, intensity, prefill_flops
from tests.helpers import ROOT

BLOCK = 3_502_592
MLA_BLOCK, INDEX_BLOCK = 3_316_736, 185_856


@pytest.fixture(scope="module")
def cfg():
    return preset("glm-5.3")


@pytest.fixture(scope="module")
def dep():
    # the reference deployment with the KV budget pinned at 15 GiB (docs/deployment.md, "Memory per GPU") so the
    # fits are exact
    return Deployment(gpus=8, pcp=8, dcp=8, tp=1, dp=8, kv_gib=15.0, hisparse_pool_gib=48.0)


def test_kv_bytes_per_token_by_component(cfg, dep):
    assert kv_components(cfg, dep) == {"mla": 78 * 656, "indexer": 21 * 132, "mtp_mla": 656, "mtp_indexer": 132,
                                       "total": 54_728}
    assert kv_spec(cfg, dep).block_bytes == BLOCK == MLA_BLOCK + INDEX_BLOCK


def test_request_kv_at_1m_and_per_gpu_under_dcp8(cfg, dep):
    spec = kv_spec(cfg, dep)
    # 1,048,576 tokens = 16,384 blocks: 57,386,467,328 B = 53.45 GiB; DCP8: 131,072 tokens = 2,048 blocks per GPU
    assert request_kv(spec, 1 << 20) == 16_384 * BLOCK == 57_386_467_328
    assert request_kv(spec, 1 << 20, 8) == 2_048 * BLOCK
    assert round(request_kv(spec, 1 << 20) / GIB, 2) == 53.45 and round(2_048 * BLOCK / GIB, 2) == 6.68
    # 1,000 tokens, DCP8: interleave 1 puts ceil(1000/8) = 125 on rank 0; interleave 64 gives rank 0
    # blocks 0 and 8 = 128 tokens (1000 = 512 + 488, and rank 0 gets the first 64 of each 512)
    assert tokens_on_rank(1000, 8, 1) == 125 and tokens_on_rank(1000, 8, 64) == 128
    assert request_kv(spec, 1000, 8, 64) == 2 * BLOCK


def test_parameter_count_and_expert_bytes(cfg):
    # per layer: attention q_a 12,582,912 + q_b 33,554,432 + kv_a 3,538,944 + kv_b 14,680,064
    #            + o 100,663,296 + norms 2,048 + 512 = 165,022,208, layer norms 12,288
    # indexer 8,388,608 + 786,432 + 256 + 196,608 = 9,371,904 (21 layers); dense MLP 226,492,416 (3)
    # MoE 256 x 37,748,736 + shared 37,748,736 + router 1,572,864 = 9,702,998,016 (75)
    # embeddings + lm_head 2 x 951,582,720, final norm 6,144
    expected = (2 * 951_582_720 + 6_144 + 78 * (165_022_208 + 12_288) + 21 * 9_371_904 + 3 * 226_492_416
                + 75 * 9_702_998_016)
    assert expected == 743_377_000_704
    assert weight_bytes(cfg, False, "fp8").num_params == expected
    # fp8 expert: w13 [4096, 6144] 25,165,824 B + 32 x 48 scales x 4 B; w2 [6144, 2048] 12,582,912 B
    # + 48 x 16 x 4 B -> 37,757,952 B; 76 MoE layers (with MTP) x 256 experts
    w = weight_bytes(cfg, True, "fp8")
    assert w.experts == 76 * 256 * 37_757_952
    assert w.per_gpu(tp=1, ep=8) == w.replicated + w.tp_split + w.experts // 8


def test_what_fits_at_128k_and_largest_contexts(cfg, dep):
    c = capacity(cfg, dep, [131_072])
    budget = 15 * GIB  # 16,106,127,360
    row = c["contexts"][0]
    # prefill, DCP8: 16,384 tokens = 256 blocks per GPU (896,663,552 B) + two gather buffers
    # 2 x 131,072 x (656 + 132) = 206,569,472 B -> (budget - 206,569,472) // 896,663,552 = 17
    assert row["prefill_concurrency"] == (budget - 206_569_472) // (256 * BLOCK) == 17
    # decode resident: 2,048 blocks = 7,173,308,416 B -> 2 fit in 15 GiB
    assert row["decode_concurrency_resident"] == 2
    # spilled: GPU 2,048 x 185,856 + 79 layers x 4,097 rows x 656 B = 592,956,016; host 2,048 x 3,316,736 =
    # 6,792,675,328 -> the 48 GiB pool takes 7; 15 GiB - 7 x 592,956,016 leaves room for 1 resident
    assert row["decode_concurrency_hybrid"] == 7 + (budget - 7 * 592_956_016) // (2_048 * BLOCK) == 8
    mc = c["max_context"]
    assert mc["prefill"] == 1 << 20  # 6.68 GiB + 1.54 GiB of gather buffers: the max position limits it
    assert mc["decode_resident"] == (budget // BLOCK) * 64 == 294_272  # 4,598 blocks
    assert mc["decode_hisparse"] == (48 * GIB // MLA_BLOCK) * 64 == 994_496  # the host pool limits it


def test_tp8_prefill_fits_less(cfg):
    tp8 = Deployment(gpus=8, pcp=1, dcp=1, tp=8, kv_gib=15.0)
    assert capacity(cfg, tp8, [131_072])["max_context"]["prefill"] == 294_272  # no DCP: whole KV per GPU


def test_sparse_mla_roofline(cfg, dep):
    spec = kv_spec(cfg, dep)
    # per query, layer: FLOPs = H x 2048 x 2 x (576 + 512); bytes = 2048 x (656 + 4) + H x (2x576 + 2x512 + 4)
    assert intensity(cfg, spec, 8) == pytest.approx(35_651_584 / 1_369_120)  # 26.0 FLOP/B (TP8)
    assert intensity(cfg, spec, 64) == pytest.approx(285_212_672 / 1_491_200)  # 191.3 FLOP/B (PCP)
    assert 989 / 4.8 == pytest.approx(206.04, abs=0.01)  # H200 ridge: both memory-bound, PCP close to it


def test_prefill_flops_split(cfg, dep):
    spec = kv_spec(cfg, dep)
    act = active_params(cfg, True)
    # MoE per token, 76 layers: 8/256 of 256 experts x 37,748,736 + shared 37,748,736 + router 1,572,864
    assert act.moe == 76 * (8 * 37_748_736 + 37_748_736 + 1_572_864)
    # rest: 79 x attention 165,019,648 + 22 x indexer 9,371,648 + 3 dense MLPs + MTP eh_proj 6144 x 12288
    assert act.rest == 79 * 165_019_648 + 22 * 9_371_648 + 3 * 226_492_416 + 6144 * 12288
    f = prefill_flops(cfg, spec, 8192, True)
    assert f["indexer"] == 22 * 2 * 32 * 128 * 8192 * 8193 // 2
    assert f["sparse_mla"] == 79 * 64 * 2176 * (2048 * 2049 // 2 + (8192 - 2048) * 2048)
    assert f["moe"] == 2 * 8192 * act.moe and f["total"] == sum(v for k, v in f.items() if k != "total")


@pytest.mark.parametrize("divisor,approx", [(8, 30_195), (1, 249_014)])
def test_indexer_overtakes_sparse_mla(cfg, dep, divisor, approx):
    # for L > 2048: indexer 22 x 4096 x L(L+1); MLA 79 x 139,264 x (2048 L - 2,096,128) / divisor
    # (TP8 replicates the indexer and splits MLA heads: divisor 8; PCP8 splits both: divisor 1)
    a, mla = 22 * 4096, 79 * 139_264
    crossing = lambda n: a * n * (n + 1) * divisor - mla * (2048 * n - 2_096_128)
    b, c0 = a * divisor - mla * 2048, mla * 2_096_128
    root = (-b + math.sqrt(b * b - 4 * a * divisor * c0)) / (2 * a * divisor)
    got = indexer_crossover(cfg, kv_spec(cfg, dep), True, mla_divisor=divisor)
    assert crossing(got - 1) < 0 <= crossing(got) and abs(got - root) < 1
    # docs/deployment.md, "Rooflines that shape the layout": near 32K under TP8, near 256K under PCP8
    assert got == approx


def test_plan_cli_json_and_errors(capsys, tmp_path):
    assert plan_cli.main(["--json", "--contexts", "4096,131072", "--kv-gib", "15"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kv_bytes_per_token"]["total"] == 54_728 and [r["context"] for r in out["contexts"]] == [4096, 131_072]
    assert out["prefill_flops"]["crossover_tp"] == 30_195 and out["roofline"]["tp_heads"] == 8
    assert plan_cli.main(["--gpus", "8", "--pcp", "4", "--tp", "1"]) == 2
    assert "PCP x TP" in capsys.readouterr().err
    assert plan_cli.main(["--model", str(tmp_path / "nope.json")]) == 2


def test_plan_table_on_a_config_file(capsys):

    tiny = ROOT / "checkpoints" / "tiny-code"
    assert plan_cli.main(["--model", str(tiny), "--gpus", "2", "--pcp", "2", "--dcp", "2", "--dp", "2",
                          "--kv-gib", "1", "--hisparse-pool-gib", "1", "--kv-offloading-gib", "1"]) == 0
    text = capsys.readouterr().out
    assert "KV bytes per token" in text and "Indexer overtakes sparse MLA" in text


def test_rank_weights_come_from_the_engine_meta_model(cfg):
    """PCP8 x EP8 prefill ranks and DP8 x EP8 decode ranks of GLM-5.3 in FP8 fit in 106 GiB (15 GiB of KV
    left at 0.9 of 140 GiB less the reserve); the bytes are the engine's own parameters for that rank."""
    import dataclasses

    import torch

    from engine.loading.loader import build_model
    from engine.model.fp8 import Fp8Linear
    from planner.capacity import rank_weight_bytes, weights_per_gpu

    dep = Deployment()
    for role in ("prefill", "decode"):
        assert weights_per_gpu(cfg, dep, role) <= 106 * GIB
    by = rank_weight_bytes(cfg, True, "fp8", 8)
    fp8 = dataclasses.replace(cfg, quantization="fp8", weight_block_size=(128, 128))
    model = build_model(fp8, device="meta", dtype=torch.bfloat16, with_mtp=True, expert_shard=(0, 32))
    assert model.model.layers[5].mlp.experts.w13.shape[0] == 32
    assert isinstance(model.model.layers[5].self_attn.kv_b_proj, Fp8Linear)
    assert by["float8_e4m3fn"] == sum(p.numel() for p in model.parameters() if p.dtype == torch.float8_e4m3fn)
    assert sum(by.values()) == weights_per_gpu(cfg, dep, "decode")
    assert weights_per_gpu(cfg, Deployment(weight_dtype="bf16"), "prefill") > 200 * GIB  # why FP8 is needed


def test_decode_host_memory_counts_the_kv_offload_tier(cfg, dep):
    c = capacity(cfg, dep, [131_072])
    # the decode rank's 16 GiB tier keeps whole blocks (MLA + indexer): 17,179,869,184 // (2,048 x 3,502,592) = 2
    assert c["contexts"][0]["decode_tier_contexts"] == 16 * GIB // (2_048 * BLOCK) == 2
    assert c["decode_host_bytes_per_rank"] == {"hisparse_pool": 48 * GIB, "kv_offloading": 16 * GIB,
                                               "total": 64 * GIB, "host_per_gpu": 256 * GIB}
    off = capacity(cfg, Deployment(kv_gib=15.0, decode_kv_offloading_gib=0), [131_072])
    assert off["contexts"][0]["decode_tier_contexts"] == 0
    with pytest.raises(ValueError, match="HiSparse pool 48.0 GiB \\+ KV offloading 16.0 GiB exceeds"):
        Deployment(host_gib=60.0)
    with pytest.raises(ValueError, match="--decode-kv-offloading-gib must be >= 0"):
        Deployment(decode_kv_offloading_gib=-1)


def test_plan_cli_decode_offloading_flag(capsys):
    assert plan_cli.main(["--json", "--contexts", "131072", "--kv-gib", "15", "--decode-kv-offloading-gib", "32"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["deployment"]["decode_kv_offloading_gib"] == 32 and out["contexts"][0]["decode_tier_contexts"] == 4
    assert plan_cli.main(["--decode-kv-offloading-gib", "300"]) == 2
    assert "exceeds host memory per GPU" in capsys.readouterr().err
