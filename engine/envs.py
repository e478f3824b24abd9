"""Every environment variable the engine reads, typed, in one place (the services' own are in
services/settings.py). They exist for containers and tests; an explicit argument always wins. Torch,
NCCL and torchrun read their own variables; the `dist_*` functions only read torchrun's contract.
"""

from __future__ import annotations

import os


def env_int(name: str, default: int) -> int:
    """An integer variable (unset or empty: `default`), with an error that names it when it is not one."""
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
    return env_int("PDSERVE_CPU_THREADS", 1)


def packed_projections() -> bool:
    """MLA's projections of one input as one GEMM (1, default; engine.model.projections) or one GEMM each (0:
    for comparison)."""
    return env_int("PDSERVE_PACKED_PROJECTIONS", 1) != 0


def fused_ops() -> bool:
    """On CUDA, the norms, RoPE and MoE routing as one Triton launch each (1, default) or as eager torch ops
    (0: for comparison; the arithmetic is the same, engine/model/layers.py)."""
    return env_int("PDSERVE_FUSED_OPS", 1) != 0


# ---- multi-rank engines (torchrun's variables; set by engine.parallel.spawn for spawned ranks) ----
def dist_rank() -> int | None:
    """This process's rank when torchrun or engine.parallel.spawn started it, else None."""
    return env_int("RANK", -1) if os.environ.get("RANK") else None


def dist_world_size() -> int | None:
    return env_int("WORLD_SIZE", -1) if os.environ.get("WORLD_SIZE") else None


def dist_local_rank() -> int:
    return env_int("LOCAL_RANK", 0)


def dist_master_addr() -> str:
    return os.environ.get("MASTER_ADDR", "127.0.0.1")


def dist_master_port() -> int | None:
    return env_int("MASTER_PORT", -1) if os.environ.get("MASTER_PORT") else None


def dist_device() -> str | None:
    """'cpu' or 'cuda' for a rank process (set by engine.parallel.spawn); None: cuda when available."""
    return os.environ.get("PDSERVE_DIST_DEVICE") or None


def cp_kv_prefetch() -> bool:
    """Overlap layer l+1's DCP context all-gather with layer l's compute (1, default) or not (0)."""
    return env_int("PDSERVE_CP_KV_PREFETCH", 1) != 0


def cp_check_outputs() -> bool:
    """Debug: after every step, check that all ranks sampled the same tokens (one extra small gather)."""
    return env_int("PDSERVE_CP_CHECK_OUTPUTS", 0) != 0


def parent_pid() -> int | None:
    """Set by engine.parallel.spawn: a spawned rank exits when this process is gone (no orphans)."""
    return env_int("PDSERVE_PARENT_PID", -1) if os.environ.get("PDSERVE_PARENT_PID") else None


def torchelastic_agent_store() -> bool:
    """Set by torchrun: its agent already hosts the rendezvous store at MASTER_ADDR:MASTER_PORT."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def port_range() -> tuple[int, int] | None:
    """PDSERVE_PORT_RANGE="LO-HI" (inclusive): where `engine.parallel.dist.free_port` draws the ports it hands
    out (services, rendezvous, Redis started by us), e.g. a firewall's open range, or one disjoint range per
    concurrent launcher on a host so that two launchers never hand out the same port. Unset: below the OS's
    ephemeral range."""
    raw = os.environ.get("PDSERVE_PORT_RANGE", "").strip()
    if not raw:
        return None
    try:
        lo, hi = (int(x) for x in raw.split("-"))
    except ValueError as e:
        raise ValueError(f"environment variable PDSERVE_PORT_RANGE must be LO-HI, got {raw!r}") from e
    if not 1024 <= lo <= hi <= 65535:
        raise ValueError(f"environment variable PDSERVE_PORT_RANGE must lie in 1024-65535 with LO <= HI, got {raw!r}")
    return lo, hi
