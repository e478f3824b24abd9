"""bench.serving.cold_start: its topology (own Triton cache for every service, --warmup engines) and its count of
compiled variants."""

from __future__ import annotations

from bench.serving.cold_start import cold_topology, compiled_variants
from services.launch import topology as topology_mod
from tests.helpers import ROOT


def test_the_topology_gives_every_service_the_cache_and_the_engines_the_warm_up(tmp_path):
    topo = cold_topology(ROOT / "configs" / "topology.cpu.yaml", tmp_path / "run", tmp_path / "triton", warmup=True)
    assert topo["env"]["TRITON_CACHE_DIR"] == str(tmp_path / "triton")
    for kind in ("prefill", "decode"):
        assert topo["services"][kind]["args"]["warmup"] is True
        assert "--warmup" in topology_mod.args_to_flags(topo["services"][kind]["args"])
    assert "warmup" not in topo["services"]["router"].get("args", {})
    plain = cold_topology(ROOT / "configs" / "topology.cpu.yaml", tmp_path / "run", tmp_path / "triton", warmup=False)
    assert "warmup" not in plain["services"]["decode"]["args"]


def test_compiled_variants_are_counted_by_kernel(tmp_path):
    for i, name in enumerate(["_store_rows_kernel", "_store_rows_kernel", "_merge_kernel"]):
        d = tmp_path / f"hash{i}"
        d.mkdir()
        (d / f"{name}.json").write_text("{}")
        (d / f"__grp__{name}.json").write_text("{}")  # Triton's group file: not a variant
        (d / f"{name}.cubin").write_bytes(b"")
    assert compiled_variants(tmp_path) == {"_store_rows_kernel": 2, "_merge_kernel": 1}
