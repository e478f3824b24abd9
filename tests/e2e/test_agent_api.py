"""An agent against the whole system (`pdserve up`'s default topology: GLM tool-call and reasoning
parsers on): forced tool calls through the official openai client, whole and streamed, and a two-turn
agent loop that reuses the first turn's cached prefix.

The forced calls are enforced by the engines' grammar-constrained sampling (structured outputs): the
tiny model writes Python, so without the grammar it would not produce a call at all."""

from __future__ import annotations

import json

import pytest

from services.deploy import launcher
from tests.helpers import system

pytestmark = pytest.mark.xdist_group("agent_api")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "metric": {"type": "boolean"}}, "required": ["city", "days"]}
ANSWER = {"type": "object", "properties": {"verdict": {"type": "string", "enum": ["sunny", "rainy"]}},
          "required": ["verdict"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "final_answer", "description": "Say the answer",
                                           "parameters": ANSWER}}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    dep = system.up(tmp_path_factory.mktemp("agent"))
    yield openai.OpenAI(base_url=dep.endpoints()["router"][0] + "/v1", api_key="unused")
    launcher.down(dep)


def _named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def _ask(client, messages, tool: str, **kw):
    return client.chat.completions.create(model="tiny-code", messages=messages, tools=TOOLS, tool_choice=_named(tool),
                                          max_tokens=320, temperature=0, extra_body=NO_THINKING, **kw)


def test_named_tool_choice_whole_and_streamed(client):
    messages = [{"role": "user", "content": "What is the weather in Paris for the next three days?"}]
    whole = _ask(client, messages, "get_weather")
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)

    calls: dict[int, dict] = {}
    finish = None
    for chunk in _ask(client, messages, "get_weather", stream=True):
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": tc.id, "name": tc.function.name, "arguments": ""})
                entry["arguments"] += tc.function.arguments or ""
            assert not (c.delta.content or "").startswith("<tool_call")
            finish = c.finish_reason or finish
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_weather", call.function.arguments)]


def test_agent_loop_second_turn_hits_the_cache(client):
    messages = [{"role": "system", "content": "You are a weather agent. Use the tools."},
                {"role": "user", "content": "Is it sunny in Rome this week?"}]
    first = _ask(client, messages, "get_weather")
    (call,) = first.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    messages += [{"role": "assistant", "content": first.choices[0].message.content,
                  "tool_calls": [{"id": call.id, "type": "function",
                                  "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"forecast": "sunny", "high_c": 24})}]
    second = _ask(client, messages, "final_answer")
    (answer,) = second.choices[0].message.tool_calls
    assert answer.function.name == "final_answer"
    jsonschema.validate(json.loads(answer.function.arguments), ANSWER)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens > 0
