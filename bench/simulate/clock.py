"""An asyncio event loop on a virtual clock: when nothing is ready to run, time jumps to the next timer.

Everything the simulator runs is a coroutine or a timer on this loop — the AgentX replayer's think times and
stops (bench/serving/replay.py on `loop.time`), each engine's steps (`call_later` by the step's cost), the
transfers, the router's refresh task — so a simulated hour takes as long as its Python work, and the order of
events is a function of the inputs and the seed alone. Nothing may wait on real I/O: with no timer left and
nothing ready, the loop would block (the replayer always holds its stop timer, so a run ends).
"""

from __future__ import annotations

import asyncio
import heapq


class VirtualClockLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        super().__init__()
        self._virtual_now = 0.0

    def time(self) -> float:
        return self._virtual_now

    def _run_once(self) -> None:
        # nothing to run now: move the clock to the earliest live timer (its select() then returns at once). A
        # cancelled timer at the head is dropped first, as the base loop would: jumping to its time instead would
        # leave the base loop a real wait for the next one.
        while self._scheduled and self._scheduled[0].cancelled():
            handle = heapq.heappop(self._scheduled)
            handle._scheduled = False
            self._timer_cancelled_count -= 1
        if not self._ready and self._scheduled:
            self._virtual_now = max(self._virtual_now, self._scheduled[0].when())
        super()._run_once()


def run(coro):
    """Run `coro` to completion on a fresh virtual-clock loop."""
    loop = VirtualClockLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()
