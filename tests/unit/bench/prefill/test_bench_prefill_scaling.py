"""bench.prefill.scaling report: the tables the benchmark writes to BENCHMARKS.md, from recorded results."""

from __future__ import annotations

import json

from bench.prefill.report import report
from tests.helpers import ROOT

DATA = ROOT / "bench" / "data" / "pcp-h200x2"


def test_report_of_the_recorded_two_gpu_run():
    runs = [json.loads(p.read_text()) for p in sorted(DATA.glob("*.json"))]
    assert {r["kind"] for r in runs} == {"check", "time"}
    text = report(runs)
    # speed-up of PCP2xDCP1xEP at 32K from the recorded times, and the DCP extra cost column
    one = next(r for r in runs if r["kind"] == "time" and r["pcp"] == 1)
    pcp = next(r for r in runs if r["kind"] == "time" and r["pcp"] == 2 and r["dcp"] == 1)
    speedup = one["ttft"]["32768"]["ttft_s"] / pcp["ttft"]["32768"]["ttft_s"]
    assert f"| 32,768 | {1e3 * one['ttft']['32768']['ttft_s']:,.0f} ms |" in text
    assert f"{speedup:.2f}x" in text
    assert "DCP extra cost" in text and "dcp_ctx" in text and "tokens that fit" in text
    assert "tiny-code exact (fp32)" in text
