"""DP x EP with HiSparse on every rank: each rank's own host pool and hot buffers, misses every step, greedy
tokens equal to the single-rank resident engine (fp32 path), with and without MTP3; bad configurations."""

from __future__ import annotations

import inspect

import pytest

from engine import LLM
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from tests.engine.parallel.test_dp_engine import _run
from tests.helpers.ep_counts import rank_stats

pytestmark = pytest.mark.xdist_group("cp")

EXACT = {"device": "cpu", "dtype": "float32", "kv_cache_dtype": "float32", "indexer_precision": "fp32"}
TOPK = 16  # code16's index_topk (tests/conftest.py)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(code16):
    import difflib

    from engine.frontend.tokenizer import Tokenizer

    ids = Tokenizer(code16).encode(inspect.getsource(difflib))
    lens = [8 * TOPK + 2, 8 * TOPK + 30, 8 * TOPK + 55, 8 * TOPK + 70]  # >= 8x top-k: misses every step
    return [ids[i * 400: i * 400 + n] for i, n in enumerate(lens)]


@pytest.mark.parametrize("spec,async_scheduling", [(0, False), (3, False), (3, True)])
def test_hisparse_misses_every_step_on_every_rank(code16, prompts, spec, async_scheduling):
    kw = dict(EXACT, num_speculative_tokens=spec) if spec else dict(EXACT)
    want = _run(LLM(str(code16), num_blocks=64, **kw).core, prompts, GREEDY)[0]
    hot_blocks = 1 if spec == 0 else 2  # a device pool of hot buffers only: every request decodes from host
    # MTP3: decode on the padded static path (the GPU's, run eagerly here) with planned steps
    static = {"enforce_eager": False} if spec else {}
    dp = LLM(str(code16), num_blocks=2 * hot_blocks + 1, hisparse={"host_pool_blocks": 48},
             data_parallel_size=2, enable_expert_parallel=True, async_scheduling=async_scheduling, **kw, **static)
    try:
        misses, busy = [], []  # per step: each rank's misses so far, whether both its requests decoded
        core = dp.core
        step = core.step

        def counted_step():
            busy.append([False, False])
            out = step()
            misses.append([s["hisparse"].misses for s in rank_stats(core)])
            return out

        def counted_schedule(rank, schedule):
            def run():
                sched = schedule()
                busy[-1][rank] = len(sched.chunks) == 2  # both its requests run (one alone would fit its pages)
                return sched
            return run

        core.step = counted_step
        for r, s in enumerate(core.schedulers):  # with async scheduling a step may wait for the one before it
            s.schedule = counted_schedule(r, s.schedule)
        got, ranks = _run(core, prompts, GREEDY)
        core.step = step
        assert got == want and sorted(ranks) == [0, 0, 1, 1]
        decode_steps = [(i, r) for i in range(1, len(misses)) for r in (0, 1) if busy[i][r]]  # step 0: prefill
        assert len(decode_steps) > 8
        assert all(misses[i][r] > misses[i - 1][r] for i, r in decode_steps), f"a decode step without misses: {misses}"
        stats = rank_stats(dp.core)
        assert all(s["hisparse"].num_host_blocks == 48 for s in stats)
        assert all(s["planned_steps"] >= len(decode_steps) // 2 for s in stats)  # decode steps: static dispatch
        # a host pool too small for one request: refused when it arrives, nothing taken
        with pytest.raises(ValueError, match="needs more KV blocks than the engine has"):
            core.add_request(Request("big", prompts[0] * 24, GREEDY))
        assert not core.has_unfinished() and all(kv.num_free_blocks == kv.num_blocks for kv in core.kvs)
    finally:
        dp.core.shutdown()


def test_bad_dp_configs(code16, tiny_ckpt, caplog):
    with pytest.raises(ValueError, match="divisible by --data-parallel-size"):
        LLM(str(code16), num_blocks=8, data_parallel_size=3, enable_expert_parallel=True, **EXACT)
    with pytest.raises(ValueError, match="cannot hold one hot buffer"):  # a device pool too small for one request
        LLM(str(code16), num_blocks=1, hisparse={"host_pool_blocks": 48}, data_parallel_size=2,
            enable_expert_parallel=True, num_speculative_tokens=3, **EXACT)
    with pytest.raises(ValueError, match="data_parallel_size must be >= 1"):
        LLM(str(code16), num_blocks=8, data_parallel_size=0, **EXACT)
    with pytest.raises(ValueError, match="without the context parallel sizes"):
        LLM(str(code16), num_blocks=8, data_parallel_size=2, prefill_context_parallel_size=2, **EXACT)
