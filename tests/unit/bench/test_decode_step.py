"""bench.decode_step at CPU scale: every mode (async scheduling included) and engine reports a row, the
floor's parts add up, and the GPU busy time is the union of kernel intervals (overlaps counted once)."""

from __future__ import annotations

from types import SimpleNamespace

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
