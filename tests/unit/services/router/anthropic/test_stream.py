"""Chat stream chunks as Anthropic SSE events: every block sequence, tool input assembly from
input_json_delta fragments, stop reasons, usage, errors, pings; the stream assembled by the official
client's accumulator equals the non-streamed conversion of the same output."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.router.anthropic import stream
from services.router.anthropic.response import message_from_chat

USAGE = {"prompt_tokens": 12, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 8}}


def _chunk(finish=None, stop_reason=None, **delta) -> dict:
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    if finish:
        choice["stop_reason"] = stop_reason
    return {"object": "chat.completion.chunk", "choices": [choice]}


def _call(index, args, call_id=None, name=None) -> dict:
    tc = {"index": index, "function": {"arguments": args}}
    if call_id:
        tc.update(id=call_id, type="function")
        tc["function"]["name"] = name
    return tc


def _run(chunks, stops=None) -> list[tuple[str, dict]]:
    state = stream.MessageStream("msg_1", "m", stops)
    out = state.start()
    for c in chunks:
        out += state.feed(c)
    out += state.end()
    return [(e.split("\n")[0][7:], json.loads(e.split("\n")[1][6:])) for e in out]


def _shape(events) -> list[str]:
    """Event kinds, with the block type on starts and the delta type on deltas."""
    out = []
    for kind, data in events:
        if kind == "content_block_start":
            kind += ":" + data["content_block"]["type"]
        elif kind == "content_block_delta":
            kind += ":" + data["delta"]["type"]
        out.append(kind)
    return out


HEAD, TAIL = ["message_start", "ping"], ["message_delta", "message_stop"]


def test_text_only():
    ev = _run([_chunk(role="assistant", content=""), _chunk(content="Hel"), _chunk(content="lo"),
               _chunk(finish="stop", content=""), {"choices": [], "usage": USAGE}])
    assert _shape(ev) == HEAD + ["content_block_start:text", "content_block_delta:text_delta",
                                 "content_block_delta:text_delta", "content_block_stop"] + TAIL
    assert all(d["index"] == 0 for k, d in ev if k.startswith("content_block"))
    delta = ev[-2][1]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"] == {"input_tokens": 4, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 8,
                              "output_tokens": 5}
    assert ev[0][1]["message"]["content"] == [] and ev[0][1]["message"]["id"] == "msg_1"


def test_thinking_then_text_then_two_tool_calls():
    ev = _run([_chunk(reasoning_content="let me "), _chunk(reasoning_content="think"), _chunk(content="Sure."),
               _chunk(tool_calls=[_call(0, '{"ci', "call_a", "get_weather")]),
               _chunk(tool_calls=[_call(0, 'ty": "P"}')]),
               _chunk(tool_calls=[_call(1, "", "call_b", "get_time")]), _chunk(tool_calls=[_call(1, "{}")]),
               _chunk(finish="tool_calls")])
    assert _shape(ev) == HEAD + [
        "content_block_start:thinking", "content_block_delta:thinking_delta", "content_block_delta:thinking_delta",
        "content_block_stop", "content_block_start:text", "content_block_delta:text_delta", "content_block_stop",
        "content_block_start:tool_use", "content_block_delta:input_json_delta", "content_block_delta:input_json_delta",
        "content_block_stop", "content_block_start:tool_use", "content_block_delta:input_json_delta",
        "content_block_stop"] + TAIL
    starts = [d for k, d in ev if k == "content_block_start"]
    assert [d["index"] for d in starts] == [0, 1, 2, 3]
    assert starts[2]["content_block"] == {"type": "tool_use", "id": "call_a", "name": "get_weather", "input": {}}
    parts = "".join(d["delta"]["partial_json"] for k, d in ev if k == "content_block_delta" and d["index"] == 2)
    assert json.loads(parts) == {"city": "P"}
    assert ev[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_a_call_with_its_whole_arguments_in_one_delta_and_a_stop_finish():
    ev = _run([_chunk(tool_calls=[{"index": 0, "id": "c", "type": "function",
                                   "function": {"name": "f", "arguments": '{"a": 1}'}}]), _chunk(finish="stop")])
    assert _shape(ev) == HEAD + ["content_block_start:tool_use", "content_block_delta:input_json_delta",
                                 "content_block_stop"] + TAIL
    assert ev[-2][1]["delta"]["stop_reason"] == "tool_use"  # a forced call ends with "stop" in the chat format


def test_empty_output_has_no_blocks():
    assert _shape(_run([_chunk(content=""), _chunk(finish="length")])) == HEAD + TAIL


@pytest.mark.parametrize("finish,matched,stops,want", [
    ("length", None, None, {"stop_reason": "max_tokens", "stop_sequence": None}),
    ("stop", "END", ["END"], {"stop_reason": "stop_sequence", "stop_sequence": "END"}),
    ("stop", 0, ["END"], {"stop_reason": "end_turn", "stop_sequence": None}),
])
def test_stop_reasons(finish, matched, stops, want):
    ev = _run([_chunk(content="x"), _chunk(finish=finish, stop_reason=matched)], stops)
    assert ev[-2][1]["delta"] == want


def test_an_error_chunk_ends_the_stream_with_an_error_event():
    ev = _run([_chunk(content="x"), {"error": {"message": "every decode instance is at capacity",
                                              "type": "rate_limit_error", "param": None, "code": 429}}])
    assert _shape(ev) == HEAD + ["content_block_start:text", "content_block_delta:text_delta", "error"]
    assert ev[-1][1] == {"type": "error", "error": {"type": "rate_limit_error",
                                                    "message": "every decode instance is at capacity"}}


def _sse(chunks) -> list[str]:
    return [f"data: {json.dumps(c)}\n\n" for c in chunks] + ["data: [DONE]\n\n"]


def test_assembled_stream_equals_the_full_conversion():
    accumulate = pytest.importorskip("anthropic.lib.streaming._messages").accumulate_event
    chunks = [_chunk(role="assistant", content=""), _chunk(reasoning_content="plan"), _chunk(content="Calling "),
              _chunk(content="now."), _chunk(tool_calls=[_call(0, '{"city": ', "call_a", "get_weather")]),
              _chunk(tool_calls=[_call(0, '"Paris", "days": [1, 2]}')]), _chunk(finish="tool_calls"),
              {"choices": [], "usage": USAGE}]

    async def collect():
        source = stream.events(_aiter(_sse(chunks)), stream.MessageStream("msg_1", "m", None))
        return [e async for e in stream.with_pings(source)]

    snapshot, bufs = None, {}
    for e in asyncio.run(collect()):
        data = json.loads(e.split("\n")[1][6:])
        if data["type"] != "ping":
            snapshot = accumulate(event=data, current_snapshot=snapshot, json_bufs=bufs)
    full = message_from_chat({"choices": [{"message": {"reasoning_content": "plan", "content": "Calling now.",
                                                       "tool_calls": [{"id": "call_a", "function": {
                                                           "name": "get_weather",
                                                           "arguments": '{"city": "Paris", "days": [1, 2]}'}}]},
                                           "finish_reason": "tool_calls"}], "usage": USAGE}, "msg_1", "m", None)
    got = snapshot.model_dump(exclude_none=True)
    assert [b for b in got["content"]] == full["content"]
    assert (got["stop_reason"], got["usage"]["input_tokens"], got["usage"]["cache_read_input_tokens"],
            got["usage"]["output_tokens"]) == ("tool_use", 4, 8, 5)


async def _aiter(items, delay_s=0.0):
    for item in items:
        await asyncio.sleep(delay_s)
        yield item


def test_pings_while_the_source_is_silent_and_cleanup_on_close():
    closed = []

    async def slow():
        try:
            yield "a"
            await asyncio.sleep(0.35)
            yield "b"
            await asyncio.sleep(10)
            yield "never"
        finally:
            closed.append(True)

    async def go():
        gen = stream.with_pings(slow(), interval_s=0.1)
        got = [await gen.__anext__() for _ in range(6)]
        await gen.aclose()  # the client went away while the source was waiting
        return got

    got = asyncio.run(go())
    assert got[0] == "a" and "b" in got and got.count(stream.PING) >= 3
    assert closed == [True]


def test_parse_sse():
    assert stream.parse_sse('data: {"a": 1}\n\ndata: [DONE]\n\n') == [{"a": 1}, None]
