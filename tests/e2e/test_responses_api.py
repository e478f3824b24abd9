"""OpenAI's Responses API through `pdserve up` (tiny-code, the default CPU topology, stored responses in its
Redis), driven by the official `openai` client: create whole and streamed (and `responses.stream` where
the client has it), a function-calling loop continued by previous_response_id, a json_schema answer that
validates, GET and DELETE of a stored response, and 400s naming what is refused.

Thinking is off (`reasoning.effort: "none"`) and forced calls and formats are held by the engines'
grammar: the tiny model writes Python, and would otherwise neither call a tool nor write JSON."""

from __future__ import annotations

import json

import pytest

from services.launch.launcher import Deployment
from services.launch.scale import scale

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.xdist_group("default")  # shares conftest.default_deployment

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather forecast", "parameters": WEATHER}]
ITEM = {"type": "object",  # as tests/e2e/test_structured_outputs.py asks of the chat path, with the same prompts
        "properties": {"name": {"type": "string", "maxLength": 10},
                       "size": {"type": "integer", "minimum": 0, "maximum": 99},
                       "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
        "required": ["name", "size", "tags"], "additionalProperties": False}
OFF = {"effort": "none"}


def _client(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(default_deployment):
    return _client(default_deployment.endpoints()["router"][0])


@pytest.fixture(scope="module")
def other_router(default_deployment):
    """A client of a second router replica of the same deployment (`pdserve scale router 2`, undone after)."""
    run = default_deployment.run_dir
    urls = Deployment.load(scale(run, "router", 2, timeout_s=300).run_dir).endpoints()["router"]
    assert len(urls) == 2
    yield _client(urls[1])
    scale(run, "router", 1, drain_s=30)


def test_create_whole_and_streamed(client):
    kw = {"model": "tiny-code", "input": "def parse(text):", "max_output_tokens": 12, "temperature": 0,
          "reasoning": OFF}
    whole = client.responses.create(**kw)
    assert whole.status in ("completed", "incomplete") and [o.type for o in whole.output] == ["message"]
    assert 0 < whole.usage.output_tokens <= 12 and whole.usage.input_tokens > 0
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    assert whole.usage.output_tokens_details.reasoning_tokens == 0

    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text == whole.output_text  # greedy: the same tokens


def test_function_calling_loop_through_previous_response_id(client, other_router):
    """The second turn goes to another router replica: the conversation lives in Redis, not in a router."""
    # as agents do, each turn sends the instructions and tools again (a previous response carries neither)
    kw = {"model": "tiny-code", "tools": TOOLS, "instructions": "You are a weather agent.", "temperature": 0,
          "reasoning": OFF}
    first = client.responses.create(**kw, input="What is the weather in Rome this week?", max_output_tokens=200,
                                    tool_choice={"type": "function", "name": "get_weather"})
    calls = [o for o in first.output if o.type == "function_call"]
    assert first.status == "completed" and len(calls) == 1, first.output
    call = calls[0]
    assert call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER)

    output = json.dumps({"forecast": "sunny", "high_c": 24})
    second = other_router.responses.create(
        **kw, previous_response_id=first.id, max_output_tokens=16, tool_choice="none",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": output}])
    assert second.previous_response_id == first.id
    assert [o.type for o in second.output] == ["message"] and second.status in ("completed", "incomplete")
    # the second prompt is the first one, its call and the tool's output: a longer prompt, its prefix cached
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0


def test_structured_output_json_schema_validates(client):
    fmt = {"type": "json_schema", "name": "item", "schema": ITEM, "strict": True}
    for prompt in ["describe a file", "class Node:"]:
        r = client.responses.create(model="tiny-code", input=prompt, text={"format": fmt}, max_output_tokens=120,
                                    temperature=0, reasoning=OFF, store=False)
        assert r.status == "completed", r.output
        jsonschema.validate(json.loads(r.output_text), ITEM)
        assert r.text.format.type == "json_schema" and r.store is False
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(r.id)
    # the client's stream helper needs response.completed: a grammar that ends is what makes one certain here
    # (a response cut by max_output_tokens ends with response.incomplete, as OpenAI's does)
    if hasattr(client.responses, "stream"):
        with client.responses.stream(model="tiny-code", input="class Node:", text={"format": fmt},
                                     max_output_tokens=120, temperature=0, reasoning=OFF) as s:
            deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
            final = s.get_final_response()
        assert final.status == "completed" and "".join(deltas) == final.output_text == r.output_text
        jsonschema.validate(json.loads(final.output_text), ITEM)


def test_get_and_delete_a_stored_response(client):
    r = client.responses.create(model="tiny-code", input="import os", max_output_tokens=4, reasoning=OFF,
                                metadata={"run": "e2e"})
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.metadata == {"run": "e2e"}
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny-code", input="hi", previous_response_id=r.id, max_output_tokens=2)
    assert e.value.body["code"] == "previous_response_not_found" and e.value.body["param"] == "previous_response_id"


def test_refused_fields_are_400_naming_them(client):
    orphan = [{"type": "function_call_output", "call_id": "call_nobody_made", "output": "42"}]
    for kw, param in (({"tools": [{"type": "web_search"}]}, "tools[0].type"),
                      ({"input": [{"type": "computer_call", "call_id": "c"}]}, "input[0].type"),
                      ({"input": orphan}, "input[0].call_id"),
                      ({"extra_body": {"truncation": "auto"}}, "truncation"),
                      ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
                       "input[0].content[0]")):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(**{"model": "tiny-code", "input": "hi", "max_output_tokens": 2, **kw})
        assert e.value.body["param"] == param, e.value.body
