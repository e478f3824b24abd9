"""The Anthropic Messages API in-process: the router's FastAPI app over a scripted flow, driven by the
official `anthropic` client (create, stream, count_tokens) and by raw HTTP for the error cases."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from engine.frontend.tokenizer import Tokenizer
from services.router.chat_request import ChatSettings
from services.router.chat_template import ChatTemplate
from services.router.guard import ApiKeys
from services.router.http_api import RouterAPI
from services.router.reasoning import reasoning_parser
from services.router.requests import Limits
from services.router.routing import NoInstance
from services.router.tool_parsers import tool_parser
from services.rpc.grpc_server import Overloaded
from tests.conftest import TINY_CODE
from tests.helpers.fake_flow import FakeFlow

anthropic = pytest.importorskip("anthropic")
TINY = TINY_CODE
BILLING = "x-anthropic-billing-header: cc_version=2.1.62.023; cc_entrypoint=cli; cch={};"


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(TINY)


def _chat_settings() -> ChatSettings:
    """As the default topology configures the router: GLM tool and reasoning parsers."""
    return ChatSettings(ChatTemplate.load(TINY), tool_parser("glm47"), reasoning_parser("glm45"), True)


def _app(flow, keys=()):
    api = RouterAPI(flow, Limits(max_model_len=4096, vocab_size=flow.tokenizer.vocab_size), "tiny-code", None,
                    keys=ApiKeys(keys), chat=_chat_settings())
    return api.build()


def _client(app, **kw):
    http2 = pytest.importorskip("httpx2")  # the HTTP library the anthropic client is built on
    http = http2.AsyncClient(transport=http2.ASGITransport(app=app), base_url="http://router")
    return anthropic.AsyncAnthropic(base_url="http://router", api_key=kw.pop("api_key", "unused"),
                                    http_client=http, max_retries=0, **kw)


def _post(app, path, body, headers=None):
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as c:
            data = body if isinstance(body, bytes) else json.dumps(body)
            return await c.post(path, content=data, headers={"content-type": "application/json", **(headers or {})})
    return asyncio.run(go())


MSG = {"model": "tiny-code", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
WEATHER_TOOL = {"name": "get_weather", "description": "Weather of a city",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def test_create_returns_a_text_message_with_usage(tok):
    flow = FakeFlow(tok, pieces=["Hello", " world"], cached_tokens=3)
    msg = asyncio.run(_client(_app(flow)).messages.create(**MSG))
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == "Hello world"
    assert msg.stop_reason == "end_turn" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert msg.usage.cache_read_input_tokens == 3
    assert msg.usage.input_tokens == len(flow.prompts[0]) - 3
    assert msg.usage.output_tokens == len(tok.encode("Hello")) + len(tok.encode(" world"))
    assert flow.params[0].max_tokens == 16


def test_stream_assembles_to_the_same_message(tok):
    flow = FakeFlow(tok, pieces=["a", "b", "c"], finish_reason="length")

    async def go():
        async with _client(_app(flow)).messages.stream(**MSG) as s:
            kinds = [e.type async for e in s]
            return kinds, await s.get_final_message()

    kinds, final = asyncio.run(go())
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert final.content[0].text == "abc" and final.stop_reason == "max_tokens"
    assert final.usage.input_tokens == len(flow.prompts[0]) and final.usage.output_tokens == 3


def test_stop_sequence_is_reported(tok):
    flow = FakeFlow(tok, pieces=["x = 1"], stop_reason="\n\n")
    msg = asyncio.run(_client(_app(flow)).messages.create(**MSG, stop_sequences=["\n\n"]))
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == "\n\n"
    assert flow.params[0].stop == ["\n\n"]


def test_count_tokens_counts_the_rendered_prompt(tok):
    flow = FakeFlow(tok)
    app = _app(flow)
    body = {k: v for k, v in MSG.items() if k != "max_tokens"}
    counted = asyncio.run(_client(app).messages.count_tokens(**body, system="be brief"))
    asyncio.run(_client(app).messages.create(**MSG, system="be brief"))
    assert counted.input_tokens == len(flow.prompts[0]) > 0


def test_billing_header_is_stripped_so_prompts_match(tok):
    flow = FakeFlow(tok)
    client = _client(_app(flow))
    for cch in ("36ee5", "0aaa9"):  # as its own first block, and as the first line of the system text
        asyncio.run(client.messages.create(**MSG, system=[{"type": "text", "text": BILLING.format(cch)},
                                                          {"type": "text", "text": "You are a coder."}]))
        asyncio.run(client.messages.create(**MSG, system=BILLING.format(cch) + "\nYou are a coder."))
    asyncio.run(client.messages.create(**MSG, system="You are a coder."))
    assert all(p == flow.prompts[-1] for p in flow.prompts)
    assert "billing" not in tok.decode(flow.prompts[0]) and "You are a coder." in tok.decode(flow.prompts[0])


@pytest.mark.parametrize("body,where", [
    ({**MSG, "max_tokens": None}, "max_tokens"),
    ({k: v for k, v in MSG.items() if k != "max_tokens"}, "max_tokens"),
    ({**MSG, "messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}, "messages.0.content.0"),
    ({**MSG, "messages": [{"role": "user", "content": [{"type": "hologram", "text": "x"}]}]}, "messages.0.content.0"),
    ({**MSG, "unknown_field": 1}, "unknown_field"),
    ({**MSG, "temperature": 1.5}, "temperature"),
    ({**MSG, "tool_choice": {"type": "tool", "name": "f"}}, "tool_choice"),
])
def test_bad_requests_answer_400_in_anthropic_form(tok, body, where):
    flow = FakeFlow(tok)
    r = _post(_app(flow), "/v1/messages", body)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert err["error"]["message"].startswith(where), err
    assert flow.prompts == []  # nothing reached an engine


def test_malformed_json_and_unknown_model(tok):
    app = _app(FakeFlow(tok))
    r = _post(app, "/v1/messages", b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = _post(app, "/v1/messages", {**MSG, "model": "claude-nope"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_x_api_key_and_bearer_are_accepted_and_401_is_anthropic_form(tok):
    app = _app(FakeFlow(tok), keys=["sk-a:alpha"])
    assert _post(app, "/v1/messages", MSG, {"x-api-key": "sk-a"}).status_code == 200
    assert _post(app, "/v1/messages", MSG, {"authorization": "Bearer sk-a"}).status_code == 200
    r = _post(app, "/v1/messages", MSG, {"x-api-key": "sk-b"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        asyncio.run(_client(app, api_key="sk-wrong").messages.create(**MSG))
    assert asyncio.run(_client(app, api_key="sk-a").messages.create(**MSG)).content[0].text == "Hello world"


def test_upstream_failure_mid_stream_is_an_error_event(tok):
    from services.router.flow import UpstreamError

    flow = FakeFlow(tok, pieces=["a", "b"], error=UpstreamError("decode went away"))
    r = _post(_app(flow), "/v1/messages", {**MSG, "stream": True})
    assert r.status_code == 200
    kinds = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-1] == "error" and "message_stop" not in kinds
    data = json.loads([line for line in r.text.splitlines() if line.startswith("data: ")][-1][6:])
    assert data == {"type": "error", "error": {"type": "api_error", "message": "decode went away"}}


@pytest.mark.parametrize("error,status,kind,sdk_error", [
    (Overloaded("every decode instance is at capacity", 2.0), 429, "rate_limit_error", "RateLimitError"),
    (NoInstance("no healthy decode instance"), 529, "overloaded_error", "OverloadedError"),
])
def test_capacity_errors_keep_their_meaning(tok, error, status, kind, sdk_error):
    app = _app(FakeFlow(tok, pieces=[], error=error))
    r = _post(app, "/v1/messages", MSG)
    assert r.status_code == status and r.json()["error"] == {"type": kind, "message": str(error)}
    assert r.headers.get("retry-after")  # the client is told when to come back
    with pytest.raises(getattr(anthropic, sdk_error)):
        asyncio.run(_client(app).messages.create(**MSG))


def test_max_tokens_past_the_context_generates_up_to_the_window(tok):
    flow = FakeFlow(tok, pieces=["a", "b"], finish_reason="length")
    app = _app(flow)
    big = {**MSG, "max_tokens": 32000}  # what Claude Code asks for (streaming), on a 4096-token model

    async def streamed():
        async with _client(app).messages.stream(**big) as s:
            return await s.get_final_message()

    assert asyncio.run(streamed()).stop_reason == "model_context_window_exceeded"
    r = _post(app, "/v1/messages", big)  # the client itself refuses so long a non-streamed call
    assert r.status_code == 200 and r.json()["stop_reason"] == "model_context_window_exceeded"
    assert [p.max_tokens for p in flow.params] == [4096 - len(flow.prompts[0])] * 2
    flow.finish_reason = "stop"
    assert _post(app, "/v1/messages", big).json()["stop_reason"] == "end_turn"


def test_a_prompt_past_the_context_is_400(tok):
    flow = FakeFlow(tok)
    long = {**MSG, "messages": [{"role": "user", "content": "word " * 5000}]}
    r = _post(_app(flow), "/v1/messages", long)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "context length" in r.json()["error"]["message"] and flow.prompts == []


def test_a_request_shaped_as_claude_code_sends_it(tok):
    """The fields and headers a Claude Code turn carries (beta query, cache_control everywhere, context
    management, effort, adaptive thinking) are accepted; the billing line never reaches the model."""
    flow = FakeFlow(tok, pieces=["Done", "</think>", "ok"])
    body = {"model": "claude-sonnet-4-5", "max_tokens": 32000, "stream": True,
            "system": [{"type": "text", "text": BILLING.format("eb6c6")},
                       {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi",
                                                       "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}],
            "tools": [{**WEATHER_TOOL, "cache_control": {"type": "ephemeral"}}],
            "metadata": {"user_id": "user_abc_session_1"}, "thinking": {"type": "adaptive"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "output_config": {"effort": "high"}, "cache_control": {"type": "ephemeral"}}
    headers = {"x-api-key": "sk-a", "anthropic-version": "2023-06-01",
               "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14"}
    app = _app(flow, keys=["sk-a"])
    app_named = RouterAPI(flow, Limits(max_model_len=4096, vocab_size=tok.vocab_size),
                          ["tiny-code", "claude-sonnet-4-5"], None, keys=ApiKeys(["sk-a"]),
                          chat=_chat_settings()).build()
    assert _post(app, "/v1/messages?beta=true", body, headers).status_code == 404  # not a served name
    r = _post(app_named, "/v1/messages?beta=true", body, headers)
    assert r.status_code == 200, r.text
    kinds = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    prompt = tok.decode(flow.prompts[0], skip_special_tokens=False)
    assert "billing" not in prompt and "You are Claude Code." in prompt and "get_weather" in prompt
    count = _post(app_named, "/v1/messages/count_tokens?beta=true",
                  {k: v for k, v in body.items() if k not in ("max_tokens", "stream", "metadata")}, headers)
    assert count.status_code == 200 and count.json()["input_tokens"] == len(flow.prompts[0])


# ---- through the GLM tool-call and reasoning parsers of the chat path ---------------------------------
WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                            "required": ["city"]}}
CALL = ["<tool_call>get_weather<arg_key>city</arg_key><arg_value>Pa", "ris</arg_value><arg_key>days",
        "</arg_key><arg_value>2</arg_value></tool_call>"]


def _both(app, **kw):
    """The message of create and the final message of stream for the same request."""
    async def go():
        client = _client(app)
        full = await client.messages.create(**kw)
        async with client.messages.stream(**kw) as s:
            kinds = [e.type async for e in s]
            return full, await s.get_final_message(), kinds
    return asyncio.run(go())


def test_thinking_then_text(tok):
    flow = FakeFlow(tok, pieces=["Let me ", "think.</thi", "nk>The answer", " is 4."])
    full, streamed, _ = _both(_app(flow), **MSG, thinking={"type": "enabled", "budget_tokens": 1024})
    for msg in (full, streamed):
        assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in msg.content] == [
            ("thinking", "Let me think."), ("text", "The answer is 4.")]
        assert msg.stop_reason == "end_turn"
    assert tok.decode(flow.prompts[0], skip_special_tokens=False).endswith("<|assistant|><think>")
    assert tok.decode(flow.prompts[-1], skip_special_tokens=False).endswith("<|assistant|><think>")


def test_tool_use_parsed_from_glm_calls_whole_and_streamed(tok):
    flow = FakeFlow(tok, pieces=["I will check.", *CALL])
    full, streamed, kinds = _both(_app(flow), **MSG, tools=[WEATHER])
    for msg in (full, streamed):
        assert [b.type for b in msg.content] == ["text", "tool_use"] and msg.stop_reason == "tool_use"
        assert msg.content[0].text == "I will check."
        call = msg.content[1]
        assert (call.name, call.input) == ("get_weather", {"city": "Paris", "days": 2})
    assert "input_json" in kinds  # the input came as input_json_delta fragments


def test_forced_tool_choice_reaches_the_engine_as_a_grammar(tok):
    flow = FakeFlow(tok, pieces=CALL)
    msg = asyncio.run(_client(_app(flow)).messages.create(**MSG, tools=[WEATHER],
                                                          tool_choice={"type": "tool", "name": "get_weather"}))
    assert flow.params[0].structured_outputs is not None  # the sampler is held to a call of get_weather
    assert msg.stop_reason == "tool_use" and msg.content[0].input == {"city": "Paris", "days": 2}
    assert flow.params[0].max_tokens == 16


def test_tool_result_turn_renders_the_call_and_the_observation(tok):
    flow = FakeFlow(tok, pieces=["It is 18C."])
    turns = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                "input": {"city": "Paris", "days": 2}}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C"}]}]
    msg = asyncio.run(_client(_app(flow)).messages.create(model="tiny-code", max_tokens=8, tools=[WEATHER],
                                                          messages=turns))
    prompt = tok.decode(flow.prompts[0], skip_special_tokens=False)
    assert ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
            "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>") in prompt
    assert "<|observation|><tool_response>18C</tool_response>" in prompt
    assert msg.content[0].text == "It is 18C." and msg.stop_reason == "end_turn"
