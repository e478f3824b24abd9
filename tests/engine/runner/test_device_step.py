"""The decode step without host syncs, on a GPU: with async scheduling and CUDA graphs no CUDA call inside
the step synchronises (torch.cuda.set_sync_debug_mode("error") around every launch), with MTP3, without
drafts and with synthetic acceptance, greedy and with sampled requests (temperature, top-k / top-p / min-p,
seeded and unseeded: rejection sampling on the device); async scheduling gives the synchronous engine's
greedy tokens (fp32: the batches of the two differ by the finished requests' dropped steps), also with
HiSparse misses; the device step samples the host path's tokens over the same graph replays."""

from __future__ import annotations

import dataclasses
import inspect
import itertools

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.request import Request
from tests.helpers.decode_runs import MIXED, run_joining_leaving, source_prompts, steps_without_syncs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SIZES = [1, 2, 4, 8]
BF16 = dict(device="cuda", dtype="bfloat16", kv_cache_dtype="fp8_ds_mla")
FP32 = dict(device="cuda", dtype="float32", kv_cache_dtype="float32", indexer_precision="fp32")
_SEQ = itertools.count()


def _prompts(tok, n: int, base: int = 17) -> list[list[int]]:
    import difflib

    ids = tok.encode(inspect.getsource(difflib))
    return [ids[i * 300: i * 300 + base + 9 * i] for i in range(n)]


def _add(llm: LLM, prompts, max_tokens, sampling: list[SamplingParams] | None = None) -> list[str]:
    rids = [f"d{next(_SEQ)}" for _ in prompts]
    for i, (rid, p) in enumerate(zip(rids, prompts)):
        n = max_tokens + 3 * i if isinstance(max_tokens, int) else max_tokens[i]
        sp = sampling[i % len(sampling)] if sampling else SamplingParams(temperature=0.0)
        llm.core.add_request(Request(rid, list(p), dataclasses.replace(sp, max_tokens=n, ignore_eos=True)))
    return rids


def _drain(llm: LLM, rids) -> list[list[int]]:
    toks = {r: [] for r in rids}
    while llm.core.has_unfinished():
        for o in llm.core.step():
            toks.setdefault(o.req_id, []).extend(o.new_token_ids)
    llm.core.step()
    return [toks[r] for r in rids]


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("spec", [0, 3, "synthetic"])
def test_decode_step_never_syncs(tiny_code, spec, sampled):
    """Steady decode of 4 requests (graphs captured in the warm-up), greedy or a mix of greedy, sampled and
    seeded ones: every launch of a step runs under sync-debug "error", every step took the device path, and
    it counted no host read; greedy with MTP3, each step is a whole-step graph replay."""
    kw = dict(num_blocks=256, max_num_seqs=8, cuda_graph_sizes=SIZES, enforce_eager=False, async_scheduling=True,
              **BF16)
    if spec == "synthetic":
        kw["speculative_config"] = {"method": "mtp", "num_speculative_tokens": 3, "synthetic_acceptance_length": 2.5}
    elif spec:
        kw["num_speculative_tokens"] = spec
    llm = LLM(str(tiny_code), **kw)
    runner = llm.core.runner
    mix = [MIXED[i] for i in (0, 1, 4, 5)]  # greedy, unseeded, seeded min-p, seeded top-k + top-p + min-p
    rids = _add(llm, _prompts(llm.tokenizer, 4), max_tokens=400, sampling=mix if sampled else None)
    for _ in range(6):  # prefill, then decode steps until every graph of this batch is captured
        llm.core.step()
    captures = runner.static.num_captures
    steps = runner.device_decode.num_steps
    steps_without_syncs(llm, 20)
    dd = runner.device_decode
    assert dd.num_syncs == 0 and runner.num_placeholder_waits == 0 and dd.num_steps == steps + 20
    assert dd.num_placeholders >= 20 * 4 and runner.static.num_captures == captures > 0
    assert runner.static.graphs.failed is None, runner.static.graphs.failed
    if spec and not sampled:  # greedy with drafts: every steady step is one whole-step graph
        sg = dd.step_graphs
        assert sg.failed is None and sg.num_replays >= 20, (sg.failed, sg.num_replays)
    for rid in rids:
        llm.core.abort(rid)
    _drain(llm, [])


def _fp32_pair(path, **kw) -> tuple[LLM, LLM]:
    kw = dict(max_num_seqs=8, cuda_graph_sizes=SIZES, enforce_eager=False, **FP32, **kw)
    return LLM(str(path), **kw), LLM(str(path), async_scheduling=True, **kw)


@pytest.mark.parametrize("spec", [0, 3])
def test_async_equals_sync_on_the_gpu(tiny_code, spec):
    sync, llm = _fp32_pair(tiny_code, num_blocks=256, **({"num_speculative_tokens": spec} if spec else {}))
    prompts = _prompts(sync.tokenizer, 6)
    ref = _drain(sync, _add(sync, prompts, max_tokens=12))
    got = _drain(llm, _add(llm, prompts, max_tokens=12))
    assert got == ref
    assert llm.core.runner.device_decode.num_placeholders > 0
    assert llm.core.runner.static.graphs.failed is None
    assert llm.get_stats().num_free_blocks == 256


def test_async_hisparse_misses_equal_sync_on_the_gpu(code16):
    """HiSparse's plan reads exact starts: its placeholders are filled in on the host (one wait per step)."""
    sync, llm = _fp32_pair(code16, num_blocks=9, hisparse={"host_pool_blocks": 48}, num_speculative_tokens=3)
    prompts = _prompts(sync.tokenizer, 4, base=8 * 16 + 2)
    ref = _drain(sync, _add(sync, prompts, max_tokens=16))
    assert _drain(llm, _add(llm, prompts, max_tokens=16)) == ref
    assert llm.get_stats().hisparse.misses > 0


@pytest.mark.parametrize("spec", [0, 3])
def test_device_sampling_equals_host_on_the_gpu(tiny_code, spec):
    """fp32, CUDA graphs: greedy, sampled and seeded requests joining and leaving; the host path (the same
    graph replays, sampling by the same `verify`) gives the same tokens."""
    kw = dict(num_blocks=256, max_num_seqs=8, cuda_graph_sizes=SIZES, enforce_eager=False, **FP32,
              **({"num_speculative_tokens": spec} if spec else {}))
    host = LLM(str(tiny_code), **kw)
    host.core.runner.device_decode = None
    prompts = source_prompts(host.tokenizer, len(MIXED))
    ref = run_joining_leaving(host, prompts, late=2, tokens=16, sampling=MIXED)
    llm = LLM(str(tiny_code), **kw)
    got = run_joining_leaving(llm, prompts, late=2, tokens=16, sampling=MIXED)
    for i, (a, b) in enumerate(zip(ref, got)):
        assert a == b, f"request {i} ({MIXED[i]}) diverged on the device path"
    assert llm.core.runner.device_decode.num_steps >= 16 and llm.core.runner.static.graphs.failed is None
