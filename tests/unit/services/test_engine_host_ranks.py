"""EngineHost of a DP group: one Redis instance per DP rank, each with that rank's load figures and its own
prefix-cache blocks in the block index; a one-rank engine keeps its single instance and the group figures."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from prometheus_client import generate_latest

from engine.core.core import EngineStats
from services.cluster.redis_state import InstanceInfo
from services.engine_host import EngineHost
from services.rpc.metrics import ServiceMetrics
from tests.helpers.pace import until

_ZERO = EngineStats(num_running=0, num_waiting=0, num_held=0, kv_usage=0.0, num_free_blocks=8, num_blocks=8,
                    prefix_queries=0, prefix_hits=0, spec_drafts=0, spec_accepted=0, spec_steps=0, spec_emitted=0,
                    num_preemptions=0)


class _Engine:
    is_running = True

    def __init__(self, events):
        self.events, self.num_drains = events, 0  # a pass of the events loop drains once, then publishes
        self.ranks = (replace(_ZERO, num_running=2, num_free_blocks=5), replace(_ZERO, num_waiting=1, kv_usage=0.5))
        self.step_times: list[tuple[float, float | None]] = []

    def drain_step_times(self):
        out, self.step_times = self.step_times, []
        return out

    def stats(self):
        return replace(_ZERO, num_running=2, num_waiting=1, dp_ranks=self.ranks)

    async def call(self, fn):
        return fn(self)

    def drain_rank_kv_events(self):
        self.num_drains += 1
        out, self.events = self.events, [[], []]
        return out


class _State:
    def __init__(self):
        self.added: list[tuple[str, list[bytes]]] = []

    async def add_blocks(self, instance_id, hashes, ttl_s, *, publish=True):
        self.added.append((instance_id, list(hashes)))

    async def remove_blocks(self, instance_id, hashes, *, publish=True):
        pass


def test_each_rank_is_its_own_instance_with_its_own_load_and_blocks():
    a, b = b"a" * 16, b"b" * 16
    engine, state = _Engine([[("stored", a)], [("stored", b), ("stored", a), ("removed", a)]]), _State()
    infos = [InstanceInfo("decode", f"g-dp{r}", "h:1") for r in range(2)]
    host = EngineHost(engine, infos, state, ServiceMetrics("decode"), publish_blocks=True)
    assert [p.info.instance_id for p in host.presences] == ["g-dp0", "g-dp1"]
    assert host.presences[0].load()["running"] == 2 and host.presences[0].load()["free_blocks"] == 5
    assert host.presences[1].load() == {"running": 0, "waiting": 1, "kv_usage": 0.5, "free_blocks": 8,
                                        "queued_tokens": 0}

    async def one_round():
        task = asyncio.create_task(host._events_loop(period_s=0.0))
        await until(lambda: engine.num_drains >= 2 or task.done(), "a pass of the events loop")
        assert not task.done(), task.exception()
        task.cancel()
    asyncio.run(one_round())
    assert host.cached == [{a}, {b}]
    assert sorted(state.added) == [("g-dp0", [a]), ("g-dp1", [b])]
    assert [sorted(p.held_blocks()) for p in host.presences] == [[a], [b]]


def test_one_instance_reports_the_engine_figures():
    host = EngineHost(_Engine([[], []]), InstanceInfo("prefill", "p-0", "h:1"), _State(), ServiceMetrics("prefill"))
    assert len(host.presences) == 1 and host.presences[0].load()["running"] == 2


def test_the_service_counts_from_after_the_start_up_warm_up():
    """What the engine did before the host started (the warm-up's steps, prefix lookups) is not counted; what it does
    after is."""
    engine = _Engine([[], []])
    before = replace(_ZERO, num_steps=280, step_seconds=12.0, prefix_queries=5000, prefix_hits=400,
                     step_phase_seconds={"launch": 10.0})
    engine.stats = lambda: before
    engine.step_times = [(0.5, None)] * 280  # the warm-up's steps
    metrics = ServiceMetrics("decode")
    host = EngineHost(engine, InstanceInfo("decode", "d-0", "h:1"), _State(), metrics)
    engine.stats = lambda: replace(before, num_steps=283, step_seconds=12.5, prefix_queries=5100, prefix_hits=420,
                                   step_phase_seconds={"launch": 10.4})
    engine.step_times = [(0.004, None), (0.0045, 0.0003), (0.4915, 0.02)]  # after an idle wait, then back to back

    async def one_round():
        task = asyncio.create_task(host._gauges_loop(period_s=0.0))
        await until(lambda: metrics.engine_steps._value.get() > 0 or task.done(), "a pass of the gauges loop")
        task.cancel()
    asyncio.run(one_round())
    assert metrics.engine_steps._value.get() == 3
    assert metrics.engine_step_seconds._value.get() == 0.5
    assert metrics.prefix_cache_queries._value.get() == 100 and metrics.prefix_cache_hits._value.get() == 20
    # each step's own time and the gaps between back-to-back steps, as histograms (the warm-up's left out)
    text = generate_latest(metrics.registry).decode()
    assert 'pdserve:engine_step_duration_seconds_count 3.0' in text
    assert 'pdserve:engine_step_duration_seconds_bucket{le="0.005"} 2.0' in text
    assert 'pdserve:engine_step_duration_seconds_bucket{le="0.5"} 3.0' in text
    assert 'pdserve:engine_step_gap_seconds_count 2.0' in text
    assert 'pdserve:engine_step_gap_seconds_bucket{le="0.0005"} 1.0' in text
