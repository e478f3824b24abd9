"""Choosing instances: the prefill instance that minimises the work ahead of this prompt (tokens it
must compute given its cached prefix, plus tokens already queued there), and the least-loaded decode.

Instances and load figures come from Redis, re-read by a background task every `refresh_s` (so
Redis latency never sits on a request's path). When Redis is unreachable the last known instances are
used with load-only scoring, and the same task checks each of them by gRPC health instead, so routing
degrades instead of failing.

An instance whose call failed at the transport level (connection refused or reset, no reply before a
deadline) is marked unhealthy at once -- not after its Redis TTL -- and never chosen while marked; the
task re-admits it when its gRPC health answers SERVING again (restarted, resumed, re-registered).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field

from redis.exceptions import RedisError

from services.cluster.redis_state import InstanceInfo, RedisState
from services.rpc.grpc_server import check_health

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
    def __init__(self, state: RedisState, *, refresh_s: float = 0.5, block_size: int = 64,
                 health_timeout_s: float = 0.5, republish_grace_s: float = 5.0):
        self.state = state
        self.refresh_s, self.block_size, self.health_timeout_s = refresh_s, block_size, health_timeout_s
        self.republish_grace_s = republish_grace_s  # the instances' registration TTL: all re-publish within it
        self._recovered_at = float("-inf")
        self.view = _View()
        self.redis_ok = True
        self.unhealthy: dict[str, InstanceInfo] = {}
        self._inflight: dict[str, int] = {}  # requests this router has sent and not seen finish
        self._task: asyncio.Task | None = None
        self._reading: asyncio.Future | None = None

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _ready(self) -> None:
        """The first requests read the registry themselves (sharing one read: a burst of requests must
        not each open a Redis connection); then the background task keeps it fresh."""
        if self._task is not None:
            return
        if self._reading is None or self._reading.done():
            self._reading = asyncio.ensure_future(self._refresh())
        await asyncio.shield(self._reading)  # a cancelled request must not cancel the others' read
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._watch(), name="routing-watch")

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            try:
                await self._refresh()
                await self._check_health()
            except Exception:  # the task must outlive any one bad round
                log.exception("routing refresh failed")

    async def _refresh(self) -> None:
        try:
            infos = await self.state.instances()
            loads = await self.state.loads([i.instance_id for i in infos])
        except (RedisError, OSError) as exc:
            if self.redis_ok:
                log.warning("Redis unreachable (%s): routing on the last known instances, load only", exc)
            self.redis_ok = False
            return
        if not self.redis_ok:
            log.info("Redis answers again: routing on the registry")
            self._recovered_at = time.monotonic()
        self.redis_ok = True
        if time.monotonic() - self._recovered_at < self.republish_grace_s:
            # a restarted Redis is empty until every instance's next heartbeat re-publishes it: keep the
            # instances we knew (and verified by health while it was down) meanwhile
            ids = {i.instance_id for i in infos}
            infos = infos + [i for insts in self.view.by_role.values() for i in insts if i.instance_id not in ids]
        by_role: dict[str, list[InstanceInfo]] = {}
        for i in infos:
            by_role.setdefault(i.role, []).append(i)
        self.view = _View(by_role, loads, time.monotonic())
        known = {i.instance_id for i in infos}
        for gone in [i for i in self.unhealthy if i not in known]:
            del self.unhealthy[gone]  # its registration expired; it comes back by registering

    async def _check_health(self) -> None:
        """Re-admit marked instances that answer SERVING; without Redis, also check every known one."""
        known = [i for insts in self.view.by_role.values() for i in insts if i.role != "router"]
        to_check = known if not self.redis_ok else list(self.unhealthy.values())
        results = await asyncio.gather(*[check_health(i.grpc_address, timeout=self.health_timeout_s)
                                         for i in to_check])
        for info, ok in zip(to_check, results):
            if ok and info.instance_id in self.unhealthy:
                log.info("%s answers SERVING again: routing to it", info.instance_id)
                del self.unhealthy[info.instance_id]
            elif not ok:
                self.mark_unhealthy(info)

    def has_live(self, role: str) -> bool:
        return bool(self._live(role))

    async def require(self, role: str) -> None:
        """NoInstance now when no healthy instance of `role` is left: checked before work that would be lost
        without one (a prefill whose request needs a decode)."""
        await self._ready()
        if not self._live(role):
            raise NoInstance(self._none_why(role))

    def _live(self, role: str, exclude: frozenset[str] = frozenset()) -> list[InstanceInfo]:
        return [i for i in self.view.by_role.get(role, [])
                if i.instance_id not in self.unhealthy and i.instance_id not in exclude]

    def mark_unhealthy(self, info: InstanceInfo) -> None:
        if info.instance_id not in self.unhealthy:
            log.warning("%s failed at the transport level: not routing to it until it answers health checks",
                        info.instance_id)
        self.unhealthy[info.instance_id] = info

    def started(self, instance_id: str) -> None:
        self._inflight[instance_id] = self._inflight.get(instance_id, 0) + 1

    def finished(self, instance_id: str) -> None:
        left = self._inflight.get(instance_id, 0) - 1
        if left > 0:
            self._inflight[instance_id] = left
        else:  # drop idle entries: the map never outgrows the instances with requests in flight
            self._inflight.pop(instance_id, None)

    async def pick_prefill(self, hashes: list[bytes], num_tokens: int, exclude: frozenset[str] = frozenset()) -> Choice:
        await self._ready()
        cands = self._live("prefill", exclude)
        if not cands:
            raise NoInstance(self._none_why("prefill"))
        runs: dict[str, int] = {}
        if hashes and self.redis_ok:
            ids = [i.instance_id for i in cands + self._live("kvstore")]
            try:
                runs = await self.state.lookup_prefix(hashes, instance_ids=ids)
            except (RedisError, OSError):
                self.redis_ok, runs = False, {}
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
        await self._ready()
        cands = self._live("decode", exclude)
        if not cands:
            raise NoInstance(self._none_why("decode"))

        def cost(i: InstanceInfo) -> tuple:
            load = self.view.loads.get(i.instance_id, {})
            busy = load.get("running", 0.0) + load.get("waiting", 0.0) + self._inflight.get(i.instance_id, 0)
            return (load.get("kv_usage", 0.0) > 0.95, busy, load.get("kv_usage", 0.0), random.random())

        return min(cands, key=cost)

    def _none_why(self, role: str) -> str:
        if self.view.by_role.get(role):
            return f"every {role} instance is unhealthy (failed calls or health checks); retry shortly"
        return f"no {role} instance is registered (is `pdserve up` running?)"
