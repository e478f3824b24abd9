"""The router's agent-facing HTTP API on a scripted flow (no engines): tool calls, reasoning, field policy,
aliases, /tokenize, /detokenize, /version, X-Request-Id and generation_config defaults."""

from __future__ import annotations

import json

import pytest

from engine.frontend.detokenizer import IncrementalDetokenizer
from engine.frontend.tokenizer import Tokenizer
from services.router.chat_request import ChatSettings
from services.router.chat_template import ChatTemplate
from services.router.flow import Chunk
from services.router.http_api import RouterAPI
from services.router.reasoning import reasoning_parser
from services.router.requests import Limits
from services.router.tool_parsers import tool_parser
from services.rpc.metrics import ServiceMetrics
from tests.conftest import TINY_CODE

TINY = TINY_CODE
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"]}}}


class _Routing:
    redis_ok = True


class ScriptedFlow:
    """Answers every request with `self.script`, one token per chunk; records what it was asked."""

    def __init__(self, tok: Tokenizer):
        self.tokenizer, self.routing, self.script, self.calls = tok, _Routing(), "", []

    async def generate(self, ids, params, stats, cache_salt=None):
        self.calls.append((ids, params))
        detok = IncrementalDetokenizer(self.tokenizer, params)
        out = self.tokenizer.encode(self.script)
        for i, t in enumerate(out):
            stats.completion_tokens += 1
            last = i == len(out) - 1
            yield Chunk([t], detok.update([t]) + (detok.flush() if last else ""), None, "stop" if last else None)


@pytest.fixture
def app():
    from fastapi.testclient import TestClient

    tok = Tokenizer(TINY)
    flow = ScriptedFlow(tok)
    chat = ChatSettings(ChatTemplate.load(TINY), tool_parser("glm47"), reasoning_parser("glm45"), True)
    api = RouterAPI(flow, Limits(4096, tok.vocab_size), ["tiny-code", "glm-5"], ServiceMetrics("router", "t"),
                    chat=chat, generation_defaults={"temperature": 0.25, "top_k": 7})
    return TestClient(api.build()), flow


def _chat(client, **body):
    return client.post("/v1/chat/completions", json={"model": "glm-5", "max_tokens": 64,
                                                     "messages": [{"role": "user", "content": "weather?"}], **body})


def _stream(client, **body):
    body = {"model": "tiny-code", "max_tokens": 64, "stream": True, "messages": [{"role": "user", "content": "w"}],
            **body}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def _assemble(chunks):
    content, reasoning, calls, finish = "", "", {}, None
    for c in chunks:
        for ch in c["choices"]:
            d = ch["delta"]
            content += d.get("content") or ""
            reasoning += d.get("reasoning_content") or ""
            for tc in d.get("tool_calls") or []:
                if "id" in tc:
                    assert tc["index"] not in calls and tc["type"] == "function"
                    calls[tc["index"]] = {"id": tc["id"], "type": "function",
                                          "function": {"name": tc["function"]["name"], "arguments": ""}}
                calls[tc["index"]]["function"]["arguments"] += tc["function"]["arguments"]
            finish = ch["finish_reason"] or finish
    return content, reasoning, [calls[i] for i in sorted(calls)], finish


def test_tool_call_reasoning_whole_and_streamed(app):
    client, flow = app
    flow.script = ("let me see</think>Checking.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo"
                   "</arg_value><arg_key>days</arg_key><arg_value>2</arg_value></tool_call>")
    r = _chat(client, tools=[WEATHER])
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and r.json()["model"] == "tiny-code"
    msg = choice["message"]
    assert msg["reasoning_content"] == "let me see" and msg["content"] == "Checking."
    (call,) = msg["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}
    content, reasoning, calls, finish = _assemble(_stream(client, tools=[WEATHER]))
    assert (content, reasoning, finish) == ("Checking.", "let me see", "tool_calls")
    assert [c["function"] for c in calls] == [call["function"]]
    prompt = flow.tokenizer.decode(flow.calls[0][0], False)
    assert prompt.endswith("<|user|>weather?<|assistant|><think>") and '"get_weather"' in prompt


def test_thinking_off_and_tool_choice_none(app):
    client, flow = app
    flow.script = "plain <tool_call>get_weather</tool_call>"
    r = _chat(client, tools=[WEATHER], tool_choice="none", chat_template_kwargs={"enable_thinking": False})
    msg = r.json()["choices"][0]["message"]
    assert msg["content"] == flow.script and msg.get("reasoning_content") is None and "tool_calls" not in msg
    assert flow.tokenizer.decode(flow.calls[-1][0], False).endswith("<|assistant|></think>")


def test_forced_tool_choice_sends_a_grammar(app):
    client, flow = app
    flow.script = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome</arg_value></tool_call>"
    r = _chat(client, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
              chat_template_kwargs={"enable_thinking": False})
    assert r.status_code == 200, r.text
    spec = flow.calls[-1][1].structured_outputs
    assert spec.kind == "grammar" and "<tool_call>get_weather" in spec.spec and spec.reasoning_end == ""
    _chat(client, tools=[WEATHER], tool_choice="required")
    assert flow.calls[-1][1].structured_outputs.reasoning_end == "</think>"  # thinking on: gated after it


def test_history_with_tool_calls_renders(app):
    client, flow = app
    flow.script = "ok"
    messages = [{"role": "user", "content": "w"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    r = _chat(client, tools=[WEATHER], messages=messages)
    assert r.status_code == 200, r.text
    prompt = flow.tokenizer.decode(flow.calls[-1][0], False)
    assert ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome</arg_value></tool_call>"
            "<|observation|><tool_response>sunny</tool_response><|assistant|><think>") in prompt
    bad = [*messages[:1], {**messages[1], "tool_calls": [{"function": {"name": "x", "arguments": "{oops"}}]}]
    assert _chat(client, messages=bad).json()["error"]["param"] == "messages[1].tool_calls"


@pytest.mark.parametrize("body,param", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]}, "tools"),
    ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
    ({"model": "gpt-4"}, "model"),
])
def test_bad_requests_are_400_with_param(app, body, param):
    client, flow = app
    r = _chat(client, **body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert not flow.calls  # nothing reached an engine


def test_harmless_fields_accepted_and_generation_defaults(app):
    client, flow = app
    flow.script = "x"
    r = _chat(client, store=False, metadata={"a": "b"}, service_tier="auto", user="u", logit_bias={}, top_p=0.5)
    assert r.status_code == 200, r.text
    params = flow.calls[-1][1]
    assert (params.temperature, params.top_k, params.top_p) == (0.25, 7, 0.5)
    _chat(client, temperature=1.0)
    assert flow.calls[-1][1].temperature == 1.0


def test_tokenize_detokenize_version_models_and_request_id(app):
    client, flow = app
    r = client.post("/tokenize", json={"prompt": "def f():"})
    ids = r.json()["tokens"]
    assert r.json()["count"] == len(ids) > 0 and r.json()["max_model_len"] == 4096
    assert client.post("/detokenize", json={"tokens": ids}).json() == {"prompt": "def f():"}
    chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert flow.tokenizer.decode(chat["tokens"], False) == "[gMASK]<sop><|user|>hi<|assistant|><think>"
    assert client.post("/detokenize", json={"tokens": [10 ** 6]}).status_code == 400
    assert client.get("/version").json()["version"]
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["tiny-code", "glm-5"]
    flow.script = "x"
    r = client.post("/v1/chat/completions", headers={"X-Request-Id": "agent-42"},
                    json={"messages": [{"role": "user", "content": "w"}], "max_tokens": 4})
    assert r.headers["x-request-id"] == "agent-42" and r.json()["id"].startswith("chatcmpl-agent-42-")
    assert client.get("/version").headers["x-request-id"]


def test_no_template_is_400(tmp_path):
    from fastapi.testclient import TestClient

    tok = Tokenizer(TINY)
    api = RouterAPI(ScriptedFlow(tok), Limits(4096, tok.vocab_size), "m", ServiceMetrics("router", "t2"))
    r = TestClient(api.build()).post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]


def test_auto_tool_choice_needs_the_flag():
    from fastapi.testclient import TestClient

    tok = Tokenizer(TINY)
    flow = ScriptedFlow(tok)
    chat = ChatSettings(ChatTemplate.load(TINY), tool_parser("glm47"), reasoning_parser("glm45"), False)
    client = TestClient(RouterAPI(flow, Limits(4096, tok.vocab_size), "m", ServiceMetrics("router", "t3"),
                                  chat=chat).build())
    for choice in ("auto", None):  # None: the default with tools is auto
        body = {"tools": [WEATHER]} if choice is None else {"tools": [WEATHER], "tool_choice": choice}
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    flow.script = "ok"
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER],
                                                  "tool_choice": "required", "max_tokens": 8})
    assert r.status_code == 200 and flow.calls[-1][1].structured_outputs is not None


def test_generation_config_defaults(tmp_path):
    from services.router.extra_api import apply_generation_defaults, load_generation_defaults
    from services.router.openai_models import ChatCompletionRequest, CompletionRequest

    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 40, "do_sample": True, "max_new_tokens": 77, "eos_token_id": [0]}))
    defaults = load_generation_defaults(tmp_path)
    assert defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 40, "max_tokens": 77}
    assert load_generation_defaults(tmp_path / "none") == {}
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], top_p=0.5, max_completion_tokens=9)
    apply_generation_defaults(chat, defaults)
    assert (chat.temperature, chat.top_p, chat.top_k, chat.max_tokens) == (0.6, 0.5, 40, None)
    comp = CompletionRequest(prompt="x")
    apply_generation_defaults(comp, defaults)
    assert comp.max_tokens == 77
