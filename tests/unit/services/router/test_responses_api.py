"""The Responses API's conversion both ways: input items, tools, tool_choice, text.format and reasoning into
the chat request; chat results and chat stream chunks into output items, events, status and usage; what is
refused with a 400 naming the field. Pure functions here; the endpoint in-process through the official
client: tests/unit/services/router/test_responses_api_endpoint.py."""

from __future__ import annotations

import json

import pytest

from services.router.requests import BadRequest
from services.router.responses_api import convert, response, stream
from services.router.responses_api.models import ResponsesRequest

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER}


def _chat(**req) -> dict:
    body = ResponsesRequest(**{"input": "hi", **req})
    return convert.chat_request(body, convert.input_items(body.input))


def _refused(param: str, **req) -> BadRequest:
    with pytest.raises(BadRequest) as info:
        _chat(**req)
    assert info.value.param == param and str(info.value).startswith(param), (info.value.param, str(info.value))
    return info.value


# ---- input items -> chat messages ---------------------------------------------------------------------
def test_string_input_and_instructions():
    chat = _chat(instructions="Be brief.", max_output_tokens=7, temperature=0.5, user="u1")
    assert chat["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert (chat["max_tokens"], chat["temperature"], chat["user"]) == (7, 0.5, "u1")
    assert "stream" not in chat and "tools" not in chat and "response_format" not in chat


def test_an_agent_turn_becomes_one_assistant_message_then_tool_results():
    items = [
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                        {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "rain"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "sun"}]},
    ]
    assert _chat(input=items)["messages"] == [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "Let me look.", "reasoning_content": "think", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
        {"role": "tool", "tool_call_id": "c2", "content": "sun"},
    ]


def test_reasoning_comes_back_from_content_our_encoding_or_the_summary():
    ours = convert.encode_reasoning("deep thought")
    assert convert.decode_reasoning(ours) == "deep thought" and convert.decode_reasoning("gAAAAB-opaque") is None
    cases = [({"encrypted_content": ours}, "deep thought"),
             ({"encrypted_content": "gAAAAB-opaque", "summary": [{"type": "summary_text", "text": "short"}]}, "short"),
             ({"content": [{"type": "reasoning_text", "text": "whole"}],
               "summary": [{"type": "summary_text", "text": "short"}]}, "whole")]
    for extra, text in cases:
        items = [{"role": "user", "content": "q"}, {"type": "reasoning", "summary": [], **extra},
                 {"role": "assistant", "content": "a"}, {"role": "user", "content": "again"}]
        assert _chat(input=items)["messages"][1] == {"role": "assistant", "content": "a", "reasoning_content": text}
    # reasoning with no assistant turn after it (a response cut while thinking) is its own turn
    items = [{"role": "user", "content": "q"}, {"type": "reasoning", "summary": [], "encrypted_content": ours},
             {"role": "user", "content": "go on"}]
    turn = {"role": "assistant", "content": "", "reasoning_content": "deep thought"}
    assert _chat(input=items)["messages"][1] == turn


@pytest.mark.parametrize("item,param", [
    ({"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}, "input[0].content[0]"),
    ({"role": "user", "content": [{"type": "input_text"}]}, "input[0].content[0]"),
    ({"role": "user", "content": [{"type": {"a": 1}, "text": "x"}]}, "input[0].content[0]"),
    ({"role": ["user"], "content": "x"}, "input[0].role"),
    ({"role": "tool", "content": "x"}, "input[0].role"),
    ({"type": "web_search_call", "id": "ws"}, "input[0].type"),
    ({"type": "item_reference", "id": "msg_1"}, "input[0].type"),
    ({"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}, "input[0].arguments"),
    ({"type": "function_call", "name": "f", "arguments": "{}"}, "input[0].call_id"),
    ({"type": "function_call_output", "call_id": "c", "output": [{"type": "input_file"}]}, "input[0].output[0]"),
    ({"type": "reasoning", "summary": [{"type": "x"}]}, "input[0].summary"),
])
def test_bad_items_are_400_naming_them(item, param):
    _refused(param, input=[item])


# ---- tools, tool_choice, text.format, reasoning, include --------------------------------------------------
def test_function_tools_and_tool_choice_in_chat_form():
    chat = _chat(tools=[{**TOOL, "strict": True}], tool_choice={"type": "function", "name": "get_weather"},
                 parallel_tool_calls=False)
    assert chat["tools"] == [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                                               "description": "Weather", "strict": True}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["parallel_tool_calls"] is False
    assert _chat(tools=[TOOL], tool_choice="required")["tool_choice"] == "required"
    assert "tool_choice" not in _chat(tool_choice="auto") and "tool_choice" not in _chat(tool_choice="none")


def test_built_in_tools_and_hosted_tool_choices_are_refused():
    err = _refused("tools[1].type", tools=[TOOL, {"type": "web_search"}])
    assert "web_search" in str(err)
    _refused("tools[0].defer_loading", tools=[{**TOOL, "defer_loading": True}])
    _refused("tool_choice", tools=[TOOL], tool_choice={"type": "allowed_tools", "mode": "auto", "tools": []})
    _refused("tool_choice", tools=[TOOL], tool_choice={"type": "file_search"})


def test_text_format_and_reasoning_effort():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = _chat(text={"format": {"type": "json_schema", "name": "out", "schema": schema, "strict": True}})
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "out", "schema": schema,
                                                                              "strict": True}}
    assert _chat(text={"format": {"type": "json_object"}})["response_format"] == {"type": "json_object"}
    assert "response_format" not in _chat(text={"format": {"type": "text"}})
    _refused("text.format.type", text={"format": {"type": "grammar"}})
    _refused("text.format.schema", text={"format": {"type": "json_schema", "name": "x"}})
    assert _chat(reasoning={"effort": "none"})["chat_template_kwargs"] == {"enable_thinking": False}
    assert "chat_template_kwargs" not in _chat(reasoning={"effort": "high", "summary": "auto"})
    assert _chat(stream=True)["stream_options"] == {"include_usage": True}


def test_include_and_metadata_checks():
    assert convert.check_include(["reasoning.encrypted_content"]) is True
    assert convert.check_include(["web_search_call.results"]) is False and convert.check_include(None) is False
    with pytest.raises(BadRequest) as info:
        convert.check_include(["message.output_text.logprobs"])
    assert info.value.param == "include[0]"
    with pytest.raises(BadRequest):
        convert.check_metadata({f"k{i}": "v" for i in range(17)})
    with pytest.raises(BadRequest):
        convert.check_metadata({"k": "v" * 513})
    convert.check_metadata({"k" * 64: "v" * 512})


# ---- chat results -> output items, status, usage --------------------------------------------------------
USAGE = {"prompt_tokens": 20, "completion_tokens": 9, "prompt_tokens_details": {"cached_tokens": 16}}


def _skeleton(**req) -> dict:
    class Params:
        temperature, top_p = 0.0, 1.0
    return response.skeleton("resp_1", ResponsesRequest(input="hi", **req), "tiny-code", Params)


def _chat_result(message: dict, finish: str = "stop") -> dict:
    return {"choices": [{"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish}],
            "usage": USAGE}


def _words(text: str) -> int:
    return len(text.split())


def test_whole_result_items_status_and_usage():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    out = response.from_chat(_skeleton(), _chat_result({"reasoning_content": "two words", "content": "Hi",
                                                        "tool_calls": [call]}, "tool_calls"), True, _words)
    assert [i["type"] for i in out["output"]] == ["reasoning", "message", "function_call"]
    rs, msg, fc = out["output"]
    assert rs["content"] == [{"type": "reasoning_text", "text": "two words"}]
    assert convert.decode_reasoning(rs["encrypted_content"]) == "two words"
    assert msg["content"][0]["text"] == "Hi" and msg["status"] == "completed" and msg["id"].startswith("msg_")
    assert (fc["call_id"], fc["name"], fc["arguments"]) == ("call_1", "get_weather", '{"city": "Oslo"}')
    assert out["status"] == "completed" and out["incomplete_details"] is None and out["completed_at"]
    assert out["usage"] == {"input_tokens": 20, "input_tokens_details": {"cached_tokens": 16}, "output_tokens": 9,
                            "output_tokens_details": {"reasoning_tokens": 2}, "total_tokens": 29}


def test_length_is_incomplete_and_nothing_written_is_an_empty_message():
    out = response.from_chat(_skeleton(max_output_tokens=9), _chat_result({"content": "cut"}, "length"), False, _words)
    assert out["status"] == "incomplete" and out["incomplete_details"] == {"reason": "max_output_tokens"}
    assert out["output"][0]["status"] == "incomplete" and "encrypted_content" not in json.dumps(out)
    empty = response.from_chat(_skeleton(), _chat_result({"content": ""}), False, _words)
    assert [(i["type"], i["content"][0]["text"]) for i in empty["output"]] == [("message", "")]


# ---- chat stream chunks -> events -------------------------------------------------------------------------
def _chunk(finish=None, **delta) -> dict:
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def _events(chunks: list[dict], skeleton=None) -> tuple[list[dict], dict]:
    state = stream.ResponseEvents(skeleton or _skeleton(), False, _words)
    out = state.start()
    for c in chunks:
        out += state.feed(c)
    closing, final = state.end()
    out += closing + [state.final(final)]
    parsed = []
    for e in out:
        head, data = e.split("\n")[:2]
        parsed.append(json.loads(data[6:]))
        assert head == f"event: {parsed[-1]['type']}"
    return parsed, final


def test_stream_event_sequence_and_final_equal_to_the_whole_result():
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    chunks = [_chunk(role="assistant", reasoning_content="two "), _chunk(reasoning_content="words"),
              _chunk(content="H"), _chunk(content="i"), _chunk(tool_calls=[call]),
              _chunk(tool_calls=[{"index": 0, "function": {"arguments": '{"city": '}}]),
              _chunk("tool_calls", tool_calls=[{"index": 0, "function": {"arguments": '"Oslo"}'}}]),
              {"choices": [], "usage": USAGE}]
    events, final = _events(chunks)
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [0, 1, 2]
    assert events[-2]["item"]["arguments"] == '{"city": "Oslo"}' and events[-3]["name"] == "get_weather"
    whole = response.from_chat(_skeleton(), _chat_result({"reasoning_content": "two words", "content": "Hi",
                                                          "tool_calls": [{**call, "function": {
                                                              "name": "get_weather",
                                                              "arguments": '{"city": "Oslo"}'}}]}), False, _words)

    def strip(r):
        return {**r, "output": [{k: v for k, v in i.items() if k != "id"} for i in r["output"]],
                "completed_at": None}
    assert strip(events[-1]["response"]) == strip(whole) and events[-1]["response"] == final


def test_stream_cut_by_length_ends_incomplete_and_an_error_fails_it():
    events, final = _events([_chunk(content="cut"), _chunk("length")])
    assert events[-1]["type"] == "response.incomplete" and final["status"] == "incomplete"
    assert events[-2]["item"]["status"] == "incomplete"
    state = stream.ResponseEvents(_skeleton(), False, _words)
    state.start()
    state.feed(_chunk(content="partial"))
    out = [json.loads(e.split("\n")[1][6:]) for e in state.feed(
        {"error": {"message": "decode lost", "type": "upstream_error", "param": None, "code": 502}})]
    assert [e["type"] for e in out] == ["error", "response.failed"] and state.failed
    assert out[0]["code"] == "server_error" and out[1]["response"]["error"]["message"] == "decode lost"
    assert out[1]["response"]["output"][0]["status"] == "incomplete"


def test_a_function_call_output_must_answer_a_call_made_before_it():
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    out = {"type": "function_call_output", "call_id": "c1", "output": "x"}
    convert.check_call_outputs([call], [out])  # the call is in the stored conversation
    convert.check_call_outputs([], [call, out])  # or earlier in this input
    with pytest.raises(BadRequest) as e:
        convert.check_call_outputs([call], [{**out, "call_id": "c2"}])
    assert e.value.param == "input[0].call_id"
    with pytest.raises(BadRequest):
        convert.check_call_outputs([], [out, call])  # an answer before its call
