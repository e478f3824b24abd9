"""Structured outputs through the engine on tiny-code: schema/regex/choice/grammar outputs hold, with
MTP3 on and off, across a prefill -> decode split, and the grammar waits for the end of reasoning."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine import LLM, SamplingParams
from engine.core.request import Request
from engine.structured import StructuredOutputSpec as Spec
from tests.engine.test_disagg_engine import _copy_blocks

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "count", "ok"], "additionalProperties": False}
PROMPTS = ["import os\n", "def main():\n    ", "class Parser:\n"]


@pytest.fixture(scope="module", params=[None, 3], ids=["plain", "mtp3"])
def llm(request, tiny_code):
    kw = {"num_speculative_tokens": request.param} if request.param else {}
    return LLM(str(tiny_code), num_blocks=96, **kw)


def _gen(llm, spec, temperature, max_tokens=60):
    sps = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i, structured_outputs=spec)
           for i in range(len(PROMPTS))]
    return llm.generate(PROMPTS, sps)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate(llm, temperature):
    for o in _gen(llm, Spec.json_schema(SCHEMA), temperature):
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), SCHEMA)


@pytest.mark.parametrize("spec, check", [
    (Spec.regex(r"[a-c]{3}-\d{2}"), lambda t: re.fullmatch(r"[a-c]{3}-\d{2}", t)),
    (Spec.choice(["alpha", "beta", "gamma"]), lambda t: t in ("alpha", "beta", "gamma")),
    (Spec.grammar('root ::= "def " [a-z_]+ "():"'), lambda t: re.fullmatch(r"def [a-z_]+\(\):", t)),
])
def test_regex_choice_grammar_outputs_match(llm, spec, check):
    for temperature in (0.0, 1.0):
        for o in _gen(llm, spec, temperature):
            assert o.finish_reason == "stop" and check(o.text), (spec.kind, o.text)


def test_json_object_outputs_are_objects(llm):
    outs = _gen(llm, Spec.json_object(), 1.0, max_tokens=120) + _gen(llm, Spec.json_object(), 0.0, max_tokens=120)
    assert all(o.text.startswith("{") for o in outs)
    done = [o for o in outs if o.finish_reason == "stop"]  # free-form strings may run to max_tokens
    assert done and all(isinstance(json.loads(o.text), dict) for o in done)


def test_mtp_greedy_equals_plain_greedy_under_a_grammar(tiny_code):
    spec = Spec.json_schema(SCHEMA)
    plain = [o.token_ids for o in _gen(LLM(str(tiny_code), num_blocks=96), spec, 0.0)]
    mtp = LLM(str(tiny_code), num_blocks=96, num_speculative_tokens=3)
    assert [o.token_ids for o in _gen(mtp, spec, 0.0)] == plain
    st = mtp.core.stats()
    assert st.spec_drafts > st.spec_accepted > 0  # drafts were checked: some accepted, some refused


def test_mtp_drafts_follow_the_grammar(tiny_code):
    from engine.runner.structured import engine_backend
    from engine.structured.matcher import RequestGrammar

    llm = LLM(str(tiny_code), num_blocks=96, num_speculative_tokens=3)
    spec = Spec.json_schema(SCHEMA)
    core = llm.core
    req = Request("r", llm.tokenizer.encode(PROMPTS[2]), SamplingParams(max_tokens=60, temperature=1.0, seed=5,
                                                                         structured_outputs=spec))
    core.add_request(req)
    backend = engine_backend(core.cfg)
    checked = 0
    while core.has_unfinished():
        core.step()
        if req.is_finished or not req.spec_token_ids:
            continue
        g = RequestGrammar(backend, spec, req.prompt_token_ids)
        assert g.replay(req.output_token_ids)
        for d in req.spec_token_ids:  # every proposed draft is a valid continuation
            assert g.advance(d), (req.output_token_ids, req.spec_token_ids)
            if g.is_terminated:
                break
        checked += 1
    assert checked > 3 and req.status.value == "stop"
    jsonschema.validate(json.loads(llm.tokenizer.decode(req.output_token_ids)), SCHEMA)
    st = core.stats()
    assert st.spec_accepted / st.spec_drafts > 0.25  # unmasked drafts: about 1 in 70 accepted here


def test_preempted_requests_replay_their_grammar(tiny_code):
    spec = Spec.regex(r"(x = [0-9]{1,3}\n){20}")
    sps = [SamplingParams(max_tokens=150, temperature=0.0, structured_outputs=spec) for _ in PROMPTS]
    want = [o.token_ids for o in LLM(str(tiny_code), num_blocks=96).generate(PROMPTS, sps)]
    small = LLM(str(tiny_code), num_blocks=4)  # 256 token slots for three ~110-token requests
    got = small.generate(PROMPTS, sps)
    assert small.core.stats().num_preemptions > 0
    assert [o.token_ids for o in got] == want  # recomputed requests rebuilt their matchers from their tokens
    assert all(re.fullmatch(r"(x = [0-9]{1,3}\n){20}", o.text) for o in got)


def test_grammar_stops_even_with_ignore_eos(tiny_code):
    llm = LLM(str(tiny_code), num_blocks=32)
    (o,) = llm.generate("x = ", SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                                               structured_outputs=Spec.choice(["yes", "no"])))
    assert o.text in ("yes", "no") and o.finish_reason == "stop"


@pytest.mark.parametrize("spec_tokens", [None, 3])
def test_prefill_then_decode_keeps_the_grammar(tiny_code, spec_tokens):
    kw = {"num_speculative_tokens": spec_tokens} if spec_tokens else {}
    agg = LLM(str(tiny_code), num_blocks=64, **kw)
    spec = Spec.json_schema(SCHEMA)
    sp = SamplingParams(max_tokens=60, temperature=0.0, structured_outputs=spec)
    ids = agg.tokenizer.encode(PROMPTS[1])
    (want,) = agg.generate([ids], sp)
    jsonschema.validate(json.loads(want.text), SCHEMA)

    pre = LLM(str(tiny_code), num_blocks=64, **kw).core
    dec = LLM(str(tiny_code), num_blocks=64, **kw).core
    r = Request("p", ids, SamplingParams(max_tokens=1, temperature=0.0, structured_outputs=spec),
                hold_kv_on_finish=True)
    pre.add_request(r)
    while pre.has_unfinished():
        outs = pre.step()
    first = outs[-1].new_token_ids
    assert first == want.token_ids[:1]
    d = Request("d", ids, sp)
    d.append_output(first)
    block_ids, n_cached = dec.reserve_import(d, len(ids))
    _copy_blocks(pre.runner.kv_cache, pre.held_block_ids("p"), dec.runner.kv_cache, block_ids, n_cached // 64)
    pre.release_held("p")
    dec.import_done("d", ok=True)
    got = list(first)
    while dec.has_unfinished():
        for o in dec.step():
            got.extend(o.new_token_ids)
    assert got == want.token_ids  # the decode engine's matcher replayed the first token
    assert dec.stats().num_free_blocks == 64


def test_grammar_applies_only_after_reasoning(tiny_code):
    llm = LLM(str(tiny_code), num_blocks=64)
    tok = llm.tokenizer
    gated = Spec.regex(r"y[0-9]", reasoning_end="</think>")
    free = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    (unconstrained,) = llm.generate(PROMPTS[0], free)
    (o,) = llm.generate(PROMPTS[0], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                   structured_outputs=gated))
    assert o.token_ids == unconstrained.token_ids  # still thinking: nothing is masked
    # the prompt already closed thinking: constrained from the first token
    (o,) = llm.generate(PROMPTS[0] + "</think>", SamplingParams(max_tokens=6, temperature=0.0,
                                                               structured_outputs=gated))
    assert re.fullmatch(r"y[0-9]", o.text) and o.finish_reason == "stop"
    # thinking ended in tokens generated earlier (as a decode engine receives them): replayed, then constrained
    ids = tok.encode(PROMPTS[0])
    req = Request("r", ids, SamplingParams(max_tokens=20, temperature=0.0, structured_outputs=gated))
    req.append_output(tok.encode("hmm</think>"))
    llm.core.add_request(req)
    text = []
    while llm.core.has_unfinished():
        for out in llm.core.step():
            text.extend(out.new_token_ids)
    assert re.fullmatch(r"y[0-9]", tok.decode(text)), tok.decode(text)


def test_engine_rejects_a_bad_spec(tiny_code):
    llm = LLM(str(tiny_code), num_blocks=16)
    with pytest.raises(ValueError, match="invalid regex"):
        llm.generate("x", SamplingParams(max_tokens=4, structured_outputs=Spec.regex("(a")))
    assert llm.core.stats().num_free_blocks == 16 and not llm.core.has_unfinished()
