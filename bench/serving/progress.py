"""A live one-line progress bar on stderr (a plain line every few seconds when not a terminal)."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from typing import TextIO

BAR_WIDTH = 24


def render(title: str, phase: str, done: float, total: float, unit: str, fields: dict[str, object]) -> str:
    frac = min(max(done / total, 0.0), 1.0) if total > 0 else 1.0
    filled = int(round(frac * BAR_WIDTH))
    bar = "#" * filled + "-" * (BAR_WIDTH - filled)
    info = " ".join(f"{k} {v}" for k, v in fields.items())
    return f"{title} {phase:<7} [{bar}] {done:5.0f}/{total:.0f}{unit} {info}"


class ProgressBar:
    """Redraws `render(...)` every `interval_s` until `stop()`; `fields()` is read at each redraw.

    Progress is elapsed seconds out of `total` unless `done()` counts something else (then `unit`)."""

    def __init__(self, title: str, total: float, fields: Callable[[], dict[str, object]],
                 phase: Callable[[], str], stream: TextIO | None = None, enabled: bool = True,
                 done: Callable[[], float] | None = None, unit: str = "s"):
        self.title, self.total, self.fields, self.phase = title, total, fields, phase
        self.done, self.unit = done, unit
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval_s = 0.5 if self.tty else 10.0
        self._t0 = time.perf_counter()
        self._task: asyncio.Task | None = None

    def line(self) -> str:
        done = self.done() if self.done else time.perf_counter() - self._t0
        return render(self.title, self.phase(), done, self.total, self.unit, self.fields())

    def start(self) -> None:
        self._t0 = time.perf_counter()
        if self.enabled:
            self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self._draw()

    def _draw(self, final: bool = False) -> None:
        text = self.line()
        if self.tty:
            self.stream.write("\r\x1b[2K" + text + ("\n" if final else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._draw(final=True)
