"""Redis state against a real (private) redis-server: registry heartbeats and TTL expiry, the
block index's longest-prefix lookups, KV events, and re-publication after a Redis restart."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.cluster.redis_server import RedisServer
from services.cluster.redis_state import INSTANCES, KV_EVENTS, InstanceInfo, InstancePresence, KVEvent, RedisState
from tests.helpers.pace import pinned

pytestmark = pytest.mark.timeout(300)


def _hashes(n: int, tag: int = 0) -> list[bytes]:
    return [bytes([tag]) + i.to_bytes(15, "little") for i in range(n)]


async def _until(cond, timeout: float, what: str):
    """Poll `await cond()` until true; the deadline is generous, it only bounds how long a failure takes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await cond():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_registry_heartbeats_and_ttl_expiry(redis_url):
    async def main():
        state = RedisState(redis_url)
        a = InstanceInfo("prefill", "prefill-0", "10.0.0.1:50051", "10.0.0.1:9100", {"num_blocks": 128.0},
                         {"agent": "prefill-0-r0"})
        b = InstanceInfo("decode", "decode-0", "10.0.0.2:50071")
        pa = InstancePresence(state, a, ttl_s=1.0, heartbeat_s=0.2, load=lambda: {"num_requests_running": 3})
        pb = InstancePresence(state, b, ttl_s=1.0, heartbeat_s=0.2)
        await pa.start()
        await pb.start()
        assert {i.instance_id: i for i in await state.instances()} == {"prefill-0": a, "decode-0": b}
        assert [i.instance_id for i in await state.instances("decode")] == ["decode-0"]
        await asyncio.sleep(1.5)  # > ttl: only heartbeats keep them alive
        assert len(await state.instances()) == 2
        assert (await state.loads(["prefill-0"]))["prefill-0"] == {"num_requests_running": 3.0}
        await pb.stop(deregister=False)  # a crash: no deregistration, the TTL must clean up
        await _until(lambda: _ids(state, {"prefill-0"}), 30.0, "decode-0 to expire")
        assert await state.redis.zrange(INSTANCES, 0, -1) == ["prefill-0"]  # index pruned
        await pa.stop()
        assert await state.instances() == []
        await state.close()

    asyncio.run(main())


async def _ids(state: RedisState, expected: set[str]) -> bool:
    return {i.instance_id for i in await state.instances()} == expected


def test_longest_prefix_lookup(redis_url):
    async def main():
        state = RedisState(redis_url)
        h = _hashes(1200)
        for info in (InstanceInfo("prefill", "p0", "a:1"), InstanceInfo("kvstore", "kv0", "b:1"),
                     InstanceInfo("prefill", "dead", "c:1")):
            await state.register(info, ttl_s=30)
        await state.add_blocks("p0", h[:5], ttl_s=30)
        await state.add_blocks("kv0", h[:3] + h[4:1100], ttl_s=30)  # a gap at block 3
        await state.add_blocks("dead", h, ttl_s=30)
        await state.redis.delete("pdserve:instance:dead")  # its registration expired
        assert await state.lookup_prefix(h[:6]) == {"p0": 5, "kv0": 3}
        assert await state.lookup_prefix(h[:6], role="kvstore") == {"kv0": 3}
        assert await state.lookup_prefix(h[1:]) == {"p0": 4, "kv0": 2}  # not a prefix of theirs
        assert await state.lookup_prefix(_hashes(3, tag=9)) == {}
        # a run longer than one pipeline chunk (512)
        await state.add_blocks("kv0", h[3:4], ttl_s=30)
        assert await state.lookup_prefix(h, role="kvstore") == {"kv0": 1100}
        await state.remove_blocks("kv0", h[700:701])
        assert await state.lookup_prefix(h, instance_ids=["kv0"]) == {"kv0": 700}
        assert await state.redis.pttl(f"pdserve:block:{h[0].hex()}") > 25_000
        await state.close()

    asyncio.run(main())


def test_kv_events(redis_url):
    async def main():
        state = RedisState(redis_url)
        events: list[KVEvent] = []

        async def listen():
            async for ev in state.events():
                events.append(ev)

        listening = await _subscribers(state)
        task = asyncio.create_task(listen())
        await _until(lambda: _is(_subscribers(state), listening + 1), 30.0, "the listener's subscription")
        info = InstanceInfo("kvstore", "kv1", "x:1")
        await state.register(info, ttl_s=10)
        h = _hashes(3)
        await state.add_blocks("kv1", h, ttl_s=10)
        await state.remove_blocks("kv1", h[2:])
        await state.deregister("kv1", h[:2])
        await _until(lambda: _async(len(events) >= 3), 30.0, "three events")
        assert events == [KVEvent("kv1", "stored", tuple(h)), KVEvent("kv1", "removed", (h[2],)),
                          KVEvent("kv1", "cleared")]
        assert await state.holders(h[0]) == set()  # deregistration emptied the index
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await state.close()

    asyncio.run(main())


async def _async(value):
    return value


async def _is(coro, expected) -> bool:
    return await coro == expected


async def _subscribers(state: RedisState) -> int:
    """Clients subscribed to the KV event channel (a listener's subscription is live once this counts it)."""
    return dict(await state.redis.pubsub_numsub(KV_EVENTS)).get(KV_EVENTS, 0)


def test_republish_after_redis_restart():
    with pinned():
        server = RedisServer.start(die_with_parent=True)
    port = int(server.url.rsplit(":", 1)[1].split("/")[0])
    try:
        async def main():
            nonlocal server
            state = RedisState(server.url, socket_timeout=0.5)
            held = _hashes(4, tag=3)
            info = InstanceInfo("kvstore", "kv-r", "y:1")
            presence = InstancePresence(state, info, ttl_s=2.0, heartbeat_s=0.1, held_blocks=lambda: held)
            await presence.start()
            events: list[KVEvent] = []

            async def listen():
                async for ev in RedisState(server.url, socket_timeout=0.5).events(retry_s=0.1):
                    events.append(ev)

            listener = asyncio.create_task(listen())
            assert await state.lookup_prefix(held) == {"kv-r": 4}
            server.stop()  # everything in Redis is lost (no snapshot, no AOF)
            await asyncio.sleep(0.5)  # heartbeats fail meanwhile and are retried
            with pinned():
                server = RedisServer.start(port, die_with_parent=True)
            await _until(lambda: _lookup_is(state, held, {"kv-r": 4}), 60.0, "re-publication")
            # the lookup can see the re-added blocks before the heartbeat task resumes to count its re-publication
            await _until(lambda: _async(presence.num_republished >= 1), 30.0, "the re-publication counted")
            assert presence.num_republished >= 1
            assert [i.instance_id for i in await state.instances()] == ["kv-r"]
            await _until(lambda: _async(any(e.kind == "resync" for e in events)), 60.0, "event resync")
            listener.cancel()
            await asyncio.gather(listener, return_exceptions=True)
            await presence.stop()
            await state.close()

        asyncio.run(main())
    finally:
        server.stop()


async def _lookup_is(state: RedisState, hashes, expected) -> bool:
    try:
        return await state.lookup_prefix(hashes) == expected
    except Exception:  # noqa: BLE001 - polled until true: a failed lookup is just "not yet"
        return False


def test_a_redis_that_cannot_bind_its_port_is_never_reported_as_started(redis_server):
    """Started on a port another redis-server already holds, ours fails to bind while the other answers PING: the
    start must fail (PortTaken) instead of handing out the other server as this one, which a caller would then
    stop, pause or flush as its own. An auto-chosen port moves on to another."""
    from services.cluster.redis_server import PortTaken, _server_pid

    taken = int(redis_server.url.rsplit(":", 1)[1].split("/")[0])
    with pytest.raises(PortTaken, match="another redis-server"):
        RedisServer.start(taken, die_with_parent=True)
    assert _server_pid(redis_server.url) == redis_server.pid  # the other one is untouched
    own = RedisServer.start(die_with_parent=True)
    try:
        assert own.url != redis_server.url and _server_pid(own.url) == own.pid
    finally:
        own.stop()
