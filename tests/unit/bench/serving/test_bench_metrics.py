"""Metric formulas on a synthetic event log whose answers are worked out by hand below."""

from __future__ import annotations

import pytest

from bench.serving.client import RequestRecord
from bench.serving.metrics import goodput, measured_window, request_counts, summarize, validity


def _rec(prompt, out, start, first, end, cached=None, **kw) -> RequestRecord:
    r = RequestRecord(prompt_len=prompt, max_tokens=out, t_start=start, t_first=first, t_end=end,
                      output_tokens=out, prompt_tokens=prompt, cached_tokens=cached, **kw)
    r.itl_s = [(end - first) / (out - 1)] * (out - 1) if out > 1 else []
    return r


@pytest.fixture
def log() -> list[RequestRecord]:
    return [
        _rec(100, 10, 0.0, 0.5, 1.4, cached=50),  # e2e 1.4, TTFT 0.5, TPOT 0.9/9 = 0.1, 0.14 s/token
        _rec(200, 5, 1.0, 1.2, 2.2, cached=0),  # e2e 1.2, TTFT 0.2, TPOT 1.0/4 = 0.25, 0.24 s/token
        _rec(300, 20, 2.0, 3.0, 4.0, cached=150),  # e2e 2.0, TTFT 1.0, TPOT 1/19, 0.10 s/token
        RequestRecord(prompt_len=50, max_tokens=5, t_start=2.5, t_end=2.6, error="HTTP 500"),
        RequestRecord(prompt_len=9000, max_tokens=5, t_start=2.7, t_end=2.7, overflow=True),
        _rec(5000, 50, -3.0, -2.0, 0.5, cached=0, measured=False),  # warm-up: ignored
        RequestRecord(prompt_len=70, max_tokens=5, t_start=3.5, cancelled=True),  # cut at the end: ignored
    ]


def test_summary_matches_hand_derivation(log):
    # window: warm-up ends at 0, stop at 3, last counted completion at 4.0 -> 4 s
    window = measured_window(log, t_measure=0.0, t_stop=3.0)
    assert window.duration_s == 4.0
    m = summarize(log, window, num_gpus=2)
    # tokens: input 100+200+300 = 600 (cached ones included), output 10+5+20 = 35
    assert m["total_input_tokens"] == 600 and m["total_output_tokens"] == 35
    assert m["throughput_per_gpu"] == pytest.approx(635 / 4 / 2)
    assert m["output_throughput"] == pytest.approx(35 / 4) and m["request_throughput"] == pytest.approx(3 / 4)
    # interactivity: s/token sorted [0.10, 0.14, 0.24]; P90 at rank 0.9*2 = 1.8 -> 0.14 + 0.8*0.10 = 0.22
    assert m["interactivity"] == pytest.approx(1 / 0.22)
    # TTFT sorted [0.2, 0.5, 1.0]: median 500 ms, P90 = 0.5 + 0.8*0.5 = 0.9 s
    assert m["median_ttft_ms"] == pytest.approx(500) and m["p90_ttft_ms"] == pytest.approx(900)
    assert m["mean_ttft_ms"] == pytest.approx(1700 / 3)
    assert m["mean_tpot_ms"] == pytest.approx(1000 * (0.1 + 0.25 + 1 / 19) / 3)
    assert m["median_e2el_ms"] == pytest.approx(1400)
    assert m["mean_itl_ms"] == pytest.approx(1000 * (9 * 0.1 + 4 * 0.25 + 19 / 19) / 32)
    assert m["prefix_cache_hit_rate"] == pytest.approx(200 / 600)
    # due requests: 3 ok + 1 error + 1 overflow (warm-up and cancelled excluded)
    assert (m["num_requests"], m["completed"], m["num_errors"], m["num_overflow"]) == (5, 3, 1, 1)
    assert m["error_rate"] == pytest.approx(0.2) and m["overflow_rate"] == pytest.approx(0.2)
    assert not m["valid"] and len(m["invalid_reasons"]) == 2


def test_the_first_gap_after_the_first_token_is_told_apart_from_the_decodes_own(log):
    """The ITL in two: each request's first gap (across the KV handoff to the decode) and the decode's gaps after
    it; together they are every ITL."""
    log[0].itl_s = [0.45] + [0.05] * 8  # 0.9 s after the first token, as before: a slow handoff, then fast steps
    m = summarize(log, measured_window(log, t_measure=0.0, t_stop=3.0))
    # first gaps sorted [1/19, 0.25, 0.45]: median 250 ms, P90 = 0.25 + 0.8 * 0.2 = 0.41 s
    assert m["median_handoff_ms"] == pytest.approx(250) and m["p90_handoff_ms"] == pytest.approx(410)
    # the rest: 8 x 0.05, 3 x 0.25, 18 x 1/19
    assert m["mean_decode_itl_ms"] == pytest.approx(1000 * (8 * 0.05 + 3 * 0.25 + 18 / 19) / 29)
    assert m["mean_itl_ms"] == pytest.approx((3 * m["mean_handoff_ms"] + 29 * m["mean_decode_itl_ms"]) / 32)


def test_hit_rate_is_none_when_the_server_does_not_report_it(log):
    for r in log:
        r.cached_tokens = None
    m = summarize(log, measured_window(log, 0.0, 3.0))
    assert m["prefix_cache_hit_rate"] is None and m["throughput_per_gpu"] == pytest.approx(635 / 4)


@pytest.mark.parametrize("n_overflow,n_errors,valid", [(1, 0, True), (2, 0, False), (0, 10, True), (0, 11, False)])
def test_validity_thresholds(n_overflow, n_errors, valid):
    recs = [RequestRecord(prompt_len=1, max_tokens=1, t_start=0, t_first=0.1, t_end=0.2, output_tokens=1)
            for _ in range(100 - n_overflow - n_errors)]
    recs += [RequestRecord(prompt_len=1, max_tokens=1, overflow=True) for _ in range(n_overflow)]
    recs += [RequestRecord(prompt_len=1, max_tokens=1, error="x") for _ in range(n_errors)]
    assert (not validity(request_counts(recs))) == valid


def test_goodput(log):
    window = measured_window(log, 0.0, 3.0)
    assert goodput(log, window, {"ttft": 600}) == pytest.approx(2 / 4)  # TTFTs 500 and 200 ms pass
    assert goodput(log, window, {"ttft": 600, "tpot": 200}) == pytest.approx(1 / 4)  # TPOT 250 ms fails
    with pytest.raises(ValueError, match="SLO"):
        goodput(log, window, {"latency": 1})
