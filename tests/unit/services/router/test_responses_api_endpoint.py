"""The Responses API in-process: the router's FastAPI app over a scripted flow, driven by the official
`openai` client (create whole and streamed, responses.stream, retrieve, delete, previous_response_id) and
by raw HTTP for the refusals, the store's failures and tenants."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from engine.frontend.tokenizer import Tokenizer
from services.router.chat_request import ChatSettings
from services.router.chat_template import ChatTemplate
from services.router.flow import UpstreamError
from services.router.guard import ApiKeys
from services.router.http_api import RouterAPI
from services.router.reasoning import reasoning_parser
from services.router.requests import Limits
from services.router.responses_api.store import KEY_PREFIX, RedisResponseStore, StoreUnavailable
from services.router.tool_parsers import tool_parser
from services.rpc.grpc_server import Overloaded
from tests.conftest import TINY_CODE
from tests.helpers.fake_flow import FakeFlow, StubRouting

openai = pytest.importorskip("openai")
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER}]
CALL = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>"


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(TINY_CODE)


def _app(flow, keys=()):
    """As the default topology configures the router: GLM tool and reasoning parsers, auto tool choice."""
    chat = ChatSettings(ChatTemplate.load(TINY_CODE), tool_parser("glm47"), reasoning_parser("glm45"), True)
    return RouterAPI(flow, Limits(max_model_len=4096, vocab_size=flow.tokenizer.vocab_size), "tiny-code", None,
                     keys=ApiKeys(keys), chat=chat).build()


def _client(app, api_key="unused"):
    http2 = pytest.importorskip("httpx2")  # the HTTP library the openai client is built on
    http = http2.AsyncClient(transport=http2.ASGITransport(app=app), base_url="http://router")
    return openai.AsyncOpenAI(base_url="http://router/v1", api_key=api_key, http_client=http, max_retries=0)


def _http(app, method, path, body=None, key=None):
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as c:
            headers = {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {})}
            return await c.request(method, path, content=json.dumps(body) if body is not None else None,
                                   headers=headers)
    return asyncio.run(go())


def _prompt(tok, flow, i=-1) -> str:
    return tok.decode(flow.prompts[i], skip_special_tokens=False)


def test_create_whole_streamed_and_with_the_stream_helper_agree(tok):
    flow = FakeFlow(tok, script="<think>hmm</think>Sure." + CALL, cached_tokens=3)
    client = _client(_app(flow))

    async def go():
        whole = await client.responses.create(model="tiny-code", input="Weather in Paris?", tools=TOOLS,
                                              max_output_tokens=64)
        kinds = [e.type async for e in await client.responses.create(
            model="tiny-code", input="Weather in Paris?", tools=TOOLS, max_output_tokens=64, stream=True)]
        async with client.responses.stream(model="tiny-code", input="Weather in Paris?", tools=TOOLS,
                                           max_output_tokens=64) as s:
            deltas = [e.delta async for e in s if e.type == "response.output_text.delta"]
            final = await s.get_final_response()
        return whole, kinds, deltas, final, await client.responses.retrieve(final.id)

    whole, kinds, deltas, final, stored = asyncio.run(go())
    for r in (whole, final):
        assert [o.type for o in r.output] == ["reasoning", "message", "function_call"] and r.status == "completed"
        assert r.output[0].content[0].text == "hmm" and r.output_text == "Sure."
        assert (r.output[2].name, json.loads(r.output[2].arguments)) == ("get_weather", {"city": "Paris"})
        assert r.usage.input_tokens == len(flow.prompts[0]) and r.usage.input_tokens_details.cached_tokens == 3
        assert r.usage.output_tokens == len(tok.encode(flow.script)) and r.usage.output_tokens_details.reasoning_tokens
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.reasoning_text.delta" in kinds and "response.function_call_arguments.done" in kinds
    assert "".join(deltas) == "Sure." and stored.usage == final.usage
    assert [(o.id, o.status) for o in stored.output] == [(o.id, o.status) for o in final.output]
    assert flow.params[0].max_tokens == 64 and whole.id.startswith("resp_") and whole.model == "tiny-code"


def test_function_calling_loop_through_previous_response_id(tok):
    flow = FakeFlow(tok, pieces=["Ask the tool.</think>", CALL])  # the prompt opens <think>: reasoning first
    client = _client(_app(flow))

    async def go():
        first = await client.responses.create(model="tiny-code", input="Weather in Paris?", tools=TOOLS,
                                              instructions="Be brief.",
                                              tool_choice={"type": "function", "name": "get_weather"})
        call = first.output[-1]
        flow.pieces = ["</think>It is sunny."]
        second = await client.responses.create(model="tiny-code", previous_response_id=first.id, tools=TOOLS, input=[
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21C"}])
        flow.pieces = ["</think>Bye."]
        third = await client.responses.create(model="tiny-code", previous_response_id=second.id, input="Thanks!")
        return first, second, third

    first, second, third = asyncio.run(go())
    assert flow.params[0].structured_outputs is not None  # the named call is held to the tool's grammar
    assert [o.type for o in first.output] == ["reasoning", "function_call"] and second.output_text == "It is sunny."
    assert second.previous_response_id == first.id and third.output_text == "Bye."
    prompt = _prompt(tok, flow, 1)
    assert "Weather in Paris?" in prompt and "<arg_value>Paris</arg_value>" in prompt and "sunny, 21C" in prompt
    assert "Ask the tool." in prompt  # the reasoning of the turn that called the tool goes back to the model
    assert "Be brief." in _prompt(tok, flow, 0) and "Be brief." not in prompt  # instructions are not carried over
    assert "It is sunny." in _prompt(tok, flow, 2) and "sunny, 21C" in _prompt(tok, flow, 2)


def test_unknown_unstored_and_deleted_ids_are_404(tok):
    """GET / DELETE of an unknown id: 404; continuing an unknown one is a bad request (400, as OpenAI answers)."""
    flow = FakeFlow(tok)
    app = _app(flow)
    r = _http(app, "POST", "/v1/responses", {"input": "hi", "previous_response_id": "resp_nope"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "previous_response_not_found"
    assert r.json()["error"]["param"] == "previous_response_id" and not flow.prompts
    unstored = _http(app, "POST", "/v1/responses", {"input": "hi", "store": False}).json()
    assert unstored["store"] is False and _http(app, "GET", f"/v1/responses/{unstored['id']}").status_code == 404
    stored = _http(app, "POST", "/v1/responses", {"input": "hi", "metadata": {"k": "v"}}).json()
    assert _http(app, "GET", f"/v1/responses/{stored['id']}").json()["metadata"] == {"k": "v"}
    deleted = _http(app, "DELETE", f"/v1/responses/{stored['id']}").json()
    assert deleted == {"id": stored["id"], "object": "response.deleted", "deleted": True}
    assert _http(app, "GET", f"/v1/responses/{stored['id']}").json()["error"]["code"] == "not_found"
    assert _http(app, "DELETE", f"/v1/responses/{stored['id']}").status_code == 404
    assert _http(app, "GET", "/v1/responses/bad!id").json()["error"]["param"] == "path.response_id"  # a 400


def test_tenants_never_see_each_others_responses(tok):
    app = _app(FakeFlow(tok), keys=["ka:alpha", "kb:beta"])
    resp_id = _http(app, "POST", "/v1/responses", {"input": "hi"}, key="ka").json()["id"]
    assert _http(app, "GET", f"/v1/responses/{resp_id}", key="ka").status_code == 200
    assert _http(app, "GET", f"/v1/responses/{resp_id}", key="kb").status_code == 404
    assert _http(app, "DELETE", f"/v1/responses/{resp_id}", key="kb").status_code == 404
    r = _http(app, "POST", "/v1/responses", {"input": "hi", "previous_response_id": resp_id}, key="kb")
    assert r.status_code == 400 and r.json()["error"]["code"] == "previous_response_not_found"
    assert _http(app, "GET", f"/v1/responses/{resp_id}").status_code == 401


@pytest.mark.parametrize("extra,param", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"background": True}, "background"), ({"truncation": "auto"}, "truncation"), ({"top_logprobs": 3}, "top_logprobs"),
    ({"frequency_penalty": 1.0}, "frequency_penalty"), ({"include": ["message.output_text.logprobs"]}, "include[0]"),
    ({"text": {"verbosity": "high"}}, "text.verbosity"), ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 10 ** 6}, "max_output_tokens"), ({"temperature": -1}, "temperature"),
    ({"tool_choice": "required"}, "tool_choice"), ({"input": [{"type": "computer_call_output"}]}, "input[0].type"),
    ({"model": "gpt-5"}, "model"), ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 7}}}},
                                    "text.format.schema"),
])
def test_refusals_are_400_naming_the_field(tok, extra, param):
    flow = FakeFlow(tok)
    r = _http(_app(flow), "POST", "/v1/responses", {"input": "hi", **extra})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and param.split("[")[0] in err["message"], err
    assert set(err) == {"message", "type", "param", "code"} and not flow.prompts


def test_structured_output_and_thinking_off_reach_the_engine(tok):
    flow = FakeFlow(tok, pieces=['{"a": 1}'])
    fmt = {"type": "json_schema", "name": "out", "strict": True,
           "schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}
    r = asyncio.run(_client(_app(flow)).responses.create(model="tiny-code", input="json please", text={"format": fmt},
                                                          reasoning={"effort": "none"}))
    assert flow.params[0].structured_outputs.kind == "json" and r.text.format.type == "json_schema"
    assert _prompt(tok, flow).endswith("</think>") and json.loads(r.output_text) == {"a": 1}
    assert r.reasoning.effort == "none"


def test_failures_mid_stream_and_before_it(tok):
    flow = FakeFlow(tok, pieces=["a", "b"], error=UpstreamError("decode went away"))
    r = _http(_app(flow), "POST", "/v1/responses", {"input": "hi", "stream": True})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert r.status_code == 200 and [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-1]["response"]["error"]["message"] == "decode went away"
    assert events[-1]["response"]["status"] == "failed" and "[DONE]" not in r.text
    busy = _http(_app(FakeFlow(tok, pieces=[], error=Overloaded("at capacity", 2.0))), "POST", "/v1/responses",
                 {"input": "hi"})
    assert busy.status_code == 429 and busy.headers["retry-after"] == "2"


class _RedisRouting(StubRouting):
    def __init__(self, redis):
        self.state = SimpleNamespace(redis=redis)  # as Routing holds its RedisState


class _Redis:
    """The three calls RedisResponseStore makes, in a dict; `down` makes each raise as a lost Redis does."""

    def __init__(self):
        self.data, self.ttl, self.down = {}, {}, False

    async def _check(self):
        if self.down:
            raise RedisConnectionError("connection refused")

    async def set(self, key, value, ex):
        await self._check()
        self.data[key], self.ttl[key] = value, ex

    async def get(self, key):
        await self._check()
        return self.data.get(key)

    async def delete(self, key):
        await self._check()
        self.data.pop(key, None)


def test_redis_store_keys_ttl_and_an_unavailable_redis_is_503(tok):
    redis = _Redis()
    store = RedisResponseStore(redis, ttl_s=90)
    asyncio.run(store.save({"id": "resp_abc", "output": []}, [], "alpha"))
    assert redis.ttl == {KEY_PREFIX + "resp_abc": 90}
    assert asyncio.run(store.load("resp_abc", "alpha"))["response"]["id"] == "resp_abc"
    assert asyncio.run(store.load("resp_abc", "beta")) is None and asyncio.run(store.load("x:y", "alpha")) is None
    redis.down = True
    with pytest.raises(StoreUnavailable):
        asyncio.run(store.load("resp_abc", "alpha"))

    redis.down = False
    app = _app(FakeFlow(tok, routing=_RedisRouting(redis)))  # a routing that reads Redis: the store is there
    assert isinstance(app.state.responses_store, RedisResponseStore)
    stored = _http(app, "POST", "/v1/responses", {"input": "hi"}).json()
    assert KEY_PREFIX + stored["id"] in redis.data and redis.ttl[KEY_PREFIX + stored["id"]] == 24 * 3600
    redis.down = True
    r = _http(app, "POST", "/v1/responses", {"input": "hi"})
    assert r.status_code == 503 and r.headers["retry-after"] == "2" and "Redis" in r.json()["error"]["message"]
    assert _http(app, "GET", f"/v1/responses/{stored['id']}").status_code == 503
    assert _http(app, "POST", "/v1/responses", {"input": "hi", "store": False}).status_code == 200
