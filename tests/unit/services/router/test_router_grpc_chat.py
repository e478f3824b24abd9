"""gRPC Router.Generate with a chat: the template, forced tool choice and the reasoning / tool-call split."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from engine.frontend.tokenizer import Tokenizer
from proto.pdserve.v1 import common_pb2
from services.router.chat_request import ChatSettings
from services.router.chat_template import ChatTemplate
from services.router.grpc_api import RouterServicer
from services.router.reasoning import reasoning_parser
from services.router.requests import Limits
from services.router.tool_parsers import tool_parser
from tests.helpers.fake_flow import FakeFlow
from tests.unit.services.router.test_router_agent_api import TINY, WEATHER


class _Aborted(Exception):
    pass


class _Context:
    def invocation_metadata(self):
        return ()

    def set_trailing_metadata(self, md):
        pass

    async def abort(self, code, details):
        raise _Aborted(code, details)


def _run(servicer, request):
    async def go():
        return [r async for r in servicer.Generate(request, _Context())]
    return asyncio.run(go())


@pytest.fixture
def servicer():
    tok = Tokenizer(TINY)
    chat = ChatSettings(ChatTemplate.load(TINY), tool_parser("glm47"), reasoning_parser("glm45"), True)
    return RouterServicer(FakeFlow(tok, script=""), Limits(4096, tok.vocab_size), ["tiny-code", "alias"], chat=chat)


def _request(**chat):
    fields = {"messages_json": json.dumps([{"role": "user", "content": "weather?"}]),
              "tools_json": json.dumps([WEATHER]), **chat}
    return common_pb2.GenerateRequest(model="alias", chat=common_pb2.ChatRequest(**fields),
                                      sampling_params=common_pb2.SamplingParams(max_tokens=64))


def test_chat_request_splits_reasoning_and_tool_calls(servicer):
    servicer.flow.script = ("hmm</think>Sure.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo"
                            "</arg_value></tool_call>")
    replies = _run(servicer, _request())
    assert "".join(r.text for r in replies) == servicer.flow.script
    assert "".join(r.reasoning for r in replies) == "hmm" and "".join(r.content for r in replies) == "Sure."
    calls = [tc for r in replies for tc in r.tool_calls]
    assert calls[0].name == "get_weather" and calls[0].id
    assert json.loads("".join(tc.arguments for tc in calls)) == {"city": "Oslo"}
    assert replies[-1].finish_reason == "tool_calls" and replies[-1].usage.completion_tokens == len(replies)
    prompt = servicer.flow.tokenizer.decode(servicer.flow.prompts[-1], False)
    assert prompt.endswith("<|user|>weather?<|assistant|><think>")


def test_forced_tool_choice_and_bad_chat(servicer):
    servicer.flow.script = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>x</arg_value></tool_call>"
    _run(servicer, _request(tool_choice_json=json.dumps("required"),
                            chat_template_kwargs_json=json.dumps({"enable_thinking": False})))
    spec = servicer.flow.params[-1].structured_outputs
    assert spec.kind == "grammar" and spec.reasoning_end == ""
    for bad in (_request(tool_choice_json='{"type": "function", "function": {"name": "nope"}}'),
                _request(messages_json="[{"), _request(messages_json="[]")):
        with pytest.raises(_Aborted) as e:
            _run(servicer, bad)
        assert e.value.args[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert len(servicer.flow.prompts) == 1
