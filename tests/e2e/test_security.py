"""Security of the running system: API keys on the HTTP and gRPC APIs (401 / UNAUTHENTICATED),
request size limits with clear 400/413 errors, per-tenant prefix caches (one tenant never hits
another's blocks), internal services reachable on loopback only (deployment: `hardened`)."""

from __future__ import annotations

import asyncio
import socket
import urllib.request

import grpc
import pytest

from engine import SamplingParams
from proto.pdserve.v1 import common_pb2, router_pb2_grpc
from services.rpc.convert import sampling_to_proto
from services.rpc.net import split_address
from tests.helpers import hardened as h
from tests.helpers.hardened import HARDENED_LIMITS as LIM

pytestmark = pytest.mark.xdist_group("hardened")


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer sk-wrong"}, {"authorization": "sk-alpha-1"},
                                     {"authorization": "Bearer sk-alpha-1x"}])
def test_missing_or_wrong_key_gets_401(url, headers):
    for path, body in (("/v1/completions", {"prompt": "x", "max_tokens": 1}), ("/v1/models", None)):
        status, err, hdrs = h.request(url, path, body, headers)
        assert status == 401, (path, err)
        assert err["error"]["type"] == "authentication_error" and "API key" in err["error"]["message"]
        assert hdrs.get("www-authenticate") == "Bearer"


def test_probes_stay_open_and_every_key_works(url):
    assert urllib.request.urlopen(url + "/health", timeout=5).status == 200
    assert b"pdserve:" in urllib.request.urlopen(url + "/metrics", timeout=5).read()
    for tenant, which in (("alpha", 0), ("alpha", 1), ("beta", 0)):
        status, body, _ = h.request(url, "/v1/completions", {"prompt": "z = 3", "max_tokens": 2}, h.auth(tenant, which))
        assert status == 200, body


def test_grpc_router_needs_the_key(hardened):
    address = hardened.endpoints()["router_grpc"][0]
    g = common_pb2.GenerateRequest(prompt="def f():", sampling_params=sampling_to_proto(SamplingParams(max_tokens=3)))

    async def call(metadata):
        async with grpc.aio.insecure_channel(address) as ch:
            return [r async for r in router_pb2_grpc.RouterStub(ch).Generate(g, metadata=metadata, timeout=60)]

    for metadata in ((), (("authorization", "Bearer nope"),)):
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            asyncio.run(call(metadata))
        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED and "API key" in exc.value.details()
    replies = asyncio.run(call((("authorization", "Bearer sk-beta-1"),)))
    assert replies[-1].usage.completion_tokens == 3


def test_tenants_never_share_prefix_blocks_while_one_tenant_does(url):
    prompt = list(range(1000, 1000 + 6 * 64 + 10))  # 6 full blocks
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}

    def cached(tenant: str, which: int = 0, **extra) -> int:
        status, out, _ = h.request(url, "/v1/completions", {**body, **extra}, h.auth(tenant, which))
        assert status == 200, out
        return out["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("alpha") == 0
    assert cached("alpha", 1) >= 6 * 64  # another key of the same tenant: the cache is shared
    assert cached("beta") == 0  # same prompt, other tenant: no hit (local cache or kvstore)
    assert cached("beta", cache_salt="tenant:alpha") == 0  # a chosen salt cannot reach alpha's blocks
    assert cached("beta") >= 6 * 64  # beta's own blocks from its first request


_TOO_BIG = [
    ({"prompt": [7] * 4096}, 400, "prompt", "context_length_exceeded"),
    ({"prompt": "x", "max_tokens": 5000}, 400, "max_tokens", "context_length_exceeded"),
    ({"prompt": "x", "max_tokens": 2 ** 63}, 400, "max_tokens", None),
    ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens", None),
    ({"prompt": "x", "n": LIM["max_n"] + 1}, 400, "n", None),
    ({"prompt": "x", "n": 0}, 400, "n", None),
    ({"prompt": "x", "stop": [f"s{i}" for i in range(17)]}, 400, "stop", None),
    ({"prompt": "x", "stop": ["y" * 257]}, 400, "stop", None),
    ({"prompt": "x", "stop": [""]}, 400, "stop", None),
    ({"prompt": "x", "stop_token_ids": list(range(65))}, 400, "stop_token_ids", None),
    ({"prompt": "x", "stop_token_ids": [10 ** 6]}, 400, "stop_token_ids", None),
    ({"prompt": "x", "logprobs": 21}, 400, "logprobs", None),
    ({"prompt": "x", "logprobs": -1}, 400, "logprobs", None),
    ({"prompt": [[1, 2]] * 65}, 400, "prompt", None),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", None),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs", None),
    ({"prompt": "x" * (LIM["max_body_bytes"] + 10)}, 413, None, None),
]


@pytest.mark.parametrize("body,status,param,code", _TOO_BIG)
def test_size_limits_answer_clear_errors(url, body, status, param, code):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    got, err, _ = h.request(url, path, body, h.auth())
    assert got == status, err
    assert err["error"]["message"]
    if param is not None:
        assert err["error"]["param"] == param, err
    if code is not None:
        assert err["error"]["code"] == code, err


def test_internal_services_answer_on_loopback_only(insts):
    try:
        host_ip = socket.gethostbyname(socket.gethostname())
    except OSError:
        host_ip = "127.0.0.1"
    for role in ("prefill", "decode", "kvstore"):
        for address in (insts[role].grpc_address, insts[role].metrics_address):
            host, port = split_address(address)
            assert host == "127.0.0.1", (role, address)
            if not host_ip.startswith("127."):
                with pytest.raises(OSError):  # nothing listens on the host's own address
                    socket.create_connection((host_ip, port), timeout=2).close()
