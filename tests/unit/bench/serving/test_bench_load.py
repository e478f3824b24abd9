"""`pdserve bench load`'s pure parts: the seeded workload, the token comparison, the RSS windows, the steady
state decided by completed requests and the flatness check over it (synthetic runs: flat, leaking, and growing only
during a slow warm-up)."""

from __future__ import annotations

import os

import pytest

from bench.serving.loadcheck import (
    RssSampler,
    SteadyState,
    compare_tokens,
    memory_growth,
    memory_violations,
    tree_rss_mib,
)
from bench.serving.loadtest import LoadConfig, make_prompts, pick


def test_prompts_are_seeded_sessions_whose_turns_extend_each_other():
    cfg = LoadConfig(sessions=3, turns=4, system_len=80, seed=7)
    prompts = make_prompts(cfg, vocab_size=1000)
    assert prompts == make_prompts(cfg, vocab_size=1000)
    assert prompts != make_prompts(LoadConfig(sessions=3, turns=4, seed=8), vocab_size=1000)
    assert len(prompts) == 12
    assert all(p[:80] == prompts[0][:80] for p in prompts)  # one system prompt, over a 64-token block
    for s in range(3):
        turns = prompts[4 * s: 4 * s + 4]
        assert all(b[:len(a)] == a and len(b) > len(a) for a, b in zip(turns, turns[1:]))
    assert all(16 <= t < 1000 for p in prompts for t in p)


def test_each_workers_requests_are_the_same_every_run():
    cfg = LoadConfig(min_tokens=8, max_tokens=32)
    picks = [pick(cfg, w, k, 32) for w in range(50) for k in range(3)]
    assert picks == [pick(cfg, w, k, 32) for w in range(50) for k in range(3)]
    assert len(set(picks)) > 100 and all(0 <= i < 32 and 8 <= m <= 32 for i, m in picks)
    with pytest.raises(ValueError):
        LoadConfig(min_tokens=10, max_tokens=5)


def test_compare_tokens_counts_lost_duplicated_and_different_tokens():
    reference = [[1, 2, 3, 4, 5], [9, 8, 7, 6]]
    same = compare_tokens([(0, 3, [1, 2, 3]), (1, 4, [9, 8, 7, 6])], reference)
    assert same["mismatched_streams"] == same["lost_tokens"] == same["duplicated_tokens"] == 0
    bad = compare_tokens([(0, 4, [1, 2, 4]), (0, 3, [1, 2, 2, 3]), (1, 2, [9, 7])], reference)
    assert bad["lost_tokens"] == 1 and bad["duplicated_tokens"] == 1 and bad["mismatched_streams"] == 3
    assert [m["first_difference"] for m in bad["mismatches"]] == [2, 2, 1]


def test_rss_of_this_process_window_peaks_and_medians():
    assert 10 < tree_rss_mib(os.getpid()) < 64 * 1024
    assert tree_rss_mib(2 ** 22 + 12345) == 0.0  # no such process
    s = RssSampler({"a": 1})
    s.samples = [(0.0, {"a": 10.0}), (1.0, {"a": 30.0}), (2.0, {"a": 20.0}), (3.0, {"a": 25.0})]
    assert s.peak() == {"a": 30.0}
    assert s.peak(1.5, 3.0) == {"a": 25.0} and s.peak(5.0, 6.0) == {"a": 0.0}
    growth = memory_growth(s.samples, ((0.0, 2.0), (2.0, 3.0)))["a"]  # medians of 10, 30, 20 and of 20, 25
    assert growth["first_window_median_mib"] == 20.0 and growth["second_window_median_mib"] == 22.5
    assert growth["growth_mib"] == 2.5
    assert growth["samples"] == [3, 2] and memory_growth(s.samples, ((5.0, 6.0), (6.0, 7.0)))["a"]["samples"] == [0, 0]


# ---- the steady state and its memory windows (synthetic runs) ------------------------------------------------

WORKERS, GROWTH_MIB, GROWTH_FRAC = 200, 96.0, 0.05  # tests/e2e/test_load.py's bound


def _run(first_wave_s: float, request_s: float, end_s: float) -> list[tuple[int, float]]:
    """(worker, completion time) of a closed loop: the first wave's requests end spread over `first_wave_s`
    (the last worker's at `first_wave_s`), then each worker completes one every `request_s`."""
    out = []
    for w in range(WORKERS):
        t = first_wave_s * (w + 1) / WORKERS
        while t <= end_s:
            out.append((w, t))
            t += request_s * (0.8 + 0.4 * ((w * 7919) % 100) / 100)  # workers drift apart
    return sorted(out, key=lambda c: c[1])


def _measure(completions, rss_at, t_stop: float, window_requests: int = WORKERS):
    """Feed the completions to a SteadyState, sample `rss_at(t, completed so far)` each second, and return
    (steady, windows, growth, violations)."""
    steady = SteadyState(WORKERS, window_requests=window_requests)
    samples, done = [], 0
    for t in range(int(t_stop) + 1):
        while done < len(completions) and completions[done][1] <= t:
            steady.completed(*completions[done])
            done += 1
        samples.append((float(t), {"decode-0": rss_at(float(t), done), "router-0": 400.0}))
    windows = steady.windows(t_stop)
    growth = memory_growth(samples, windows) if windows else {}
    return steady, windows, growth, memory_violations(growth, GROWTH_MIB, GROWTH_FRAC) if windows else None


def _batch_noise(t: float) -> float:
    """A batch's activations: +-80 MiB from one second to the next."""
    return 80.0 * (((int(t) * 37) % 11) / 5.0 - 1.0)


def test_steady_state_opens_when_every_worker_completed_its_first_request():
    steady = SteadyState(3, warmup_per_worker=2, window_requests=2)
    for w, t in [(0, 1.0), (1, 2.0), (0, 3.0), (2, 4.0), (1, 5.0), (0, 6.0)]:
        steady.completed(w, t)
    assert steady.t_open is None and steady.windows() is None  # worker 2 completed one request of two
    steady.completed(2, 7.0)
    assert steady.t_open == 7.0 and not steady.ready
    for t in (8.0, 9.0, 10.0):
        steady.completed(0, t)
    assert not steady.ready and steady.describe(0.0)["why"] == "3 requests completed after warm-up, 4 needed"
    steady.completed(1, 11.0)
    steady.completed(2, 12.0)  # after the stop: the drain is not steady
    assert steady.ready and steady.windows(t_stop=11.5) == ((7.0, 9.0), (9.0, 11.0))
    assert steady.describe(0.0, t_stop=11.5)["requests"] == [2, 2]
    with pytest.raises(ValueError):
        SteadyState(0)


def test_a_flat_series_passes():
    completions = _run(first_wave_s=15.0, request_s=12.0, end_s=60.0)
    steady, windows, growth, bad = _measure(completions, lambda t, n: 2800.0 + _batch_noise(t), t_stop=60.0)
    assert steady.t_open == 15.0 and windows[0][0] == 15.0
    assert min(growth["decode-0"]["samples"]) >= 10 and bad == [], growth


def test_a_leaking_series_fails():
    """0.8 MiB kept per completed request: what the bound is there to catch, however fast the machine."""
    for request_s, end_s in ((12.0, 60.0), (48.0, 240.0)):  # an idle machine, and one 4x slower
        completions = _run(first_wave_s=request_s * 1.25, request_s=request_s, end_s=end_s)
        _, windows, growth, bad = _measure(completions, lambda t, n: 2800.0 + 0.8 * n + _batch_noise(t), t_stop=end_s)
        assert windows is not None and growth["decode-0"]["growth_mib"] > GROWTH_FRAC * 2800
        assert len(bad) == 1 and bad[0].startswith("decode-0: RSS grew"), growth


def test_growth_during_warm_up_only_passes_on_a_slow_machine():
    """The CI failure replayed: 4x slower, the first wave of 200 prefills ends at 58 s while the decode's RSS
    fills (+480 MiB), then it stays flat. Thirds of the first 60 s saw ~+160 MiB of that ramp; the steady
    state opens after it, and the load goes on until both windows hold 200 completions."""
    ramp = lambda t, n: 2400.0 + 480.0 * min(t / 58.0, 1.0) + _batch_noise(t)
    completions = _run(first_wave_s=58.0, request_s=48.0, end_s=400.0)
    third = 60.0 / 3
    by_thirds = memory_growth([(float(t), {"decode-0": ramp(t, 0)}) for t in range(61)],
                              ((third, 2 * third), (2 * third, 60.0)))
    assert memory_violations(by_thirds, GROWTH_MIB, GROWTH_FRAC) != []  # what the wall-time windows reported
    assert not _measure(completions, ramp, t_stop=60.0)[0].ready  # at 60 s: no steady state yet
    steady, windows, growth, bad = _measure(completions, ramp, t_stop=200.0)
    assert steady.ready and windows[0][0] == 58.0
    assert bad == [], growth


def test_too_few_samples_in_a_window_is_not_flat():
    growth = memory_growth([(0.0, {"a": 100.0}), (1.0, {"a": 100.0}), (5.0, {"a": 100.0})], ((0.0, 1.0), (1.0, 5.0)))
    assert growth["a"]["samples"] == [2, 2]
    assert memory_violations(growth, GROWTH_MIB, GROWTH_FRAC) == ["a: RSS samples per window [2, 2], at least 3 needed"]
