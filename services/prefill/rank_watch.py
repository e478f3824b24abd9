"""Liveness of a multi-rank prefill engine: one dead or hung worker rank means a dead engine.

Rank 0 sends a no-op collective to every rank every `period_s` while the engine is idle (it runs between
steps, so while the engine is busy it completes after the current step). A worker whose process is gone
makes it fail at once (gloo sees the closed connection). A worker that is alive but stuck (stopped, in a
dead-locked driver call) makes it wait instead: when no ping has completed for `hang_timeout_s`
(`PDSERVE_RANK_HANG_TIMEOUT_S`), the engine counts as hung. The engine cannot be rebuilt in-process (its
process group is broken, or blocked), so the service then goes out of service: health NOT_SERVING,
deregistered from Redis, every call failing with UNAVAILABLE, and the process exits with status 1 for its
supervisor to restart the instance (at once when hung: its engine thread may never return).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from engine.frontend.async_engine import AsyncEngine
from services import settings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineDeath:
    reason: str
    hung: bool  # the engine thread is stuck (in a collective): it cannot be shut down cleanly


async def wait_for_engine_death(engine: AsyncEngine, *, period_s: float = 0.5,
                                hang_timeout_s: float | None = None) -> EngineDeath:
    """Return once the engine is dead or hung; runs until cancelled otherwise."""
    hang_timeout_s = settings.rank_hang_timeout_s() if hang_timeout_s is None else hang_timeout_s
    multi_rank = engine.config.parallel.world_size > 1
    last_ok = time.monotonic()
    while True:
        await asyncio.sleep(period_s)
        if not engine.is_running:
            return EngineDeath("the engine loop stopped", hung=False)
        if not multi_rank:
            continue
        try:
            await asyncio.wait_for(engine.call(lambda core: core.collective_rpc("services.prefill.rank_export:ping")),
                                   hang_timeout_s or 30.0)
            last_ok = time.monotonic()
        except TimeoutError:
            stalled = time.monotonic() - last_ok
            if hang_timeout_s and stalled >= hang_timeout_s:
                return EngineDeath(f"no collective completed for {stalled:.1f} s: a worker rank hangs", hung=True)
        except Exception as exc:  # noqa: BLE001 - any failure of the collective means a rank is gone
            return EngineDeath(f"a worker rank is gone ({type(exc).__name__}: {exc})", hung=False)
