"""`pdserve serve MODEL [flags]`: the topology vLLM-style flags derive on hosts of 0, 1 and 16 GPUs, where each
flag lands, and the refusals; the derived topology passes the launcher's own checks."""

from __future__ import annotations

import pytest
import yaml

from services.launch import topology
from services.launch.placement import check_placement
from services.launch.process_specs import describe, plan
from services.launch.serve import derive, parse_args, serve_main, to_topology

REFERENCE = ["/models/GLM-5.3-FP8", "-pcp", "8", "-dcp", "8", "-dp", "8", "--enable-expert-parallel",
             "--kv-cache-dtype", "fp8_ds_mla", "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 3}',
             "--attention-config", '{"hisparse_config": {"host_pool_gib": 48}, "sparse_mla_force_mqa": true}',
             "--tool-call-parser", "glm47", "--reasoning-parser", "glm45", "--enable-auto-tool-choice",
             "--served-model-name", "glm-5.3", "--max-num-seqs", "64", "--enforce-eager", "--port", "8001"]


def _topo(argv: list[str], gpus: int) -> dict:
    a, extra = parse_args(argv)
    raw = to_topology(derive(a, extra, gpus))
    check_placement(topology.load(raw))
    return raw


def test_the_reference_node_pair_on_one_16_gpu_host():
    raw = _topo(REFERENCE, 16)
    s = raw["services"]
    assert s["prefill"]["gpus"] == list(range(8)) and s["decode"]["gpus"] == list(range(8, 16))
    assert (s["prefill"]["prefill_context_parallel_size"], s["prefill"]["decode_context_parallel_size"],
            s["decode"]["data_parallel_size"]) == (8, 8, 8)
    # MTP and HiSparse are decode's; the rest of the attention config and every unknown flag go to both engines
    pre, dec = s["prefill"]["args"], s["decode"]["args"]
    assert "speculative-config" not in pre and dec["speculative-config"]["method"] == "mtp"
    assert pre["attention-config"] == {"sparse_mla_force_mqa": True}
    assert dec["attention-config"] == {"sparse_mla_force_mqa": True, "hisparse_config": {"host_pool_gib": 48}}
    for kind in ("prefill", "decode"):
        args = s[kind]["args"]
        assert args["max-num-seqs"] == "64" and args["enforce-eager"] is True and args["enable-expert-parallel"] is True
    assert s["kvstore"]["args"]["kv-cache-dtype"] == "fp8_ds_mla"
    router = s["router"]
    assert router["port"] == 8001 and router["args"]["tool-call-parser"] == "glm47"
    assert router["args"]["served-model-name"] == ["glm-5.3"] and router["args"]["enable-auto-tool-choice"] is True
    assert raw["env"]["NCCL_NVLS_ENABLE"] == "0"


def test_the_16_gpu_dry_run_plans_the_reference_processes():
    raw = _topo(REFERENCE, 16)
    topo = topology.load(raw)
    text = describe(topo, topo.redis_url, plan(topo, topo.redis_url))
    for name in [f"prefill-0.rank{r}" for r in range(8)] + [f"decode-0.rank{r}" for r in range(8)]:
        assert f"\n{name}\n" in text, name
    assert "kvstore-0" in text and "router-0" in text and text.rstrip().endswith("18 processes")
    assert "CUDA_VISIBLE_DEVICES=8,9,10,11,12,13,14,15 LOCAL_RANK=7" in text  # decode rank 7 on GPU 15


def test_one_gpu_is_shared_and_no_gpu_is_cpu():
    one = _topo(["ckpt", "--gpu-memory-utilization", "0.8"], 1)["services"]
    assert one["prefill"]["gpus"] == one["decode"]["gpus"] == [0]
    assert one["prefill"]["args"]["gpu-memory-utilization"] == one["decode"]["args"]["gpu-memory-utilization"] == 0.4
    cpu = _topo(["ckpt"], 0)["services"]
    assert "gpus" not in cpu["prefill"] and "device" not in cpu["prefill"]["args"]


@pytest.mark.parametrize("argv, gpus, match", [
    (REFERENCE, 8, "16 in all; this host has 8"),
    (["ckpt", "-dp", "2"], 1, r"decode 2 \(DP 2\), 3 in all"),
    (["ckpt", "--speculative-config", "[1]"], 0, "JSON object"),
    (["ckpt", "-pcp", "0"], 0, ">= 1"),
    (["ckpt", "stray"], 0, "unexpected argument"),
    (["ckpt", "-pcp", "4", "-dcp", "2"], 0, r"parallel-size 2\): decode_context_parallel_size must be"),
    (["ckpt", "--enable-auto-tool-choice"], 0, "needs --tool-call-parser"),
])
def test_what_cannot_run_is_refused_with_the_reason(argv, gpus, match):
    a, extra = parse_args(argv)
    with pytest.raises(ValueError, match=match):
        derive(a, extra, gpus)


def test_dry_run_and_emitted_topology_start_the_same(tmp_path, capsys):
    out = tmp_path / "topo.yaml"
    assert serve_main(["checkpoints/tiny-code", "--dry-run", "--emit-topology", str(out), "--port", "0"]) == 0
    printed = capsys.readouterr().out
    assert "prefill-0" in printed and "decode-0" in printed and "router-0" in printed
    emitted = topology.load(yaml.safe_load(out.read_text()))
    assert {s.kind for s in emitted.services} == {"prefill", "decode", "router", "kvstore"}
    assert serve_main(["checkpoints/tiny-code", "--dry-run", "-dp", "2", "--device", "cuda"]) == 2  # no GPU here
