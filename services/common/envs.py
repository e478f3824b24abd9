"""Every environment variable pdserve's services read, in one typed place (STYLE §7).

Flags win over these; they exist for containers (docker-compose.yml) and tests. NIXL/UCX read their
own variables (`UCX_TLS`, `UCX_NET_DEVICES`, ...) directly; we only pass them through.
"""

from __future__ import annotations

import os

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def redis_url() -> str:
    """`PDSERVE_REDIS_URL`: where the shared state lives."""
    return os.environ.get("PDSERVE_REDIS_URL", DEFAULT_REDIS_URL)


def advertise_host() -> str | None:
    """`PDSERVE_ADVERTISE_HOST`: the address other services should dial (default: this host's IP)."""
    return os.environ.get("PDSERVE_ADVERTISE_HOST") or None


def nixl_backends() -> tuple[str, ...]:
    """`PDSERVE_NIXL_BACKENDS`: comma-separated NIXL backends (default UCX; POSIX also works on CPU)."""
    raw = os.environ.get("PDSERVE_NIXL_BACKENDS", "UCX")
    return tuple(b.strip() for b in raw.split(",") if b.strip())


def nixl_progress_thread() -> bool:
    """`PDSERVE_NIXL_PROGRESS_THREAD=1`: use NIXL's progress thread (it spins a core) instead of
    event-loop polling (see services/common/nixl_agent.py)."""
    return os.environ.get("PDSERVE_NIXL_PROGRESS_THREAD", "0").lower() in ("1", "true", "yes")


def log_level() -> str:
    """`PDSERVE_LOG_LEVEL`: logging level name of every service (default INFO)."""
    return os.environ.get("PDSERVE_LOG_LEVEL", "INFO").upper()


def api_keys() -> tuple[str, ...]:
    """`PDSERVE_API_KEY`: comma-separated router API keys, each `key` or `key:tenant` (same as
    `--api-key`); empty = no authentication."""
    raw = os.environ.get("PDSERVE_API_KEY", "")
    return tuple(k.strip() for k in raw.split(",") if k.strip())


# ---- fault injection (tests only; tests/e2e/test_faults.py sets them on real processes) ----------

def fault_nixl_fail_first_n() -> int:
    """`PDSERVE_FAULT_NIXL_FAIL_FIRST_N`: the decode service's first N KV pull attempts fail as a NIXL
    transfer error would (0 = off)."""
    return int(os.environ.get("PDSERVE_FAULT_NIXL_FAIL_FIRST_N", "0"))

