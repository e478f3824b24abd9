"""Every environment variable the services read, typed, in one place (the engine's are in engine/envs.py).
Service flags win over these; they exist for containers (docker-compose.yml) and tests. NIXL/UCX read their
own variables (`UCX_TLS`, `UCX_NET_DEVICES`, ...) directly; we only pass them through.
"""

from __future__ import annotations

import os

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def redis_url() -> str:
    """`PDSERVE_REDIS_URL`: where the shared state lives."""
    return os.environ.get("PDSERVE_REDIS_URL", DEFAULT_REDIS_URL)


def log_level() -> str:
    """`PDSERVE_LOG_LEVEL`: logging level name of every service (default INFO)."""
    return os.environ.get("PDSERVE_LOG_LEVEL", "INFO").upper()


def advertise_host() -> str | None:
    """`PDSERVE_ADVERTISE_HOST`: the address other services should dial (default: this host's IP)."""
    return os.environ.get("PDSERVE_ADVERTISE_HOST") or None


def api_keys() -> tuple[str, ...]:
    """`PDSERVE_API_KEY`: comma-separated router API keys, each `key` or `key:tenant` (same as
    `--api-key`); empty = no authentication."""
    raw = os.environ.get("PDSERVE_API_KEY", "")
    return tuple(k.strip() for k in raw.split(",") if k.strip())


def nixl_backends() -> tuple[str, ...]:
    """`PDSERVE_NIXL_BACKENDS`: comma-separated NIXL backends (default UCX; POSIX also works on CPU)."""
    raw = os.environ.get("PDSERVE_NIXL_BACKENDS", "UCX")
    return tuple(b.strip() for b in raw.split(",") if b.strip())


def nixl_progress_thread() -> bool:
    """`PDSERVE_NIXL_PROGRESS_THREAD=1`: use NIXL's progress thread (it spins a core) instead of
    event-loop polling (see services/transfer/nixl_agent.py)."""
    return os.environ.get("PDSERVE_NIXL_PROGRESS_THREAD", "0").lower() in ("1", "true", "yes")


def nixl_idle_poll_s() -> float:
    """`PDSERVE_NIXL_IDLE_POLL_S`: how often an agent that has seen no activity for a while polls NIXL (default
    0.02; the busy interval is 2 ms). See services/transfer/nixl_agent.py, "Progress"."""
    raw = os.environ.get("PDSERVE_NIXL_IDLE_POLL_S", "")
    try:
        value = float(raw) if raw else 0.02
    except ValueError as e:
        raise ValueError(f"PDSERVE_NIXL_IDLE_POLL_S must be a number of seconds, got {raw!r}") from e
    if not 0 < value <= 1:
        raise ValueError(f"PDSERVE_NIXL_IDLE_POLL_S must lie in (0, 1] seconds, got {raw!r}")
    return value


def rank_hang_timeout_s() -> float:
    """`PDSERVE_RANK_HANG_TIMEOUT_S`: a multi-rank engine (a PCP prefill, a DP decode group) whose ranks
    complete no collective for this long (a worker hung, not dead) goes out of service and exits for a
    restart (default 120; 0 = never). A step is bounded by the chunked-prefill token budget, so a healthy
    engine completes one far sooner."""
    raw = os.environ.get("PDSERVE_RANK_HANG_TIMEOUT_S", "")
    try:
        value = float(raw) if raw else 120.0
    except ValueError as e:
        raise ValueError(f"environment variable PDSERVE_RANK_HANG_TIMEOUT_S must be a number, got {raw!r}") from e
    if value < 0:
        raise ValueError(f"PDSERVE_RANK_HANG_TIMEOUT_S must be >= 0, got {value}")
    return value


# ---- fault injection (a debug facility: services/decode/faults.py; tests/e2e/test_faults.py sets it) --------

def fault_nixl_fail_first_n() -> int:
    """`PDSERVE_FAULT_NIXL_FAIL_FIRST_N`: the decode service's first N KV pull attempts fail as a NIXL
    transfer error would (0 = off)."""
    return int(os.environ.get("PDSERVE_FAULT_NIXL_FAIL_FIRST_N", "0"))
