"""Tests on a slow machine: the services pinned where PDSERVE_TEST_PIN_CPU says, how much slower than usual the
machine runs right now, and polling until a condition holds.

CI's two cores are at times 3-4x slower than usual. A test waits for events (a counter moving, a gauge back to
zero), never for a fixed time, and each wait has a generous deadline: the deadline only bounds how long a real
failure takes to report. The few bounds that are latencies the product promises ("the streams end within the
idle timeout plus a few seconds") take the seconds beyond the product's own deadline times `slowdown()`.

    with pinned(): proc = subprocess.Popen(...)    # started on the pinned CPUs, if any
    slack_s = scaled(5.0)                          # 5 s on an idle machine, 20 s on one 4x slower
    await until(lambda: engine.released, "the lease's release")
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

from tests.helpers.env import pin_cpus

# The calibration loop below (a million multiply-adds in CPython, the median of three) takes this long on an
# idle 2-core CI machine; its time now over this is the slowdown.
REFERENCE_S = 0.05
_CALIBRATE = """
import statistics, time
def once():
    t, x = time.perf_counter(), 0
    for i in range(1_000_000):
        x += i * i
    return time.perf_counter() - t
print(statistics.median(once() for _ in range(3)))
"""


@contextlib.contextmanager
def pinned() -> Iterator[None]:
    """Processes started inside run on PDSERVE_TEST_PIN_CPU's CPUs (a child inherits the affinity of the
    thread that starts it); nothing changes when it is unset. Only the calling thread is pinned, and only
    meanwhile, so the test's own clients keep every core (but a thread this process starts meanwhile, such as
    gRPC's own on its first call, stays on those CPUs)."""
    cpus = pin_cpus()
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def slowdown(services: bool = True) -> float:
    """How many times slower than an idle CI machine the CPUs run now (>= 1): the calibration loop timed in a
    child process that competes with what runs there. `services`: where the services run (pinned, if they
    are); False: where this test process runs (tests of in-process code)."""
    with pinned() if services else contextlib.nullcontext():
        out = subprocess.run([sys.executable, "-c", _CALIBRATE], capture_output=True, text=True, check=True,
                             timeout=600).stdout
    return max(1.0, float(out) / REFERENCE_S)


def scaled(seconds: float, factor: float | None = None) -> float:
    """`seconds` as long as they last on this machine now (`factor`: a slowdown() measured already)."""
    return seconds * (slowdown() if factor is None else factor)


async def until(cond: Callable[[], object], what: str, timeout: float = 60.0, period: float = 0.01) -> object:
    """Poll `cond` (a function, or one returning an awaitable) on the running event loop until it gives something
    true, and return that; AssertionError naming `what` past `timeout` (generous: it bounds how long a failure
    takes to report, not how fast the code must be)."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        await asyncio.sleep(period)
