"""`python -m bench.hisparse --cpu-smoke` runs end to end at toy sizes (GPU numbers come from the real run)."""

from __future__ import annotations

import json

from bench.hisparse.decode import main


def test_cpu_smoke_runs_all_modes(tmp_path):
    out = tmp_path / "hisparse.json"
    res = main(["--cpu-smoke", "--contexts", "700", "--batches", "2", "--churn", "0.1,0.6", "--out", str(out)])
    assert json.loads(out.read_text())["rows"] == res["rows"]
    rows = {(r["mode"], r["churn"]): r for r in res["rows"]}
    assert set(m for m, _ in rows) == {"resident", "hisparse", "offload"}
    low, high = rows[("hisparse", 0.1)], rows[("hisparse", 0.6)]
    assert 0.0 < high["hit_rate"] < low["hit_rate"] < 1.0, "more churn, fewer hits"
    assert 0 < low["h2d_bytes_per_step"] < high["h2d_bytes_per_step"]
    offload = next(r for r in res["rows"] if r["mode"] == "offload")
    ctx_bytes = 2 * 700 * 4 * 164  # two requests' whole contexts, 4 layers of 164-byte rows
    assert offload["h2d_bytes_per_step"] >= ctx_bytes > 10 * high["h2d_bytes_per_step"]
    assert rows[("resident", 0.1)]["h2d_bytes_per_step"] == 0 and all(r["step_ms"] > 0 for r in res["rows"])


def test_cpu_smoke_paired_mode(tmp_path):
    """Resident and HiSparse stepped alternately: one row per batch with both medians and the pair ratio."""
    res = main(["--cpu-smoke", "--pair-contexts", "300,700", "--batches", "1,2", "--steps", "4",
                "--out", str(tmp_path / "pair.json")])
    assert [r["batch"] for r in res["rows"]] == [1, 2]
    for r in res["rows"]:
        assert r["pairs"] == 4 and r["resident_ms"] > 0 and r["hisparse_ms"] > 0 and r["ratio_median"] > 0
        assert (r["resident_context"], r["hisparse_context"]) == (300, 700)


def test_cpu_smoke_paired_modes_offload(tmp_path):
    """Any two modes can be paired: HiSparse against offload-only at one context, the same steps for both."""
    res = main(["--cpu-smoke", "--pair-contexts", "700,700", "--pair-modes", "hisparse,offload", "--batches", "2",
                "--steps", "3", "--out", str(tmp_path / "pair.json")])
    (r,) = res["rows"]
    assert r["pairs"] == 3 and r["hisparse_ms"] > 0 and r["offload_ms"] > 0 and r["ratio"] == "offload / hisparse"
    assert (r["hisparse_context"], r["offload_context"]) == (700, 700)


def test_cpu_smoke_host_breakdown(tmp_path):
    """--host-breakdown: per case, host microseconds and calls per step of the step's parts (bench.hisparse.host_timer),
    counted over the measured steps only; the wrapped functions are restored afterwards."""
    import engine.hisparse.backend as backend

    before = backend.HiSparseBackend.sparse_mla
    res = main(["--cpu-smoke", "--contexts", "300", "--batches", "2", "--modes", "resident,hisparse", "--steps", "3",
                "--host-breakdown", "--out", str(tmp_path / "hb.json")])
    rows = {r["mode"]: r["host_breakdown_us"] for r in res["rows"]}
    assert rows["hisparse"]["HiSparseBackend.sparse_mla"]["calls"] == 4.0, "4 layers per step"
    assert rows["hisparse"]["plan_forward"]["calls"] == 1.0
    assert "HiSparseBackend.sparse_mla" not in rows["resident"] and rows["resident"]["decode_meta"]["us"] > 0
    assert backend.HiSparseBackend.sparse_mla is before
