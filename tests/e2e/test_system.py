"""The whole system as processes (launcher, private Redis, kvstore, prefill, decode with MTP3, router),
real NIXL over loopback: outputs equal the offline engine's, prefixes are reused, the OpenAI client
streams, bad input gets 400, abandoned KV is freed."""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect

import pytest

from engine import LLM, SamplingParams
from tests.helpers import system

pytestmark = pytest.mark.xdist_group("default")  # shares conftest.default_deployment


@pytest.fixture(scope="module")
def deployment(default_deployment):
    return default_deployment


@pytest.fixture(scope="module")
def url(deployment) -> str:
    return deployment.endpoints()["router"][0]


@pytest.fixture(scope="module")
def instances(deployment) -> dict:
    return {i.role: i for i in system.with_state(deployment.redis_url, lambda s: s.instances())}


@pytest.fixture(scope="module")
def offline(tiny_code) -> LLM:
    return LLM(str(tiny_code), kv_cache_dtype="fp8_ds_mla", num_blocks=256)


def _prompts(tok, n: int) -> list[list[int]]:
    import difflib
    ids = tok.encode(inspect.getsource(difflib))
    return [ids[i * 300: i * 300 + 20 + 37 * i] for i in range(n)]


def _blocks_in_use(instances, role: str) -> float:
    return system.metric(instances[role].metrics_address, "pdserve:kv_cache_usage_perc")


def test_greedy_outputs_equal_the_offline_engine(url, offline):
    prompts = _prompts(offline.tokenizer, 8)
    expected = offline.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    for ids, want in zip(prompts, expected):
        status, body = system.post(url, "/v1/completions", {"prompt": ids, "max_tokens": 24, "temperature": 0,
                                                            "ignore_eos": True, "return_token_ids": True})
        assert status == 200, body
        assert body["choices"][0]["text"] == want.text
        assert body["choices"][0]["token_ids"] == list(want.token_ids)
        assert body["usage"]["completion_tokens"] == 24


def test_a_stop_string_ends_the_request_where_the_offline_engine_ends_it(url, offline):
    """The services' engines detokenize a request only when it has stop strings (they stream token ids): one
    found late in the text ends the request with the offline engine's text, tokens and finish reason."""
    (prompt,) = _prompts(offline.tokenizer, 1)
    plain = offline.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))[0].text
    stop = plain[len(plain) * 2 // 3: len(plain) * 2 // 3 + 4]
    (want,) = offline.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop]))
    status, body = system.post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 40, "temperature": 0,
                                                        "ignore_eos": True, "stop": [stop], "return_token_ids": True})
    assert status == 200, body
    choice = body["choices"][0]
    assert want.finish_reason == "stop" and choice["finish_reason"] == "stop", (choice, stop)
    assert choice["text"] == want.text and stop not in choice["text"]
    assert body["usage"]["completion_tokens"] == len(want.token_ids) < 40


def test_logprobs_through_prefill_and_decode_equal_the_offline_engine(url, offline):
    """The first token's logprobs come from the prefill, the rest from the decode's deltas: each token's logprob
    and its top-2 alternatives as the offline engine computes them."""
    (prompt,) = _prompts(offline.tokenizer, 1)
    (want,) = offline.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2))
    status, body = system.post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0,
                                                        "ignore_eos": True, "logprobs": 2, "return_token_ids": True})
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["token_ids"] == list(want.token_ids)
    got = choice["logprobs"]["token_logprobs"]
    assert len(got) == 12 and len(choice["logprobs"]["top_logprobs"]) == 12
    for i, (lp, tok) in enumerate(zip(got, want.token_ids)):
        assert abs(lp - want.logprobs[i][tok]) < 1e-3, (i, lp, want.logprobs[i])
    for i, top in enumerate(choice["logprobs"]["top_logprobs"]):
        best = sorted(want.logprobs[i].values(), reverse=True)[:2]
        assert sorted(top.values(), reverse=True)[:2] == pytest.approx(best, abs=1e-3), (i, top, want.logprobs[i])


def test_second_turn_reuses_the_prefix(url, offline):
    import difflib
    first = offline.tokenizer.encode(inspect.getsource(difflib))[2000:2400]
    second = first + offline.tokenizer.encode("\n# the next turn\n")
    body = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
    assert system.post(url, "/v1/completions", {**body, "prompt": first})[0] == 200
    status, warm = system.post(url, "/v1/completions", {**body, "prompt": second})
    assert status == 200
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] >= 6 * 64
    (cold,) = offline.generate([second], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert warm["choices"][0]["text"] == cold.text


def test_openai_client_streams_and_32_concurrent_requests_finish(url):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    chat = client.chat.completions.create(model="tiny-code", messages=[{"role": "user", "content": "def add(a, b):"}],
                                          max_tokens=16, temperature=0, stream=True,
                                          stream_options={"include_usage": True},
                                          extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    chunks = list(chat)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].usage.completion_tokens == 16
    comp = client.completions.create(model="tiny-code", prompt="import os\n", max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in comp)

    def one(i: int) -> int:
        s = client.completions.create(model="tiny-code", prompt=f"x = {i}\n", max_tokens=12, stream=True,
                                      extra_body={"ignore_eos": True})
        return sum(1 for c in s if c.choices and c.choices[0].text is not None)

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        counts = list(pool.map(one, range(32)))
    assert all(c >= 1 for c in counts)


def test_health_metrics_and_models(url, instances):
    import json
    import urllib.request

    models = json.loads(urllib.request.urlopen(url + "/v1/models").read())
    assert models["data"][0]["id"] == "tiny-code" and models["data"][0]["max_model_len"] == 4096
    assert json.loads(urllib.request.urlopen(url + "/health").read())["status"] == "ok"
    from services.rpc.grpc_server import check_health_sync
    for role in ("prefill", "decode", "kvstore"):
        assert check_health_sync(instances[role].grpc_address), role
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    for name in ("pdserve:time_to_first_token_seconds", "pdserve:e2e_request_latency_seconds",
                 "pdserve:num_requests_running"):
        assert name in text
    assert system.metric(instances["decode"].metrics_address, "pdserve:nixl_bytes_transferred_total") > 0
    decode_text = urllib.request.urlopen(f"http://{instances['decode'].metrics_address}/metrics").read().decode()
    for name in ("pdserve:hisparse_hits_total", "pdserve:hisparse_misses_total", "pdserve:hisparse_h2d_bytes_total",
                 "pdserve:spec_decode_num_accepted_tokens_total", "pdserve:kv_cache_usage_perc",
                 "pdserve:num_requests_waiting", "pdserve:time_per_output_token_seconds"):
        assert name in decode_text, name
    assert system.metric(instances["decode"].metrics_address, "pdserve:spec_decode_num_draft_tokens_total") > 0
    rounds = system.metric(instances["decode"].metrics_address, "pdserve:spec_decode_num_full_rounds_total")
    tokens = system.metric(instances["decode"].metrics_address, "pdserve:spec_decode_num_full_round_tokens_total")
    assert rounds > 0 and rounds <= tokens <= 4 * rounds  # MTP3: 1-4 tokens a full round
    # the decode time split: the engine step by phase, each token delta's delay in the decode and the router
    assert 'pdserve:engine_step_phase_seconds_total{phase="launch"}' in decode_text
    assert 'pdserve:engine_step_phase_cpu_seconds_total{phase="launch"}' in decode_text
    assert system.metric(instances["decode"].metrics_address, "pdserve:token_delta_delay_seconds_count") > 0
    assert system.metric(url.removeprefix("http://"), "pdserve:token_delta_delay_seconds_count") > 0


@pytest.mark.parametrize("body,status", [
    (b"{not json", 400),
    (b"\xff\xfe\x00garbage", 400),
    ({"prompt": "x", "model": "no-such-model"}, 400),
    ({"prompt": "x", "max_tokens": 0}, 400),
    ({"prompt": "x", "max_tokens": -5}, 400),
    ({"prompt": "x", "n": 100000}, 400),
    ({"prompt": [1, 2, 999999]}, 400),
    ({"prompt": list(range(10, 4200))}, 400),
    ({"prompt": "x", "temperature": -1}, 400),
    ({"messages": []}, 400),
])
def test_bad_input_gets_400_and_the_system_keeps_serving(url, body, status):
    path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
    got, err = system.post(url, path, body)
    assert got == status, err
    assert err["error"]["message"]
    ok, _ = system.post(url, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert ok == 200


def test_abandoned_and_aborted_requests_free_their_blocks(url, instances, offline):
    import grpc

    from proto.pdserve.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
    from services.rpc.convert import sampling_to_proto

    async def prefill_without_decode():
        async with grpc.aio.insecure_channel(instances["prefill"].grpc_address) as ch:
            g = common_pb2.GenerateRequest(request_id="abandoned", prompt_token_ids=list(range(100, 400)),
                                           sampling_params=sampling_to_proto(SamplingParams(max_tokens=50)))
            reply = await prefill_pb2_grpc.PrefillStub(ch).Prefill(prefill_pb2.PrefillRequest(request=g, lease_ms=800))
            return reply.kv

    # The handle names the pages the lease holds (the gauge, read after the reply, may already see them freed
    # on a slow machine); then the expiry is the event to wait for: the counter moves and the pages come back.
    expired = lambda: system.metric(instances["prefill"].metrics_address, "pdserve:kv_lease_expired_total")
    expired_before = expired()
    kv = asyncio.run(prefill_without_decode())
    assert kv.lease_id and len(kv.ranks[0].block_ids) >= 300 // 64
    assert system.wait_for(lambda: expired() > expired_before), "the abandoned lease never expired"
    assert system.wait_for(lambda: _blocks_in_use(instances, "prefill") == 0), "lease expiry leaked"

    import json
    import urllib.request

    req = urllib.request.Request(url + "/v1/completions", headers={"content-type": "application/json"},
                                 data=json.dumps({"prompt": list(range(50, 300)), "max_tokens": 2000,
                                                  "ignore_eos": True, "stream": True}).encode())
    resp = urllib.request.urlopen(req, timeout=60)
    resp.readline()
    assert system.wait_for(lambda: _blocks_in_use(instances, "decode") > 0)  # 2,000 tokens: held for a while
    resp.close()  # the client goes away mid-stream
    assert system.wait_for(lambda: _blocks_in_use(instances, "decode") == 0), "decode kept the blocks"
    assert system.wait_for(lambda: _blocks_in_use(instances, "prefill") == 0)
