"""`pdserve bench load`'s pure parts: the seeded workload, the token comparison, the RSS windows."""

from __future__ import annotations

import os

import pytest

from bench.serving.loadcheck import RssSampler, compare_tokens, tree_rss_mib
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


def test_rss_of_this_process_and_window_peaks():
    assert 10 < tree_rss_mib(os.getpid()) < 64 * 1024
    assert tree_rss_mib(2 ** 22 + 12345) == 0.0  # no such process
    s = RssSampler({"a": 1})
    s.samples = [(0.0, {"a": 10.0}), (1.0, {"a": 30.0}), (2.0, {"a": 20.0}), (3.0, {"a": 25.0})]
    assert s.peak() == {"a": 30.0}
    assert s.peak(1.5, 3.0) == {"a": 25.0} and s.peak(5.0, 6.0) == {"a": 0.0}
    assert s.median(0.0, 2.0) == {"a": 20.0} and s.median(2.0, 3.0) == {"a": 22.5} and s.median(5.0, 6.0) == {"a": 0.0}
