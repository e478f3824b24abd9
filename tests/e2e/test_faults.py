"""Fault injection on real processes during streaming load (policies in docs/failures.md): NIXL pulls
that fail, a lease that expires and whose pages are reused under a slow puller, decode killed
mid-stream, Redis paused and killed, the kvstore paused and killed, one rank of a PCP=2 prefill killed.
In every case no client call outlives its deadline and the KV block counters return to zero."""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import time
from urllib.parse import urlparse

import grpc
import pytest

from engine import LLM, SamplingParams
from proto.pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from services import launcher
from services.common.convert import sampling_to_proto
from services.common.grpc_server import check_health_sync
from services.common.redis_server import RedisServer
from services.common.redis_state import RedisState
from tests.e2e import chaos, system

CLIENT_TIMEOUT_S = 45.0  # every client call is bounded by this; the router's deadlines are far shorter
ROUTER = {"stream-idle-timeout-s": 5, "request-timeout-s": 40}
GREEDY = {"temperature": 0, "ignore_eos": True}


def _corpus(tok) -> list[int]:
    import argparse
    import difflib
    import typing
    ids = tok.encode("".join(inspect.getsource(m) for m in (difflib, argparse, typing, inspect)))
    assert len(ids) > 64_000, "the corpus is too short for the slices below"
    return ids


@pytest.fixture(scope="module")
def offline(tiny_code) -> LLM:
    return LLM(str(tiny_code), kv_cache_dtype="fp8_ds_mla", num_blocks=256)


@pytest.fixture(scope="module")
def corpus(offline) -> list[int]:
    return _corpus(offline.tokenizer)


def _instances(dep) -> dict[str, object]:
    async def read():
        state = RedisState(dep.redis_url)
        try:
            return {i.instance_id: i for i in await state.instances()}
        finally:
            await state.close()
    return asyncio.run(read())


def _usage(address: str) -> float:
    return system.metric(address, "pdserve:kv_cache_usage_perc")


def _assert_blocks_freed(addresses: list[str], timeout: float = 15.0) -> None:
    for a in addresses:
        assert system.wait_for(lambda: _usage(a) == 0, timeout=timeout), f"KV blocks still in use at {a}"


def _bodies(corpus: list[int], n: int, max_tokens: int, start: int = 0) -> list[dict]:
    return [{"prompt": corpus[start + 400 * i: start + 400 * i + 90 + 23 * i], "max_tokens": max_tokens, **GREEDY}
            for i in range(n)]


def _expected(offline: LLM, bodies: list[dict]) -> list[str]:
    outs = offline.generate([b["prompt"] for b in bodies],
                            SamplingParams(max_tokens=bodies[0]["max_tokens"], temperature=0.0, ignore_eos=True))
    return [o.text for o in outs]


# ---- one deployment: kvstore, prefill (48 blocks), decode (first 3 pulls fail), router ----------------

@pytest.fixture(scope="module")
def dep(tmp_path_factory):
    topo = system.topology(tmp_path_factory.mktemp("faults"), router=ROUTER,
                           prefill={"num-blocks": 48, "kvstore-timeout-s": 1})
    topo["services"]["decode"]["env"] = {"PDSERVE_FAULT_NIXL_FAIL_FIRST_N": "3"}
    dep = launcher.up(topo, timeout_s=240, die_with_parent=True)
    yield dep
    launcher.down(dep)


@pytest.fixture(scope="module")
def addr(dep) -> dict[str, str]:
    """instance id -> metrics address, plus 'url' -> the router."""
    out = {i.instance_id: i.metrics_address for i in _instances(dep).values()}
    return {**out, "url": dep.url}


@pytest.mark.xdist_group("faults")
def test_nixl_pull_failures_retry_once_then_recompute(dep, addr, offline, corpus):
    bodies = _bodies(corpus, 3, 12)
    want = _expected(offline, bodies)
    for body, text in zip(bodies, want):  # one at a time: pulls 1+2 fail (recompute), 3 fails then succeeds
        status, out = system.post(addr["url"], "/v1/completions", body, timeout=CLIENT_TIMEOUT_S)
        assert status == 200, out
        assert out["choices"][0]["text"] == text
    decode = addr["decode-0"]
    assert system.metric(decode, "pdserve:kv_pull_failures_total") == 3
    assert system.metric(decode, "pdserve:kv_pull_recomputes_total") == 1
    _assert_blocks_freed([addr["prefill-0"], decode])


@pytest.mark.xdist_group("faults")
def test_expired_lease_with_reused_pages_is_never_decoded_from(dep, addr, offline, corpus):
    """A lease expires before decode pulls; its pages go to other requests; the pull must be refused
    (recomputed) -- the tokens equal the offline engine's, not garbage with a 200."""
    infos = _instances(dep)
    prompt = corpus[5000:5000 + 5 * 64 - 7]
    (want,) = offline.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    before = system.metric(addr["decode-0"], "pdserve:kv_pull_not_intact_total")
    got, stale, reused = asyncio.run(_pull_after_reuse(infos["prefill-0"].grpc_address,
                                                       infos["decode-0"].grpc_address, prompt, corpus))
    assert set(stale.ranks[0].block_ids) & reused, "the test must reuse the expired lease's pages"
    assert got == list(want.token_ids)
    assert system.metric(addr["decode-0"], "pdserve:kv_pull_not_intact_total") == before + 1
    assert system.metric(addr["prefill-0"], "pdserve:kv_lease_expired_total") >= 1
    _assert_blocks_freed([addr["prefill-0"], addr["decode-0"]])


@pytest.mark.xdist_group("faults")
def test_decode_killed_mid_stream(dep, addr, offline, corpus):
    load = chaos.Load(addr["url"], _bodies(corpus, 4, 1500), CLIENT_TIMEOUT_S).start()
    assert load.wait_started(60), "streams did not start"
    t_kill = time.monotonic()
    chaos.kill(dep, "decode-0")
    results = load.join()
    assert time.monotonic() - t_kill < 10, "streams did not end promptly after decode died"
    for r in results:
        assert r.status == 200 and r.text, r
        assert r.error is not None and r.error["type"] == "upstream_error" and r.done, r
        assert r.finish_reason is None
    # the router stopped choosing it at once (its Redis entry is still live): 503 fast, no hang
    t0 = time.monotonic()
    status, err = system.post(addr["url"], "/v1/completions", {"prompt": "x = 1", "max_tokens": 4},
                              timeout=CLIENT_TIMEOUT_S)
    assert status == 503 and "decode" in err["error"]["message"], err
    assert time.monotonic() - t0 < 5
    _assert_blocks_freed([addr["prefill-0"]])  # leases released, not left to expire
    chaos.restart(dep, "decode-0", env={"PDSERVE_FAULT_NIXL_FAIL_FIRST_N": "0"})
    bodies = _bodies(corpus, 2, 10, start=9000)
    want = _expected(offline, bodies)
    ok = system.wait_for(lambda: system.post(addr["url"], "/v1/completions", bodies[0], timeout=30)[0] == 200,
                         timeout=90, period=1.0)
    assert ok, "the router did not route to the restarted decode"
    for body, text in zip(bodies, want):
        status, out = system.post(addr["url"], "/v1/completions", body, timeout=CLIENT_TIMEOUT_S)
        assert status == 200 and out["choices"][0]["text"] == text, out
    _assert_blocks_freed([addr["prefill-0"], addr["decode-0"]])


@pytest.mark.xdist_group("faults")
def test_decode_paused_streams_end_at_the_idle_timeout(dep, addr, offline, corpus):
    load = chaos.Load(addr["url"], _bodies(corpus, 3, 1500, start=15000), CLIENT_TIMEOUT_S).start()
    assert load.wait_started(60)
    t_pause = time.monotonic()
    chaos.pause(dep, "decode-0")
    try:
        results = load.join()
        assert time.monotonic() - t_pause < ROUTER["stream-idle-timeout-s"] + 5, "streams outlived the idle timeout"
        for r in results:
            assert r.status == 200 and r.done and r.finish_reason is None, r
            assert r.error is not None and "sent nothing" in r.error["message"], r
        t0 = time.monotonic()  # the router stopped choosing the silent decode
        status, err = system.post(addr["url"], "/v1/completions", {"prompt": "y = 2", "max_tokens": 4},
                                  timeout=CLIENT_TIMEOUT_S)
        assert status == 503 and time.monotonic() - t0 < 5, err
    finally:
        chaos.resume(dep, "decode-0")
    bodies = _bodies(corpus, 1, 10, start=18000)
    (want,) = _expected(offline, bodies)
    ok = system.wait_for(lambda: system.post(addr["url"], "/v1/completions", bodies[0], timeout=30)[0] == 200,
                         timeout=30, period=1.0)
    status, out = system.post(addr["url"], "/v1/completions", bodies[0], timeout=CLIENT_TIMEOUT_S)
    assert ok and status == 200 and out["choices"][0]["text"] == want, out
    _assert_blocks_freed([addr["prefill-0"], addr["decode-0"]])


@pytest.mark.xdist_group("faults")
def test_redis_paused_then_killed_router_keeps_serving_and_state_is_republished(dep, addr, offline,
                                                                                 corpus):
    port = urlparse(dep.redis_url).port
    assert dep.redis_pid and port != 6379, "only the deployment's private Redis may be stopped"
    bodies = _bodies(corpus, 4, 40, start=12000)
    want = _expected(offline, bodies)
    load = chaos.Load(addr["url"], bodies, CLIENT_TIMEOUT_S).start()
    assert load.wait_started(60)
    os.kill(dep.redis_pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()  # a new request while Redis hangs: served on the last known instances
        status, out = system.post(addr["url"], "/v1/completions", bodies[0], timeout=CLIENT_TIMEOUT_S)
        assert status == 200 and out["choices"][0]["text"] == want[0], out
        assert time.monotonic() - t0 < 10
        results = load.join()
    finally:
        os.kill(dep.redis_pid, signal.SIGCONT)
    assert [r.text for r in results] == want and all(r.ok for r in results), results

    chaos_redis_kill(dep)
    load = chaos.Load(addr["url"], bodies, CLIENT_TIMEOUT_S).start()
    results = load.join()
    assert [r.text for r in results] == want and all(r.ok for r in results), results
    assert all(r.elapsed < 20 for r in results)
    import json
    import urllib.request
    health = json.loads(urllib.request.urlopen(addr["url"] + "/health", timeout=5).read())
    assert health["redis"] is False

    server = RedisServer.start(port, die_with_parent=True)
    dep.redis_pid, dep.redis_workdir = server.pid, server.workdir
    want_ids = {"router-0", "prefill-0", "decode-0", "kvstore-0"}
    assert system.wait_for(lambda: want_ids <= set(_instances(dep)), timeout=15), "state not re-published"
    assert system.wait_for(
        lambda: json.loads(urllib.request.urlopen(addr["url"] + "/health", timeout=5).read())["redis"], timeout=10)
    status, out = system.post(addr["url"], "/v1/completions", bodies[1], timeout=CLIENT_TIMEOUT_S)
    assert status == 200 and out["choices"][0]["text"] == want[1], out
    _assert_blocks_freed([addr["prefill-0"], addr["decode-0"]])


@pytest.mark.xdist_group("faults")
def test_kvstore_paused_then_killed_prefill_recomputes(dep, addr, offline, corpus):
    url, prefill = addr["url"], addr["prefill-0"]
    session = corpus[20000:20000 + 10 * 64 + 5]
    assert system.post(url, "/v1/completions", {"prompt": session, "max_tokens": 4, **GREEDY})[0] == 200
    assert system.wait_for(lambda: system.metric(addr["kvstore-0"], "pdserve:kvstore_num_stored_blocks") >= 10)
    for i in range(4):  # push the session out of prefill's 48 blocks; the kvstore keeps it
        filler = corpus[30000 + 1000 * i: 30000 + 1000 * i + 15 * 64]
        assert system.post(url, "/v1/completions", {"prompt": filler, "max_tokens": 2, **GREEDY})[0] == 200
    failures = system.metric(prefill, "pdserve:kvstore_failures_total")
    turn = session + corpus[40000:40030]
    bodies = [{"prompt": turn, "max_tokens": 12, **GREEDY}] + _bodies(corpus, 3, 12, start=41000)
    want = _expected(offline, bodies[:1]) + _expected(offline, bodies[1:])
    chaos.pause(dep, "kvstore-0")
    try:
        results = chaos.Load(url, bodies, CLIENT_TIMEOUT_S).start().join()
    finally:
        chaos.resume(dep, "kvstore-0")
    assert [r.text for r in results] == want and all(r.ok for r in results), results
    assert all(r.elapsed < 15 for r in results), [r.elapsed for r in results]
    assert system.metric(prefill, "pdserve:kvstore_failures_total") > failures, "the load never hit the kvstore"

    chaos.kill(dep, "kvstore-0")
    results = chaos.Load(url, bodies, CLIENT_TIMEOUT_S).start().join()
    assert [r.text for r in results] == want and all(r.ok for r in results), results
    _assert_blocks_freed([prefill, addr["decode-0"]])


def chaos_redis_kill(dep) -> None:
    os.kill(dep.redis_pid, signal.SIGKILL)
    assert system.wait_for(lambda: not os.path.exists(f"/proc/{dep.redis_pid}") or
                           open(f"/proc/{dep.redis_pid}/stat").read().split(")")[1].split()[0] == "Z", timeout=5)


async def _pull_after_reuse(prefill_addr: str, decode_addr: str, prompt: list[int], corpus: list[int]):
    """Prefill `prompt` with a 200 ms lease, let it expire, hold three other prompts' KV (45 of the 48
    blocks: some must be the expired pages), then ask decode to continue from the stale handle."""
    def gen(req_id: str, ids: list[int], max_tokens: int) -> common_pb2.GenerateRequest:
        return common_pb2.GenerateRequest(request_id=req_id, prompt_token_ids=ids, sampling_params=sampling_to_proto(
            SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)))

    async with grpc.aio.insecure_channel(prefill_addr) as pch, grpc.aio.insecure_channel(decode_addr) as dch:
        prefill = prefill_pb2_grpc.PrefillStub(pch)
        g = gen("stale", prompt, 16)
        first = await prefill.Prefill(prefill_pb2.PrefillRequest(request=g, lease_ms=200), timeout=30)
        await asyncio.sleep(0.8)  # expired: its pages are free for anyone
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


# ---- PCP=2 prefill x 2 instances: one rank of one instance dies ---------------------------------------

@pytest.mark.xdist_group("faults-pcp")
def test_prefill_rank_killed_instance_goes_out_of_service_and_back(tmp_path_factory, offline, corpus):
    topo = system.topology(tmp_path_factory.mktemp("faults-pcp"), router=ROUTER)
    topo["services"]["prefill"].update(replicas=2, prefill_context_parallel_size=2)
    del topo["services"]["kvstore"]
    dep = launcher.up(topo, timeout_s=300, die_with_parent=True)
    try:
        _prefill_rank_death(dep, offline, corpus)
    finally:
        launcher.down(dep)


def _prefill_rank_death(dep, offline, corpus) -> None:
    infos = _instances(dep)
    p0, p1, dec = infos["prefill-0"], infos["prefill-1"], infos["decode-0"]
    # long prompts, so that several are being prefilled on prefill-0 when its rank dies
    bodies = [{"prompt": corpus[3000 * i: 3000 * i + 1200 + 150 * i], "max_tokens": 16, **GREEDY} for i in range(8)]
    want = _expected(offline, bodies)
    load = chaos.Load(dep.url, bodies, CLIENT_TIMEOUT_S).start()
    time.sleep(0.5)
    t_kill = time.monotonic()
    chaos.kill(dep, "prefill-0.rank1")
    results = load.join()
    print("in flight when prefill-0.rank1 died:", [("ok" if r.ok else "error", round(r.elapsed, 2)) for r in results])
    router_log = open(chaos.record(dep, "router-0").log).read()
    retried = router_log.count("trying another")
    assert retried or not all(r.ok for r in results), "no request was in flight at prefill-0 when its rank died"
    for r, text in zip(results, want):  # each either completed correctly or failed cleanly: never wrong, never hung
        assert r.elapsed < 30, r
        assert (r.ok and r.text == text) or (r.error is not None and r.finish_reason is None), r
    # the instance takes itself out of service: unhealthy, deregistered, rank 0 exits for a restart
    assert system.wait_for(lambda: not check_health_sync(p0.grpc_address), timeout=15)
    assert system.wait_for(lambda: "prefill-0" not in _instances(dep), timeout=15), "prefill-0 still registered"
    assert system.wait_for(lambda: chaos.exit_code(dep, "prefill-0.rank0") is not None, timeout=20)
    assert chaos.exit_code(dep, "prefill-0.rank0") == 1
    assert time.monotonic() - t_kill < 40
    served_before = system.metric(p1.metrics_address, "pdserve:time_to_first_token_seconds_count")
    for body, text in zip(bodies[:3], want[:3]):  # new requests go to the other instance
        status, out = system.post(dep.url, "/v1/completions", body, timeout=CLIENT_TIMEOUT_S)
        assert status == 200 and out["choices"][0]["text"] == text, out
    assert system.metric(p1.metrics_address, "pdserve:time_to_first_token_seconds_count") == served_before + 3

    chaos.restart(dep, "prefill-0.rank0")
    chaos.restart(dep, "prefill-0.rank1")
    assert system.wait_for(lambda: "prefill-0" in _instances(dep) and check_health_sync(p0.grpc_address),
                           timeout=120, period=1.0), "the restarted prefill did not re-register"

    def p0_served() -> float:
        return system.metric(p0.metrics_address, "pdserve:time_to_first_token_seconds_count")
    fresh = _bodies(corpus, 6, 8, start=50000)  # no cached prefix anywhere: routed by load alone
    for body, text in zip(fresh, _expected(offline, fresh)):
        status, out = system.post(dep.url, "/v1/completions", body, timeout=CLIENT_TIMEOUT_S)
        assert status == 200 and out["choices"][0]["text"] == text, out
    assert system.wait_for(lambda: p0_served() >= 1, timeout=5), "the router never chose the restarted prefill"
    _assert_blocks_freed([p0.metrics_address, p1.metrics_address, dec.metrics_address])
