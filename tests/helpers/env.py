"""Environment variables that change how the tests run, one typed function each (the product's own are read in
engine/settings.py alone; these change nothing in what the product does)."""

from __future__ import annotations

import os

PIN_CPU = "PDSERVE_TEST_PIN_CPU"


def pin_cpus() -> set[int] | None:
    """PDSERVE_TEST_PIN_CPU: the CPUs ("0", "0,1", "2-3") every service the tests start runs on, to run the e2e
    tier as a slow machine would (the services on one core beside a busy loop); unset: wherever the OS puts them."""
    raw = os.environ.get(PIN_CPU, "").strip()
    if not raw:
        return None
    cpus: set[int] = set()
    try:
        for part in raw.split(","):
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ValueError(f"{PIN_CPU}={raw!r}: expected CPU numbers such as 0 or 0,2-3") from None
    return cpus

