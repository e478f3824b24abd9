"""Prefill KV leases and page generations: a puller's copy is confirmed only while the lease is live and
every page still has the generation the handle gave; expiry and reuse are caught, releases happen once."""

from __future__ import annotations

import asyncio

from services.prefill.leases import LeaseTable
from tests.helpers.pace import until


class _Engine:
    """Stands in for the engine's `release_held`: records which requests gave their blocks back."""

    def __init__(self):
        self.released: list[str] = []

    async def release(self, req_id: str) -> None:
        self.released.append(req_id)


def _table(engine: _Engine, default_s: float = 30.0) -> LeaseTable:
    return LeaseTable(engine.release, default_s=default_s, max_s=60.0)


def test_confirm_of_a_live_lease_is_intact_and_releases_once():
    async def run():
        engine = _Engine()
        t = _table(engine)
        lease = t.grant("r1", block_ids=[4, 5, 6])
        assert lease.generations == (0, 0, 0)
        assert await t.confirm(lease.lease_id, lease.generations)
        assert engine.released == ["r1"]
        assert t.generations.of([4, 5, 6]) == (1, 1, 1)  # the pages moved on when given back
        assert not await t.confirm(lease.lease_id, lease.generations)  # a second confirm: gone
        assert engine.released == ["r1"]
    asyncio.run(run())


def test_expired_lease_whose_pages_were_reused_is_not_intact():
    async def run():
        engine = _Engine()
        t = _table(engine, default_s=0.05)
        t.start(period_s=0.01)
        old = t.grant("r1", block_ids=[7, 8])
        await until(lambda: engine.released, "the lease to expire")  # the blocks go back to the engine
        assert engine.released == ["r1"] and not t.leases
        new = t.grant("r2", block_ids=[8, 9])  # block 8 reused by another request
        assert new.generations == (1, 0)
        # the slow puller of r1 finishes its READ now: what it copied of block 8 may be r2's
        assert not await t.confirm(old.lease_id, old.generations)
        assert await t.confirm(new.lease_id, new.generations)
        await t.stop()
    asyncio.run(run())


def test_stale_generations_are_refused_even_on_a_live_lease():
    async def run():
        engine = _Engine()
        t = _table(engine)
        first = t.grant("r1", block_ids=[3])
        await t.pulled(first.lease_id)
        second = t.grant("r2", block_ids=[3])
        assert not await t.confirm(second.lease_id, first.generations)  # a handle from before the reuse
        assert engine.released == ["r1", "r2"]  # refused, but the lease is still released (no leak)
    asyncio.run(run())


def test_expiry_waits_for_readers_and_confirm_after_expiry_fails():
    async def run():
        engine = _Engine()
        t = _table(engine, default_s=0.05)
        t.start(period_s=0.01)
        lease = t.grant("r1", block_ids=[1])
        gate = asyncio.Event()
        reader = asyncio.get_running_loop().create_task(gate.wait())  # e.g. the kvstore offload
        t.add_reader(lease, reader)
        # the sweep that marks it expired decides its release in the same step: seen expired, it was decided
        await until(lambda: lease.expired, "the lease to expire")
        assert engine.released == []  # still read by the offload: not freed yet
        assert not await t.confirm(lease.lease_id, lease.generations)
        gate.set()
        await until(lambda: engine.released, "the release once the reader finished")
        assert engine.released == ["r1"]
        await t.stop()
    asyncio.run(run())


def test_a_block_shared_by_live_leases_moves_on_only_with_the_last():
    """Requests prefilled together share their prefix-cache hits: releasing one lease must not fail the
    confirm of another that still holds the shared page; the page moves on when the last lets it go."""
    async def run():
        engine = _Engine()
        t = _table(engine)
        a = t.grant("a", block_ids=[1, 2])
        b = t.grant("b", block_ids=[1, 3])  # block 1: the shared system prompt
        assert await t.confirm(a.lease_id, a.generations)
        assert t.generations.of([1, 2, 3]) == (0, 1, 0)  # b still holds block 1
        assert await t.confirm(b.lease_id, b.generations), "a's release must not fail b's confirm"
        assert t.generations.of([1, 2, 3]) == (1, 1, 1)
        c = t.grant("c", block_ids=[1])  # reused once free: c's READ sees the new generation
        assert c.generations == (1,) and engine.released == ["a", "b"]
    asyncio.run(run())


def test_a_puller_is_answered_without_waiting_for_the_engines_release():
    """wait=False (the ReleaseKV RPC): the table decides and releases at once (lease gone, generations moved on),
    and the engine's release, which waits for the engine's step in progress, runs on its own; a second confirm
    finds the lease gone; stop() lets the pending release finish."""
    async def run():
        gate, released = asyncio.Event(), []

        async def slow_release(req_id: str) -> None:  # the engine mid-step: its call runs at the step's end
            await gate.wait()
            released.append(req_id)

        t = LeaseTable(slow_release, default_s=30.0, max_s=60.0)
        lease = t.grant("r1", block_ids=[4, 5])
        assert await asyncio.wait_for(t.confirm(lease.lease_id, lease.generations, wait=False), timeout=5)
        assert not t.leases and t.generations.of([4, 5]) == (1, 1) and released == []
        assert not await t.confirm(lease.lease_id, lease.generations, wait=False)
        other = t.grant("r2", block_ids=[6])
        assert await asyncio.wait_for(t.pulled(other.lease_id, wait=False), timeout=5)
        gate.set()
        await t.stop()
        assert sorted(released) == ["r1", "r2"]  # each once
    asyncio.run(run())
