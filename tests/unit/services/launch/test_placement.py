"""GPU placement and multi-host topologies: the reference two-host files, `pdserve up --dry-run`,
CUDA_VISIBLE_DEVICES / LOCAL_RANK per process, advertised addresses, and every refusal before start."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.config.arg_utils import EngineArgs
from services.decode.main import parse_args as parse_decode_args
from services.launch import topology
from services.launch.placement import check_placement, placement
from services.launch.process_specs import plan
from services.rpc import net
from tests.helpers import ROOT

H200 = ROOT / "configs" / "h200x16"


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_decode_host_is_one_dp8_ep8_group_on_8_gpus():
    topo = topology.load(H200 / "decode-host.yaml")
    procs = plan(topo, topo.redis_url)
    assert [p.name for p in procs] == [f"decode-0.rank{r}" for r in range(8)]
    assert [p.placement.gpu for p in procs] == list(range(8))
    assert all(p.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7" for p in procs)  # NCCL sees the group's GPUs
    assert [p.env["LOCAL_RANK"] for p in procs] == [str(r) for r in range(8)]
    assert [p.address for p in procs] == ["10.0.0.2:50071"] + [""] * 7  # rank 0 serves every rank's instance
    for r, p in enumerate(procs):
        assert _flag(p.cmd, "--port") == "50071" and _flag(p.cmd, "--instance-id") == "decode-0"
        assert _flag(p.cmd, "--data-parallel-size") == "8" and "--enable-expert-parallel" in p.cmd
        assert _flag(p.cmd, "--rank") == str(r) and _flag(p.cmd, "--world-size") == "8"
        assert _flag(p.cmd, "--master-addr") == "127.0.0.1"
        assert _flag(p.cmd, "--advertise-host") == "10.0.0.2" and _flag(p.cmd, "--host") == "0.0.0.0"
        assert '"host_pool_gib": 48' in _flag(p.cmd, "--attention-config")
        assert float(_flag(p.cmd, "--kv-offloading-size")) == 16  # GiB of host KV tier behind the pool
        assert '"num_speculative_tokens": 3' in _flag(p.cmd, "--speculative-config")
        assert p.env["NCCL_NVLS_ENABLE"] == "0" and "UCX_TLS" in p.env
    engine = EngineArgs.from_cli_args(parse_decode_args(procs[0].cmd[procs[0].cmd.index("services.decode") + 1:]))
    assert engine.kv_offloading_size == 16 and engine.attention_config["hisparse_config"]["host_pool_gib"] == 48


def test_prefill_host_has_8_ranks_on_gpus_0_to_7_and_a_512_gib_kvstore():
    topo = topology.load(H200 / "prefill-host.yaml")
    procs = plan(topo, topo.redis_url)
    ranks = [p for p in procs if p.kind == "prefill"]
    assert [p.placement.gpu for p in ranks] == list(range(8))
    assert all(p.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7" for p in ranks)
    assert [p.env["LOCAL_RANK"] for p in ranks] == [str(r) for r in range(8)]
    line = " ".join(ranks[0].cmd)
    assert ("--prefill-context-parallel-size 8 --decode-context-parallel-size 8" in line and "--dcp-comm-backend ag_rs"
            in line and "--enable-expert-parallel" in ranks[0].cmd and '{"sparse_mla_force_mqa": true}' in line)
    (kvstore,) = [p for p in procs if p.kind == "kvstore"]
    assert _flag(kvstore.cmd, "--pool-gib") == "512" and kvstore.placement.gpu is None
    assert {p.kind for p in procs} == {"kvstore", "prefill", "router"}
    decode = topology.load(H200 / "decode-host.yaml")
    assert topo.redis_url == decode.redis_url and topo.multi_host and decode.multi_host


def test_no_process_advertises_a_wildcard(monkeypatch):
    for f in (H200 / "prefill-host.yaml", H200 / "decode-host.yaml", ROOT / "configs" / "topology.gpu-1.yaml"):
        for p in plan(topology.load(f), "redis://x:1/0"):
            assert _flag(p.cmd, "--advertise-host") not in ("0.0.0.0", "::", "")
            assert not p.address.startswith("0.0.0.0")
    monkeypatch.setattr(net, "routable_address", lambda: "192.0.2.7")
    topo = topology.load({"model": "m", "host": "0.0.0.0", "services": {"router": {}}})
    assert topo.advertised == "192.0.2.7"  # bind all, advertise this host's routable address
    assert net.advertise_host(None, "0.0.0.0") == "192.0.2.7"
    assert net.advertise_host("0.0.0.0", "10.1.1.1") == "10.1.1.1"
    assert net.advertise_host(None, "127.0.0.1") == "127.0.0.1"


def test_dry_run_prints_every_process_and_starts_nothing(tmp_path):
    r = subprocess.run([sys.executable, "-m", "services.cli", "up", "--config", str(H200 / "decode-host.yaml"),
                        "--dry-run"], capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for r in range(8):
        assert f"decode-0.rank{r}\n" in out and f"LOCAL_RANK={r}," in out and f"--rank {r} --world-size 8" in out
    assert out.count("CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 ") == 8 and out.count("--port 50071 ") == 8
    assert "--data-parallel-size 8" in out and "--enable-expert-parallel" in out
    assert "advertises 10.0.0.2" in out and "8 processes" in out and "0.0.0.0:" not in out
    assert out.count("--kv-offloading-size 16") == 8


def test_gpu_1_topology_shares_one_gpu():
    topo = topology.load(ROOT / "configs" / "topology.gpu-1.yaml")
    check_placement(topo, num_gpus=1)
    procs = plan(topo, topo.redis_url)
    assert {p.env.get("CUDA_VISIBLE_DEVICES") for p in procs if p.kind in ("prefill", "decode")} == {"0"}
    decode = topo.service("decode").args
    assert decode["kv-cache-dtype"] == "fp8_ds_mla" and decode["speculative-config"]["num_speculative_tokens"] == 3
    assert decode["attention-config"]["hisparse_config"]["host_pool_gib"] > 0


def test_multi_rank_placement_per_replica():
    spec = topology.load({"model": "m", "services": {"prefill": {
        "replicas": 2, "prefill_context_parallel_size": 2, "gpus": [4, 5, 6, 7]}}}).service("prefill")
    got = [(placement(spec, r, k).gpu, placement(spec, r, k).env()) for r in range(2) for k in range(2)]
    assert got == [(4, {"CUDA_VISIBLE_DEVICES": "4,5", "LOCAL_RANK": "0"}),
                   (5, {"CUDA_VISIBLE_DEVICES": "4,5", "LOCAL_RANK": "1"}),
                   (6, {"CUDA_VISIBLE_DEVICES": "6,7", "LOCAL_RANK": "0"}),
                   (7, {"CUDA_VISIBLE_DEVICES": "6,7", "LOCAL_RANK": "1"})]


def test_decode_groups_place_their_ranks_per_replica():
    topo = topology.load({"model": "m", "services": {"decode": {
        "replicas": 2, "data_parallel_size": 2, "port": 50071, "gpus": [4, 5, 6, 7]}}})
    procs = plan(topo, topo.redis_url)
    assert [(p.name, p.placement.gpu, p.env["CUDA_VISIBLE_DEVICES"], p.env["LOCAL_RANK"]) for p in procs] == [
        ("decode-0.rank0", 4, "4,5", "0"), ("decode-0.rank1", 5, "4,5", "1"),
        ("decode-1.rank0", 6, "6,7", "0"), ("decode-1.rank1", 7, "6,7", "1")]
    assert [p.address for p in procs] == ["127.0.0.1:50071", "", "127.0.0.1:50072", ""]
    assert [_flag(p.cmd, "--instance-id") for p in procs] == ["decode-0", "decode-0", "decode-1", "decode-1"]
    single = plan(topology.load({"model": "m", "services": {"decode": {}}}), "redis://x:1/0")
    assert [p.name for p in single] == ["decode-0"] and "--data-parallel-size" not in single[0].cmd
    assert "--rank" not in single[0].cmd  # one-rank decode: the flags it always had


def _two_engines(a: float, b: float, **top) -> dict:
    return {"model": "m", **top, "services": {"prefill": {"gpus": [0], "args": {"gpu-memory-utilization": a}},
                                               "decode": {"gpus": [0], "args": {"gpu-memory-utilization": b}}}}


def test_co_located_engines_fit_when_shares_sum_to_at_most_one():
    check_placement(topology.load(_two_engines(0.5, 0.5)), num_gpus=1)
    with pytest.raises(ValueError, match=r"GPU 0 is over-committed.*prefill-0 \(0.6\), decode-0 \(0.5\).*1.1 > 1"):
        check_placement(topology.load(_two_engines(0.6, 0.5)), num_gpus=1)
    with pytest.raises(ValueError, match="over-committed"):  # with host_gpus, at load time
        topology.load(_two_engines(0.9, 0.9, host_gpus=1))
    with pytest.raises(ValueError, match="over-committed.*decode-0 .*decode-1"):  # default share 0.9 each
        topology.load({"model": "m", "host_gpus": 1, "services": {"decode": {"replicas": 2, "gpus": [0, 0]}}})


@pytest.mark.parametrize("raw, match", [
    ({"model": "m", "host_gpus": 8, "services": {"prefill": {"prefill_context_parallel_size": 8,
                                                             "gpus": [1, 2, 3, 4, 5, 6, 7, 8]}}},
     r"services.prefill.gpus asks for GPU 8, but this host has GPUs 0-7"),
    ({"model": "m", "services": {"decode": {"replicas": 3, "gpus": [0, 1]}}},
     "services.decode.gpus lists 2 GPUs for 3"),
    ({"model": "m", "services": {"decode": {"data_parallel_size": 2, "gpus": [0, 1, 2]}}},
     r"services.decode.gpus lists 3 GPUs for 2 processes \(1 replica\(s\) x 2 rank\(s\)\)"),
    ({"model": "m", "services": {"decode": {"data_parallel_size": 0}}},
     "services.decode.data_parallel_size must be a positive integer"),
    ({"model": "m", "services": {"decode": {"args": {"data-parallel-size": 2}}}},
     "set `data_parallel_size`"),
    ({"model": "m", "services": {"prefill": {"data_parallel_size": 2}}}, "services.prefill: unknown key"),
    ({"model": "m", "services": {"decode": {"gpus": [-1]}}}, "services.decode.gpus must be a non-empty list"),
    ({"model": "m", "services": {"decode": {"gpus": "0"}}}, "services.decode.gpus must be"),
    ({"model": "m", "services": {"router": {"gpus": [0]}}}, "services.router: unknown key"),
    ({"model": "m", "services": {"decode": {"gpus": [0], "args": {"gpu-memory-utilization": 1.5}}}},
     "services.decode.args.gpu-memory-utilization must be in"),
    ({"model": "m", "multi_host": True, "host": "0.0.0.0", "services": {"decode": {}}},
     "multi_host topology needs `redis_url`"),
    ({"model": "m", "multi_host": True, "host": "0.0.0.0", "redis_url": "redis://127.0.0.1:6379/0",
      "services": {"decode": {}}}, "Redis other hosts can reach"),
    ({"model": "m", "multi_host": True, "redis_url": "redis://10.0.0.1:6379/0", "services": {"decode": {}}},
     "not loopback"),
    ({"model": "m", "advertise_host": "0.0.0.0", "services": {"decode": {}}}, "wildcard"),
    ({"model": "m", "host_gpus": -1, "services": {"decode": {}}}, "host_gpus must be"),
    ({"model": "m", "hosts_gpus": 8, "services": {"decode": {}}}, "unknown key"),
])
def test_bad_placements_are_rejected(raw, match):
    with pytest.raises(ValueError, match=match):
        topology.load(raw)


def test_gpu_beyond_this_host_is_refused_by_up_before_anything_starts(tmp_path):
    bad = tmp_path / "t.yaml"
    bad.write_text("model: m\nhost_gpus: 2\nservices:\n  decode: {replicas: 3, gpus: [0, 1, 2]}\n")
    r = subprocess.run([sys.executable, "-m", "services.cli", "up", "--config", str(bad),
                        "--run-dir", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)
    assert r.returncode == 1 and "services.decode.gpus asks for GPU 2, but this host has GPUs 0-1" in r.stderr
    assert not (tmp_path / "run").exists()  # nothing started, not even the run directory
    bad.write_text("model: m\nservices:\n  decode: {gpus: [0]\n")
    r = subprocess.run([sys.executable, "-m", "services.cli", "up", "--config", str(bad), "--dry-run"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)
    assert r.returncode == 1 and "not valid YAML" in r.stderr
