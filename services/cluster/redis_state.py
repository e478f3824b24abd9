"""pdserve's shared state in Redis: instance registry, load, prefix-block index, KV events.

Key schema (all under `pdserve:`; hashes appear as 32 hex chars):

    pdserve:instance:<id>   hash   role, instance_id, grpc_address, metrics_address, capacity (json),
                                   extra (json)                                   TTL ttl_s
    pdserve:load:<id>       hash   per-instance load figures (floats)             TTL ttl_s
    pdserve:instances       zset   id -> last heartbeat (unix s); an index only, pruned lazily
    pdserve:block:<hash>    set    ids of the instances holding that block       TTL block_ttl_s
    pdserve:kv_events       pub/sub channel of KVEvent JSON
    pdserve:response:<id>   string a response the router stored for the Responses API (JSON)  TTL
                                   (services/router/responses_api/store.py)

Apart from those stored responses (lost with Redis, by design: the client is told 404), Redis holds
nothing that the instances cannot rebuild: `InstancePresence` heartbeats an instance
(`EXPIRE` of its key) and, when the key is gone (Redis restarted, flushed, or the instance stalled
past its TTL), re-registers it and re-adds every block it holds. Readers treat an instance as alive
only while its key exists, so a crashed instance's block entries are ignored and then expire.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Sequence
from dataclasses import asdict, dataclass, field

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

log = logging.getLogger(__name__)

PREFIX = "pdserve:"
INSTANCES = PREFIX + "instances"
KV_EVENTS = PREFIX + "kv_events"
ROLES = ("router", "prefill", "decode", "kvstore")
EVENT_KINDS = ("stored", "removed", "cleared", "resync")
_CHUNK = 512  # hashes per pipeline round trip / per event message


def instance_key(instance_id: str) -> str:
    return f"{PREFIX}instance:{instance_id}"


def load_key(instance_id: str) -> str:
    return f"{PREFIX}load:{instance_id}"


def block_key(block_hash: bytes) -> str:
    return f"{PREFIX}block:{block_hash.hex()}"


@dataclass(frozen=True)
class InstanceInfo:
    role: str
    instance_id: str
    grpc_address: str
    metrics_address: str = ""
    capacity: dict[str, float] = field(default_factory=dict)  # e.g. num_blocks, max_num_seqs
    extra: dict[str, str] = field(default_factory=dict)  # e.g. dp_rank, nixl agent name

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not self.instance_id or ":" in self.instance_id:
            raise ValueError(f"instance_id must be non-empty without ':', got {self.instance_id!r}")

    def to_hash(self) -> dict[str, str]:
        d = asdict(self)
        return {**d, "capacity": json.dumps(d["capacity"]), "extra": json.dumps(d["extra"])}

    @classmethod
    def from_hash(cls, h: dict[str, str]) -> InstanceInfo:
        return cls(role=h["role"], instance_id=h["instance_id"], grpc_address=h["grpc_address"],
                   metrics_address=h.get("metrics_address", ""), capacity=json.loads(h.get("capacity", "{}")),
                   extra=json.loads(h.get("extra", "{}")))


@dataclass(frozen=True)
class KVEvent:
    """Blocks stored at / removed from an instance; `cleared` = all its blocks are gone;
    `resync` (local only) = the subscription was re-established and events may have been lost."""

    instance_id: str
    kind: str
    block_hashes: tuple[bytes, ...] = ()

    def to_json(self) -> str:
        return json.dumps({"instance_id": self.instance_id, "kind": self.kind,
                           "block_hashes": [h.hex() for h in self.block_hashes]})

    @classmethod
    def from_json(cls, raw: str | bytes) -> KVEvent:
        d = json.loads(raw)
        if d.get("kind") not in EVENT_KINDS:
            raise ValueError(f"unknown KV event kind {d.get('kind')!r}")
        return cls(d["instance_id"], d["kind"], tuple(bytes.fromhex(h) for h in d.get("block_hashes", ())))


class RedisState:
    """Typed access to the key schema above (one connection pool per process)."""

    def __init__(self, url: str, *, socket_timeout: float = 2.0, max_connections: int = 64):
        self.url = url
        # A blocking pool: with hundreds of requests in flight, a call waits for a free connection
        # (up to socket_timeout) instead of failing at once with "Too many connections", which every
        # caller would take for Redis being down.
        pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=socket_timeout,
                                                        decode_responses=True, socket_timeout=socket_timeout,
                                                        socket_connect_timeout=socket_timeout)
        self.redis = aioredis.Redis.from_pool(pool)

    async def ping(self) -> bool:
        try:
            return bool(await self.redis.ping())
        except (RedisError, OSError):
            return False

    async def close(self) -> None:
        await self.redis.aclose()

    # ---- registry ------------------------------------------------------------------------------
    async def register(self, info: InstanceInfo, ttl_s: float, load: dict[str, float] | None = None) -> None:
        pipe = self.redis.pipeline(transaction=True)
        key = instance_key(info.instance_id)
        pipe.delete(key)
        pipe.hset(key, mapping=info.to_hash())
        pipe.pexpire(key, int(ttl_s * 1000))
        pipe.zadd(INSTANCES, {info.instance_id: time.time()})
        _set_load(pipe, info.instance_id, load or {}, ttl_s)
        await pipe.execute()

    async def refresh(self, instance_id: str, ttl_s: float, load: dict[str, float] | None = None) -> bool:
        """Extend the instance's TTL and write its load; False when its key is gone (re-register)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.pexpire(instance_key(instance_id), int(ttl_s * 1000))
        pipe.zadd(INSTANCES, {instance_id: time.time()})
        _set_load(pipe, instance_id, load or {}, ttl_s)
        return bool((await pipe.execute())[0])

    async def deregister(self, instance_id: str, held_blocks: Iterable[bytes] = ()) -> None:
        await self.remove_blocks(instance_id, list(held_blocks), publish=False)
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(instance_key(instance_id), load_key(instance_id))
        pipe.zrem(INSTANCES, instance_id)
        pipe.publish(KV_EVENTS, KVEvent(instance_id, "cleared").to_json())
        await pipe.execute()

    async def instances(self, role: str | None = None) -> list[InstanceInfo]:
        """Live instances (key present), optionally of one role; prunes dead ids from the index."""
        ids = await self.redis.zrange(INSTANCES, 0, -1)
        pipe = self.redis.pipeline(transaction=False)
        for i in ids:
            pipe.hgetall(instance_key(i))
        found = await pipe.execute() if ids else []
        dead = [i for i, h in zip(ids, found) if not h]
        if dead:
            await self.redis.zrem(INSTANCES, *dead)
        infos = [InstanceInfo.from_hash(h) for h in found if h]
        return [i for i in infos if role is None or i.role == role]

    async def loads(self, instance_ids: Sequence[str]) -> dict[str, dict[str, float]]:
        pipe = self.redis.pipeline(transaction=False)
        for i in instance_ids:
            pipe.hgetall(load_key(i))
        found = await pipe.execute() if instance_ids else []
        return {i: {k: float(v) for k, v in h.items()} for i, h in zip(instance_ids, found)}

    # ---- block index ---------------------------------------------------------------------------
    async def add_blocks(self, instance_id: str, hashes: Sequence[bytes], ttl_s: float, *,
                         publish: bool = True) -> None:
        for chunk in _chunks(hashes):
            pipe = self.redis.pipeline(transaction=False)
            for h in chunk:
                pipe.sadd(block_key(h), instance_id)
                pipe.pexpire(block_key(h), int(ttl_s * 1000))
            if publish:
                pipe.publish(KV_EVENTS, KVEvent(instance_id, "stored", tuple(chunk)).to_json())
            await pipe.execute()

    async def remove_blocks(self, instance_id: str, hashes: Sequence[bytes], *, publish: bool = True) -> None:
        for chunk in _chunks(hashes):
            pipe = self.redis.pipeline(transaction=False)
            for h in chunk:
                pipe.srem(block_key(h), instance_id)
            if publish:
                pipe.publish(KV_EVENTS, KVEvent(instance_id, "removed", tuple(chunk)).to_json())
            await pipe.execute()

    async def holders(self, block_hash: bytes) -> set[str]:
        return set(await self.redis.smembers(block_key(block_hash)))

    async def lookup_prefix(self, hashes: Sequence[bytes], *, role: str | None = None,
                            instance_ids: Collection[str] | None = None) -> dict[str, int]:
        """Longest cached prefix, in blocks, per live instance (of `role`, or among `instance_ids`).

        Instances holding no leading block are absent. One pipelined round trip per 512 hashes,
        stopping at the first chunk where no candidate still has an unbroken run."""
        if instance_ids is None:
            instance_ids = [i.instance_id for i in await self.instances(role)]
        active, runs = set(instance_ids), dict.fromkeys(instance_ids, 0)
        for chunk in _chunks(hashes):
            if not active:
                break
            pipe = self.redis.pipeline(transaction=False)
            for h in chunk:
                pipe.smembers(block_key(h))
            for holders in await pipe.execute():
                active &= holders
                if not active:
                    break
                for i in active:
                    runs[i] += 1
        return {i: n for i, n in runs.items() if n}

    # ---- KV events -----------------------------------------------------------------------------
    async def publish(self, event: KVEvent) -> None:
        await self.redis.publish(KV_EVENTS, event.to_json())

    async def events(self, retry_s: float = 0.5) -> AsyncIterator[KVEvent]:
        """KV events forever; across a Redis restart yields KVEvent('', 'resync') after resubscribing
        (events were lost meanwhile: re-read the index / registry)."""
        first = True
        while True:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(KV_EVENTS)
                if not first:
                    yield KVEvent("", "resync")
                first = False
                while True:
                    msg = await pubsub.get_message(timeout=1.0)
                    if msg is not None and msg["type"] == "message":
                        yield KVEvent.from_json(msg["data"])
            except (TimeoutError, RedisConnectionError, OSError) as exc:
                log.warning("KV event subscription lost (%s); resubscribing", exc)
                first = False
                await asyncio.sleep(retry_s)
            finally:
                await pubsub.aclose()


class InstancePresence:
    """Keeps one instance registered: heartbeats, load figures, and re-publication of its state.

    `held_blocks()` returns every block hash the instance holds now; it is re-added to the index
    whenever the registration vanished (Redis restart) and every `block_ttl_s / 2` (so index
    entries of a live instance never expire). `load()` returns its current load figures."""

    def __init__(self, state: RedisState, info: InstanceInfo, *, ttl_s: float = 5.0, heartbeat_s: float = 1.0,
                 block_ttl_s: float = 600.0, held_blocks: Callable[[], Sequence[bytes]] = tuple,
                 load: Callable[[], dict[str, float]] = dict):
        if not 0 < heartbeat_s < ttl_s:
            raise ValueError(f"heartbeat_s ({heartbeat_s}) must be in (0, ttl_s={ttl_s})")
        self.state, self.info = state, info
        self.ttl_s, self.heartbeat_s, self.block_ttl_s = ttl_s, heartbeat_s, block_ttl_s
        self.held_blocks, self.load = held_blocks, load
        self.num_republished = 0
        self._last_block_refresh = 0.0
        self._published = False
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Publish now if Redis answers, else from the first heartbeat that reaches it."""
        try:
            await self.publish_all()
        except (RedisError, OSError) as exc:
            log.warning("Redis unreachable at start (%s); %s registers when it answers", exc, self.info.instance_id)
        self._task = asyncio.create_task(self._run(), name=f"presence-{self.info.instance_id}")

    async def stop(self, deregister: bool = True) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if deregister:
            try:
                await self.state.deregister(self.info.instance_id, self.held_blocks())
            except (RedisError, OSError) as exc:
                log.warning("could not deregister %s: %s", self.info.instance_id, exc)

    async def publish_all(self) -> None:
        """Register and (re-)add every held block, announcing them as stored."""
        await self.state.register(self.info, self.ttl_s, self.load())
        await self.state.add_blocks(self.info.instance_id, list(self.held_blocks()), self.block_ttl_s)
        self._last_block_refresh = time.monotonic()
        self._published = True

    async def beat(self) -> None:
        if not self._published:
            await self.publish_all()
        elif not await self.state.refresh(self.info.instance_id, self.ttl_s, self.load()):
            log.warning("registration of %s vanished from Redis; re-publishing", self.info.instance_id)
            await self.publish_all()
            self.num_republished += 1
        elif time.monotonic() - self._last_block_refresh > self.block_ttl_s / 2:
            await self.state.add_blocks(self.info.instance_id, list(self.held_blocks()), self.block_ttl_s,
                                        publish=False)
            self._last_block_refresh = time.monotonic()

    async def _run(self) -> None:
        failing = False
        while True:
            await asyncio.sleep(self.heartbeat_s)
            try:
                await self.beat()
            except (RedisError, OSError) as exc:  # Redis down: keep trying; beat() re-publishes when back
                if not failing:
                    log.warning("heartbeats of %s failing: %s", self.info.instance_id, exc)
                failing = True
            else:
                if failing:
                    log.info("heartbeats of %s reach Redis again", self.info.instance_id)
                failing = False


def registered_instances(redis_url: str, role: str | None = None) -> list[InstanceInfo]:
    """The instances registered in Redis now, from synchronous code (benchmarks, scripts): one connection."""
    async def read() -> list[InstanceInfo]:
        state = RedisState(redis_url)
        try:
            return await state.instances(role)
        finally:
            await state.close()

    return asyncio.run(read())


def _set_load(pipe, instance_id: str, load: dict[str, float], ttl_s: float) -> None:
    if load:
        pipe.hset(load_key(instance_id), mapping={k: repr(float(v)) for k, v in load.items()})
        pipe.pexpire(load_key(instance_id), int(ttl_s * 1000))


def _chunks(seq: Sequence[bytes]) -> Iterable[Sequence[bytes]]:
    for start in range(0, len(seq), _CHUNK):
        yield seq[start:start + _CHUNK]
