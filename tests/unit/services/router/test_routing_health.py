"""Routing under failures: an instance that failed a call is never chosen until its gRPC health passes
again; with Redis down the last known instances are kept and checked by health instead."""

from __future__ import annotations

import asyncio

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from engine.parallel.dist import free_port
from services.cluster.redis_state import InstanceInfo
from services.router import routing as routing_mod
from services.router.routing import NoInstance, Routing
from services.rpc.grpc_server import GrpcServer


class _State:
    def __init__(self, infos: list[InstanceInfo]):
        self.infos, self.down = infos, False

    async def instances(self):
        if self.down:
            raise RedisConnectionError("Redis is down")
        return list(self.infos)

    async def loads(self, ids):
        return {}

    async def lookup_prefix(self, hashes, instance_ids=None):
        return {}


async def _serving() -> tuple[GrpcServer, str]:
    server = GrpcServer(0, "127.0.0.1")
    port = await server.start()
    await server.set_serving(True)
    return server, f"127.0.0.1:{port}"


async def _until(cond, timeout: float = 60.0) -> bool:
    """Poll `cond` until true; the deadline is generous (it bounds how long a failure takes to report)."""
    for _ in range(int(timeout / 0.02)):
        if cond():
            return True
        await asyncio.sleep(0.02)
    return cond()


def _count_health_checks(monkeypatch) -> list[tuple[str, bool]]:
    """(address, answer) of every health check the routing makes, as they complete."""
    checks: list[tuple[str, bool]] = []
    real = routing_mod.check_health

    async def counted(address, *args, **kwargs):
        ok = await real(address, *args, **kwargs)
        checks.append((address, ok))
        return ok
    monkeypatch.setattr(routing_mod, "check_health", counted)
    return checks


def test_failed_instance_is_skipped_until_its_health_passes(monkeypatch):
    checks = _count_health_checks(monkeypatch)

    async def run():
        server, address = await _serving()
        await server.set_serving(False)  # e.g. restarting
        dec = InstanceInfo("decode", "decode-0", address)
        routing = Routing(_State([dec]), refresh_s=0.05)
        try:
            assert (await routing.pick_decode()).instance_id == "decode-0"
            await routing.require("decode")
            routing.mark_unhealthy(dec)  # a call to it just failed at the transport level
            with pytest.raises(NoInstance, match="unhealthy"):
                await routing.pick_decode()
            with pytest.raises(NoInstance, match="unhealthy"):  # what the flow checks before any prefill work
                await routing.require("decode")
            # three health checks answered NOT_SERVING (not a length of time: a slow machine makes fewer)
            assert await _until(lambda: sum(a == address and not ok for a, ok in checks) >= 3)
            assert "decode-0" in routing.unhealthy, "re-admitted while its health says NOT_SERVING"
            await server.set_serving(True)
            assert await _until(lambda: "decode-0" not in routing.unhealthy)
            assert (await routing.pick_decode()).instance_id == "decode-0"
        finally:
            await routing.close()
            await server.stop(0)
    asyncio.run(run())


def test_redis_down_keeps_known_instances_and_checks_them_by_health():
    async def run():
        server, address = await _serving()
        alive = InstanceInfo("prefill", "prefill-0", address)
        dead = InstanceInfo("prefill", "prefill-1", f"127.0.0.1:{free_port()}")  # nothing listens there
        state = _State([alive, dead])
        routing = Routing(state, refresh_s=0.05)
        try:
            await routing.pick_prefill([], 10)
            state.down = True
            assert await _until(lambda: not routing.redis_ok)
            assert await _until(lambda: "prefill-1" in routing.unhealthy), "a dead instance was not found by health"
            picks = {(await routing.pick_prefill([b"h" * 16], 10)).instance.instance_id for _ in range(20)}
            assert picks == {"prefill-0"}
            state.down, state.infos = False, []  # Redis restarted empty: the instances re-register soon
            assert await _until(lambda: routing.redis_ok)
            assert (await routing.pick_prefill([], 10)).instance.instance_id == "prefill-0"
        finally:
            await routing.close()
            await server.stop(0)
    asyncio.run(run())
