"""The load test: 200 concurrent greedy streams for at least 60 s against the default CPU topology (`pdserve up`
on free ports, a private Redis). Every stream's token ids equal the offline engine's, nothing fails,
no KV block stays held once the load drained, and no service's memory grows in the steady state.

The steady state is decided by completed requests, not by seconds (bench/serving/loadcheck.SteadyState): it
opens once each of the 200 workers completed its first request, and its memory windows are the completions
after that, split in halves. On a slow machine the load runs longer (up to MAX_DURATION_S) until both halves
hold 200 completions, instead of comparing two slices of the first wave of prefills."""

from __future__ import annotations

import json

import pytest

from bench.serving.loadcheck import memory_violations
from bench.serving.loadtest import LoadConfig, format_summary, run_load
from services.launch import launcher
from tests.helpers import system

# The module fixture runs the whole load, which the first test's timeout holds: ~80 s on an idle 2-core machine,
# ~7 min with the services on one core beside a busy loop and the other pytest worker's deployments.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("load"), pytest.mark.timeout(1500)]

CONCURRENCY, DURATION_S = 200, 60.0
MAX_DURATION_S = 600.0  # idle 2-core machine: warm-up ends at ~27 s, both windows are full by ~55 s
# Flat memory: the median RSS over the second half of the steady completions may exceed the first half's by
# at most max(96 MiB, 5%). Measured without a leak (BENCHMARKS.md, then as thirds of the 60 s): router, kvstore
# and Redis move by < 2 MiB; prefill by up to +26 MiB and decode by -65..+18 MiB with the batch composition
# (activations, not retained memory: the prefill's median falls back after the drain); under the whole
# suite's two workers the prefill was once seen at +73.5 MiB (+10.5 MiB alone). The windows' centres are
# about 200 completions apart or more, so a leak of ~0.5 MiB per request (a batch's logits kept, a request's
# KV-sized buffer) breaks the bound on the router or prefill; the 5% (about 140 MiB on decode) leaves
# decode's batch-dependent working set room. What was once seen to break the bound without a leak: the decode
# growing +163 MiB while its first 200 prefills filled it, when windows were thirds of the wall time on a
# machine 4x slower than usual; tests/unit/bench/serving/test_bench_load.py replays that case.
GROWTH_MIB, GROWTH_FRAC = 96.0, 0.05


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    run_dir = tmp_path_factory.mktemp("load")
    dep = system.up(run_dir)
    try:
        out = run_load(dep, LoadConfig(concurrency=CONCURRENCY, duration_s=DURATION_S, max_duration_s=MAX_DURATION_S,
                                       min_tokens=8, max_tokens=32))
    finally:
        launcher.down(dep)
    (run_dir / "load.json").write_text(json.dumps(out, indent=1))
    print("\n" + format_summary(out))
    return out


def test_200_streams_for_60_s_finish_without_errors(result):
    assert result["errors"] == [] and result["num_errors"] == 0
    assert result["in_flight_min"] >= CONCURRENCY, "the client did not keep 200 streams open"
    # every worker finished at least one request (on a fast machine most send several)
    assert result["completed"] == result["requests_sent"] >= CONCURRENCY
    assert result["total_output_tokens"] >= 8 * result["completed"]


def test_every_stream_equals_the_offline_engine(result):
    tokens = result["tokens"]
    assert tokens["streams_checked"] == result["completed"]
    assert tokens["lost_tokens"] == 0 and tokens["duplicated_tokens"] == 0
    assert tokens["mismatched_streams"] == 0, tokens["mismatches"][:2]


def test_no_kv_block_is_held_after_the_drain(result):
    held = result["blocks_in_use_after_drain"]
    assert any(k.startswith("prefill") for k in held) and any(k.startswith("decode") for k in held)
    assert result["leaked_blocks"] == 0, held


def test_memory_is_flat_after_warm_up(result):
    steady, processes = result["memory"]["steady"], result["memory"]["processes"]
    assert steady["measured"], f"the load never reached its steady state in {MAX_DURATION_S:.0f} s: {steady['why']}"
    assert min(steady["requests"]) >= CONCURRENCY, steady
    assert {"router-0", "prefill-0", "decode-0", "kvstore-0"} <= set(processes)
    growth = {name: m for name, m in processes.items() if "growth_mib" in m}
    assert growth.keys() == processes.keys(), processes
    assert memory_violations(growth, GROWTH_MIB, GROWTH_FRAC) == [], steady
