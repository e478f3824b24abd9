"""The router turns every structured-output spelling into one spec, and answers a bad one with 400 +
`param` before anything is sent to an engine."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from engine.frontend.tokenizer import Tokenizer
from engine.structured import StructuredOutputSpec as Spec
from proto.pdserve.v1 import common_pb2
from services.router.chat_request import ChatSettings
from services.router.chat_template import ChatTemplate
from services.router.http_api import RouterAPI
from services.router.openai_models import ChatCompletionRequest, CompletionRequest
from services.router.prepare import ServedModel, prepare_chat, prepare_completion, prepare_generate
from services.router.requests import BadRequest, Limits
from services.router.structured import structured_from_request
from tests.conftest import TINY_CODE

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
LIMITS = Limits(max_model_len=2048, vocab_size=4096)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(TINY_CODE)


def _served(tok: Tokenizer, limits: Limits = LIMITS) -> ServedModel:
    return ServedModel(("tiny-code",), tok, limits, ChatSettings(ChatTemplate.load(TINY_CODE)))


def _chat(**extra) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=20, **extra)


@pytest.mark.parametrize("extra, want", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     Spec.json_schema(SCHEMA)),
    ({"response_format": {"type": "json_object"}}, Spec.json_object()),
    ({"response_format": {"type": "text"}}, None),
    ({"structured_outputs": {"json": SCHEMA}}, Spec.json_schema(SCHEMA)),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, Spec.json_schema(SCHEMA)),
    ({"structured_outputs": {"regex": "a+b", "backend": "xgrammar"}}, Spec.regex("a+b")),
    ({"structured_outputs": {"choice": ["x", "y"]}}, Spec.choice(["x", "y"])),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, Spec.grammar('root ::= "a"')),
    ({"structured_outputs": {"json_object": True}}, Spec.json_object()),
    ({"guided_json": SCHEMA}, Spec.json_schema(SCHEMA)),
    ({"guided_regex": "[0-9]+"}, Spec.regex("[0-9]+")),
    ({"guided_choice": ["x", "y"]}, Spec.choice(["x", "y"])),
    ({"guided_grammar": 'root ::= "a"'}, Spec.grammar('root ::= "a"')),
    ({}, None),
])
def test_every_spelling_becomes_one_spec(tok, extra, want):
    assert prepare_chat(_chat(**extra), _served(tok), None).params.structured_outputs == want
    body = CompletionRequest(prompt="x", **extra)
    assert prepare_completion(body, _served(tok), None).params.structured_outputs == want


def test_reasoning_gate_unless_the_spec_spells_the_marker():
    gated = structured_from_request({"guided_regex": "[0-9]+"}, reasoning_end="</think>")
    assert gated.reasoning_end == "</think>"
    whole = structured_from_request({"structured_outputs": {"regex": "<think>x</think>y"}}, reasoning_end="</think>")
    assert whole.reasoning_end == ""  # the spec describes the reasoning too
    assert structured_from_request({"guided_regex": "[0-9]+"}).reasoning_end == ""
    off = {"guided_regex": "[0-9]+", "chat_template_kwargs": {"enable_thinking": False}}
    assert structured_from_request(off, reasoning_end="</think>").reasoning_end == ""  # no thinking to wait for
    limits = Limits(max_model_len=2048, vocab_size=4096, reasoning_end="</think>")
    served = _served(Tokenizer(TINY_CODE), limits)
    chat = _chat(guided_regex="[0-9]+")
    assert prepare_chat(chat, served, None).params.structured_outputs.reasoning_end == "</think>"
    body = CompletionRequest(prompt="x", guided_regex="[0-9]+")
    assert prepare_completion(body, served, None).params.structured_outputs.reasoning_end == ""


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
     "response_format.json_schema.schema", "invalid JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "needs a schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA, "strict": "yes"}}},
     "response_format.json_schema.strict", "must be a bool"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "must be text"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex", "invalid regex"),
    ({"structured_outputs": {"regex": "(?<=a)b"}}, "structured_outputs.regex", "invalid regex"),
    ({"structured_outputs": {"grammar": "root ::= nothing"}}, "structured_outputs.grammar", "invalid grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag", "not supported"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty list"),
    ({"guided_json": "{oops"}, "guided_json", "not valid JSON"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "give one"),
]


@pytest.mark.parametrize("extra, param, msg", BAD)
def test_bad_specs_name_their_param(tok, extra, param, msg):
    with pytest.raises(BadRequest, match=msg) as e:
        prepare_chat(_chat(**extra), _served(tok), None)
    assert e.value.param == param


class _NoEngines:
    """A flow with a tokenizer and nothing else: a request that got past the checks would fail with 500."""

    def __init__(self, tok):
        self.tokenizer = tok
        self.routing = SimpleNamespace(redis_ok=True)


@pytest.mark.parametrize("extra, param, _msg", BAD[:1] + BAD[4:7])
def test_http_400_with_param_and_nothing_reaches_an_engine(tok, extra, param, _msg):
    api = RouterAPI(_NoEngines(tok), LIMITS, "tiny-code", metrics=None,
                    chat=ChatSettings(ChatTemplate.load(TINY_CODE)))
    client = TestClient(api.build())
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"})):
        r = client.post(path, json={**body, "max_tokens": 5, **extra})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param


def test_grpc_generate_checks_the_spec(tok):
    g = common_pb2.GenerateRequest(prompt="hi", sampling_params=common_pb2.SamplingParams(
        max_tokens=5, structured_outputs=common_pb2.StructuredOutput(kind="regex", spec="(a")))
    with pytest.raises(BadRequest, match="invalid regex") as e:
        prepare_generate(g, _served(tok), None)
    assert e.value.param == "sampling_params.structured_outputs"
    g.sampling_params.structured_outputs.spec = "a+"
    assert prepare_generate(g, _served(tok), None).params.structured_outputs == Spec.regex("a+")
