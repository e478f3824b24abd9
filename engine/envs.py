"""Every environment variable pdserve reads, typed, in one place (STYLE §7)."""

from __future__ import annotations

import os


def _int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError as e:
        raise ValueError(f"environment variable {name} must be an integer, got {raw!r}") from e


def cpu_threads() -> int:
    """Torch threads for a CPU engine. Default 1: the tiny models' ops are far smaller than the cost of
    waking an OpenMP team, and services run several engines per host."""
    return _int("PDSERVE_CPU_THREADS", 1)


def log_level() -> str:
    return os.environ.get("PDSERVE_LOG_LEVEL", "INFO").upper()


def redis_url() -> str:
    return os.environ.get("PDSERVE_REDIS_URL", "redis://127.0.0.1:6379/0")
