"""Sampled requests in the device decode step, on CPU: temperature, top-k / top-p / min-p, seeded and
unseeded, beside greedy ones, with and without MTP3 (drafts verified by rejection sampling on the device),
requests joining and leaving — the same tokens as the host path over the same padded forwards; a seeded
request's tokens do not depend on its batch-mates; with async scheduling (placeholders filled in on the
device) seeded and greedy requests give the synchronous host path's tokens."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.helpers.decode_runs import MIXED, run_joining_leaving, source_prompts

SIZES = [1, 2, 4, 8]


def _llm(path, spec: int, host: bool = False, **kw) -> LLM:
    kw = dict(num_blocks=160, max_num_seqs=8, cuda_graph_sizes=SIZES, enforce_eager=False, **kw)
    if spec:
        kw["num_speculative_tokens"] = spec
    llm = LLM(str(path), **kw)
    if host:  # every step samples on the host path, over the same padded static forwards
        llm.core.runner.device_decode = None
    return llm


def _decode_steps_on_host(llm: LLM) -> list[int]:
    """Counts the host path's steps whose chunks are all decode chunks (the device step's to take)."""
    runner, seen = llm.core.runner, [0]
    execute = runner._execute_host

    def count(sched):
        if sched.chunks and all(c.sample and c.start > 0 and len(c.token_ids) == 1 + c.num_draft_tokens
                                for c in sched.chunks):
            seen[0] += 1
        return execute(sched)

    runner._execute_host = count
    return seen


@pytest.mark.parametrize("spec", [0, 3])
def test_device_sampling_equals_host_path(tiny_code, spec):
    host = _llm(tiny_code, spec, host=True)
    prompts = source_prompts(host.tokenizer, len(MIXED))
    ref = run_joining_leaving(host, prompts, late=2, tokens=10, sampling=MIXED)
    llm = _llm(tiny_code, spec)
    on_host = _decode_steps_on_host(llm)
    got = run_joining_leaving(llm, prompts, late=2, tokens=10, sampling=MIXED)
    for i, (a, b) in enumerate(zip(ref, got)):
        assert a == b, f"request {i} ({MIXED[i]}) diverged on the device path"
    dd = llm.core.runner.device_decode
    assert dd.num_steps >= 10 and on_host[0] == 0, "a decode step of the mixed batch took the host path"
    assert {b for b, _, _ in llm.core.runner.static.shapes} >= {6, 8}, "the batch grew and shrank"
    if spec:
        st, ref_st = llm.get_stats(), host.get_stats()
        assert 0 < st.spec_accepted < st.spec_drafts, "rejection sampling accepted some drafts, not all"
        assert (st.spec_accepted, st.spec_drafts) == (ref_st.spec_accepted, ref_st.spec_drafts)
    assert llm.get_stats().num_free_blocks == 160


def test_seeded_request_ignores_its_batch_mates(tiny_code):
    """MTP3: a seeded request alone, beside greedy and unseeded sampled requests, and beside other seeded ones."""
    llm = _llm(tiny_code, 3)
    prompts = source_prompts(llm.tokenizer, 4)
    seeded = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=42)
    alone = run_joining_leaving(llm, prompts[:1], tokens=24, sampling=[seeded])[0]
    steps = llm.core.runner.device_decode.num_steps
    mates = [seeded, SamplingParams(temperature=1.0), SamplingParams(temperature=0.0),
             SamplingParams(temperature=0.8, min_p=0.1, seed=7)]
    assert run_joining_leaving(llm, prompts, tokens=24, sampling=mates)[0] == alone
    assert run_joining_leaving(llm, [prompts[0], prompts[3]], late=1, tokens=24,
                               sampling=[seeded, mates[3]])[0] == alone
    assert llm.core.runner.device_decode.num_steps > steps


@pytest.mark.parametrize("spec", [0, 3])
def test_async_device_sampling_equals_sync_host_path(tiny_code, spec):
    """Seeded and greedy requests (unseeded ones share the engine's generator, which the async engine's
    dropped steps of finished requests also draw from)."""
    sampling = [p for p in MIXED if p.greedy or p.seed is not None]
    host = _llm(tiny_code, spec, host=True)
    prompts = source_prompts(host.tokenizer, len(sampling))
    ref = run_joining_leaving(host, prompts, late=2, tokens=10, sampling=sampling)
    llm = _llm(tiny_code, spec, async_scheduling=True)
    assert run_joining_leaving(llm, prompts, late=2, tokens=10, sampling=sampling) == ref
    dd = llm.core.runner.device_decode
    assert dd.num_steps >= 10 and dd.num_placeholders > 0


def test_min_tokens_joins_the_device_step_once_reached(tiny_code):
    """Stop tokens are masked on the host until min_tokens; from then on the request samples on the device."""
    sampling = [SamplingParams(temperature=0.9, min_tokens=6, seed=9), SamplingParams(temperature=0.0, min_tokens=3),
                SamplingParams(temperature=1.0, top_p=0.9)]
    host = _llm(tiny_code, 3, host=True)
    prompts = source_prompts(host.tokenizer, len(sampling))
    ref = run_joining_leaving(host, prompts, tokens=14, sampling=sampling)
    llm = _llm(tiny_code, 3)
    on_host = _decode_steps_on_host(llm)
    assert run_joining_leaving(llm, prompts, tokens=14, sampling=sampling) == ref
    assert on_host[0] > 0 and llm.core.runner.device_decode.num_steps > 0
