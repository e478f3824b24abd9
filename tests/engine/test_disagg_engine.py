"""Prefill/decode disaggregation at the engine level: KV exported by one engine, imported by another
(block copies stand in for NIXL here), gives exactly the aggregated engine's tokens."""

from __future__ import annotations

import inspect

import pytest

from engine import LLM, SamplingParams
from engine.core.request import Request


def _prompts(tok):
    import difflib
    ids = tok.encode(inspect.getsource(difflib))
    return [ids[:70], ids[500:700], ids[900:905], ids[1000:1128]]


def _copy_blocks(src_cache, src_ids, dst_cache, dst_ids, first_block):
    for s, d in list(zip(src_ids, dst_ids))[first_block:]:
        dst_cache.mla[d].copy_(src_cache.mla[s])
        dst_cache.index[d].copy_(src_cache.index[s])


@pytest.mark.parametrize("spec", [None, 3])
def test_prefill_then_decode_equals_aggregated(tiny_code, spec):
    kw = dict(num_speculative_tokens=spec) if spec else {}
    agg = LLM(str(tiny_code), num_blocks=64, **kw)
    prompts = _prompts(agg.tokenizer)
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in agg.generate(prompts, sp)]

    pre = LLM(str(tiny_code), num_blocks=64, **kw).core
    dec = LLM(str(tiny_code), num_blocks=64, **kw).core
    for i, ids in enumerate(prompts):
        r = Request(f"p{i}", ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                    hold_kv_on_finish=True)
        pre.add_request(r)
        while pre.has_unfinished():
            outs = pre.step()
        first = outs[-1].new_token_ids[0]
        assert first == expected[i][0]
        src_blocks = pre.held_block_ids(r.req_id)

        d = Request(f"d{i}", ids, sp)
        d.append_output([first])
        block_ids, n_cached = dec.reserve_import(d, len(ids))
        _copy_blocks(pre.runner.kv_cache, src_blocks, dec.runner.kv_cache, block_ids, n_cached // 64)
        assert pre.release_held(r.req_id)
        dec.import_done(d.req_id, ok=True)
        got = [first]
        while dec.has_unfinished():
            for o in dec.step():
                got.extend(o.new_token_ids)
        assert got == expected[i], f"prompt {i}"
    assert pre.stats().num_free_blocks == 64
    assert dec.stats().num_free_blocks == 64


def test_import_failure_recomputes_locally(tiny_code):
    agg = LLM(str(tiny_code), num_blocks=32)
    ids = _prompts(agg.tokenizer)[1]
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    (want,) = agg.generate([ids], sp)
    dec = LLM(str(tiny_code), num_blocks=32).core
    d = Request("d", ids, sp)
    d.append_output([want.token_ids[0]])
    assert dec.reserve_import(d, len(ids)) is not None
    dec.import_done("d", ok=False)  # nothing arrived: the decode engine computes the prompt itself
    got = [want.token_ids[0]]
    while dec.has_unfinished():
        for o in dec.step():
            got.extend(o.new_token_ids)
    assert got == want.token_ids and dec.stats().num_free_blocks == 32


def test_abort_during_import_defers_the_free(tiny_code):
    dec = LLM(str(tiny_code), num_blocks=16).core
    d = Request("d", list(range(10, 200)), SamplingParams(max_tokens=5))
    d.append_output([7])
    blocks, _ = dec.reserve_import(d, 190)
    assert dec.abort("d")
    assert dec.stats().num_free_blocks == 16 - len(blocks), "blocks a transfer may still write must stay held"
    dec.import_done("d", ok=True)
    assert dec.stats().num_free_blocks == 16 and not dec.has_unfinished()


def test_reserve_import_reports_short_pool_without_side_effects(tiny_code):
    dec = LLM(str(tiny_code), num_blocks=4).core
    big = Request("big", list(range(10, 10 + 64 * 3)), SamplingParams(max_tokens=5))
    big.append_output([7])
    assert dec.reserve_import(big, 64 * 3) is not None
    other = Request("other", list(range(10, 10 + 64 * 2)), SamplingParams(max_tokens=5))
    other.append_output([7])
    assert dec.reserve_import(other, 128) is None
    assert dec.stats().num_free_blocks == 0 and "other" not in dec.scheduler.requests
