"""Liveness of a multi-rank prefill engine: one dead worker rank means a dead engine.

Rank 0 sends a no-op collective to every rank every `period_s` while the engine is idle (a step does
the same while it is busy); a worker whose process is gone makes it fail at once (gloo sees the
closed connection). The engine cannot be rebuilt in-process (its process group is broken), so the
service then goes out of service: health NOT_SERVING, deregistered from Redis, every call failing
with UNAVAILABLE, and the process exits with status 1 for its supervisor to restart the instance.
"""

from __future__ import annotations

import asyncio
import logging

from engine.async_engine import AsyncEngine

log = logging.getLogger(__name__)


async def wait_for_engine_death(engine: AsyncEngine, *, period_s: float = 0.5, ping_timeout_s: float = 30.0) -> str:
    """Return (a reason) once the engine is dead; runs until cancelled otherwise."""
    multi_rank = engine.config.parallel.world_size > 1
    while True:
        await asyncio.sleep(period_s)
        if not engine.is_running:
            return "the engine loop stopped"
        if not multi_rank:
            continue
        try:
            await asyncio.wait_for(engine.call(lambda core: core.collective_rpc("services.prefill.rank_export:ping")),
                                   ping_timeout_s)
        except asyncio.TimeoutError:
            continue  # a long step holds the loop; a dead rank fails that step instead
        except Exception as exc:  # noqa: BLE001 - any failure of the collective means a rank is gone
            return f"a worker rank is gone ({type(exc).__name__}: {exc})"
