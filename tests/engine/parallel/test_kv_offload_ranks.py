"""The KV offload tier over ranks (gloo): on a PCP2 x DCP2 engine every rank stores and loads its share of
each virtual block from the SchedulerOutput's copies, and `reserve_import` runs them on every rank before
it returns; on a DP2 group each rank has its own tier, fed by its own SchedulerOutput. Greedy tokens equal
the single-rank engine's that kept the prefix on its device."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.request import Request
from tests.helpers import kv_pages

pytestmark = pytest.mark.xdist_group("cp")  # one process group per process: keep these on one worker

EXACT = dict(device="cpu", dtype="float32", kv_cache_dtype="float32", indexer_precision="fp32")
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(1, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_pcp2_dcp2_tier_loads_each_ranks_share(tiny_ckpt):
    prefix = _ids(256, seed=1)  # two virtual blocks of 128 tokens
    turns = [prefix + _ids(10, seed=2), _ids(600, seed=3), _ids(600, seed=4), prefix + _ids(20, seed=5)]
    ref = LLM(str(tiny_ckpt), num_blocks=96, **EXACT)
    want = [ref.generate([t], GREEDY)[0].token_ids for t in turns]
    llm = LLM(str(tiny_ckpt), num_blocks=6, kv_offloading_size=0.01, prefill_context_parallel_size=2,
              decode_context_parallel_size=2, **EXACT)
    try:
        core = llm.core
        core.check_outputs = True  # every step: all ranks sampled the same tokens
        assert core.kv.offload.block_bytes == 2 * core.runner.kv_offload.block_bytes  # a share on each rank
        outs = [llm.generate([t], GREEDY)[0] for t in turns]
        assert [o.token_ids for o in outs] == want
        assert outs[3].num_cached_tokens == 256 and core.stats().kv_offload.num_loaded >= 2
        # the decode path: evict the prefix again, then reserve_import gets it back from the tier on every rank
        llm.generate([_ids(600, seed=6)], GREEDY)
        d = Request("dec", list(turns[3]), GREEDY)
        d.append_output(want[3][:1])  # what the prefill sampled
        loaded = core.stats().kv_offload.num_loaded
        block_ids, n_cached = core.reserve_import(d, len(turns[3]))
        assert n_cached == 256 and core.stats().kv_offload.num_loaded > loaded and not core.kv.offload.copies
        core.import_done("dec", ok=False)  # nothing imported: the rest is computed on the ranks
        got = want[3][:1]
        while core.has_unfinished():
            for o in core.step():
                got += o.new_token_ids
        assert got[:len(want[3])] == want[3]
        core.step()
        assert core.stats().num_free_blocks == 6
    finally:
        llm.core.shutdown()


def _step_all(core, reqs: list[Request], rank: int) -> dict[str, list[int]]:
    got = {r.req_id: [] for r in reqs}
    for r in reqs:  # one at a time: each turn sees what the previous one left in the caches
        core.add_request(r, rank=rank)
        while core.has_unfinished():
            for o in core.step():
                got[o.req_id] += o.new_token_ids
    return got


def test_dp2_rank1_has_its_own_tier(tiny_ckpt):
    prefix = _ids(256, seed=11)
    turns = [prefix + _ids(10, seed=12), _ids(400, seed=13), _ids(400, seed=14), prefix + _ids(20, seed=15)]
    ref = LLM(str(tiny_ckpt), num_blocks=96, **EXACT)
    want = [ref.generate([t], GREEDY)[0].token_ids for t in turns]
    llm = LLM(str(tiny_ckpt), num_blocks=8, kv_offloading_size=0.01, data_parallel_size=2, **EXACT)
    try:
        core = llm.core
        got = _step_all(core, [Request(f"t{i}", t, GREEDY) for i, t in enumerate(turns)], rank=1)
        assert [got[f"t{i}"] for i in range(4)] == want
        r0, r1 = core.kvs[0].offload_stats(), core.kvs[1].offload_stats()
        assert r0.num_stored == 0 and r1.num_loaded >= 1 and r1.hits >= 64
        total = core.stats().kv_offload
        assert total.num_blocks == r0.num_blocks + r1.num_blocks and total.num_loaded == r1.num_loaded
        # the decode path on rank 1: evict the prefix again; reserve_import loads it in rank 1's process
        # before it returns (the pull writes the rest next), with the single-rank engine's bytes
        _step_all(core, [Request("filler", _ids(400, seed=16), GREEDY)], rank=1)
        ref_ids = [ref.core.kv.pool.lookup(h).block_id for h in Request("x", prefix, GREEDY).block_hashes(64)]
        ref_mla, ref_index = ref.core.runner.kv_cache.mla[ref_ids], ref.core.runner.kv_cache.index[ref_ids]
        d = Request("dec", list(turns[3]), GREEDY)
        d.append_output(want[3][:1])
        block_ids, n_cached = core.reserve_import(d, len(turns[3]), rank=1)
        assert n_cached == 256 and not any(kv.offload.copies for kv in core.kvs)
        mla, index = core.collective_rpc(kv_pages.read_kv_blocks, 1, block_ids[:4])[1]
        assert torch.equal(mla, ref_mla) and torch.equal(index, ref_index)
        core.import_done("dec", ok=False)
        while core.has_unfinished():
            core.step()
        core.step()
        assert core.stats().num_free_blocks == 16  # both ranks' pools
    finally:
        llm.core.shutdown()
