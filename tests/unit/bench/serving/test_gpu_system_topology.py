"""bench.serving.gpu_system's topology rewrite: fresh ports and Redis, the model and memory share, and a
decode without HiSparse on request (other attention settings kept)."""

from __future__ import annotations

from pathlib import Path

from bench.serving.gpu_system import topology

GPU1 = Path(__file__).resolve().parents[4] / "configs" / "topology.gpu-1.yaml"


def test_rewrites_ports_share_and_hisparse(tmp_path):
    topo = topology(GPU1, tmp_path, "m", dummy=True, share=0.2)
    dec = topo["services"]["decode"]["args"]
    assert "hisparse_config" in dec["attention-config"] and dec["gpu-memory-utilization"] == 0.2
    assert topo["model"] == "m" and dec["load-format"] == "dummy" and topo["run_dir"] == str(tmp_path)
    assert all(s["port"] == 0 for s in topo["services"].values())
    plain = topology(GPU1, tmp_path, None, dummy=False, share=None, hisparse=False)
    assert "attention-config" not in plain["services"]["decode"]["args"]
    assert plain["services"]["decode"]["args"]["speculative-config"]["num_speculative_tokens"] == 3
