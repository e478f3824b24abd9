"""KV imported into a DP x EP group (the decode service's path): a request admitted on DP rank r gets rank r's
blocks, the prompt's KV written into rank r's own pages (in its own process: block copies stand in for NIXL
here) gives exactly the aggregated single-rank engine's tokens, with and without HiSparse + MTP3; an abort
during the transfer frees the blocks only at import_done; bad ranks are refused."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.core.request import Request
from engine.parallel.spawn import RankPool
from tests.engine.parallel.test_dp_engine import EXACT, _ids
from tests.helpers import kv_pages

pytestmark = pytest.mark.xdist_group("cp")

SP = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
LENS = (70, 5, 130, 64)


@pytest.fixture(scope="module")
def rank_pool():
    pool = RankPool()
    yield pool
    pool.close()


def _prefill(pre, rid: str, ids: list[int]) -> tuple[int, list[int]]:
    """(first token, held block ids) of `ids` prefilled by a single-rank engine."""
    pre.add_request(Request(rid, ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                            hold_kv_on_finish=True))
    while pre.has_unfinished():
        outs = pre.step()
    return outs[-1].new_token_ids[0], pre.held_block_ids(rid)


def _import(pre, dp, rid: str, ids: list[int], rank: int) -> int:
    """Prefill `ids`, import its KV on DP rank `rank`; returns the first token (the prefill's)."""
    first, src = _prefill(pre, "p" + rid, ids)
    req = Request(rid, ids, SP)
    req.append_output([first])
    block_ids, n_cached = dp.core.reserve_import(req, len(ids), rank=rank)
    assert dp.core.rank_of[rid] == rank and n_cached == 0
    n = len(src)
    cache = pre.runner.kv_cache
    wrote = dp.core.collective_rpc(kv_pages.write_kv_blocks, rank, block_ids[:n],
                                   cache.mla[src].clone(), cache.index[src].clone())
    assert wrote == [r == rank for r in range(2)]
    assert pre.release_held("p" + rid)
    dp.core.import_done(rid, ok=True)
    return first


def _drain(core, rids: list[str]) -> dict[str, list[int]]:
    toks: dict[str, list[int]] = {r: [] for r in rids}
    while core.has_unfinished():
        for o in core.step():
            toks[o.req_id].extend(o.new_token_ids)
    core.step()  # the runners drop the finished requests' state
    return toks


@pytest.mark.parametrize("variant", ["plain", "hisparse-mtp3"])
def test_import_into_the_chosen_rank_equals_aggregated(tiny_ckpt, rank_pool, variant):
    kw = dict(EXACT)
    if variant != "plain":
        kw.update(num_speculative_tokens=3)
    agg = LLM(str(tiny_ckpt), **kw)
    prompts = [_ids(n, seed=40 + n) for n in LENS]
    want = [o.token_ids for o in agg.generate(prompts, SP)]
    pre = LLM(str(tiny_ckpt), **kw).core
    dp_kw = dict(kw, hisparse={"host_pool_blocks": 48}) if variant != "plain" else kw
    dp = LLM(str(tiny_ckpt), rank_pool=rank_pool, data_parallel_size=2, enable_expert_parallel=True, **dp_kw)
    try:
        ranks = [1, 1, 0, 1]  # not the least-loaded placement: the caller's choice is kept
        firsts = {}
        for i, (ids, rank) in enumerate(zip(prompts, ranks)):
            firsts[f"d{i}"] = _import(pre, dp, f"d{i}", ids, rank)
        assert [len(s.waiting) for s in dp.core.schedulers] == [1, 3]
        got = _drain(dp.core, list(firsts))
        assert [[firsts[r]] + got[r] for r in firsts] == want
        st = dp.core.stats()
        assert [r.num_free_blocks for r in st.dp_ranks] == [kv.num_blocks for kv in dp.core.kvs]
        if variant != "plain":
            assert st.spec_drafts > 0
            held = [(h.num_resident + h.num_mixed + h.num_host, h.num_device_blocks - h.num_free_device_blocks)
                    for h in (r.hisparse for r in st.dp_ranks)]
            assert held == [(0, 0), (0, 0)], "a rank kept HiSparse rows of finished requests"
            assert st.hisparse.num_host_blocks == 2 * 48
    finally:
        dp.core.shutdown()


def test_abort_during_import_and_bad_ranks(tiny_ckpt, rank_pool):
    dp = LLM(str(tiny_ckpt), rank_pool=rank_pool, data_parallel_size=2, enable_expert_parallel=True, **EXACT)
    try:
        core = dp.core
        req = Request("a", _ids(150, seed=1), SamplingParams(max_tokens=5))
        req.append_output([7])
        blocks, _ = core.reserve_import(req, 150, rank=1)
        free = core.kvs[1].num_blocks - len(blocks)
        assert core.abort("a") and core.kvs[1].num_free_blocks == free, "a transfer may still write these blocks"
        core.import_done("a", ok=True)
        assert core.kvs[1].num_free_blocks == core.kvs[1].num_blocks and not core.has_unfinished()
        core.step()
        assert not core.has_finished_to_drop()
        for bad in (2, -1, "1"):
            with pytest.raises(ValueError, match="outside this group of 2 ranks"):
                core.reserve_import(Request(f"b{bad}", [5, 6, 7], SP), 2, rank=bad)
        with pytest.raises(KeyError, match="not importing"):
            core.import_done("never", ok=True)
        dup = Request("dup", [5, 6, 7], SP)
        dup.append_output([1])
        assert core.reserve_import(dup, 3, rank=0) is not None
        with pytest.raises(ValueError, match="already in use"):
            core.reserve_import(Request("dup", [5, 6, 7], SP), 3, rank=1)
        core.abort("dup")
        core.import_done("dup", ok=False)
        assert all(kv.num_free_blocks == kv.num_blocks for kv in core.kvs)
    finally:
        dp.core.shutdown()
