"""The Anthropic Messages API through `pdserve up` (tiny-code, the default CPU topology), driven by the
official `anthropic` client: create and stream, count_tokens, a forced tool_use whose input
validates against its input_schema, prefix reuse despite a per-request billing header, and 400s in
Anthropic's error form for what we refuse."""

from __future__ import annotations

import pytest

from tests.helpers import system

anthropic = pytest.importorskip("anthropic")
pytestmark = pytest.mark.xdist_group("default")  # shares conftest.default_deployment

WEATHER = {"name": "get_weather", "description": "Current weather of a city",
           # values the grammar bounds: a random-weight model would write free text forever
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                                             "metric": {"type": "boolean"}},
                            "required": ["city", "metric"], "additionalProperties": False}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def router_url(default_deployment):
    return default_deployment.endpoints()["router"][0]


@pytest.fixture(scope="module")
def client(router_url):
    return anthropic.Anthropic(base_url=router_url, api_key="unused", max_retries=0, timeout=120)


def test_create_and_stream_give_the_same_text(client, router_url):
    kw = {"model": "tiny-code", "max_tokens": 12, "messages": USER, "thinking": {"type": "disabled"},
          "extra_body": {"temperature": 0}}  # newer clients no longer send sampling fields
    msg = client.messages.create(**kw)
    assert msg.type == "message" and msg.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text
    assert 0 < msg.usage.output_tokens <= 12
    with client.messages.stream(**kw) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    assert final.content[0].text == msg.content[0].text and final.stop_reason == msg.stop_reason
    assert final.usage.output_tokens == msg.usage.output_tokens
    # the same path as the chat API: the same greedy text for the same conversation
    status, chat = system.post(router_url, "/v1/chat/completions", {
        "model": "tiny-code", "max_tokens": 12, "temperature": 0, "messages": USER,
        "chat_template_kwargs": {"enable_thinking": False}})
    assert status == 200 and chat["choices"][0]["message"]["content"] == msg.content[0].text


def test_count_tokens_matches_the_usage_of_a_request(client):
    kw = {"model": "tiny-code", "messages": USER, "system": "You answer briefly."}
    counted = client.messages.count_tokens(**kw).input_tokens
    used = client.messages.create(**kw, max_tokens=2).usage
    assert counted == used.input_tokens + used.cache_read_input_tokens > 0


def test_billing_header_does_not_defeat_the_prefix_cache(client):
    rules = "".join(f"Rule {i}: keep functions short and name things plainly.\n" for i in range(60))
    usages = []
    for cch in ("36ee5", "0aaa9"):
        system_blocks = [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.62.023; "
                                                  f"cc_entrypoint=cli; cch={cch};"},
                         {"type": "text", "text": rules}]
        usages.append(client.messages.create(model="tiny-code", max_tokens=2, system=system_blocks,
                                             messages=USER).usage)
    assert usages[1].cache_read_input_tokens >= 4 * 64, usages


def test_forced_tool_use_validates_against_its_schema(client):
    jsonschema = pytest.importorskip("jsonschema")
    kw = {"model": "tiny-code", "max_tokens": 256, "extra_body": {"temperature": 0}, "messages": USER,
          "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"}}
    msg = client.messages.create(**kw)
    calls = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and calls and calls[0].name == "get_weather"
    jsonschema.validate(calls[0].input, WEATHER["input_schema"])
    with client.messages.stream(**kw) as s:
        final = s.get_final_message()
    streamed = [b for b in final.content if b.type == "tool_use"]
    assert [(b.name, b.input) for b in streamed] == [(b.name, b.input) for b in calls]
    # the agent loop's next turn: the result goes back and the model answers
    reply = client.messages.create(model="tiny-code", max_tokens=8, tools=[WEATHER], messages=USER + [
        {"role": "assistant", "content": [c.model_dump() for c in calls]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id, "content": "18C"}]}])
    assert reply.type == "message" and reply.usage.cache_read_input_tokens >= 64  # the first turn's prefix


@pytest.mark.parametrize("change,where", [
    ({"messages": [{"role": "user", "content": [{"type": "hologram", "data": "x"}]}]}, "messages.0.content.0"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]},
     "messages.0.content.0"),
    ({"max_tokens": None}, "max_tokens"),
])
def test_refused_requests_answer_400_in_anthropic_form(router_url, change, where):
    body = {"model": "tiny-code", "max_tokens": 8, "messages": USER, **change}
    body = {k: v for k, v in body.items() if v is not None}
    status, err = system.post(router_url, "/v1/messages", body, headers={"anthropic-version": "2023-06-01"})
    assert status == 400, err
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert err["error"]["message"].startswith(where + ": "), err
