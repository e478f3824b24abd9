"""Async scheduling on CPU (`async_scheduling=True`): the same tokens, text, finish and stop reasons as the
synchronous engine — plain and MTP3, on the static decode path (placeholders filled in on the device) and
on the plain path (filled in on the host) — with EOS, stop tokens, stop strings, max_tokens, seeded
sampling beside greedy requests, a client abort, preemption, and HiSparse misses every step."""

from __future__ import annotations

import dataclasses
import inspect
import json

import pytest

from engine import LLM, SamplingParams
from engine.core.request import Request
from engine.frontend.output_processor import OutputProcessor

EXACT = dict(dtype="float32", kv_cache_dtype="float32", indexer_precision="fp32")


def _prompts(tok, n: int, base: int = 21, step: int = 7) -> list[list[int]]:
    import difflib

    ids = tok.encode(inspect.getsource(difflib))
    return [ids[i * 250: i * 250 + base + step * i] for i in range(n)]


def _generate(llm: LLM, reqs: list[Request], abort_after: dict[str, int] | None = None) -> dict[str, tuple]:
    """Like LLM.generate (stop strings abort in the core), with the caller's Requests (EOS ids) and client
    aborts: request r is aborted as soon as it has delivered abort_after[r] tokens. -> per request (token ids,
    text, finish reason, stop reason)."""
    core, proc, final = llm.core, OutputProcessor(llm.tokenizer), {}
    for r in reqs:
        r = Request(r.req_id, list(r.prompt_token_ids), r.sampling_params, eos_token_ids=r.eos_token_ids)
        core.add_request(r)
        proc.add(r)
    while core.has_unfinished():
        updated, to_abort = proc.process(core.step())
        for rid in to_abort:
            core.abort(rid)
        for o in updated:
            if not o.finished and len(o.token_ids) >= (abort_after or {}).get(o.req_id, 1 << 30):
                core.abort(o.req_id)
                o = proc.abort(o.req_id)
            if o.finished:
                final[o.req_id] = (list(o.token_ids), o.text, o.finish_reason, o.stop_reason)
    core.step()  # the runner drops the finished requests' state
    assert llm.get_stats().num_free_blocks == llm.get_stats().num_blocks, "KV blocks leaked"
    return final


def _requests(llm: LLM, prompts) -> list[Request]:
    """Greedy requests ending every way there is; the stop token, EOS and stop string are picked from a
    plain greedy run so that they do occur."""
    greedy = SamplingParams(max_tokens=26, temperature=0.0, ignore_eos=True)
    ref = llm.generate(prompts, greedy)
    text = ref[3].text
    stop_str = text[len(text) // 2: len(text) // 2 + 3]
    assert stop_str.strip(), "pick another prompt: no stop string in the middle of its text"
    sp = [greedy,
          dataclasses.replace(greedy, max_tokens=7),
          dataclasses.replace(greedy, stop_token_ids=[ref[2].token_ids[9]]),
          dataclasses.replace(greedy, stop=[stop_str]),
          dataclasses.replace(greedy, ignore_eos=False, max_tokens=30),
          SamplingParams(max_tokens=3, temperature=0.8, top_p=0.9, seed=7)]  # host-path sampling, same batch
    reqs = [Request(f"r{i}", list(p), s) for i, (p, s) in enumerate(zip(prompts, sp))]
    reqs[4].eos_token_ids = (ref[4].token_ids[13],)
    return reqs


@pytest.mark.parametrize("spec", [0, 3])
@pytest.mark.parametrize("static", [True, False])
def test_async_equals_sync(tiny_code, spec, static):
    kw = dict(num_blocks=96, max_num_seqs=8, cuda_graph_sizes=[1, 2, 4, 8], enforce_eager=not static)
    if spec:
        kw["num_speculative_tokens"] = spec
    base = LLM(str(tiny_code), **kw)
    reqs = _requests(base, _prompts(base.tokenizer, 6))
    sync = LLM(str(tiny_code), **kw)
    ref = _generate(sync, reqs, abort_after={"r0": 11})
    llm = LLM(str(tiny_code), async_scheduling=True, **kw)
    got = _generate(llm, reqs, abort_after={"r0": 11})
    assert got == ref
    reasons = {r: v[2] for r, v in got.items()}
    assert reasons == {"r0": "abort", "r1": "length", "r2": "stop", "r3": "stop", "r4": "stop", "r5": "length"}
    assert got["r2"][3] == reqs[2].sampling_params.stop_token_ids[0] and got["r3"][3] == reqs[3].sampling_params.stop[0]
    runner = llm.core.runner
    if static:  # decode steps ran on the device path, their placeholders filled in there
        assert runner.device_decode.num_steps > 0 and runner.device_decode.num_placeholders > 0
        assert runner.static.num_reruns > 0, "the MTP catch-up runs on the target pass's batch"
    else:
        assert runner.device_decode is None and runner.num_host_placeholders > 0
    if spec:
        assert llm.get_stats().spec_accepted > 0
        assert llm.get_stats().spec_accepted == sync.get_stats().spec_accepted
    for core in (sync.core, llm.core):  # the engine thread's CPU time: counted, and never above the phase's wall
        cpu, wall = core.stats().step_phase_cpu_seconds, core.stats().step_phase_seconds
        assert set(cpu) == {"schedule", "launch", "update"} and cpu["launch"] > 0
        assert all(0 <= cpu[p] <= wall[p] + 1e-4 for p in cpu), (cpu, wall)


def test_async_preemption_equals_sync(tiny_code):
    """A pool too small for the batch: requests are preempted (some while their step runs) and recomputed."""
    kw = dict(num_blocks=7, max_num_seqs=8, cuda_graph_sizes=[1, 2, 4, 8], enforce_eager=False,
              num_speculative_tokens=3)
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    sync = LLM(str(tiny_code), **kw)
    prompts = _prompts(sync.tokenizer, 5, base=40, step=3)
    reqs = [Request(f"p{i}", list(p), sp) for i, p in enumerate(prompts)]
    ref = _generate(sync, reqs)
    llm = LLM(str(tiny_code), async_scheduling=True, **kw)
    assert _generate(llm, reqs) == ref
    assert llm.get_stats().num_preemptions > 0


def test_async_hisparse_misses_equal_resident(code16):
    """HiSparse with a device pool of hot buffers only (misses every decode step) and MTP3, static path:
    async = sync = the fully resident engine."""
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    resident = LLM(str(code16), num_blocks=64, num_speculative_tokens=3, **EXACT)
    prompts = _prompts(resident.tokenizer, 3, base=8 * 16 + 2, step=25)
    reqs = [Request(f"h{i}", list(p), sp) for i, p in enumerate(prompts)]
    ref = _generate(resident, reqs)
    kw = dict(num_blocks=len(prompts) * 2 + 1, hisparse={"host_pool_blocks": 48}, num_speculative_tokens=3,
              enforce_eager=False, **EXACT)
    sync = LLM(str(code16), **kw)
    assert _generate(sync, reqs) == ref
    llm = LLM(str(code16), async_scheduling=True, **kw)
    assert _generate(llm, reqs) == ref
    st = llm.get_stats().hisparse
    assert st.misses > 0 and st.spilled_pages > 0
    assert llm.core.runner.device_decode.num_steps > 0
    assert llm.core.runner.num_host_placeholders > 0, "HiSparse places pages by exact starts: filled on the host"


def test_async_scheduling_refuses_context_parallel_ranks(tiny_code):
    """A context-parallel engine's ranks run one shared step: it stays synchronous (a DP group schedules ahead:
    tests/engine/parallel/test_dp_engine.py)."""
    with pytest.raises(ValueError, match="async_scheduling runs single-rank engines and DP groups"):
        LLM(str(tiny_code), num_blocks=16, async_scheduling=True, prefill_context_parallel_size=2)


def test_async_structured_outputs_equal_sync(tiny_code):
    """Grammar requests (host-path sampling, MTP3 drafts within the grammar) finish when their grammar does;
    the step planned after that runs with a complete grammar and is dropped."""
    from engine.structured import StructuredOutputSpec as Spec

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "n"], "additionalProperties": False}
    prompts = ["import os\n", "def main():\n    ", "class Parser:\n", "x = "]
    sps = [SamplingParams(max_tokens=60, temperature=t, seed=i, structured_outputs=Spec.json_schema(schema))
           for i, t in enumerate((0.0, 1.0, 0.0))]
    sps.append(SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                              structured_outputs=Spec.choice(["yes", "no"])))
    kw = dict(num_blocks=96, num_speculative_tokens=3, enforce_eager=False, cuda_graph_sizes=[1, 2, 4])
    ref = LLM(str(tiny_code), **kw).generate(prompts, sps)
    got = LLM(str(tiny_code), async_scheduling=True, **kw).generate(prompts, sps)
    assert [(o.token_ids, o.text, o.finish_reason) for o in got] == [(o.token_ids, o.text, o.finish_reason)
                                                                        for o in ref]
    assert all(o.finish_reason == "stop" for o in got)
    assert all(json.loads(o.text) for o in got[:3]) and got[3].text in ("yes", "no")
