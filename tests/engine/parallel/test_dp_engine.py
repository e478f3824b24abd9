"""DP x EP decode group over real ranks (gloo, one process per rank) against the single-rank engine: greedy
tokens equal for a batch spread over the ranks, one request (the other rank idle throughout), uneven
prompts; with MTP3; the dynamic dispatcher's rows = one copy per (token, destination rank); the static
dispatch of planned decode steps on the padded static path (eager on the CPU), idle rank included."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.request import Request
from engine.parallel.spawn import RankPool
from tests.helpers.ep_counts import dispatched_rows, rank_stats, reset_counters, routed_pairs

pytestmark = pytest.mark.xdist_group("cp")  # one process group per process: keep these on one worker

EXACT = {"device": "cpu", "dtype": "float32", "kv_cache_dtype": "float32", "indexer_precision": "fp32",
         "num_blocks": 64}
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
LENS = (5, 127, 40, 90, 1)  # uneven: prefill of one rank beside decode of the other


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(1, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(core, prompts, sp=GREEDY) -> tuple[list[list[int]], list[int]]:
    """Greedy tokens by stepping the core; also the rank each request went to."""
    rids = [f"r{i}" for i in range(len(prompts))]
    for rid, p in zip(rids, prompts):
        core.add_request(Request(rid, list(p), sp))
    ranks = [core.rank_of[r] for r in rids] if hasattr(core, "rank_of") else []
    toks = {rid: [] for rid in rids}
    while core.has_unfinished():
        for o in core.step():
            toks[o.req_id].extend(o.new_token_ids)
    core.step()  # the runners drop the finished requests' state
    while core.has_unfinished():  # async scheduling: that step is in flight until one more step reads it back
        core.step()
    return [toks[r] for r in rids], ranks


@pytest.fixture(scope="module")
def rank_pool():
    """The spawned ranks serve both configurations (and the HiSparse module's engines after them)."""
    pool = RankPool()
    yield pool
    pool.close()


@pytest.fixture(scope="module", params=[(0, "dynamic", False), (3, "static", False), (3, "static", True)],
                ids=["plain-dynamic", "mtp3-static", "mtp3-static-async"])
def engines(request, tiny_ckpt, rank_pool):
    spec, dispatch, async_scheduling = request.param
    kw = dict(EXACT, num_speculative_tokens=spec) if spec else EXACT
    ref = LLM(str(tiny_ckpt), **kw)
    # static: decode steps planned, on the padded static path (the CUDA-graph path, run eagerly on the CPU)
    static = {"enforce_eager": False} if dispatch == "static" else {}
    # async: every rank launches step N + 1 before it reads step N back (the group's async scheduling)
    dp = LLM(str(tiny_ckpt), rank_pool=rank_pool, data_parallel_size=2, enable_expert_parallel=True,
             ep_decode_dispatch=dispatch, async_scheduling=async_scheduling, **kw, **static)
    yield ref, dp, spec
    dp.core.shutdown()  # its ranks go back to rank_pool


def test_batch_spread_over_both_ranks(engines):
    ref, dp, spec = engines
    prompts = [_ids(n, seed=n) for n in LENS]
    got, ranks = _run(dp.core, prompts)
    assert sorted(set(ranks)) == [0, 1] and ranks[:2] == [0, 1]  # least loaded: alternating
    assert got == _run(ref.core, prompts)[0]
    if spec:
        assert dp.get_stats().spec_drafts > 0


def test_single_request_other_rank_idle(engines):
    ref, dp, _ = engines
    prompt = _ids(70, seed=3)
    reset_counters(dp.core)
    before = [s["dummy_passes"] for s in rank_stats(dp.core)]
    with routed_pairs(ref, 2) as pairs:
        want = _run(ref.core, [prompt])[0]
    got, ranks = _run(dp.core, [prompt])
    assert got == want and ranks == [0]
    stats = rank_stats(dp.core)
    after = [s["dummy_passes"] for s in stats]
    assert after[1] > before[1]  # rank 1 joined every MoE layer with no rows
    if dp.config.parallel.ep_decode_dispatch == "dynamic":
        assert after[0] == before[0]
        # decode DP2 x EP2: one copy per (token, destination rank), every step
        assert pairs[0] > 0 and dispatched_rows(dp.core, dp.config.model.hidden_size) == pairs[0]
        assert all(s["planned_steps"] == 0 for s in stats)
    else:  # the prompt's step dynamic, every decode step planned on both ranks; idle rank 1 ran padding (rank 0
        # too, for draft passes its last steps did not need)
        assert stats[0]["planned_steps"] == stats[1]["planned_steps"] >= len(want) - 1
        assert stats[0]["dynamic_steps"] == stats[1]["dynamic_steps"] >= 1


def test_stats_and_abort(engines):
    _, dp, _ = engines
    core = dp.core
    core.add_request(Request("a", _ids(20, seed=1), GREEDY))
    core.add_request(Request("b", _ids(30, seed=2), GREEDY))
    core.step()
    st = dp.get_stats()
    assert st.num_running == 2 and st.num_blocks == 2 * core.kv.num_blocks
    assert core.abort("a") and core.abort("b") and not core.abort("a")
    core.step()
    if dp.config.scheduler.async_scheduling:  # the step just launched (it drops a and b) is read back by the next
        assert core.in_flight and core.step() == [] and not core.in_flight
    assert not core.has_unfinished() and all(kv.num_free_blocks == kv.num_blocks for kv in core.kvs)
    # an idle group sends nothing: no round, no MoE collective
    reset_counters(core)
    assert core.step() == [] and core.step() == []
    assert all(not s["comm_calls"] for s in rank_stats(core))
    with pytest.raises(ValueError, match="already in use"):
        core.add_request(Request("c", [1, 2], GREEDY))
        core.add_request(Request("c", [1, 2], GREEDY))
    core.abort("c")


def test_async_engine_streams_from_a_dp_group(engines):
    """The AsyncEngine (what the services run) over the group: concurrent streams, tokens as offline."""
    import asyncio

    from engine.frontend.async_engine import AsyncEngine

    ref, dp, _ = engines
    prompts = [_ids(n, seed=200 + n) for n in (12, 60, 33)]
    want = _run(ref.core, prompts)[0]

    async def main():
        eng = AsyncEngine(dp.config, core=dp.core)
        eng.start()

        async def one(p):
            toks = []
            async for out in eng.generate(p, GREEDY):
                toks = list(out.token_ids)
            return toks

        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await eng.shutdown()

    assert asyncio.run(main()) == want


def test_the_start_up_warm_up_runs_on_a_dp_group_and_changes_no_answer(engines):
    """engine/core/warmup.py on the group: every rank's pool free and its prefix cache empty afterwards, no KV event
    left for the router, and the group's greedy tokens still the single-rank engine's."""
    from engine.core.warmup import warm_up

    ref, dp, spec = engines
    if not spec:
        pytest.skip("the MTP3 static-dispatch group covers it")
    while dp.core.has_unfinished():  # async scheduling: the last engine's loop may have left a step in flight
        dp.core.step()
    report = warm_up(dp.core, max_tokens=40, max_batch=3, long_context=False)  # the group, not the shapes, is tested
    assert report.prefill_lengths and report.decode_batches and report.steps > 0
    assert all(kv.num_free_blocks == kv.num_blocks for kv in dp.core.kvs)
    assert dp.core.drain_rank_kv_events() == [[], []]
    prompts = [_ids(n, 70 + i) for i, n in enumerate((33, 64))]
    got, _ = _run(dp.core, prompts)
    want, _ = _run(ref.core, prompts)
    assert got == want
