"""Structured outputs through `pdserve up` (router -> prefill samples the first token -> decode with
MTP3 and HiSparse continues): `response_format` json_schema answers validate against the schema,
vLLM's `structured_outputs` and `guided_*` fields hold, a bad spec is a 400 naming its param, and a
regex that spells out the reasoning splits into reasoning_content and content."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import yaml

from tests.helpers import system

pytestmark = pytest.mark.xdist_group("default")  # shares conftest.default_deployment

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "size": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
          "required": ["name", "size", "tags"], "additionalProperties": False}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def url(default_deployment):
    return default_deployment.endpoints()["router"][0]


@pytest.fixture(scope="module")
def client(url):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=url + "/v1", api_key="unused")


def _chat(client, content: str, **kw):
    return client.chat.completions.create(model="tiny-code", messages=[{"role": "user", "content": content}], **kw)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_response_format_json_schema_answers_validate(client, temperature):
    fmt = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA, "strict": True}}
    for i, prompt in enumerate(["describe a file", "class Node:", "def parse(text):"]):
        r = _chat(client, prompt, response_format=fmt, max_tokens=120, temperature=temperature, seed=i,
                  extra_body=NO_THINKING)
        c = r.choices[0]
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), SCHEMA)


def test_streamed_json_schema_answer_validates(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA}}
    chunks = list(_chat(client, "import os", response_format=fmt, max_tokens=120, temperature=1.0, seed=7,
                        stream=True, extra_body=NO_THINKING))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("extra, check", [
    ({"structured_outputs": {"regex": r"[a-f]{4}-[0-9]{3}"}}, lambda t: re.fullmatch(r"[a-f]{4}-[0-9]{3}", t)),
    ({"structured_outputs": {"choice": ["red", "green", "blue"]}}, lambda t: t in ("red", "green", "blue")),
    ({"guided_regex": r"v[0-9]\.[0-9]"}, lambda t: re.fullmatch(r"v[0-9]\.[0-9]", t)),
    ({"guided_json": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}},
     lambda t: isinstance(json.loads(t)["ok"], bool)),
])
def test_vllm_fields_hold_on_chat_and_completions(client, extra, check):
    r = _chat(client, "pick one", max_tokens=40, temperature=1.0, seed=3, extra_body={**extra, **NO_THINKING})
    assert r.choices[0].finish_reason == "stop" and check(r.choices[0].message.content), r.choices[0].message.content
    c = client.completions.create(model="tiny-code", prompt="x = ", max_tokens=40, temperature=1.0, seed=4,
                                  extra_body=extra)
    assert c.choices[0].finish_reason == "stop" and check(c.choices[0].text), c.choices[0].text


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "(?<=a)b"}}, "structured_outputs.regex"),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar"),
])
def test_bad_specs_get_400_with_param(url, extra, param):
    status, err = system.post(url, "/v1/chat/completions",
                              {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra})
    assert status == 400 and err["error"]["param"] == param, err
    ok, _ = system.post(url, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert ok == 200


def _reasoning_parser_on() -> bool:
    topo = yaml.safe_load(system.TOPOLOGY.read_text())
    return bool(topo["services"]["router"].get("args", {}).get("reasoning-parser"))


@pytest.mark.skipif(not _reasoning_parser_on(), reason="the default topology runs no reasoning parser")
def test_regex_through_the_reasoning_splits_it(client):
    r = _chat(client, "think, then answer", max_tokens=30, temperature=1.0, seed=1,
              extra_body={"structured_outputs": {"regex": "<think>x</think>y"}})
    msg = r.choices[0].message
    assert getattr(msg, "reasoning_content", None) == "x" and msg.content == "y", msg
