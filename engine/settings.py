"""Every environment variable pdserve reads or sets for itself, typed, in one place (docs/settings.md lists them).

Variables exist for containers, launchers and tests; an explicit argument or flag always wins over them. Each
accessor reads the environment when it is called, not at import, so a test's `monkeypatch.setenv` takes
effect, and a malformed value is a ValueError that names the variable. Torch, NCCL, UCX and Triton read their
own variables; only those that our code reads or sets (torchrun's contract, TRITON_INTERPRET, CUDA_HOME) are
here. Code that starts a child process passes its environment on as a whole (engine/parallel/spawn.py,
services/launch/launcher.py): the only other places `os.environ` appears.

This module is the tree's bottom floor (tests/unit/test_layering.py): the kernels import it too, so it
imports nothing but the standard library.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


# ---- parsing: unset or empty is the default; anything malformed names its variable ---------------------

def _raw(name: str) -> str | None:
    value = os.environ.get(name, "").strip()
    return value or None


def _int(name: str, default: int | None) -> int | None:
    raw = _raw(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError as e:
        raise ValueError(f"environment variable {name} must be an integer, got {raw!r}") from e


def _float(name: str, default: float) -> float:
    raw = _raw(name)
    if raw is None:
        return default
    try:
        return float(raw)
    except ValueError as e:
        raise ValueError(f"environment variable {name} must be a number, got {raw!r}") from e


def _bool(name: str, default: bool) -> bool:
    raw = _raw(name)
    if raw is None:
        return default
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise ValueError(f"environment variable {name} must be one of {_TRUE + _FALSE}, got {raw!r}")


def _csv(name: str, default: str) -> tuple[str, ...]:
    raw = os.environ.get(name, default)
    return tuple(part.strip() for part in raw.split(",") if part.strip())


# ---- the engine ---------------------------------------------------------------------------------------

def cpu_threads() -> int:
    """`PDSERVE_CPU_THREADS`: torch threads of a CPU engine (default 1: the tiny models' ops are far smaller
    than the cost of waking an OpenMP team, and services run several engines per host)."""
    n = _int("PDSERVE_CPU_THREADS", 1)
    if n < 1:
        raise ValueError(f"environment variable PDSERVE_CPU_THREADS must be >= 1, got {n}")
    return n


def port_range() -> tuple[int, int] | None:
    """`PDSERVE_PORT_RANGE="LO-HI"` (inclusive): where `engine.parallel.dist.free_port` draws the ports it hands
    out (services, rendezvous, Redis started by us), e.g. a firewall's open range, or one disjoint range per
    concurrent launcher on a host so that two launchers never hand out the same port. Unset: below the OS's
    ephemeral range."""
    raw = _raw("PDSERVE_PORT_RANGE")
    if raw is None:
        return None
    try:
        lo, hi = (int(x) for x in raw.split("-"))
    except ValueError as e:
        raise ValueError(f"environment variable PDSERVE_PORT_RANGE must be LO-HI, got {raw!r}") from e
    if not 1024 <= lo <= hi <= 65535:
        raise ValueError(f"environment variable PDSERVE_PORT_RANGE must lie in 1024-65535 with LO <= HI, got {raw!r}")
    return lo, hi


# ---- the ranks of a multi-rank engine: torchrun's contract, and what engine.parallel.spawn adds ---------

def dist_rank() -> int | None:
    """`RANK`: this process's rank when torchrun or engine.parallel.spawn started it, else None."""
    return _int("RANK", None)


def dist_world_size() -> int | None:
    """`WORLD_SIZE`: the number of ranks, when started as a rank, else None."""
    return _int("WORLD_SIZE", None)


def dist_local_rank() -> int:
    """`LOCAL_RANK`: the GPU this rank drives on its host (default 0)."""
    return _int("LOCAL_RANK", 0)


def assigned_local_rank() -> int | None:
    """`LOCAL_RANK` when a launcher named this process's GPU (services.launch gives each rank its own), else None."""
    return _int("LOCAL_RANK", None)


def dist_master_addr() -> str:
    """`MASTER_ADDR`: where rank 0's rendezvous store listens (default 127.0.0.1)."""
    return _raw("MASTER_ADDR") or "127.0.0.1"


def dist_master_port() -> int | None:
    """`MASTER_PORT`: the rendezvous store's port, when started as a rank, else None."""
    return _int("MASTER_PORT", None)


def torchelastic_agent_store() -> bool:
    """`TORCHELASTIC_USE_AGENT_STORE`, set by torchrun: its agent already hosts the rendezvous store at
    MASTER_ADDR:MASTER_PORT (torchrun writes exactly "True")."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def dist_device() -> str | None:
    """`PDSERVE_DIST_DEVICE`: 'cpu' or 'cuda' for a spawned rank (set by engine.parallel.spawn); None: cuda
    when available."""
    raw = _raw("PDSERVE_DIST_DEVICE")
    if raw not in (None, "cpu", "cuda"):
        raise ValueError(f"environment variable PDSERVE_DIST_DEVICE must be 'cpu' or 'cuda', got {raw!r}")
    return raw


def parent_pid() -> int | None:
    """`PDSERVE_PARENT_PID`: a spawned rank exits when this process is gone (no orphans)."""
    return _int("PDSERVE_PARENT_PID", None)


def spawned_rank_environ(device_type: str, parent: int) -> dict[str, str]:
    """The variables engine.parallel.spawn adds to torchrun's for the ranks it starts (read back by
    `dist_device` and `parent_pid` in the child)."""
    return {"PDSERVE_DIST_DEVICE": device_type, "PDSERVE_PARENT_PID": str(parent)}


def set_torchrun_environ(values: Mapping[str, str]) -> None:
    """Make this process a rank: torchrun's variables (`engine.parallel.dist.DistEnv.to_environ`) set in its own
    environment, for a service started rank by rank with flags (services.rpc.service_args.set_rank_environ),
    so that it joins its engine through the one contract every rank is started with."""
    os.environ.update(values)


# ---- the kernels ----------------------------------------------------------------------------------------

def default_to_triton_interpreter() -> None:
    """`TRITON_INTERPRET=1` unless the caller set it. Called by kernels/triton_support.py, before Triton's first import,
    on a torch build that cannot compile kernels (no CUDA, no ROCm): Triton decides at import whether it
    compiles or interprets, so this is the one moment the choice can be made for every kernel."""
    os.environ.setdefault("TRITON_INTERPRET", "1")


def cuda_home() -> str | None:
    """`CUDA_HOME`, else `CUDA_PATH`: the toolkit whose bin/nvcc builds kernels/csrc (else nvcc on PATH)."""
    return _raw("CUDA_HOME") or _raw("CUDA_PATH")


def kernel_cache_dir() -> Path:
    """`PDSERVE_KERNEL_CACHE`: where built CUDA kernels are kept (default ~/.cache/pdserve/kernels)."""
    raw = _raw("PDSERVE_KERNEL_CACHE")
    return Path(raw) if raw else Path.home() / ".cache" / "pdserve" / "kernels"


# ---- the services -----------------------------------------------------------------------------------------

def redis_url() -> str:
    """`PDSERVE_REDIS_URL`: where the shared state lives (the default of every service's --redis-url)."""
    return _raw("PDSERVE_REDIS_URL") or DEFAULT_REDIS_URL


def log_level() -> str:
    """`PDSERVE_LOG_LEVEL`: logging level name of every service (default INFO)."""
    return (_raw("PDSERVE_LOG_LEVEL") or "INFO").upper()


def advertise_host() -> str | None:
    """`PDSERVE_ADVERTISE_HOST`: the address other services should dial (default: this host's IP)."""
    return _raw("PDSERVE_ADVERTISE_HOST")


def api_keys() -> tuple[str, ...]:
    """`PDSERVE_API_KEY`: comma-separated router API keys, each `key` or `key:tenant` (same as `--api-key`);
    empty = no authentication."""
    return _csv("PDSERVE_API_KEY", "")


def nixl_backends() -> tuple[str, ...]:
    """`PDSERVE_NIXL_BACKENDS`: comma-separated NIXL backends (default UCX; POSIX also works on CPU)."""
    return _csv("PDSERVE_NIXL_BACKENDS", "UCX") or ("UCX",)


def nixl_progress_thread() -> bool:
    """`PDSERVE_NIXL_PROGRESS_THREAD=1`: use NIXL's progress thread (it spins a core) instead of event-loop
    polling (services/transfer/nixl_agent.py)."""
    return _bool("PDSERVE_NIXL_PROGRESS_THREAD", False)


def nixl_idle_poll_s() -> float:
    """`PDSERVE_NIXL_IDLE_POLL_S`: how often an agent that has seen no activity for a while polls NIXL (default
    0.02; the busy interval is 2 ms). See services/transfer/nixl_agent.py, "Progress"."""
    value = _float("PDSERVE_NIXL_IDLE_POLL_S", 0.02)
    if not 0 < value <= 1:
        raise ValueError(f"environment variable PDSERVE_NIXL_IDLE_POLL_S must lie in (0, 1] seconds, got {value}")
    return value


def switch_interval_ms() -> float | None:
    """`PDSERVE_SWITCH_INTERVAL_MS`: the interpreter's thread switch interval of a service process, milliseconds
    in (0, 1000] (default unset: Python's 5 ms). Applied at a service's start (services/rpc/grpc_server.py)."""
    if _raw("PDSERVE_SWITCH_INTERVAL_MS") is None:
        return None
    value = _float("PDSERVE_SWITCH_INTERVAL_MS", 0.0)
    if not 0 < value <= 1000:  # also refuses nan
        raise ValueError(f"environment variable PDSERVE_SWITCH_INTERVAL_MS must lie in (0, 1000] ms, got {value}")
    return value


def rank_hang_timeout_s() -> float:
    """`PDSERVE_RANK_HANG_TIMEOUT_S`: a multi-rank engine (a PCP prefill, a DP decode group) whose ranks complete
    no collective for this long (a worker hung, not dead) goes out of service and exits for a restart (default
    120; 0 = never). A step is bounded by the chunked-prefill token budget, so a healthy engine completes one
    far sooner."""
    value = _float("PDSERVE_RANK_HANG_TIMEOUT_S", 120.0)
    if value < 0:
        raise ValueError(f"environment variable PDSERVE_RANK_HANG_TIMEOUT_S must be >= 0, got {value}")
    return value


def fault_nixl_fail_first_n() -> int:
    """`PDSERVE_FAULT_NIXL_FAIL_FIRST_N`: fault injection (services/decode/faults.py, a debug facility): the
    decode service's first N KV pull attempts fail as a NIXL transfer error would (0 = off)."""
    n = _int("PDSERVE_FAULT_NIXL_FAIL_FIRST_N", 0)
    if n < 0:
        raise ValueError(f"environment variable PDSERVE_FAULT_NIXL_FAIL_FIRST_N must be >= 0, got {n}")
    return n
