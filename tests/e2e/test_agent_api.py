"""An agent against the whole system (`pdserve up`'s default topology: GLM tool-call and reasoning
parsers on): forced tool calls through the official openai client, whole and streamed, and a two-turn
agent loop that reuses the first turn's cached prefix.

The forced calls are enforced by the engines' grammar-constrained sampling (structured outputs): the
tiny model writes Python, so without the grammar it would not produce a call at all."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.xdist_group("default")  # shares conftest.default_deployment
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
def deployment(default_deployment):
    return default_deployment


@pytest.fixture(scope="module")
def client(deployment):
    return openai.OpenAI(base_url=deployment.endpoints()["router"][0] + "/v1", api_key="unused")


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


def test_bad_tool_requests_are_400_with_param(client):
    messages = [{"role": "user", "content": "hi"}]
    for kw, param in (({"tools": TOOLS, "tool_choice": _named("nope")}, "tool_choice"),
                      ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]},
                       "tools"),
                      ({"extra_body": {"logit_bias": {"3": 5}}}, "logit_bias")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny-code", messages=messages, max_tokens=4, **kw)
        assert e.value.body["param"] == param, e.value.body


def test_grpc_chat_forced_tool_call(deployment):
    import asyncio

    import grpc

    from proto.pdserve.v1 import common_pb2, router_pb2_grpc

    chat = common_pb2.ChatRequest(messages_json=json.dumps([{"role": "user", "content": "Weather in Oslo?"}]),
                                  tools_json=json.dumps(TOOLS), tool_choice_json=json.dumps(_named("get_weather")),
                                  chat_template_kwargs_json=json.dumps({"enable_thinking": False}))
    request = common_pb2.GenerateRequest(chat=chat, sampling_params=common_pb2.SamplingParams(
        max_tokens=320, temperature=0.0))

    async def run():
        async with grpc.aio.insecure_channel(deployment.endpoints()["router_grpc"][0]) as ch:
            return [r async for r in router_pb2_grpc.RouterStub(ch).Generate(request, timeout=120)]

    replies = asyncio.run(run())
    calls = [tc for r in replies for tc in r.tool_calls]
    assert calls and calls[0].name == "get_weather" and calls[0].id
    jsonschema.validate(json.loads("".join(tc.arguments for tc in calls)), WEATHER)
    assert replies[-1].finish_reason == "tool_calls" and replies[-1].usage.completion_tokens > 0
