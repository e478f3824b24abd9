"""Bounded queues, end to end: beyond its bound each service answers at once with "retry after"
(router: HTTP 429 + Retry-After; prefill, decode, kvstore: RESOURCE_EXHAUSTED + retry-after-ms),
a full decode makes the router answer 429 and free the prefill's KV, and every slot and block is
given back afterwards (deployment: `hardened` in conftest.py, small bounds)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from engine import SamplingParams
from proto.pdserve.v1 import common_pb2, decode_pb2_grpc, kvstore_pb2, kvstore_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from services.cluster.redis_state import InstanceInfo, InstancePresence, RedisState
from services.rpc.convert import sampling_to_proto
from services.rpc.grpc_server import RETRY_AFTER_KEY, GrpcServer, Overloaded, grpc_errors
from tests.helpers import hardened as h
from tests.helpers import pace, system
from tests.helpers.hardened import HARDENED_LIMITS as LIM

pytestmark = pytest.mark.xdist_group("hardened")


def _open_stream(url: str, prompt: list[int]):
    """A long streaming completion, returned once decode is producing its tokens (2nd chunk read)."""
    req = urllib.request.Request(url + "/v1/completions", headers={"content-type": "application/json", **h.auth()},
                                 data=json.dumps({"prompt": prompt, "max_tokens": 1500, "ignore_eos": True,
                                                  "stream": True}).encode())
    resp = urllib.request.urlopen(req, timeout=60)
    seen = 0
    while seen < 2:
        line = resp.readline()
        assert line, "the stream ended early"
        seen += line.startswith(b"data: {")
    return resp


def _retry_after(exc: grpc.aio.AioRpcError) -> int:
    return int(dict(exc.trailing_metadata() or ()).get(RETRY_AFTER_KEY, "0"))


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def _reject_burst(url: str, count: int) -> None:
    """`count` requests that the router must refuse (each needs more slots than are free)."""
    body = {"prompt": "x = 1", "max_tokens": 1, "n": 2}
    with ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(lambda _: h.request(url, "/v1/completions", body, h.auth())[0], range(count)))
    assert statuses == [429] * count


def test_router_and_decode_bounds_answer_429_and_give_everything_back(hardened, url, insts):
    expired = lambda: system.metric(insts["prefill"].metrics_address, "pdserve:kv_lease_expired_total")
    expired_before = expired()
    streams = [_open_stream(url, list(range(200 + i, 330 + i))) for i in range(LIM["decode_inflight"])]
    try:
        # router bound: 2 choices in flight + 2 more > 3
        status, err, headers = h.request(url, "/v1/completions", {"prompt": "x = 1", "max_tokens": 1, "n": 2},
                                         h.auth())
        assert status == 429 and err["error"]["type"] == "rate_limit_error", err
        assert "router" in err["error"]["message"] and int(headers["Retry-After"]) >= 1
        # decode bound: the router admits it, prefill computes it, the only decode is full
        status, err, headers = h.request(url, "/v1/completions", {"prompt": list(range(600, 800)), "max_tokens": 8},
                                         h.auth("beta"))
        assert status == 429, err
        assert "decode" in err["error"]["message"] and int(headers["Retry-After"]) >= 1
        # the rejected request's prefill KV was released, not left to its 30 s lease: freed, and no lease expired
        assert system.wait_for(lambda: h.blocks_in_use(insts["prefill"]) == 0)
        assert expired() == expired_before, "the rejected request's lease expired instead of being released"
        # rejected requests leave nothing behind: the router's memory is flat over a burst of them
        router_pid = next(p.pid for p in hardened.processes if p.kind == "router")
        _reject_burst(url, 100)
        rss0 = _rss_mib(router_pid)
        _reject_burst(url, 400)
        rss1 = _rss_mib(router_pid)
        print(f"router RSS over 400 rejected requests: {rss0:.1f} -> {rss1:.1f} MiB")
        assert rss1 - rss0 < 8, "memory grew with rejected requests"
    finally:
        for s in streams:
            s.close()
    assert h.engines_idle(insts), "blocks still in use after the streams closed"
    router_metrics = insts["router"].metrics_address
    assert system.wait_for(lambda: system.metric(router_metrics, "pdserve:num_requests_running") == 0)
    # every admission slot came back: a request needing all of them at once is served
    status, body, _ = h.request(url, "/v1/completions", {"prompt": "y = 2", "max_tokens": 1,
                                                         "n": LIM["router_inflight"]}, h.auth())
    assert status == 200 and len(body["choices"]) == LIM["router_inflight"], body


def test_prefill_bound_answers_resource_exhausted_with_retry_after(insts):
    rng = __import__("random").Random(7)
    prompts = [[rng.randrange(100, 4000) for _ in range(1200)] for _ in range(3 * LIM["prefill_inflight"])]

    async def one(stub, i: int, ids: list[int]):
        g = common_pb2.GenerateRequest(request_id=f"burst-{os.getpid()}-{i}", prompt_token_ids=ids,
                                       sampling_params=sampling_to_proto(SamplingParams(max_tokens=1)))
        try:
            await stub.Prefill(prefill_pb2.PrefillRequest(request=g), timeout=60)
            return "ok", 0, ""
        except grpc.aio.AioRpcError as exc:
            return exc.code(), _retry_after(exc), exc.details()

    async def burst():
        async with grpc.aio.insecure_channel(insts["prefill"].grpc_address) as ch:
            stub = prefill_pb2_grpc.PrefillStub(ch)
            return await asyncio.gather(*[one(stub, i, p) for i, p in enumerate(prompts)])

    results = asyncio.run(burst())
    codes = [r[0] for r in results]
    assert set(codes) <= {"ok", grpc.StatusCode.RESOURCE_EXHAUSTED}, results
    assert LIM["prefill_inflight"] <= codes.count("ok") < len(prompts), codes
    for code, after_ms, details in results:
        if code != "ok":
            assert after_ms > 0 and "prefill" in details and "capacity" in details
    assert h.engines_idle(insts)


def test_kvstore_bounds_open_transfers(insts):
    rng = __import__("random").Random(11)

    async def run():
        async with grpc.aio.insecure_channel(insts["kvstore"].grpc_address) as ch:
            stub = kvstore_pb2_grpc.KVStoreStub(ch)
            ids, refused = [], None
            for _ in range(LIM["kvstore_open"] + 1):
                hashes = [rng.randbytes(16) for _ in range(2)]
                try:
                    res = await stub.Reserve(kvstore_pb2.ReserveRequest(block_hashes=hashes, ttl_ms=20_000))
                    ids.append(res.reservation_id)
                except grpc.aio.AioRpcError as exc:
                    refused = exc
                    break
            for rid in ids:
                assert (await stub.Release(kvstore_pb2.ReleaseRequest(id=rid))).released
            again = await stub.Reserve(kvstore_pb2.ReserveRequest(block_hashes=[rng.randbytes(16)], ttl_ms=20_000))
            await stub.Release(kvstore_pb2.ReleaseRequest(id=again.reservation_id))
            return ids, refused, again

    ids, refused, again = asyncio.run(run())
    assert refused is not None and refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, ids
    assert len(ids) <= LIM["kvstore_open"] and _retry_after(refused) > 0
    assert again.reservation_id, "released transfers must free their slots"


class _Full(prefill_pb2_grpc.PrefillServicer, decode_pb2_grpc.DecodeServicer):
    """A prefill and decode that are always at capacity (what a saturated instance answers)."""

    def __init__(self):
        self.calls = {"Prefill": 0, "Generate": 0}

    @grpc_errors
    async def Prefill(self, request, context):
        self.calls["Prefill"] += 1
        raise Overloaded("prefill-full is at capacity", retry_after_s=2.0)

    @grpc_errors
    async def Generate(self, request, context):
        self.calls["Generate"] += 1
        raise Overloaded("decode-full is at capacity", retry_after_s=2.0)
        yield  # a server stream, like the real one


ROUTER_REFRESH_S = 0.5  # how often the router re-reads the registry


@contextlib.contextmanager
def _registered_full_instances(redis_url: str):
    """Serve `_Full` on loopback and register it in Redis as one more prefill and one more decode. On the way
    out they deregister first and keep answering "at capacity" until the router has re-read the registry a few
    times at this machine's pace: a request it still sends them meanwhile moves on to the real instances,
    where one sent to a stopped server would fail."""
    servicer, started, deregister, stop = _Full(), threading.Event(), threading.Event(), threading.Event()

    async def serve():
        server = GrpcServer(0)
        server.add_service(prefill_pb2_grpc.add_PrefillServicer_to_server, servicer, "pdserve.v1.Prefill")
        server.add_service(decode_pb2_grpc.add_DecodeServicer_to_server, servicer, "pdserve.v1.Decode")
        address = f"127.0.0.1:{await server.start()}"
        state = RedisState(redis_url)
        presences = [InstancePresence(state, InstanceInfo(role, f"{role}-full", address, "127.0.0.1:1"),
                                      heartbeat_s=0.5) for role in ("prefill", "decode")]
        for p in presences:
            await p.start()
        started.set()
        while not deregister.is_set():
            await asyncio.sleep(0.05)
        for p in presences:
            await p.stop(deregister=True)
        await state.close()
        while not stop.is_set():
            await asyncio.sleep(0.05)
        await server.stop(0)

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    assert started.wait(60), "the stand-in did not start"
    try:
        yield servicer
    finally:
        deregister.set()
        time.sleep(pace.scaled(3 * ROUTER_REFRESH_S))
        stop.set()
        thread.join(60)


def test_router_skips_a_full_instance_for_another_one(hardened, url, insts):
    """With a full prefill and a full decode registered beside the real ones, every request is
    still served: the router takes RESOURCE_EXHAUSTED as "try the next instance of that role"."""
    with _registered_full_instances(hardened.redis_url) as full:
        # until the router has found the stand-ins (its next registry read) and picked each twice; every
        # request meanwhile is served
        statuses, deadline = [], time.monotonic() + 120
        while min(full.calls.values()) < 2 and time.monotonic() < deadline:
            i = len(statuses)
            status, body, _ = h.request(url, "/v1/completions", {"prompt": f"v{i} = {i}", "max_tokens": 3},
                                        h.auth())
            statuses.append(status)
            assert status == 200, body
    assert full.calls["Prefill"] >= 2 and full.calls["Generate"] >= 2, (full.calls, statuses)
    assert h.engines_idle(insts), "a request retried elsewhere left blocks behind"
