"""The rank watch of multi-rank engines (PCP prefill, DP decode groups): a dead rank (the ping fails), a hung
rank (no ping completes within the hang timeout) and a healthy busy engine (pings complete, if late) are
told apart."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from services.rank_watch import wait_for_engine_death


class FakeEngine:
    def __init__(self, ping):
        self.config = SimpleNamespace(parallel=SimpleNamespace(world_size=2))
        self.is_running = True
        self.ping = ping

    async def call(self, fn):
        return await self.ping()


def run(coro):
    return asyncio.run(coro)


def test_a_hung_rank_is_reported_after_the_hang_timeout():
    async def never():
        await asyncio.sleep(3600)

    async def go():
        t0 = asyncio.get_running_loop().time()
        death = await wait_for_engine_death(FakeEngine(never), period_s=0.01, hang_timeout_s=0.3)
        return death, asyncio.get_running_loop().time() - t0
    death, waited = run(go())
    assert death.hung and "hangs" in death.reason and 0.3 <= waited < 5.0


def test_a_dead_rank_is_reported_at_once():
    async def fail():
        raise RuntimeError("Connection closed by peer")
    death = run(wait_for_engine_death(FakeEngine(fail), period_s=0.01, hang_timeout_s=5))
    assert not death.hung and "gone" in death.reason and "Connection closed" in death.reason


def test_slow_but_completing_pings_are_healthy():
    async def slow():
        await asyncio.sleep(0.05)  # a step in progress delays the ping, well within the hang timeout

    async def go():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(wait_for_engine_death(FakeEngine(slow), period_s=0.01, hang_timeout_s=2.0), 1.0)
    run(go())


def test_a_cancellation_as_a_ping_completes_ends_the_watch():
    """The service cancels the watch when it stops. A ping completing in the same loop iteration must not
    swallow that cancellation (a nested asyncio.wait_for does, under Python 3.11: the watch then runs forever
    and the service's shutdown waits for it)."""
    async def go():
        pings: list[asyncio.Future] = []

        async def ping():
            pings.append(asyncio.get_running_loop().create_future())
            await pings[-1]

        watch = asyncio.create_task(wait_for_engine_death(FakeEngine(ping), period_s=0.001, hang_timeout_s=5))
        while not pings:
            await asyncio.sleep(0)
        pings[-1].set_result(None)  # the ping's completion is queued before the cancellation below
        watch.cancel()
        done, _ = await asyncio.wait([watch], timeout=2.0)
        assert watch in done, "the watch outlived its cancellation"
        assert watch.cancelled()
    run(go())


def test_a_stopped_loop_is_reported():
    eng = FakeEngine(None)
    eng.is_running = False
    death = run(wait_for_engine_death(eng, period_s=0.01, hang_timeout_s=0))
    assert not death.hung and death.reason == "the engine loop stopped"


def test_the_hang_timeout_comes_from_the_environment(monkeypatch):
    from engine import settings
    monkeypatch.setenv("PDSERVE_RANK_HANG_TIMEOUT_S", "7.5")
    assert settings.rank_hang_timeout_s() == 7.5
    monkeypatch.setenv("PDSERVE_RANK_HANG_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="must be a number"):
        settings.rank_hang_timeout_s()
