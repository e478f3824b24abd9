"""The load test: 200 concurrent greedy streams for 60 s against the default CPU topology (`pdserve up`
on free ports, a private Redis). Every stream's token ids equal the offline engine's, nothing fails,
no KV block stays held once the load drained, and no service's memory grows after warm-up."""

from __future__ import annotations

import json

import pytest

from bench.serving.loadtest import LoadConfig, format_summary, run_load
from services.launch import launcher
from tests.helpers import system

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("load")]

CONCURRENCY, DURATION_S = 200, 60.0
# Flat memory: the median RSS over the last third of the run may exceed the middle third's by at most
# max(64 MiB, 5%). Measured without a leak (BENCHMARKS.md): router, kvstore and Redis move by < 2 MiB;
# prefill by up to +26 MiB and decode by -65..+18 MiB, because the 200 workers start together and
# their second requests' prefills bunch up in the last third (batch activations, not retained memory:
# the prefill's median falls back after the drain); under the whole suite's two workers the prefill
# was once seen at +73.5 MiB (+10.5 MiB alone). Each third completes ~140 requests, so a leak of
# ~0.7 MiB per request (a batch's logits kept, a request's KV-sized buffer) breaks the bound on the
# router or prefill; the 5% (about 140 MiB on decode) leaves decode's batch-dependent working set room.
GROWTH_MIB, GROWTH_FRAC = 96.0, 0.05


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    run_dir = tmp_path_factory.mktemp("load")
    dep = system.up(run_dir)
    try:
        out = run_load(dep, LoadConfig(concurrency=CONCURRENCY, duration_s=DURATION_S, min_tokens=8, max_tokens=32))
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
    memory = result["memory"]
    assert {"router-0", "prefill-0", "decode-0", "kvstore-0"} <= set(memory)
    for name, m in memory.items():
        assert m["middle_third_median_mib"] > 0, name
        bound = max(GROWTH_MIB, GROWTH_FRAC * m["middle_third_median_mib"])
        assert m["growth_mib"] <= bound, f"{name}: RSS grew {m['growth_mib']} MiB after warm-up (bound {bound:.0f})"
