"""Every environment variable pdserve reads — the engine's and the services' — typed, in one place
(STYLE §7). Service flags win over these; they exist for containers (docker-compose.yml) and tests.
NIXL/UCX read their own variables (`UCX_TLS`, `UCX_NET_DEVICES`, ...) directly; we only pass them through.
"""

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
    """`PDSERVE_LOG_LEVEL`: logging level name of every service (default INFO)."""
    return os.environ.get("PDSERVE_LOG_LEVEL", "INFO").upper()


DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def redis_url() -> str:
    """`PDSERVE_REDIS_URL`: where the shared state lives."""
    return os.environ.get("PDSERVE_REDIS_URL", DEFAULT_REDIS_URL)


# ---- multi-rank engines (torchrun's variables; set by engine.parallel.spawn for spawned ranks) ----
def dist_rank() -> int | None:
    """This process's rank when a launcher (torchrun or ours) started it, else None."""
    return _int("RANK", -1) if os.environ.get("RANK") else None


def dist_world_size() -> int | None:
    return _int("WORLD_SIZE", -1) if os.environ.get("WORLD_SIZE") else None


def dist_local_rank() -> int:
    return _int("LOCAL_RANK", 0)


def dist_master_addr() -> str:
    return os.environ.get("MASTER_ADDR", "127.0.0.1")


def dist_master_port() -> int | None:
    return _int("MASTER_PORT", -1) if os.environ.get("MASTER_PORT") else None


def dist_device() -> str | None:
    """'cpu' or 'cuda' for a rank process (set by our launcher); None: cuda when available."""
    return os.environ.get("PDSERVE_DIST_DEVICE") or None


def cp_kv_prefetch() -> bool:
    """Overlap layer l+1's DCP context all-gather with layer l's compute (1, default) or not (0)."""
    return _int("PDSERVE_CP_KV_PREFETCH", 1) != 0


def cp_check_outputs() -> bool:
    """Debug: after every step, check that all ranks sampled the same tokens (one extra small gather)."""
    return _int("PDSERVE_CP_CHECK_OUTPUTS", 0) != 0


def rank_hang_timeout_s() -> float:
    """`PDSERVE_RANK_HANG_TIMEOUT_S`: a multi-rank prefill whose ranks complete no collective for this long
    (a worker hung, not dead) goes out of service and exits for a restart (default 120; 0 = never). A step
    is bounded by the chunked-prefill token budget, so a healthy engine completes one far sooner."""
    raw = os.environ.get("PDSERVE_RANK_HANG_TIMEOUT_S", "")
    try:
        value = float(raw) if raw else 120.0
    except ValueError as e:
        raise ValueError(f"environment variable PDSERVE_RANK_HANG_TIMEOUT_S must be a number, got {raw!r}") from e
    if value < 0:
        raise ValueError(f"PDSERVE_RANK_HANG_TIMEOUT_S must be >= 0, got {value}")
    return value


def parent_pid() -> int | None:
    """Set by our launcher: a spawned rank exits when this process is gone (no orphans)."""
    return _int("PDSERVE_PARENT_PID", -1) if os.environ.get("PDSERVE_PARENT_PID") else None


def torchelastic_agent_store() -> bool:
    """Set by torchrun: its agent already hosts the rendezvous store at MASTER_ADDR:MASTER_PORT."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


# ---- services ----------------------------------------------------------------------------------

def advertise_host() -> str | None:
    """`PDSERVE_ADVERTISE_HOST`: the address other services should dial (default: this host's IP)."""
    return os.environ.get("PDSERVE_ADVERTISE_HOST") or None


def nixl_backends() -> tuple[str, ...]:
    """`PDSERVE_NIXL_BACKENDS`: comma-separated NIXL backends (default UCX; POSIX also works on CPU)."""
    raw = os.environ.get("PDSERVE_NIXL_BACKENDS", "UCX")
    return tuple(b.strip() for b in raw.split(",") if b.strip())


def nixl_progress_thread() -> bool:
    """`PDSERVE_NIXL_PROGRESS_THREAD=1`: use NIXL's progress thread (it spins a core) instead of
    event-loop polling (see services/transfer/nixl_agent.py)."""
    return os.environ.get("PDSERVE_NIXL_PROGRESS_THREAD", "0").lower() in ("1", "true", "yes")


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

