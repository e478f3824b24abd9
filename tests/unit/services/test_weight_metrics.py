"""Each engine's /metrics reports its ranks' weight bytes by dtype (from EngineStats.weight_bytes)."""

from __future__ import annotations

import asyncio

from prometheus_client import generate_latest

from engine.core.core import EngineStats
from services.engine_host import EngineHost
from services.rpc.metrics import ServiceMetrics
from tests.helpers.pace import until


class _Engine:
    num_stats = 0  # a gauges pass reads the stats once, then sets every gauge without awaiting

    def drain_step_times(self) -> list:
        return []

    def stats(self) -> EngineStats:
        self.num_stats += 1
        return EngineStats(num_running=0, num_waiting=0, num_held=0, kv_usage=0.0, num_free_blocks=8, num_blocks=8,
                           prefix_queries=0, prefix_hits=0, spec_drafts=0, spec_accepted=0, spec_steps=0,
                           spec_emitted=0, num_preemptions=0,
                           weight_bytes=({"bfloat16": 10, "float8_e4m3fn": 300}, {"float8_e4m3fn": 290}))


def test_weight_bytes_gauges_per_rank_and_dtype():
    m = ServiceMetrics("prefill", instance_id="prefill-0")
    host = EngineHost.__new__(EngineHost)  # only the gauge loop is exercised: no Redis
    host.engine, host.metrics, host._prefix_seen, host._hisparse_seen = _Engine(), m, (0, 0), (0, 0, 0)
    host._steps_seen = (0, 0.0)

    async def one_pass():
        task = asyncio.create_task(host._gauges_loop(period_s=0.0))
        await until(lambda: host.engine.num_stats >= 2 or task.done(), "a pass of the gauges loop")
        assert not task.done(), task.exception()  # the loop keeps running: no error in a pass
        task.cancel()

    asyncio.run(one_pass())
    text = generate_latest(m.registry).decode()
    assert 'pdserve:weight_bytes{dtype="float8_e4m3fn",rank="1"} 290.0' in text
    assert 'pdserve:weight_bytes{dtype="bfloat16",rank="0"} 10.0' in text
