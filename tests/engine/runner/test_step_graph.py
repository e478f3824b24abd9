"""The whole greedy MTP decode step over padded requests (engine/runner/step_graph.py), run eagerly on the CPU:
the same greedy tokens as the per-forward device step, synchronous and with async scheduling (placeholders
filled on the device), with synthetic acceptance, across batch sizes that need padding and requests joining
and leaving; padding requests write nothing; steps that do not qualify take the per-forward path."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.helpers.decode_runs import run_joining_leaving, source_prompts

SIZES = [1, 2, 4, 8]


def _llm(path, whole: bool, **kw) -> LLM:
    llm = LLM(str(path), enforce_eager=False, num_blocks=128, max_num_seqs=8, cuda_graph_sizes=SIZES,
              num_speculative_tokens=3, **kw)
    dd = llm.core.runner.device_decode
    assert dd.step_graphs is not None and dd.step_graphs.num_captures == 0  # CPU: the padded body, eagerly
    if not whole:
        dd.step_graphs = None
    return llm


@pytest.mark.parametrize("kw", [{}, {"async_scheduling": True},
                                {"speculative_config": {"method": "mtp", "num_speculative_tokens": 3,
                                                        "synthetic_acceptance_length": 2.5}}],
                         ids=["sync", "async", "synthetic"])
def test_whole_step_equals_the_per_forward_step(tiny_code, kw):
    kw = dict(kw)
    if "speculative_config" in kw:
        spec = kw.pop("speculative_config")
        ref_llm = LLM(str(tiny_code), enforce_eager=False, num_blocks=128, max_num_seqs=8, cuda_graph_sizes=SIZES,
                      speculative_config=spec)
        ref_llm.core.runner.device_decode.step_graphs = None
        llm = LLM(str(tiny_code), enforce_eager=False, num_blocks=128, max_num_seqs=8, cuda_graph_sizes=SIZES,
                  speculative_config=spec)
    else:
        ref_llm, llm = _llm(tiny_code, False, **kw), _llm(tiny_code, True, **kw)
    prompts = source_prompts(llm.tokenizer, 7)
    ref = run_joining_leaving(ref_llm, prompts, late=3, tokens=20)
    got = run_joining_leaving(llm, prompts, late=3, tokens=20)
    for i, (a, b) in enumerate(zip(ref, got)):
        assert a == b, f"request {i} diverged on the whole-step path"
    dd, st = llm.core.runner.device_decode, llm.core.runner.static
    sg = dd.step_graphs
    assert sg.num_steps > 0 and dd.num_steps > sg.num_steps, "some steps whole, the others per forward"
    assert any(b < bp for b, bp, r in st.shapes if r == 4), "a whole step padded its requests"
    if kw.get("async_scheduling"):
        assert dd.num_placeholders > 0
    assert llm.get_stats().spec_accepted > 0
    assert llm.get_stats().num_free_blocks == 128


def test_padding_requests_of_a_whole_step_write_nothing(tiny_code):
    """Three requests padded to four: the first whole step writes the real requests' new rows only. A padding
    request's rows sit at positions 0..3 of block 0 and further (drafts) there; every real row this step
    writes lies at positions 17..63 of its first block, so a changed row at an offset below 17 is the padding's."""
    from engine.core.request import Request

    llm = _llm(tiny_code, True)
    core, runner = llm.core, llm.core.runner
    prompts = source_prompts(llm.tokenizer, 3)  # 17, 26 and 35 tokens
    for i, p in enumerate(prompts):
        core.add_request(Request(f"w{i}", list(p), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)))
    sg = runner.device_decode.step_graphs
    while sg.num_steps == 0:
        mla = runner.kv_cache.mla.clone()
        first = {runner.states[r].block_ids[0] for r in ("w0", "w1", "w2") if r in runner.states}
        longest = max((s.num_tokens for s in core.scheduler.running), default=0)
        core.step()
    assert longest + 8 < 64
    # compared as bytes: the cache is allocated uninitialised, and a NaN left there never equals itself
    changed = (runner.kv_cache.mla.view(torch.uint8) != mla.view(torch.uint8)).any(dim=-1).any(dim=1)
    changed = changed.nonzero().tolist()  # (block, offset)
    assert changed and all(b in first for b, _ in changed), f"rows outside the requests' first blocks: {changed}"
    assert all(off >= 17 for _, off in changed), f"rows at padding positions written: {changed}"


def test_steps_that_do_not_qualify_take_the_per_forward_path(tiny_code):
    llm = _llm(tiny_code, True)
    sg = llm.core.runner.device_decode.step_graphs
    prompts = source_prompts(llm.tokenizer, 4)
    run_joining_leaving(llm, prompts, tokens=16, sampling=[SamplingParams(temperature=0.0),
                                                           SamplingParams(temperature=0.8, seed=3)] * 2)
    assert sg.num_steps == 0, "a batch with a sampled request is never whole"
    assert torch.equal(sg.cols, torch.zeros_like(sg.cols))
