"""The KV offload tier on CPU (tiny-code): a prefix the device pool evicted comes back from the host tier
with tokens identical to recomputation (plain, MTP3, HiSparse); the decode's reserve_import gets tier hits
back as already-cached blocks, bit for bit; aborts leave nothing held."""

from __future__ import annotations

import inspect

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.request import Request

NUM_BLOCKS = 8  # 512 tokens: two 400-token requests evict a 256-token prefix
TIER_GIB = 0.02  # ~160 tiny-code blocks
SP = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def turns(tiny_code):
    """A first turn with a 4-block prefix, two unrelated requests, and a second turn on the same prefix."""
    import difflib

    from engine.frontend.tokenizer import Tokenizer

    ids = Tokenizer(tiny_code).encode(inspect.getsource(difflib))
    prefix = ids[:256]
    return [prefix + ids[300:305], ids[1000:1400], ids[2000:2400], prefix + ids[3000:3011]]


def _serve(llm: LLM, turns) -> tuple[list[list[int]], list[int]]:
    """Each turn alone, in order: (tokens, cached tokens) per turn."""
    outs = [llm.generate([t], SP)[0] for t in turns]
    return [o.token_ids for o in outs], [o.num_cached_tokens for o in outs]


@pytest.mark.parametrize("spec, async_scheduling", [(None, False), (3, False), (3, True)])
def test_an_evicted_prefix_comes_back_from_the_tier_with_identical_tokens(tiny_code, turns, spec, async_scheduling):
    kw = {"num_speculative_tokens": spec} if spec else {}
    kw["async_scheduling"] = async_scheduling  # the copies travel with the step planned ahead
    cold, _ = _serve(LLM(str(tiny_code), num_blocks=NUM_BLOCKS, enable_prefix_caching=False, **kw), turns)
    _, no_tier = _serve(LLM(str(tiny_code), num_blocks=NUM_BLOCKS, **kw), turns)
    assert no_tier[3] < 256, "the device pool alone must have lost the prefix for this test to mean anything"
    llm = LLM(str(tiny_code), num_blocks=NUM_BLOCKS, kv_offloading_size=TIER_GIB, **kw)
    got, cached = _serve(llm, turns)
    assert got == cold
    st = llm.get_stats()
    off = st.kv_offload
    assert cached[3] == 256 and off.hits >= 256 - no_tier[3], "the prefix came from the host tier"
    assert st.prefix_hits >= 256 and off.num_loaded >= (256 - no_tier[3]) // 64 and off.num_stored >= 4
    assert off.load_bytes == off.num_loaded * llm.core.runner.kv_offload.block_bytes
    assert 0 < off.usage <= 1 and st.num_free_blocks == NUM_BLOCKS


def test_hisparse_keeps_finished_pages_in_the_tier(code16, turns):
    """With HiSparse the KV manager's blocks are host-pool blocks: the tier extends that prefix cache."""
    exact = dict(dtype="float32", kv_cache_dtype="float32", indexer_precision="fp32")
    cold, _ = _serve(LLM(str(code16), num_blocks=64, enable_prefix_caching=False, **exact), turns)
    hs = {"host_pool_blocks": NUM_BLOCKS}
    _, no_tier = _serve(LLM(str(code16), num_blocks=4, hisparse=hs, **exact), turns)
    assert no_tier[3] < 256
    llm = LLM(str(code16), num_blocks=4, hisparse=hs, kv_offloading_size=TIER_GIB, **exact)
    got, cached = _serve(llm, turns)
    assert got == cold and cached[3] == 256
    st = llm.get_stats()
    assert st.kv_offload.num_loaded >= (256 - no_tier[3]) // 64 and st.hisparse.restored_pages > 0
    llm.core.step()  # the runner drops the finished request (and HiSparse its pages)
    assert st.num_free_blocks == st.num_blocks and not llm.core.runner.hisparse.residency.reqs


def test_reserve_import_gets_tier_hits_bit_for_bit_and_an_abort_holds_nothing(tiny_code, turns):
    llm = LLM(str(tiny_code), num_blocks=NUM_BLOCKS, kv_offloading_size=TIER_GIB)
    core, cache = llm.core, llm.core.runner.kv_cache
    llm.generate([turns[0]], SP)
    prefix_ids = [core.kv.pool.lookup(h).block_id for h in Request("x", turns[0], SP).block_hashes(64)[:4]]
    before = [(cache.mla[b].clone(), cache.index[b].clone()) for b in prefix_ids]
    llm.generate(turns[1:3], SP)
    d = Request("dec", list(turns[3]), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    d.append_output([1])
    block_ids, n_cached = core.reserve_import(d, len(turns[3]))
    assert n_cached == 256, "the tier's blocks are returned as already cached: only the rest is pulled"
    for b, (mla, index) in zip(block_ids[:4], before):  # loaded by the time reserve_import returned
        assert torch.equal(cache.mla[b], mla) and torch.equal(cache.index[b], index)
    assert core.kv.offload.locked == set() and core.kv.offload.copies == []
    assert core.abort("dec")
    core.import_done("dec", ok=False)  # the transfer gave up after the abort: only now are the blocks freed
    core.step()
    st = core.stats()
    assert st.num_free_blocks == NUM_BLOCKS and not core.scheduler.requests and not core.runner.states
    (again,) = llm.generate([turns[3]], SP)  # the prefix is still served: from the device or the tier
    assert again.num_cached_tokens == 256


def test_an_abort_after_the_loads_holds_nothing_and_leaves_the_prefix_intact(tiny_code, turns):
    """Aborted mid-prefill right after the step that loaded its prefix: its blocks are freed, and the loaded
    blocks, published again, serve the next request with the right bytes."""
    cold, _ = _serve(LLM(str(tiny_code), num_blocks=NUM_BLOCKS, enable_prefix_caching=False), turns)
    llm = LLM(str(tiny_code), num_blocks=NUM_BLOCKS, kv_offloading_size=TIER_GIB, max_num_batched_tokens=8)
    core = llm.core
    _serve(llm, turns[:3])
    loaded = core.stats().kv_offload.num_loaded
    core.add_request(Request("gone", list(turns[3]), SP))
    core.step()  # loads the prefix, computes 8 of the 11 remaining prompt tokens
    assert core.stats().kv_offload.num_loaded > loaded and core.scheduler.running
    assert core.abort("gone")
    core.step()
    assert core.stats().num_free_blocks == NUM_BLOCKS and not core.runner.states
    (out,) = llm.generate([turns[3]], SP)
    assert out.num_cached_tokens == 256 and out.token_ids == cold[3]


def test_preemption_with_the_tier_completes_identically_and_holds_nothing(tiny_code, turns):
    """A pool too small for the batch: requests are preempted, their prefixes evicted to the tier and loaded
    back when they are readmitted; outputs equal an engine that never preempts, and nothing is held."""
    prompts = [turns[0][:128] + t[i * 40:i * 40 + 30] for i, t in enumerate(turns[1:3] * 3)]
    sp = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    ref = LLM(str(tiny_code), num_blocks=128).generate(prompts, sp)
    llm = LLM(str(tiny_code), num_blocks=9, kv_offloading_size=TIER_GIB)
    got = llm.generate(prompts, sp)
    st = llm.get_stats()
    assert st.num_preemptions > 0 and st.kv_offload.num_loaded > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert st.num_free_blocks == 9 and st.num_running == 0 and not llm.core.kv.req_blocks
