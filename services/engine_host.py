"""What the prefill and decode services share around their AsyncEngine: Redis presence (registry,
load figures, re-publication), mirroring the engine's prefix-cache events into the Redis block index,
and engine gauges in Prometheus.

An engine is one instance in Redis, or, for a DP group (engine/parallel/dp.py), one instance per DP rank:
each with its own registration, load figures (that rank's requests and KV pool) and held blocks (that
rank's prefix cache), so routers balance across the ranks as across independent replicas. The gauges
are the group's (one /metrics endpoint per process)."""

from __future__ import annotations

import asyncio
import logging

from redis.exceptions import RedisError

from engine.frontend.async_engine import AsyncEngine
from services.cluster.redis_state import InstanceInfo, InstancePresence, RedisState
from services.rpc.metrics import ServiceMetrics

log = logging.getLogger(__name__)


def model_info(engine: AsyncEngine) -> tuple[str, dict[str, object]]:
    """(the model's name, the KV cache's configuration) as vLLM's metrics label them (`vllm:cache_config_info`)."""
    cfg, st = engine.config, engine.stats()
    return cfg.model_path.name, {"block_size": cfg.cache.block_size, "cache_dtype": cfg.cache.kv_cache_dtype,
                                 "num_gpu_blocks": st.num_blocks,
                                 "enable_prefix_caching": cfg.cache.enable_prefix_caching}



def load_figures(st) -> dict[str, float]:
    """What an engine instance publishes for the router's placement (services/router/routing.py), from its
    EngineStats (one rank's)."""
    return {"running": st.num_running, "waiting": st.num_waiting, "kv_usage": st.kv_usage,
            "free_blocks": st.num_free_blocks, "queued_tokens": st.num_queued_tokens}

class EngineHost:
    def __init__(self, engine: AsyncEngine, info: InstanceInfo | list[InstanceInfo], state: RedisState,
                 metrics: ServiceMetrics, *, heartbeat_s: float = 1.0, instance_ttl_s: float = 5.0,
                 block_ttl_s: float = 600.0, publish_blocks: bool = True):
        """`info`: the engine's instance, or a DP group's instances (rank r's is info[r])."""
        self.infos = list(info) if isinstance(info, list) else [info]
        self.engine, self.info, self.state, self.metrics = engine, self.infos[0], state, metrics
        self.publish_blocks = publish_blocks
        self.block_ttl_s = block_ttl_s
        self.cached: list[set[bytes]] = [set() for _ in self.infos]  # per instance: its prefix-cache hashes
        self.presences = [InstancePresence(state, i, ttl_s=instance_ttl_s, heartbeat_s=heartbeat_s,
                                           block_ttl_s=block_ttl_s, held_blocks=lambda r=r: list(self.cached[r]),
                                           load=lambda r=r: self.load_figures(r))
                          for r, i in enumerate(self.infos)]
        self._tasks: list[asyncio.Task] = []
        self._stopped = False
        self._prefix_seen = (0, 0)
        self._hisparse_seen = (0, 0, 0)
        self._steps_seen = (0, 0.0)
        self._phases_seen: dict[str, float] = {}
        self._cpu_seen: dict[str, float] = {}
        self._offload_seen = (0, 0, 0, 0)
        self._count_from(engine.stats())
        engine.drain_step_times()  # the start-up warm-up's steps are not counted either

    def _count_from(self, st) -> None:
        """The service's counters start from the engine's figures now: what it did before serving (the start-up
        warm-up) is not counted."""
        self._prefix_seen = (st.prefix_queries, st.prefix_hits)
        self._steps_seen = (st.num_steps, st.step_seconds)
        self._phases_seen = dict(st.step_phase_seconds)
        self._cpu_seen = dict(st.step_phase_cpu_seconds)
        if st.hisparse is not None:
            self._hisparse_seen = (st.hisparse.hits, st.hisparse.misses, st.hisparse.h2d_bytes)
        off = st.kv_offload
        if off is not None:
            self._offload_seen = (off.queries, off.hits, off.store_bytes, off.load_bytes)

    def load_figures(self, rank: int = 0) -> dict[str, float]:
        st = self.engine.stats()  # a snapshot the engine loop took between two steps
        if len(self.infos) > 1:
            st = st.dp_ranks[rank]
        return load_figures(st)

    async def start(self) -> None:
        for presence in self.presences:
            await presence.start()
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._events_loop(), name="kv-events"))
        self._tasks.append(loop.create_task(self._gauges_loop(), name="engine-gauges"))

    async def stop(self) -> None:
        """Leave the registry (every instance) and stop publishing; idempotent (a drain stops it first)."""
        if self._stopped:
            return
        self._stopped = True
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*[p.stop(deregister=True) for p in self.presences])

    async def _events_loop(self, period_s: float = 0.1) -> None:
        while True:
            await asyncio.sleep(period_s)
            if not self.engine.is_running:
                continue
            if len(self.infos) > 1:
                by_rank = await self.engine.call(lambda core: core.drain_rank_kv_events())
            else:
                by_rank = [await self.engine.call(lambda core: core.drain_kv_events())]
            for cached, events in zip(self.cached, by_rank):
                for kind, h in events:
                    (cached.add if kind == "stored" else cached.discard)(h)
            if not self.publish_blocks:
                continue
            try:
                for r, events in enumerate(by_rank):
                    await self._publish(r, events)
            except (RedisError, OSError) as exc:  # presence re-publishes everything once Redis is back
                log.debug("block index update deferred: %s", exc)

    async def _publish(self, rank: int, events: list[tuple[str, bytes]]) -> None:
        cached, instance_id = self.cached[rank], self.infos[rank].instance_id
        stored = [h for k, h in events if k == "stored" and h in cached]
        removed = [h for k, h in events if k == "removed" and h not in cached]
        if stored:
            await self.state.add_blocks(instance_id, stored, self.block_ttl_s)
        if removed:
            await self.state.remove_blocks(instance_id, removed)

    async def _gauges_loop(self, period_s: float = 0.5) -> None:
        m = self.metrics
        while True:
            await asyncio.sleep(period_s)
            st = self.engine.stats()
            m.num_requests_running.set(st.num_running)
            m.num_requests_waiting.set(st.num_waiting)
            m.kv_cache_usage_perc.set(st.kv_usage)
            for rank, by_dtype in enumerate(st.weight_bytes):
                for dtype, nbytes in by_dtype.items():
                    m.weight_bytes.labels(rank=str(rank), dtype=dtype).set(nbytes)
            m.engine_steps.inc(max(st.num_steps - self._steps_seen[0], 0))
            m.engine_step_seconds.inc(max(st.step_seconds - self._steps_seen[1], 0.0))
            self._steps_seen = (st.num_steps, st.step_seconds)
            for phase, secs in st.step_phase_seconds.items():
                m.engine_step_phase_seconds.labels(phase=phase).inc(max(secs - self._phases_seen.get(phase, 0.0), 0.0))
            self._phases_seen = dict(st.step_phase_seconds)
            for phase, secs in st.step_phase_cpu_seconds.items():
                m.engine_step_phase_cpu_seconds.labels(phase=phase).inc(max(secs - self._cpu_seen.get(phase, 0.0), 0.0))
            self._cpu_seen = dict(st.step_phase_cpu_seconds)
            for secs, gap in self.engine.drain_step_times():
                m.engine_step_duration_seconds.observe(secs)
                if gap is not None:
                    m.engine_step_gap_seconds.observe(gap)
            if hasattr(m, "prefix_cache_queries"):
                q, h = st.prefix_queries, st.prefix_hits
                m.prefix_cache_queries.inc(max(q - self._prefix_seen[0], 0))
                m.prefix_cache_hits.inc(max(h - self._prefix_seen[1], 0))
                self._prefix_seen = (q, h)
            if st.kv_offload is not None:
                self._offload_gauges(st.kv_offload)
            if st.hisparse is not None and hasattr(m, "hisparse_hits"):
                hs = st.hisparse
                now = (hs.hits, hs.misses, hs.h2d_bytes)
                for counter, cur, seen in zip((m.hisparse_hits, m.hisparse_misses, m.hisparse_h2d_bytes), now,
                                              self._hisparse_seen):
                    counter.inc(max(cur - seen, 0))
                self._hisparse_seen = now
                m.hisparse_device_blocks_in_use.set(hs.num_device_blocks - hs.num_free_device_blocks)
                m.hisparse_requests_placed.set(hs.num_resident + hs.num_mixed + hs.num_host)

    def _offload_gauges(self, off) -> None:
        """The host KV tier's counters (engine.kv.offload.KVOffloadStats) as increments, and its usage."""
        m = self.metrics
        now = (off.queries, off.hits, off.store_bytes, off.load_bytes)
        counters = (m.external_prefix_cache_queries, m.external_prefix_cache_hits, m.kv_offload_store_bytes,
                    m.kv_offload_load_bytes)
        for counter, cur, seen in zip(counters, now, self._offload_seen):
            counter.inc(max(cur - seen, 0))
        self._offload_seen = now
        m.kv_offload_cpu_cache_usage_perc.set(off.usage)
