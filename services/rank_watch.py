"""Liveness of a multi-rank engine (a PCP × DCP × EP prefill, a DP × EP decode group): one dead or hung
worker rank means a dead engine, and the service takes every instance of it out of service at once.

Rank 0 sends a no-op collective to every rank every `period_s` while the engine is idle (it runs between
steps, so while the engine is busy it completes after the current step). A worker whose process is gone
makes it fail at once (gloo sees the closed connection). A worker that is alive but stuck (stopped, in a
dead-locked driver call) makes it wait instead: when no ping has completed for `hang_timeout_s`
(`PDSERVE_RANK_HANG_TIMEOUT_S`), the engine counts as hung. The engine cannot be rebuilt in-process (its
process group is broken, or blocked), so the service then goes out of service: health NOT_SERVING,
deregistered from Redis, every call failing with UNAVAILABLE, and the process exits with status 1 for its
supervisor to restart the instance (at once when hung: its engine thread may never return). A decode
group's D instances (one per DP rank) leave together: one engine, one process group.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import NoReturn

from engine import settings
from engine.frontend.async_engine import AsyncEngine
from engine.parallel.worker import exit_now

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
            # asyncio.timeout, not wait_for: under Python 3.11 a wait_for whose inner call completes as this
            # task is cancelled returns the result and swallows the cancellation, and this loop never ends
            async with asyncio.timeout(hang_timeout_s or 30.0):
                await engine.call(lambda core: core.collective_rpc(ping))
            last_ok = time.monotonic()
        except TimeoutError:
            stalled = time.monotonic() - last_ok
            if hang_timeout_s and stalled >= hang_timeout_s:
                return EngineDeath(f"no collective completed for {stalled:.1f} s: a worker rank hangs", hung=True)
        except Exception as exc:  # noqa: BLE001 - any failure of the collective means a rank is gone
            return EngineDeath(f"a worker rank is gone ({type(exc).__name__}: {exc})", hung=False)


def ping(runner) -> int:
    """A no-op collective (run on every rank): it fails at once on rank 0 when a worker rank's process is gone."""
    return runner.comm.rank


async def serve_until_stopped(server, drain, engine: AsyncEngine, host, role: str) -> int:
    """0 on SIGTERM (the first signal of `drain`, services.rpc.drain.Drain: the caller drains next); 1 when the
    engine died: out of service first (health NOT_SERVING, every instance of `host`
    (services.engine_host.EngineHost) deregistered, so routers stop choosing them before their TTL would run
    out), then the caller exits; at once (os._exit) when hung."""
    stop = asyncio.create_task(drain.wait_for_signal())
    death = asyncio.create_task(wait_for_engine_death(engine))
    done, pending = await asyncio.wait([stop, death], return_when=asyncio.FIRST_COMPLETED)
    for t in pending:
        t.cancel()
    if death not in done:
        return 0
    dead = death.result()
    log.error("%s out of service: %s; exiting for a restart", role, dead.reason)
    await server.set_serving(False)
    await host.stop()
    if dead.hung:  # the engine thread is blocked in a collective: a clean shutdown would wait for it forever
        logging.shutdown()
        os._exit(1)
    return 1


def exit_service(code: int, world_size: int) -> NoReturn:
    """A service's exit with `code`. A multi-rank engine's rank 0 out of service because a rank is gone (code != 0)
    leaves without the interpreter's teardown: the process group's C++ threads, their peer dead, can still be
    joinable there and abort the process ("terminate called without an active exception"), which would turn the
    exit code 1 a restart keys on into a SIGABRT. A normal exit keeps the teardown (its atexit tells the other
    ranks to stop)."""
    if world_size > 1 and code != 0:
        logging.shutdown()
        exit_now(code)
    sys.exit(code)
