"""The kvstore service as a real process with a private Redis, driven over gRPC + NIXL like an
engine would: Reserve -> NIXL WRITE -> Commit -> Lookup -> Load -> NIXL READ (byte-exact), LRU
eviction under a small pool, reservation timeout, bad input, Redis index + events, /metrics."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
import torch

from engine.config.model_config import ModelConfig
from engine.kv.cache import KVCacheSpec, PagedKVCache
from engine.parallel.dist import free_port
from proto.pdserve.v1 import kvstore_pb2, kvstore_pb2_grpc
from services.cluster.redis_state import KV_EVENTS, KVEvent, RedisState
from services.rpc.grpc_server import channel, check_health_sync
from services.rpc.procs import tie_to_parent
from services.transfer.kvstore_client import KVStoreClient
from services.transfer.nixl_agent import NixlAgent
from tests.helpers import ROOT
from tests.helpers.pace import pinned

pytestmark = pytest.mark.timeout(300)  # the fixture's kvstore start counts against the first test

MODEL = ROOT / "checkpoints" / "tiny-code"
POOL_BLOCKS = 8
SPEC = KVCacheSpec.from_model(ModelConfig.from_pretrained(MODEL))


def H(chain: int, i: int) -> bytes:
    return bytes([chain]) + i.to_bytes(15, "little")


@pytest.fixture(scope="module")
def kvstore(redis_server, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("kvstore") / "kvstore.log"
    gib = (POOL_BLOCKS + 0.5) * SPEC.block_bytes / (1 << 30)
    cmd = [sys.executable, "-m", "services.kvstore", "--model", str(MODEL), "--pool-gib", f"{gib:.9f}",
           "--port", str(port), "--host", "127.0.0.1", "--advertise-host", "127.0.0.1",
           "--redis-url", redis_server.url, "--instance-id", "kv-test", "--reservation-grace-ms", "200",
           "--heartbeat-s", "0.2", "--instance-ttl-s", "2"]
    with open(log, "w") as out, pinned():
        proc = subprocess.Popen(tie_to_parent(cmd), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while not check_health_sync(address, "pdserve.v1.KVStore", timeout=0.5):
        assert proc.poll() is None and time.monotonic() < deadline, f"kvstore did not start:\n{log.read_text()}"
        time.sleep(0.1)
    yield address, proc, redis_server.url
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _engine_cache(seed: int) -> PagedKVCache:
    cache = PagedKVCache(SPEC, 8, "cpu")
    g = torch.Generator().manual_seed(seed)
    for t in (cache.mla, cache.index):
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8, generator=g))
    return cache


async def _client(address: str, cache: PagedKVCache) -> tuple[KVStoreClient, NixlAgent]:
    agent = NixlAgent(f"engine-{os.getpid()}-{time.monotonic_ns()}")
    local = agent.prep_local(agent.register({"mla": cache.mla, "index": cache.index}))
    client = KVStoreClient(address, agent, local, SPEC)
    await client.connect()
    return client, agent


def test_store_lookup_load_roundtrip_and_eviction(kvstore):
    address, _, redis_url = kvstore

    async def main():
        src, dst = _engine_cache(seed=1), _engine_cache(seed=2)
        writer, wagent = await _client(address, src)
        reader, ragent = await _client(address, dst)
        state = RedisState(redis_url)
        chain = [H(1, i) for i in range(3)]
        assert await writer.store(chain, [5, 0, 3]) == 3
        assert await writer.store(chain, [5, 0, 3]) == 0  # already there: nothing reserved
        assert await reader.lookup(chain + [H(1, 9)]) == 3
        assert await reader.load(chain + [H(1, 9)], [7, 6, 1, 2]) == 3
        for name in ("mla", "index"):
            assert torch.equal(getattr(dst, name)[[7, 6, 1]], getattr(src, name)[[5, 0, 3]])
            assert torch.equal(getattr(dst, name)[2], getattr(_engine_cache(2), name)[2])  # untouched
        assert wagent.stats.bytes_transferred == 3 * SPEC.block_bytes == ragent.stats.bytes_transferred
        await _until(lambda: state.lookup_prefix(chain), {"kv-test": 3}, "index of chain 1")

        # LRU eviction: 8 blocks; chain 1 (3 blocks) was used, then 6 new blocks evict its oldest one
        events: list[KVEvent] = []
        listening = await _subscribers(state)
        listener = asyncio.create_task(_collect(state, events))
        await _until(lambda: _subscribers(state), listening + 1, "the listener's subscription")
        assert await writer.store([H(2, i) for i in range(6)], [0, 1, 2, 3, 4, 5]) == 6
        assert await reader.lookup(chain) == 0  # H(1, 0) was the least recently used
        assert await reader.lookup(chain[1:]) == 2
        await _until(lambda: state.lookup_prefix(chain[1:]), {"kv-test": 2}, "index after eviction")
        assert await state.lookup_prefix(chain) == {}
        await _until(lambda: _value(any(e.kind == "removed" and chain[0] in e.block_hashes for e in events)),
                     True, "a removed event")
        listener.cancel()
        for c in (writer, reader):
            await c.close()
        await state.close()

    asyncio.run(main())


def test_reservation_timeout_frees_blocks(kvstore):
    address, _, _ = kvstore

    async def main():
        async with channel(address) as ch:
            stub = kvstore_pb2_grpc.KVStoreStub(ch)
            t0 = time.monotonic()
            res = await stub.Reserve(kvstore_pb2.ReserveRequest(block_hashes=[H(3, 0), H(3, 1)], ttl_ms=300))
            assert len(res.block_ids) == 2 and res.reservation_id
            free = (await stub.Describe(kvstore_pb2.DescribeRequest())).num_free_blocks
            await asyncio.sleep(0.4 - (time.monotonic() - t0))
            with pytest.raises(grpc.aio.AioRpcError) as err:  # expired: the blocks may be reused
                await stub.Commit(kvstore_pb2.CommitRequest(reservation_id=res.reservation_id))
            assert err.value.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND)
            described = (await stub.Describe(kvstore_pb2.DescribeRequest())).num_free_blocks
            if time.monotonic() - t0 < 0.45:  # answered before the sweep could run (expiry 0.3 s + 0.2 s grace)
                assert described == free  # grace: not yet (a loaded machine may only get here past it)
            # past the 200 ms grace the sweeper returns both to the free list
            await _until(lambda: _free_blocks(stub), free + 2, "the expired reservation's blocks")
            again = await stub.Reserve(kvstore_pb2.ReserveRequest(block_hashes=[H(3, 0), H(3, 1)]))
            assert list(again.block_hashes) == [H(3, 0), H(3, 1)]  # the hashes are writable again
            assert (await stub.Release(kvstore_pb2.ReleaseRequest(id=again.reservation_id))).released

    asyncio.run(main())


def test_bad_input_and_metrics(kvstore):
    address, _, redis_url = kvstore

    async def main():
        async with channel(address) as ch:
            stub = kvstore_pb2_grpc.KVStoreStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Lookup(kvstore_pb2.LookupRequest(block_hashes=[b"short"]))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "16" in err.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Load(kvstore_pb2.LoadRequest(block_hashes=[H(1, 0)], ttl_ms=10**9))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert not (await stub.Release(kvstore_pb2.ReleaseRequest(id="l-nope"))).released
        state = RedisState(redis_url)
        [info] = await state.instances("kvstore")
        await state.close()
        assert info.instance_id == "kv-test" and info.capacity["num_blocks"] == POOL_BLOCKS
        return info.metrics_address

    metrics_address = asyncio.run(main())
    body = urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=5).read().decode()
    assert f"pdserve:kvstore_num_blocks {float(POOL_BLOCKS)}" in body
    assert "pdserve:kv_cache_usage_perc" in body and "pdserve:prefix_cache_hits_total" in body


def test_sigterm_deregisters(kvstore):
    _, proc, redis_url = kvstore
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0

    async def main():
        state = RedisState(redis_url)
        assert await state.instances("kvstore") == []
        await state.close()

    asyncio.run(main())


async def _collect(state: RedisState, events: list) -> None:
    async for ev in state.events():
        events.append(ev)


async def _value(v):
    return v


async def _subscribers(state: RedisState) -> int:
    """Clients subscribed to the KV event channel (a listener's subscription is live once this counts it)."""
    return dict(await state.redis.pubsub_numsub(KV_EVENTS)).get(KV_EVENTS, 0)


async def _free_blocks(stub) -> int:
    return (await stub.Describe(kvstore_pb2.DescribeRequest())).num_free_blocks


async def _until(fn, expected, what: str, timeout: float = 60.0):
    """Poll `await fn()` until it equals `expected`; the deadline only bounds how long a failure takes."""
    deadline = time.monotonic() + timeout
    while (got := await fn()) != expected:
        assert time.monotonic() < deadline, f"{what}: got {got!r}, expected {expected!r}"
        await asyncio.sleep(0.05)
