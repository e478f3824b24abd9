"""Topology files: parsing, validation errors, and the flags of each process."""

from __future__ import annotations

import pytest

from services.launch import topology
from services.launch.topology import Ports, args_to_flags
from tests.helpers import ROOT


def test_default_topology_loads():
    topo = topology.load(ROOT / "configs" / "topology.cpu.yaml")
    assert [s.kind for s in topo.services] == ["kvstore", "prefill", "decode", "router"]
    assert topo.service("router").extra["grpc_port"] == 50050
    assert topo.service("prefill").ranks == 1
    assert topo.path(topo.model) == ROOT / "checkpoints" / "tiny-code"


def test_comparison_topologies_differ_only_where_they_should():
    """The CPU-scale pair of the disaggregated comparison: PCP=2 x DCP=2 prefill + HiSparse decode against
    two DP prefills + offload-only decode (same model, kvstore, router and MTP)."""
    pcp = topology.load(ROOT / "configs" / "topology.cpu-pcp.yaml")
    base = topology.load(ROOT / "configs" / "topology.cpu-baseline.yaml")
    assert pcp.service("prefill").ranks == 2 and pcp.service("prefill").replicas == 1
    assert base.service("prefill").ranks == 1 and base.service("prefill").replicas == 2
    hs = [t.service("decode").args["attention-config"]["hisparse_config"] for t in (pcp, base)]
    assert not hs[0].get("offload_only") and hs[1]["offload_only"] is True
    for kind in ("kvstore", "router"):
        assert pcp.service(kind) == base.service(kind)
    assert all(t.service("decode").args["speculative-config"]["num_speculative_tokens"] == 3 for t in (pcp, base))


def test_prefill_ranks_and_flags():
    topo = topology.load({"model": "/m", "services": {"router": {"grpc_port": 7}, "prefill": {
        "prefill_context_parallel_size": 8, "decode_context_parallel_size": 8,
        "args": {"enable-expert-parallel": True, "dcp-comm-backend": "ag_rs",
                 "attention-config": {"sparse_mla_force_mqa": True}}}}})
    assert [s.kind for s in topo.services] == ["prefill", "router"]  # start order, not file order
    spec = topo.service("prefill")
    assert spec.ranks == 8
    argv = topology.flags(topo, spec, 0, 3, Ports(50051, 9151, master_port=29500), "redis://r:1/0")
    text = " ".join(argv)
    assert "--rank 3 --world-size 8 --master-addr 127.0.0.1 --master-port 29500" in text
    assert "--prefill-context-parallel-size 8 --decode-context-parallel-size 8" in text
    assert '--attention-config {"sparse_mla_force_mqa": true}' in text and "--enable-expert-parallel" in argv
    assert "--instance-id prefill-0" in text and "--model /m" in text


def test_args_to_flags():
    assert args_to_flags({"a": 1, "b": True, "c": False, "d": [1, 2], "--e": "x"}) == \
        ["--a", "1", "--b", "--d", "1", "--d", "2", "--e", "x"]


@pytest.mark.parametrize("raw, match", [
    ({"services": {"kvstore": {}}}, "needs `model`"),
    ({"model": "m", "services": {"tokenizer": {}}}, "unknown service kind"),
    ({"model": "m", "services": {"kvstore": {"replica": 2}}}, "unknown key"),
    ({"model": "m", "services": {"decode": {"replicas": 0}}}, "positive integer"),
    ({"model": "m", "services": {"decode": {"port": -1}}}, "non-negative"),
    ({"model": "m", "services": {"decode": {"grpc_port": 5}}}, "unknown key"),
    ({"model": "m", "services": {"decode": {"args": ["--x"]}}}, "mappings"),
    ({"model": "m", "services": {"kvstore": {}}, "redis": {}}, "unknown key"),
])
def test_bad_topologies_are_rejected(raw, match):
    with pytest.raises(ValueError, match=match):
        topology.load(raw)
