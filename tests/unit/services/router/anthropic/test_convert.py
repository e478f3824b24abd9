"""Messages requests as chat requests, and chat results as Messages responses (pure conversions)."""

from __future__ import annotations

import json

import pytest

from services.router.anthropic.convert import chat_completion_request, chat_request, strip_billing_header
from services.router.anthropic.errors import InvalidRequest, from_openai
from services.router.anthropic.models import CountTokensRequest, MessagesRequest
from services.router.anthropic.response import message_from_chat

WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def _req(**kw) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 64,
                                           "messages": [{"role": "user", "content": "hi"}], **kw})


def test_an_agent_turn_with_tools_thinking_and_results():
    messages = [
        {"role": "user",
         "content": [{"type": "text", "text": "Weather in Paris?", "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I should call the tool.", "signature": "sig"},
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Lyon"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": "20C"}],
             "is_error": False},
            {"type": "text", "text": "And tomorrow?"}]},
    ]
    body = chat_request(_req(system=[{"type": "text", "text": "You help."}], messages=messages, tools=[WEATHER],
                             thinking={"type": "enabled", "budget_tokens": 2048}))
    assert body["messages"] == [
        {"role": "system", "content": "You help."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "I should call the tool.",
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}},
                        {"id": "toolu_2", "type": "function",
                         "function": {"name": "get_weather", "arguments": json.dumps({"city": "Lyon"})}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18C"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "20C"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    assert body["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "parameters": WEATHER["input_schema"], "description": "Weather of a city"}}]
    assert body["chat_template_kwargs"] == {"enable_thinking": True}
    assert "tool_choice" not in body


@pytest.mark.parametrize("choice,want", [
    ({"type": "auto"}, "auto"), ({"type": "any"}, "required"), ({"type": "none"}, "none"),
    ({"type": "tool", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}}),
])
def test_tool_choice(choice, want):
    body = chat_request(_req(tools=[WEATHER], tool_choice=choice))
    assert body["tool_choice"] == want
    assert "parallel_tool_calls" not in body
    no_parallel = chat_request(_req(tools=[WEATHER], tool_choice={**choice, "disable_parallel_tool_use": True}))
    assert no_parallel["parallel_tool_calls"] is False


def test_sampling_stream_and_output_format():
    body = chat_completion_request(_req(temperature=0.2, top_p=0.9, top_k=5, stop_sequences=["END"], stream=True,
                                        metadata={"user_id": "u"}, thinking={"type": "disabled"},
                                        output_config={"effort": "high", "format": {
                                            "type": "json_schema", "schema": {"type": "object"}}}))
    assert (body["temperature"], body["top_p"], body["top_k"], body["stop"]) == (0.2, 0.9, 5, ["END"])
    assert body["max_tokens"] == 64 and body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["chat_template_kwargs"] == {"enable_thinking": False}
    assert body["response_format"]["json_schema"]["schema"] == {"type": "object"}
    assert "metadata" not in body
    plain = chat_completion_request(_req())
    assert not {"temperature", "top_p", "top_k", "stop", "stream"} & set(plain)
    assert plain["chat_template_kwargs"] == {"enable_thinking": False}  # no `thinking`: none, as Anthropic
    adaptive = chat_completion_request(_req(thinking={"type": "adaptive"}))
    assert adaptive["chat_template_kwargs"] == {"enable_thinking": True}


def test_billing_header_is_dropped_only_at_the_start():
    line = "x-anthropic-billing-header: cc_version=2.1.177.01c; cc_entrypoint=sdk-cli; cch=36ee5;"
    assert strip_billing_header(line) == ""
    assert strip_billing_header(line + "\nYou are Claude Code.") == "You are Claude Code."
    kept = "You are Claude Code.\n" + line
    assert strip_billing_header(kept) == kept
    body = chat_request(_req(system=[{"type": "text", "text": line}, {"type": "text", "text": "Rules."}],
                             messages=[{"role": "user", "content": line}]))
    assert body["messages"] == [{"role": "system", "content": "Rules."}, {"role": "user", "content": line}]


@pytest.mark.parametrize("kw,where", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content.0"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages.0.content.0"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                 "content": [{"type": "image", "source": {}}]}]}]},
     "messages.0.content.0.content.0"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "messages.0.content.0"),
    ({"messages": [{"role": "user", "content": [{"text": "no type"}]}]}, "messages.0.content.0"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": [
        {"type": "server_tool_use", "id": "s", "name": "web_search", "input": {}}]}, {"role": "user", "content": "x"}]},
     "messages.1.content.0"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "A: "}]}, "messages.1"),
    ({"system": [{"type": "image", "source": {}}]}, "system.0"),
    ({"tools": [{**WEATHER, "type": "web_search_20250305"}]}, "tools.0"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "other"}}, "tool_choice.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
])
def test_refusals_name_the_field(kw, where):
    with pytest.raises(InvalidRequest) as exc:
        chat_request(_req(**kw))
    assert exc.value.param == where and str(exc.value).startswith(where + ": ")


def test_count_tokens_body_has_no_sampling_fields():
    with pytest.raises(Exception, match="max_tokens"):
        CountTokensRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                           "max_tokens": 3})
    req = CountTokensRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert chat_request(req)["messages"] == [{"role": "user", "content": "x"}]


def _chat(message: dict, finish="stop", stop_reason=None, prompt=10, cached=4, completion=7) -> dict:
    return {"choices": [{"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish,
                         "stop_reason": stop_reason}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                      "prompt_tokens_details": {"cached_tokens": cached}}}


def test_response_blocks_in_order_with_usage():
    chat = _chat({"reasoning_content": "hmm", "content": "Calling.", "tool_calls": [
        {"id": "call_9", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        finish="tool_calls")
    msg = message_from_chat(chat, "msg_1", "claude-x", None)
    assert msg["content"] == [{"type": "thinking", "thinking": "hmm", "signature": ""},
                              {"type": "text", "text": "Calling."},
                              {"type": "tool_use", "id": "call_9", "name": "get_weather", "input": {"city": "Paris"}}]
    got = (msg["stop_reason"], msg["stop_sequence"], msg["model"], msg["id"])
    assert got == ("tool_use", None, "claude-x", "msg_1")
    assert msg["usage"] == {"input_tokens": 6, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 4,
                            "output_tokens": 7}


@pytest.mark.parametrize("finish,matched,stops,want", [
    ("stop", None, None, ("end_turn", None)), ("length", None, None, ("max_tokens", None)),
    ("stop", "END", ["END"], ("stop_sequence", "END")), ("stop", 7, ["END"], ("end_turn", None)),
    ("tool_calls", None, None, ("tool_use", None)),
])
def test_stop_reasons(finish, matched, stops, want):
    msg = message_from_chat(_chat({"content": "x"}, finish, matched), "m", "m", stops)
    assert (msg["stop_reason"], msg["stop_sequence"]) == want


def test_a_capped_max_tokens_reports_the_context_window():
    assert message_from_chat(_chat({"content": "x"}, "length"), "m", "m", None, capped=True)["stop_reason"] == \
        "model_context_window_exceeded"
    assert message_from_chat(_chat({"content": "x"}, "stop"), "m", "m", None, capped=True)["stop_reason"] == "end_turn"


def test_a_forced_call_that_finished_with_stop_is_still_tool_use():
    chat = _chat({"content": None, "tool_calls": [{"id": None, "function": {"name": "f", "arguments": "{}"}}]})
    msg = message_from_chat(chat, "m", "m", None)
    assert msg["stop_reason"] == "tool_use" and msg["content"][0]["id"].startswith("toolu_")
    assert msg["content"][0]["input"] == {}


def test_empty_output_is_no_blocks():
    assert message_from_chat(_chat({"content": ""}), "m", "m", None)["content"] == []


@pytest.mark.parametrize("status,body,want", [
    (400, {"error": {"message": "bad", "param": "max_tokens", "code": "invalid_request"}},
     (400, "invalid_request_error", "max_tokens: bad")),
    (400, {"error": {"message": "at most 16", "param": "stop"}},
     (400, "invalid_request_error", "stop_sequences: at most 16")),
    (400, {"error": {"message": "no model", "code": "model_not_found"}}, (404, "not_found_error", "no model")),
    (429, {"error": {"message": "busy"}}, (429, "rate_limit_error", "busy")),
    (503, {"error": {"message": "no decode"}}, (529, "overloaded_error", "no decode")),
    (502, {"error": {"message": "upstream"}}, (502, "api_error", "upstream")),
    (500, {"error": {"message": "oops"}}, (500, "api_error", "oops")),
    (401, {"error": {"message": "key"}}, (401, "authentication_error", "key")),
    (413, {"error": {"message": "big"}}, (413, "request_too_large", "big")),
])
def test_error_mapping(status, body, want):
    got_status, got = from_openai(status, body)
    assert (got_status, got["error"]["type"], got["error"]["message"]) == want and got["type"] == "error"
