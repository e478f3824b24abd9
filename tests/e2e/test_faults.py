"""Fault injection on real processes during streaming load (policies in docs/failures.md): NIXL pulls
that fail, a lease that expires and whose pages are reused under a slow puller, decode killed
mid-stream or paused, Redis paused and killed, the kvstore paused and killed (a prefill rank dying:
test_faults_prefill_rank.py). In every case no client call outlives its deadline and the KV block counters
return to zero."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.request
from urllib.parse import urlparse

import grpc
import pytest

from engine import SamplingParams
from proto.pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from services.cluster.redis_server import RedisServer
from services.launch import launcher
from services.rpc.convert import sampling_to_proto
from tests.helpers import chaos, pace, system
from tests.helpers.chaos import CLIENT_TIMEOUT_S, GREEDY, ROUTER

# Latency bounds: the product's own deadline (if any) plus seconds that are scaled by the machine's slowdown,
# measured just before each fault (tests/helpers/pace.py); waits for an event poll with generous deadlines.

# ---- phases on one deployment: kvstore, prefill (48 blocks), decode (first 3 pulls fail), router -----

def _nixl_pull_failures_retry_once_then_recompute(dep, addr, offline, corpus):
    bodies = chaos.bodies(corpus, 3, 12)
    want = chaos.expected(offline, bodies)
    for body, text in zip(bodies, want):  # one at a time: pulls 1+2 fail (recompute), 3 fails then succeeds
        status, out = system.post(addr["url"], "/v1/completions", body, timeout=CLIENT_TIMEOUT_S)
        assert status == 200, out
        assert out["choices"][0]["text"] == text
    decode = addr["decode-0"]
    assert system.metric(decode, "pdserve:kv_pull_failures_total") == 3
    assert system.metric(decode, "pdserve:kv_pull_recomputes_total") == 1
    chaos.assert_blocks_freed([addr["prefill-0"], decode])


def _expired_lease_with_reused_pages_is_never_decoded_from(dep, addr, offline, corpus):
    """A lease expires before decode pulls; its pages go to other requests; the pull must be refused
    (recomputed) -- the tokens equal the offline engine's, not garbage with a 200."""
    infos = chaos.instances(dep)
    prompt = corpus[5000:5000 + 5 * 64 - 7]
    (want,) = offline.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    before = system.metric(addr["decode-0"], "pdserve:kv_pull_not_intact_total")
    got, stale, reused = asyncio.run(_pull_after_reuse(infos["prefill-0"].grpc_address, addr["prefill-0"],
                                                       infos["decode-0"].grpc_address, prompt, corpus))
    assert set(stale.ranks[0].block_ids) & reused, "the test must reuse the expired lease's pages"
    assert got == list(want.token_ids)
    assert system.metric(addr["decode-0"], "pdserve:kv_pull_not_intact_total") == before + 1
    assert system.metric(addr["prefill-0"], "pdserve:kv_lease_expired_total") >= 1
    chaos.assert_blocks_freed([addr["prefill-0"], addr["decode-0"]])


def _decode_killed_mid_stream(dep, addr, offline, corpus):
    load = chaos.Load(addr["url"], chaos.bodies(corpus, 4, 1500), CLIENT_TIMEOUT_S).start()
    assert load.wait_started(120), "streams did not start"
    slow = pace.slowdown()
    t_kill = time.monotonic()
    chaos.kill(dep, "decode-0")
    results = load.join()
    print(f"decode killed: {len(results)} streams ended {time.monotonic() - t_kill:.2f}s after the kill "
          f"(machine {slow:.1f}x slower than usual)")
    assert time.monotonic() - t_kill < pace.scaled(10, slow), "streams did not end promptly after decode died"
    for r in results:
        assert r.status == 200 and r.text, r
        # in decode: the failure, with nowhere to move; between its first token and decode: no decode left
        assert r.error is not None and r.error["type"] in ("upstream_error", "service_unavailable") and r.done, r
        assert "sent nothing" not in r.error["message"], "ended by the idle timeout, not by the lost connection"
        assert r.finish_reason is None
    # the router stopped choosing it at once (its Redis entry is still live): 503 fast, no hang
    t0 = time.monotonic()
    status, err = system.post(addr["url"], "/v1/completions", {"prompt": "x = 1", "max_tokens": 4},
                              timeout=CLIENT_TIMEOUT_S)
    assert status == 503 and "decode" in err["error"]["message"], err
    assert time.monotonic() - t0 < pace.scaled(5, slow)
    chaos.assert_blocks_freed([addr["prefill-0"]])  # leases released, not left to expire
    chaos.restart(dep, "decode-0", env={"PDSERVE_FAULT_NIXL_FAIL_FIRST_N": "0"})
    bodies = chaos.bodies(corpus, 2, 10, start=9000)
    want = chaos.expected(offline, bodies)
    ok = system.wait_for(lambda: system.post(addr["url"], "/v1/completions", bodies[0], timeout=30)[0] == 200,
                         timeout=300, period=1.0)
    assert ok, "the router did not route to the restarted decode\n" + chaos.log_tail(dep, "decode-0")
    for body, text in zip(bodies, want):
        status, out = system.post(addr["url"], "/v1/completions", body, timeout=CLIENT_TIMEOUT_S)
        assert status == 200 and out["choices"][0]["text"] == text, out
    chaos.assert_blocks_freed([addr["prefill-0"], addr["decode-0"]])


def _decode_paused_streams_end_at_the_idle_timeout(dep, addr, offline, corpus):
    load = chaos.Load(addr["url"], chaos.bodies(corpus, 3, 1500, start=15000), CLIENT_TIMEOUT_S).start()
    assert load.wait_started(120)
    slow = pace.slowdown()
    t_pause = time.monotonic()
    chaos.pause(dep, "decode-0")
    try:
        results = load.join()
        print(f"decode paused: streams ended {time.monotonic() - t_pause:.2f}s after the pause "
              f"(idle timeout {ROUTER['stream-idle-timeout-s']}s, machine {slow:.1f}x slower than usual)")
        assert time.monotonic() - t_pause < ROUTER["stream-idle-timeout-s"] + pace.scaled(5, slow), \
            "streams outlived the idle timeout"
        for r in results:
            assert r.status == 200 and r.done and r.finish_reason is None, r
            assert r.error is not None and "sent nothing" in r.error["message"], r
        t0 = time.monotonic()  # the router stopped choosing the silent decode
        status, err = system.post(addr["url"], "/v1/completions", {"prompt": "y = 2", "max_tokens": 4},
                                  timeout=CLIENT_TIMEOUT_S)
        assert status == 503 and time.monotonic() - t0 < pace.scaled(5, slow), err
    finally:
        chaos.resume(dep, "decode-0")
    bodies = chaos.bodies(corpus, 1, 10, start=18000)
    (want,) = chaos.expected(offline, bodies)
    ok = system.wait_for(lambda: system.post(addr["url"], "/v1/completions", bodies[0], timeout=30)[0] == 200,
                         timeout=120, period=1.0)
    status, out = system.post(addr["url"], "/v1/completions", bodies[0], timeout=CLIENT_TIMEOUT_S)
    assert ok and status == 200 and out["choices"][0]["text"] == want, out
    chaos.assert_blocks_freed([addr["prefill-0"], addr["decode-0"]])


def _redis_paused_then_killed_router_keeps_serving_and_state_is_republished(dep, addr, offline,
                                                                                 corpus):
    port = urlparse(dep.redis_url).port
    assert dep.redis_pid and port != 6379, "only the deployment's private Redis may be stopped"
    bodies = chaos.bodies(corpus, 4, 40, start=12000)
    want = chaos.expected(offline, bodies)
    load = chaos.Load(addr["url"], bodies, CLIENT_TIMEOUT_S).start()
    assert load.wait_started(120)
    slow = pace.slowdown()
    os.kill(dep.redis_pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()  # a new request while Redis hangs: served on the last known instances
        status, out = system.post(addr["url"], "/v1/completions", bodies[0], timeout=CLIENT_TIMEOUT_S)
        assert status == 200 and out["choices"][0]["text"] == want[0], out
        print(f"Redis paused: a new request took {time.monotonic() - t0:.2f}s (machine {slow:.1f}x slower)")
        assert time.monotonic() - t0 < pace.scaled(15, slow)
        results = load.join()
    finally:
        os.kill(dep.redis_pid, signal.SIGCONT)
    assert [r.text for r in results] == want and all(r.ok for r in results), results

    chaos.kill_redis(dep)
    load = chaos.Load(addr["url"], bodies, CLIENT_TIMEOUT_S).start()
    results = load.join()
    assert [r.text for r in results] == want and all(r.ok for r in results), results
    assert all(r.elapsed < ROUTER["request-timeout-s"] for r in results)
    health = json.loads(urllib.request.urlopen(addr["url"] + "/health", timeout=5).read())
    assert health["redis"] is False

    with pace.pinned():
        server = RedisServer.start(port, die_with_parent=True)
    dep.redis_pid, dep.redis_workdir = server.pid, server.workdir
    want_ids = {"router-0", "prefill-0", "decode-0", "kvstore-0"}
    assert system.wait_for(lambda: want_ids <= set(chaos.instances(dep))), "state not re-published"
    assert system.wait_for(
        lambda: json.loads(urllib.request.urlopen(addr["url"] + "/health", timeout=5).read())["redis"])
    status, out = system.post(addr["url"], "/v1/completions", bodies[1], timeout=CLIENT_TIMEOUT_S)
    assert status == 200 and out["choices"][0]["text"] == want[1], out
    chaos.assert_blocks_freed([addr["prefill-0"], addr["decode-0"]])


def _kvstore_paused_then_killed_prefill_recomputes(dep, addr, offline, corpus):
    url, prefill = addr["url"], addr["prefill-0"]
    session = corpus[20000:20000 + 10 * 64 + 5]
    assert system.post(url, "/v1/completions", {"prompt": session, "max_tokens": 4, **GREEDY})[0] == 200
    assert system.wait_for(lambda: system.metric(addr["kvstore-0"], "pdserve:kvstore_num_stored_blocks") >= 10)
    for i in range(4):  # push the session out of prefill's 48 blocks; the kvstore keeps it
        filler = corpus[30000 + 1000 * i: 30000 + 1000 * i + 15 * 64]
        assert system.post(url, "/v1/completions", {"prompt": filler, "max_tokens": 2, **GREEDY})[0] == 200
    failures = system.metric(prefill, "pdserve:kvstore_failures_total")
    turn = session + corpus[40000:40030]
    bodies = [{"prompt": turn, "max_tokens": 12, **GREEDY}] + chaos.bodies(corpus, 3, 12, start=41000)
    want = chaos.expected(offline, bodies[:1]) + chaos.expected(offline, bodies[1:])
    slow = pace.slowdown()
    chaos.pause(dep, "kvstore-0")
    try:
        results = chaos.Load(url, bodies, CLIENT_TIMEOUT_S).start().join()
    finally:
        chaos.resume(dep, "kvstore-0")
    assert [r.text for r in results] == want and all(r.ok for r in results), results
    print(f"kvstore paused: requests took {max(r.elapsed for r in results):.2f}s at most "
          f"(machine {slow:.1f}x slower than usual)")
    # past the router's deadline a request fails instead: the bound never reaches it
    bound = min(pace.scaled(25, slow), ROUTER["request-timeout-s"])
    assert all(r.elapsed < bound for r in results), [r.elapsed for r in results]
    assert system.metric(prefill, "pdserve:kvstore_failures_total") > failures, "the load never hit the kvstore"

    chaos.kill(dep, "kvstore-0")
    results = chaos.Load(url, bodies, CLIENT_TIMEOUT_S).start().join()
    assert [r.text for r in results] == want and all(r.ok for r in results), results
    chaos.assert_blocks_freed([prefill, addr["decode-0"]])


@pytest.mark.xdist_group("faults")
def test_faults_on_one_deployment(tmp_path_factory, offline, corpus):
    """Each phase below injects one fault; they share one deployment and run in this order (the NIXL
    fault hook fails the deployment's first pulls; decode is restarted by the phase that kills it)."""
    topo = system.topology(tmp_path_factory.mktemp("faults"), router=ROUTER,
                           prefill={"num-blocks": 48, "kvstore-timeout-s": 1})
    topo["services"]["decode"]["env"] = {"PDSERVE_FAULT_NIXL_FAIL_FIRST_N": "3"}
    dep = system.launch(topo)
    try:
        addr = {i.instance_id: i.metrics_address for i in chaos.instances(dep).values()}
        addr["url"] = dep.url
        for phase in (_nixl_pull_failures_retry_once_then_recompute,
                      _expired_lease_with_reused_pages_is_never_decoded_from, _decode_killed_mid_stream,
                      _decode_paused_streams_end_at_the_idle_timeout,
                      _redis_paused_then_killed_router_keeps_serving_and_state_is_republished,
                      _kvstore_paused_then_killed_prefill_recomputes):
            t0 = time.monotonic()
            phase(dep, addr, offline, corpus)
            print(f"{phase.__name__}: {time.monotonic() - t0:.1f}s")
    finally:
        launcher.down(dep)


async def _pull_after_reuse(prefill_addr: str, prefill_metrics: str, decode_addr: str, prompt: list[int],
                            corpus: list[int]):
    """Prefill `prompt` with a 200 ms lease, wait until it expired and its pages are free, hold three other
    prompts' KV (45 of the 48 blocks: some must be the expired pages), then ask decode to continue from the
    stale handle."""
    expired = lambda: system.metric(prefill_metrics, "pdserve:kv_lease_expired_total")
    expired_before = expired()
    def gen(req_id: str, ids: list[int], max_tokens: int) -> common_pb2.GenerateRequest:
        return common_pb2.GenerateRequest(request_id=req_id, prompt_token_ids=ids, sampling_params=sampling_to_proto(
            SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)))

    async with grpc.aio.insecure_channel(prefill_addr) as pch, grpc.aio.insecure_channel(decode_addr) as dch:
        prefill = prefill_pb2_grpc.PrefillStub(pch)
        g = gen("stale", prompt, 16)
        first = await prefill.Prefill(prefill_pb2.PrefillRequest(request=g, lease_ms=200), timeout=30)
        # expired, and its pages free for anyone (nothing else holds a block of this prefill now)
        await pace.until(lambda: expired() > expired_before, "the 200 ms lease to expire", period=0.1)
        await pace.until(lambda: system.metric(prefill_metrics, "pdserve:kv_cache_usage_perc") == 0,
                         "the expired lease's pages to come back", period=0.1)
        holders, reused = [], set()
        for i in range(3):
            ids = corpus[60000 + 1000 * i: 60000 + 1000 * i + 15 * 64 - 10]
            r = await prefill.Prefill(prefill_pb2.PrefillRequest(request=gen(f"reuse{i}", ids, 4), lease_ms=20000),
                                      timeout=30)
            holders.append(r.kv.lease_id)
            reused |= set(r.kv.ranks[0].block_ids)
        try:
            call = decode_pb2_grpc.DecodeStub(dch).Generate(
                decode_pb2.DecodeRequest(request=g, kv=first.kv, first=first.first), timeout=30)
            tokens = list(first.first.token_ids)
            async for reply in call:
                tokens += list(reply.delta.token_ids)
        finally:
            for lease in holders:
                await prefill.ReleaseKV(prefill_pb2.ReleaseKVRequest(lease_id=lease), timeout=5)
    return tokens, first.kv, reused
