"""The one-rank stand-in benchmark end to end at CPU scale (tiny preset, FP8, EP8 share of the experts)."""

from __future__ import annotations

import json

from bench.prefill.standin import main


def test_standin_runs_and_reports(tmp_path):
    out = tmp_path / "standin.json"
    res = main(["--out", str(out), "--preset", "tiny", "--device", "cpu", "--kv-cache-dtype", "float32",
                "--num-blocks", "64", "--prefill-tokens", "96", "--chunk", "64", "--batches", "1,2",
                "--decode-steps", "2", "--prefill-repeats", "2"])
    assert json.loads(out.read_text())["kv_tokens"] == 64 * 64
    assert res["weight_bytes"]["float8_e4m3fn"] > 0 and res["num_local_experts"] >= 1
    assert res["prefill_s"] > 0 and set(res["decode_step_s"]) == {1, 2}
    assert res["spec_mean_acceptance_length"] > 1.5  # the synthetic acceptance (2.99) is applied
    assert len(res["prefill_warm_s"]) == 2 and res["prefill_warm_median_s"] > 0
