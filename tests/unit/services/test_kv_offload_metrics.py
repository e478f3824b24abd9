"""An engine's host KV tier on /metrics (vLLM's names, `pdserve:` prefix): external prefix-cache queries and
hits, store / load bytes as counters of increments, the tier's usage; the decode reports prefix hits too."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import generate_latest

from engine.core.core import EngineStats
from engine.kv.offload import OffloadTier
from services.engine_host import EngineHost
from services.rpc.metrics import ServiceMetrics
from tests.helpers.pace import until


class _Engine:
    def __init__(self, tier: OffloadTier):
        self.tier = tier
        self.num_stats = 0  # a gauges pass reads the stats once, then sets every gauge without awaiting

    def drain_step_times(self) -> list:
        return []

    def stats(self) -> EngineStats:
        self.num_stats += 1
        return EngineStats(num_running=0, num_waiting=0, num_held=0, kv_usage=0.0, num_free_blocks=8, num_blocks=8,
                           prefix_queries=640, prefix_hits=256, spec_drafts=0, spec_accepted=0, spec_steps=0,
                           spec_emitted=0, num_preemptions=0, kv_offload=self.tier.stats())


def _pass(host: EngineHost) -> None:
    async def one_pass():
        seen = host.engine.num_stats
        task = asyncio.create_task(host._gauges_loop(period_s=0.0))
        await until(lambda: host.engine.num_stats >= seen + 2 or task.done(), "a pass of the gauges loop")
        assert not task.done(), task.exception()
        task.cancel()

    asyncio.run(one_pass())


def _value(m: ServiceMetrics, name: str) -> float:
    for line in generate_latest(m.registry).decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_host_tier_counters_and_usage(role):
    tier = OffloadTier(4, block_bytes=1000)
    for i, h in enumerate((b"A" * 16, b"B" * 16, b"C" * 16)):
        tier.store(i, h, None)
    hit = tier.lookup(b"A" * 16, 64)
    tier.lock(hit)
    tier.load(hit, 7)
    tier.lookup(b"Z" * 16, 64)
    m = ServiceMetrics(role, instance_id=f"{role}-0")
    host = EngineHost.__new__(EngineHost)  # only the gauge loop is exercised: no Redis
    host.engine, host.metrics, host._prefix_seen, host._hisparse_seen = _Engine(tier), m, (0, 0), (0, 0, 0)
    host._steps_seen, host._offload_seen = (0, 0.0), (0, 0, 0, 0)
    _pass(host)
    assert _value(m, "pdserve:external_prefix_cache_queries_total") == 128
    assert _value(m, "pdserve:external_prefix_cache_hits_total") == 64
    assert _value(m, "pdserve:kv_offload_store_bytes_total") == 3000
    assert _value(m, "pdserve:kv_offload_load_bytes_total") == 1000
    assert _value(m, "pdserve:kv_offload_cpu_cache_usage_perc") == 0.75
    assert _value(m, "pdserve:prefix_cache_hits_total") == 256
    tier.store(3, b"D" * 16, None)  # one more block: the counter grows by its bytes, not by the total again
    _pass(host)
    assert _value(m, "pdserve:kv_offload_store_bytes_total") == 4000
    assert _value(m, "pdserve:kv_offload_cpu_cache_usage_perc") == 1.0
