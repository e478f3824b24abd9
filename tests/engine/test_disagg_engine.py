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


def test_import_that_gives_up_after_its_prefix_was_cached_recomputes_into_its_own_blocks(tiny_code):
    """Decode reserves a request's blocks (no local prefix hit yet); while its READ runs, another request
    computes and caches the same prefix; the READ gives up (here: its pages hold NaN bytes, as a READ of
    reused pages holds another request's). The request must compute its whole prompt into the blocks it
    reserved: taking the new prefix hits at admission appended them after its own blocks, so its first
    128 positions were read from the unwritten ones (greedy ids collapsed to token 0)."""
    import random

    rng = random.Random(0)
    p0 = [rng.randrange(16, 4096) for _ in range(180)]
    prompts = [p0, p0 + [rng.randrange(16, 4096) for _ in range(150)]]
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = [list(o.token_ids) for o in LLM(str(tiny_code), kv_cache_dtype="fp8_ds_mla").generate(prompts, sp)]
    dec = LLM(str(tiny_code), kv_cache_dtype="fp8_ds_mla", num_blocks=32).core
    got: dict[str, list[int]] = {}

    def steps(n: int) -> None:
        for _ in range(n):
            for o in dec.step():
                got[o.req_id].extend(o.new_token_ids)

    for i, ids in enumerate(prompts):  # both imports give up; the second is reserved while the first runs
        d = Request(f"d{i}", ids, sp)
        d.append_output([want[i][0]])
        got[d.req_id] = [want[i][0]]
        blocks, n_cached = dec.reserve_import(d, len(ids))
        assert n_cached == 0
        steps(2)
        for b in blocks:
            dec.runner.kv_cache.mla[b].fill_(0xFF)  # NaN in fp8_ds_mla's codes and scales
            dec.runner.kv_cache.index[b].fill_(0xFF)
        steps(2)
        dec.import_done(d.req_id, ok=False)
    while dec.has_unfinished():
        steps(1)
    assert [got["d0"], got["d1"]] == want
    assert dec.stats().num_free_blocks == 32
