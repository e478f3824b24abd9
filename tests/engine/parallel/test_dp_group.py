"""DP groups of other shapes: DP4 x EP (two experts per rank, three ranks idle for a single request) and DP2
with replicated experts (no expert parallelism: the ranks never sync), against the single-rank engine."""

from __future__ import annotations

import logging

import pytest

from engine import LLM
from tests.engine.parallel.test_dp_engine import EXACT, _ids, _run
from tests.helpers.ep_counts import rank_stats

pytestmark = pytest.mark.xdist_group("cp")


@pytest.fixture(scope="module")
def ref(tiny_ckpt):
    return LLM(str(tiny_ckpt), **EXACT)


def test_dp4_ep(tiny_ckpt, ref):
    dp = LLM(str(tiny_ckpt), data_parallel_size=4, enable_expert_parallel=True, **EXACT)
    try:
        prompts = [_ids(n, seed=10 + n) for n in (33, 7, 100, 64, 2)]
        got, ranks = _run(dp.core, prompts)
        assert ranks == [0, 1, 2, 3, 0] and got == _run(ref.core, prompts)[0]
        got, ranks = _run(dp.core, [prompts[2]])
        assert got == _run(ref.core, [prompts[2]])[0]
        stats = rank_stats(dp.core)
        assert all(s["dummy_passes"] > 0 for r, s in enumerate(stats) if r != ranks[0])
    finally:
        dp.core.shutdown()


def test_dp2_replicated_experts(tiny_ckpt, ref, caplog):
    with caplog.at_level(logging.INFO, logger="engine.parallel.dp"):
        dp = LLM(str(tiny_ckpt), data_parallel_size=2, **EXACT)
    try:
        assert "replicated" in caplog.text
        prompts = [_ids(n, seed=20 + n) for n in (50, 9, 3)]
        got, ranks = _run(dp.core, prompts)
        assert ranks == [0, 1, 0] and got == _run(ref.core, prompts)[0]
        stats = rank_stats(dp.core)
        assert all("ep_dispatch" not in s["comm_bytes"] and "dp_sync" not in s["comm_bytes"] for s in stats)
    finally:
        dp.core.shutdown()
