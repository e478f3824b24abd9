"""Leases on exported KV: a finished prefill's blocks stay pinned until decode pulled them, the lease
expired, and any offload to the kvstore that reads them has finished (whichever order).

Page generations: every engine block id has a counter that moves on each time a lease gives the block
back to the engine (after which it may be reused for another request). A block that other live leases
still hold (a prefix-cache hit shared by requests prefilled together) cannot be reused yet: its counter
moves when the last of them goes, so one request's release never fails another's confirm. The KV handle carries the
generations at export; a puller confirms after its one-sided READ (`confirm`) that the lease was still
live and every page still had its generation -- otherwise the bytes it copied may belong to another
request, and it must recompute instead of decoding from them.

    grant ─ export(gens g) ─ decode READ ─ confirm(g) ─▶ intact: release, gens g+1
                 └─ lease expires ─▶ release, gens g+1 ─ (page reused) ─ confirm(g) ─▶ not intact

A release is two things: the table's (the lease gone, the pages' generations moved on) and the engine's (its
held blocks back in its pool, an engine call that runs between two of its steps). `confirm` and `pulled` with
`wait=False` (the ReleaseKV RPC) do the table's at once and leave the engine's to run on its own: the puller has its
copy and its answer, and need not wait for the prefill's step in progress (a prefill step under load, on a decode's
KV handoff path). No page can be reused before the engine's release, which follows the generations' move.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass
class Lease:
    lease_id: str
    req_id: str
    expires: float  # monotonic
    pulled: bool = False
    expired: bool = False
    readers: set = field(default_factory=set)  # tasks still reading the blocks (kvstore offload)
    block_ids: tuple[int, ...] = ()
    generations: tuple[int, ...] = ()  # of block_ids, at grant


class PageGenerations:
    """block id -> how many times a lease gave it back to the engine (ints only, no tensors)."""

    def __init__(self):
        self._gen: dict[int, int] = {}

    def of(self, block_ids) -> tuple[int, ...]:
        return tuple(self._gen.get(b, 0) for b in block_ids)

    def bump(self, block_ids) -> None:
        for b in block_ids:
            self._gen[b] = self._gen.get(b, 0) + 1


class LeaseTable:
    def __init__(self, release: Callable[[str], Awaitable[None]], default_s: float, max_s: float,
                 on_expired: Callable[[], None] = lambda: None):
        self._release = release
        self.default_s, self.max_s = default_s, max_s
        self._on_expired = on_expired
        self.leases: dict[str, Lease] = {}
        self._holders: Counter[int] = Counter()  # block id -> live leases holding it
        self.generations = PageGenerations()
        self._task: asyncio.Task | None = None
        self._releasing: set[asyncio.Task] = set()  # the engine's releases left to run on their own (wait=False)

    def grant(self, req_id: str, lease_s: float | None = None, block_ids=()) -> Lease:
        s = self.default_s if not lease_s else min(lease_s, self.max_s)
        lease = Lease(lease_id=secrets.token_hex(8), req_id=req_id, expires=time.monotonic() + s,
                      block_ids=tuple(block_ids), generations=self.generations.of(block_ids))
        self.leases[lease.lease_id] = lease
        self._holders.update(lease.block_ids)
        return lease

    async def confirm(self, lease_id: str, generations, *, wait: bool = True) -> bool:
        """A puller finished its READ: True when what it copied is this lease's KV (lease live, every
        page at the generation the handle gave). The lease is released either way (`wait`: see `pulled`)."""
        lease = self.leases.get(lease_id)
        intact = (lease is not None and not lease.expired
                  and self.generations.of(lease.block_ids) == tuple(generations) == lease.generations)
        if lease is not None:
            await self.pulled(lease_id, wait=wait)
        return intact

    def renew(self, lease_id: str, extend_s: float) -> Lease | None:
        lease = self.leases.get(lease_id)
        if lease is None or lease.expired:
            return None
        lease.expires = min(time.monotonic() + (extend_s or self.default_s), time.monotonic() + self.max_s)
        return lease

    def add_reader(self, lease: Lease, task: asyncio.Task) -> None:
        lease.readers.add(task)
        task.add_done_callback(lambda t: self._reader_done(lease, t))

    async def pulled(self, lease_id: str, *, wait: bool = True) -> bool:
        """The lease's KV is no longer needed by its puller: released once no reader holds it. `wait` False: the
        table's part now, the engine's left to run on its own (it waits for the engine's step in progress)."""
        lease = self.leases.get(lease_id)
        if lease is None or lease.expired:
            return False
        lease.pulled = True
        await self._maybe_release(lease, wait=wait)
        return True

    def by_request(self, req_id: str) -> Lease | None:
        return next((l for l in self.leases.values() if l.req_id == req_id), None)

    def _reader_done(self, lease: Lease, task: asyncio.Task) -> None:
        lease.readers.discard(task)
        if lease.pulled or lease.expired:
            asyncio.get_running_loop().create_task(self._maybe_release(lease))

    async def _maybe_release(self, lease: Lease, wait: bool = True) -> None:
        if lease.readers or lease.lease_id not in self.leases:
            return
        del self.leases[lease.lease_id]
        self._holders.subtract(lease.block_ids)
        freed = [b for b in lease.block_ids if self._holders[b] <= 0]
        for b in freed:
            del self._holders[b]
        # before the engine may hand the pages to anyone else; a page another lease holds stays where it is
        self.generations.bump(freed)
        if wait:
            await self._release(lease.req_id)
            return
        task = asyncio.get_running_loop().create_task(self._release(lease.req_id))
        self._releasing.add(task)
        task.add_done_callback(self._released)

    def _released(self, task: asyncio.Task) -> None:
        self._releasing.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("releasing KV blocks in the engine failed: %r", task.exception())

    # ---- expiry ----------------------------------------------------------------------------------
    def start(self, period_s: float = 0.1) -> None:
        self._task = asyncio.get_running_loop().create_task(self._expire_loop(period_s))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        await asyncio.gather(*self._releasing, return_exceptions=True)  # the engine's releases still running

    async def _expire_loop(self, period_s: float) -> None:
        while True:
            await asyncio.sleep(period_s)
            now = time.monotonic()
            for lease in [l for l in self.leases.values() if not l.expired and not l.pulled and l.expires <= now]:
                lease.expired = True
                self._on_expired()
                log.warning("KV lease %s of %s expired before decode pulled it; freeing its blocks",
                            lease.lease_id, lease.req_id)
                await self._maybe_release(lease)
