"""Choosing instances: the prefill instance that minimises the work ahead of this prompt (tokens it
must compute given its cached prefix, plus tokens already queued there), and the least-loaded decode.

Instances and load figures come from Redis (refreshed at most every `refresh_s`); when Redis is
unreachable the last known instances are used with load-only scoring, so routing degrades instead of
failing. Instances that just failed a call are avoided for `avoid_s` (they re-earn trust by heartbeat).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field

from redis.exceptions import RedisError

from services.common.redis_state import InstanceInfo, RedisState

log = logging.getLogger(__name__)


@dataclass
class Choice:
    instance: InstanceInfo
    cached_blocks: int = 0  # leading prompt blocks that instance holds
    kvstore: InstanceInfo | None = None  # a kvstore holding a longer prefix
    kvstore_blocks: int = 0


@dataclass
class _View:
    by_role: dict[str, list[InstanceInfo]] = field(default_factory=dict)
    loads: dict[str, dict[str, float]] = field(default_factory=dict)
    at: float = 0.0


class NoInstance(RuntimeError):
    """No live instance of a role: the router answers 503."""


class Routing:
    def __init__(self, state: RedisState, *, refresh_s: float = 0.5, avoid_s: float = 5.0, block_size: int = 64):
        self.state = state
        self.refresh_s, self.avoid_s, self.block_size = refresh_s, avoid_s, block_size
        self.view = _View()
        self.redis_ok = True
        self._avoid: dict[str, float] = {}
        self._inflight: dict[str, int] = {}  # requests this router has sent and not seen finish
        self._reading: asyncio.Future | None = None

    async def _refresh(self) -> None:
        """Re-read the registry when the view is older than refresh_s. Concurrent callers share one
        read: a burst of requests must not each open a Redis connection (nor wait behind each other's)."""
        if time.monotonic() - self.view.at < self.refresh_s:
            return
        if self._reading is None or self._reading.done():
            self._reading = asyncio.ensure_future(self._read_registry())
        await asyncio.shield(self._reading)  # a cancelled request must not cancel the others' read

    async def _read_registry(self) -> None:
        try:
            infos = await self.state.instances()
            loads = await self.state.loads([i.instance_id for i in infos])
        except (RedisError, OSError) as exc:
            if self.redis_ok:
                log.warning("Redis unreachable (%s): routing on the last known instances, load only", exc)
            self.redis_ok = False
            self.view.at = time.monotonic()
            return
        self.redis_ok = True
        by_role: dict[str, list[InstanceInfo]] = {}
        for i in infos:
            by_role.setdefault(i.role, []).append(i)
        self.view = _View(by_role, loads, time.monotonic())

    def _live(self, role: str, exclude: frozenset[str] = frozenset()) -> list[InstanceInfo]:
        now = time.monotonic()
        self._avoid = {k: t for k, t in self._avoid.items() if t > now}  # bounded by the live instances
        found = [i for i in self.view.by_role.get(role, []) if i.instance_id not in exclude]
        ok = [i for i in found if i.instance_id not in self._avoid]
        return ok or found  # if every instance failed recently, try them anyway

    def avoid(self, instance_id: str) -> None:
        self._avoid[instance_id] = time.monotonic() + self.avoid_s
        self.view.at = 0.0  # re-read the registry on the next request

    def started(self, instance_id: str) -> None:
        self._inflight[instance_id] = self._inflight.get(instance_id, 0) + 1

    def finished(self, instance_id: str) -> None:
        left = self._inflight.get(instance_id, 0) - 1
        if left > 0:
            self._inflight[instance_id] = left
        else:  # drop idle entries: the map never outgrows the instances with requests in flight
            self._inflight.pop(instance_id, None)

    async def pick_prefill(self, hashes: list[bytes], num_tokens: int, exclude: frozenset[str] = frozenset()) -> Choice:
        await self._refresh()
        cands = self._live("prefill", exclude)
        if not cands:
            raise NoInstance("no prefill instance is registered (is `pdserve up` running?)")
        runs: dict[str, int] = {}
        if hashes and self.redis_ok:
            ids = [i.instance_id for i in cands + self._live("kvstore")]
            try:
                runs = await self.state.lookup_prefix(hashes, instance_ids=ids)
            except (RedisError, OSError):
                runs = {}
        best = min(cands, key=lambda i: (self._prefill_cost(i, runs, num_tokens), random.random()))
        choice = Choice(best, runs.get(best.instance_id, 0))
        stores = [s for s in self._live("kvstore") if runs.get(s.instance_id, 0) > choice.cached_blocks]
        if stores:
            store = max(stores, key=lambda s: runs[s.instance_id])
            choice.kvstore, choice.kvstore_blocks = store, runs[store.instance_id]
        return choice

    def _prefill_cost(self, inst: InstanceInfo, runs: dict[str, int], num_tokens: int) -> float:
        load = self.view.loads.get(inst.instance_id, {})
        cached = runs.get(inst.instance_id, 0) * self.block_size
        queued = load.get("queued_tokens", 0.0) + self._inflight.get(inst.instance_id, 0) * num_tokens * 0.5
        return max(num_tokens - cached, 1) + queued

    async def pick_decode(self, exclude: frozenset[str] = frozenset()) -> InstanceInfo:
        await self._refresh()
        cands = self._live("decode", exclude)
        if not cands:
            raise NoInstance("no decode instance is registered (is `pdserve up` running?)")

        def cost(i: InstanceInfo) -> tuple:
            load = self.view.loads.get(i.instance_id, {})
            busy = load.get("running", 0.0) + load.get("waiting", 0.0) + self._inflight.get(i.instance_id, 0)
            return (load.get("kv_usage", 0.0) > 0.95, busy, load.get("kv_usage", 0.0), random.random())

        return min(cands, key=cost)
