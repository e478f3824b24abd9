"""HiSparse decode = fully resident decode (fp32 path), with and without MTP3; counters agree with the
selections; a small device pool forces spills and still completes identically; nothing leaks; a request
larger than the device pool is served from the host pool; the offload-only baseline agrees too."""

from __future__ import annotations

import inspect

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.request import Request
from engine.hisparse.builder import HiSparseMetadataBuilder
from engine.hisparse.forward import FORWARD_STATE, HOT

EXACT = dict(dtype="float32", kv_cache_dtype="float32", indexer_precision="fp32")
TOPK = 16  # code16's index_topk (tests/conftest.py)
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def prompts(code16):
    import difflib

    from engine.frontend.tokenizer import Tokenizer

    ids = Tokenizer(code16).encode(inspect.getsource(difflib))
    lens = [8 * TOPK + 2, 8 * TOPK + 30, 8 * TOPK + 55, 8 * TOPK + 70]  # >= 8x top-k: misses every step
    return [ids[i * 400: i * 400 + n] for i, n in enumerate(lens)]


def _run(llm: LLM, prompts, max_tokens=NEW_TOKENS, on_step=None):
    """Greedy outputs by stepping the core; on_step(core) after every step. Flushes finished ids at the end."""
    core = llm.core
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rids = [f"p{i}" for i in range(len(prompts))]
    for rid, p in zip(rids, prompts):
        core.add_request(Request(rid, list(p), sp))
    toks = {rid: [] for rid in rids}
    while core.has_unfinished():
        for o in core.step():
            toks[o.req_id].extend(o.new_token_ids)
        if on_step:
            on_step(core)
    core.step()  # the runner drops the finished requests' state (and HiSparse their pages)
    return [toks[r] for r in rids]


@pytest.fixture(scope="module")
def reference(code16, prompts):
    return {spec: _run(LLM(str(code16), num_blocks=64, **EXACT, **({"num_speculative_tokens": spec} if spec else {})),
                       prompts) for spec in (0, 3)}


def _hisparse(code16, num_blocks, spec=0, **hs):
    hs.setdefault("host_pool_blocks", 48)
    kw = {"num_speculative_tokens": spec} if spec else {}
    return LLM(str(code16), num_blocks=num_blocks, hisparse=hs, **EXACT, **kw)


def _assert_nothing_leaked(llm: LLM, num_device_blocks: int):
    mgr = llm.core.runner.hisparse
    assert not mgr.residency.reqs and mgr.residency.num_free_blocks == num_device_blocks
    assert len(mgr.residency.free_hot) == mgr.residency.max_hot
    assert bool((mgr.page_table == -1).all()) or not mgr.residency.reqs
    st = llm.get_stats()
    assert st.num_free_blocks == st.num_blocks, "host blocks leaked"
    fp = llm.core.kv.device_footprint
    assert fp is None or fp.used == 0


def _record_selections(llm: LLM) -> list:
    """Wrap the inner indexer: keep (positions, meta) of every call to recount distinct selections."""
    inner = llm.core.runner.backend.inner
    calls, orig = [], inner.indexer_topk

    def rec(cache, layer, q, w, meta, topk):
        out = orig(cache, layer, q, w, meta, topk)
        calls.append((out.clone(), meta))
        return out

    inner.indexer_topk = rec
    return calls


def _distinct_hot_selections(calls) -> int:
    n = 0
    for sel, meta in calls:
        fw = FORWARD_STATE.get(meta)
        qsl = meta.query_start_loc_cpu
        for b, path in enumerate(fw.paths):
            if path == HOT:
                rows = sel[qsl[b]: qsl[b + 1]]
                n += int(torch.unique(rows[rows >= 0]).numel())
    return n


@pytest.mark.parametrize("spec", [0, 3])
def test_host_resident_decode_equals_resident(code16, prompts, reference, spec):
    """A device pool of hot buffers only: every request decodes from the host pool, misses every step."""
    hot_blocks = 1 if spec == 0 else 2  # round_up(max(2K, (1 + drafts) K) + 1 + drafts, 64) / 64
    llm = _hisparse(code16, num_blocks=len(prompts) * hot_blocks + 1, spec=spec)
    assert llm.core.runner.hisparse.layout.num_blocks == hot_blocks
    calls = _record_selections(llm)
    steps, prev = [], [0, 0]  # (misses in the step, did a request decode from its hot buffer)

    def on_step(core):
        st = core.stats().hisparse
        hot = any(HOT in FORWARD_STATE.get(meta).paths for _, meta in calls[prev[1]:])
        steps.append((st.misses - prev[0], hot))
        prev[:] = [st.misses, len(calls)]

    got = _run(llm, prompts, on_step=on_step)
    assert got == reference[spec]
    st = llm.get_stats().hisparse
    assert sum(hot for _, hot in steps) >= NEW_TOKENS // (1 + spec) - 1  # every step after the prefill
    assert all(m > 0 for m, hot in steps if hot), f"a hot decode step without misses: {steps}"
    assert st.hits + st.misses == _distinct_hot_selections(calls), "counters disagree with the selections"
    assert st.hits > 0 and st.spilled_pages > 0
    row = llm.core.runner.hisparse.row_bytes
    assert st.h2d_bytes >= st.misses * row * 2, "each miss of a full layer is copied for its shared layer too"
    _assert_nothing_leaked(llm, len(prompts) * hot_blocks + 1)


@pytest.mark.parametrize("spec", [0, 3])
def test_static_decode_path_with_misses_equals_resident(code16, prompts, reference, spec):
    """The padded static decode path (what CUDA graphs replay: the routing from the static buffers, on the CPU
    run eagerly) with a device pool of hot buffers only: misses every step, the same greedy tokens."""
    hot_blocks = 1 if spec == 0 else 2
    kw = {"num_speculative_tokens": spec} if spec else {}
    llm = LLM(str(code16), num_blocks=len(prompts) * hot_blocks + 1, hisparse={"host_pool_blocks": 48},
              enforce_eager=False, **EXACT, **kw)
    steps, prev = [], [0]

    def on_step(core):
        st = core.stats().hisparse
        steps.append(st.misses - prev[0])
        prev[0] = st.misses

    assert _run(llm, prompts, on_step=on_step) == reference[spec]
    static = llm.core.runner.static
    assert static.num_static > 0 and static.num_captures == 0
    assert static.pad and isinstance(static.builder, HiSparseMetadataBuilder)
    assert all(bp in static.sizes for _, bp, _ in static.shapes), "HiSparse forwards are padded to capture sizes"
    assert sum(m > 0 for m in steps) >= NEW_TOKENS // (1 + spec) - 1, f"decode steps without misses: {steps}"
    _assert_nothing_leaked(llm, len(prompts) * hot_blocks + 1)


def test_pressure_spills_page_by_page_and_completes(code16, prompts, reference):
    """Room for about half the pages: some requests stay resident, others go mixed / host and come back."""
    seen = set()
    llm = _hisparse(code16, num_blocks=9)

    def on_step(core):
        st = core.stats().hisparse
        seen.update(k for k in ("resident", "mixed", "host") if getattr(st, f"num_{k}"))

    assert _run(llm, prompts, on_step=on_step) == reference[0]
    st = llm.get_stats().hisparse
    assert st.spilled_pages > 0 and st.misses > 0
    assert {"resident", "mixed"} <= seen, seen
    _assert_nothing_leaked(llm, 9)


def test_host_pool_bounds_admission_and_preempts_by_recompute(code16, prompts, reference):
    """4 requests of 3-4 pages each and a host pool of 9 blocks: preemption (recompute) keeps them exact."""
    llm = LLM(str(code16), num_blocks=6, hisparse={"host_pool_blocks": 9}, num_speculative_tokens=3,
              enable_prefix_caching=False, **EXACT)
    assert _run(llm, prompts) == reference[3]
    st = llm.get_stats()
    assert st.num_preemptions > 0 and st.num_blocks == 9
    _assert_nothing_leaked(llm, 6)


@pytest.mark.parametrize("fused", [False, True], ids=["torch-plan", "fused-plan"])
def test_virtual_layout_path_equals_resident(code16, prompts, reference, fused):
    """The GPU read path (block table of device pages + hot blocks, remapped selections) on the torch backend,
    with the plan as torch ops or as the fused kernel (kernels.hisparse_plan, in Triton's interpreter)."""
    llm = _hisparse(code16, num_blocks=7, spec=3)
    llm.core.runner.hisparse.assemble = False
    llm.core.runner.hisparse.fused_plan = fused
    n = 4 if fused else NEW_TOKENS  # the interpreter is slow: greedy prefixes (two MTP3 steps, misses) are enough there
    assert _run(llm, prompts, max_tokens=n) == [t[:n] for t in reference[3]]
    assert llm.get_stats().hisparse.misses > 0
    _assert_nothing_leaked(llm, 7)


def test_request_larger_than_the_device_pool(code16, prompts):
    long_prompt = sum(prompts, [])[:420]  # 7 pages; the device pool has 3 blocks, the host pool 9
    ref = _run(LLM(str(code16), num_blocks=16, **EXACT), [long_prompt], max_tokens=12)
    llm = _hisparse(code16, num_blocks=3, host_pool_blocks=9)
    with pytest.raises(ValueError, match="more KV blocks"):
        llm.core.add_request(Request("x", long_prompt + long_prompt[:200], SamplingParams(max_tokens=4)))
    assert _run(llm, [long_prompt], max_tokens=12) == ref
    assert llm.get_stats().hisparse.misses > 0
    _assert_nothing_leaked(llm, 3)


def test_prefix_cache_hits_come_back_from_the_host_pool(code16, prompts):
    prefix = prompts[3][:192]  # three full pages, published as host blocks by the first request
    first, second = prefix + prompts[0][:20], prefix + prompts[1][:25]
    cold = _run(LLM(str(code16), num_blocks=64, enable_prefix_caching=False, **EXACT), [second], max_tokens=8)
    llm = _hisparse(code16, num_blocks=12)
    _run(llm, [first], max_tokens=8)
    restored = llm.get_stats().hisparse.restored_pages
    assert _run(llm, [second], max_tokens=8) == cold
    st = llm.get_stats()
    assert st.prefix_hits >= 192 and st.hisparse.restored_pages - restored == 3, "the hit pages are copied back"
    _assert_nothing_leaked(llm, 12)


def test_kv_imported_by_block_id_lands_in_the_host_pool(code16, prompts, reference):
    """The disaggregation path: a prefill engine's blocks copied into a HiSparse decode engine by block id
    (cache.mla / cache.index, as NIXL would) decode exactly like the aggregated engine."""
    pre = LLM(str(code16), num_blocks=16, **EXACT).core
    dec = _hisparse(code16, num_blocks=3).core
    ids = prompts[2]
    r = Request("pre", list(ids), SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                hold_kv_on_finish=True)
    pre.add_request(r)
    while pre.has_unfinished():
        first = pre.step()[-1].new_token_ids
    d = Request("dec", list(ids), SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    d.append_output(first)
    block_ids, n_cached = dec.reserve_import(d, len(ids))
    src, dst = pre.runner.kv_cache, dec.runner.kv_cache
    for s_id, d_id in zip(pre.held_block_ids("pre"), block_ids):
        dst.mla[d_id].copy_(src.mla[s_id])
        dst.index[d_id].copy_(src.index[s_id])
    dec.import_done("dec", ok=True)
    got = list(first)
    while dec.has_unfinished():
        for o in dec.step():
            got.extend(o.new_token_ids)
    assert got == reference[0][2]
    assert dec.stats().hisparse.misses > 0, "the imported request decoded from the host pool"


def test_offload_only_baseline_equals_and_moves_whole_contexts(code16, prompts, reference):
    llm = _hisparse(code16, num_blocks=1, offload_only=True)
    assert _run(llm, prompts[:2]) == reference[0][:2]
    st = llm.get_stats().hisparse
    spec = llm.core.runner.spec
    pages = sum(-(-(len(p) + NEW_TOKENS) // 64) for p in prompts[:2])
    assert st.misses == 0 and st.h2d_bytes >= pages * spec.mla_block_bytes, "whole contexts come back every step"
    _assert_nothing_leaked(llm, 1)


def test_bad_configs_are_refused(code16):
    with pytest.raises(ValueError, match="cannot hold one hot buffer"):
        _hisparse(code16, num_blocks=1, spec=3)
    with pytest.raises(ValueError, match="unknown hisparse keys"):
        LLM(str(code16), num_blocks=8, hisparse={"host_pool": 1})
    with pytest.raises(ValueError, match="single-rank"):
        LLM(str(code16), num_blocks=8, hisparse={}, prefill_context_parallel_size=2, decode_context_parallel_size=2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("spec", [0, 3])
def test_cuda_hisparse_decode_equals_resident(code16, prompts, spec):
    """The GPU path (Triton kernels, fp8 KV, fused plan, pinned host pool read in place): the same greedy
    tokens as resident decode on the GPU, with misses every step and nothing leaked."""
    kw = dict(device="cuda", dtype="bfloat16", kv_cache_dtype="fp8_ds_mla", enforce_eager=True,
              **({"num_speculative_tokens": spec} if spec else {}))  # both eager: graphs are tested apart
    ref = _run(LLM(str(code16), num_blocks=64, **kw), prompts)
    llm = LLM(str(code16), num_blocks=7, hisparse={"host_pool_blocks": 48}, **kw)
    mgr = llm.core.runner.hisparse
    assert llm.core.runner.backend.name.startswith("hisparse+triton")
    out = _run(llm, prompts)
    assert mgr.fused_plan and not mgr.assemble
    assert out == ref
    st = llm.get_stats().hisparse
    print(f"\nCUDA HiSparse (MTP {spec}): hit rate {st.hit_rate:.3f}, misses {st.misses}, copy path {st.copy_path}")
    assert st.misses > 0 and st.copy_path == "triton"
    _assert_nothing_leaked(llm, 7)
