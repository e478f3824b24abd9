"""Which GPUs each process of a topology gets, and whether the engines sharing a GPU fit on it.

A service kind that runs engines (prefill, decode) may name its GPUs: `gpus: [0, 1, ...]`, one per
process of the kind (replica-major, rank-minor: a multi-rank prefill's ranks, a decode group's DP
ranks), or a single GPU that every process of the kind shares. The launcher then sets, per process:

    one-process engines (1-rank decode / prefill)  CUDA_VISIBLE_DEVICES=<its GPU>    LOCAL_RANK=0
    multi-rank engines (PCP x DCP x EP prefill,    CUDA_VISIBLE_DEVICES=<the replica's GPUs>
    DP x EP decode group)                          LOCAL_RANK=<index of this rank's GPU in that list>

(a rank group sees all of its GPUs so NCCL finds its peers' devices; each rank selects its own).

`gpu-memory-utilization` (an engine flag, default 0.9) is the share of its GPU an engine may use, as
in vLLM: engines on one GPU must have shares that add up to at most 1; anything else is refused
before a process starts, naming the services that share the GPU.
"""

from __future__ import annotations

import shutil
import subprocess
from collections import defaultdict
from dataclasses import dataclass

from services.launch.schema import ServiceSpec, Topology

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # engine.arg_utils.EngineArgs' default


@dataclass(frozen=True)
class Placement:
    """The GPUs of one process: what it sees and which one it uses (LOCAL_RANK)."""

    gpu: int | None  # physical GPU index; None: no GPU named (the process sees whatever the host has)
    visible: tuple[int, ...] = ()
    local_rank: int = 0

    def env(self) -> dict[str, str]:
        if self.gpu is None:
            return {}
        return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, self.visible)), "LOCAL_RANK": str(self.local_rank)}


def host_gpu_count(topo: Topology) -> int:
    """The topology's `host_gpus` if it says; else what nvidia-smi lists on this host (0 without one)."""
    if topo.host_gpus is not None:
        return topo.host_gpus
    return visible_gpu_count()


def visible_gpu_count() -> int:
    """The GPUs nvidia-smi lists on this host (0 without it)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "--query-gpu=index", "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return len([line for line in out.splitlines() if line.strip()])


def placement(spec: ServiceSpec, replica: int, rank: int) -> Placement:
    """The GPUs of rank `rank` of replica `replica` of a service."""
    if not spec.gpus:
        return Placement(None)
    if len(spec.gpus) == 1:
        return Placement(spec.gpus[0], (spec.gpus[0],), 0)
    group = spec.gpus[replica * spec.ranks:(replica + 1) * spec.ranks]
    if spec.ranks == 1:
        return Placement(group[0], (group[0],), 0)
    return Placement(group[rank], tuple(group), rank)


def gpu_memory_share(spec: ServiceSpec) -> float:
    return float(spec.args.get("gpu-memory-utilization", DEFAULT_GPU_MEMORY_UTILIZATION))


def check_placement(topo: Topology, num_gpus: int | None = None) -> None:
    """ValueError naming the service when a GPU index is beyond this host's GPUs, or the engines
    placed on one GPU ask for more than all of it."""
    num_gpus = host_gpu_count(topo) if num_gpus is None else num_gpus
    shares: dict[int, list[tuple[str, float]]] = defaultdict(list)
    for spec in topo.services:
        if not spec.gpus:
            continue
        bad = [g for g in spec.gpus if g >= num_gpus]
        if bad:
            have = f"GPUs 0-{num_gpus - 1}" if num_gpus else "no GPU"
            raise ValueError(f"services.{spec.kind}.gpus asks for GPU {bad[0]}, but this host has {have} "
                             "(set `host_gpus` in the topology for a host you are not on)")
        for replica in range(spec.replicas):
            for rank in range(spec.ranks):
                name = f"{spec.kind}-{replica}" + (f".rank{rank}" if spec.ranks > 1 else "")
                shares[placement(spec, replica, rank).gpu].append((name, gpu_memory_share(spec)))
    for gpu, users in sorted(shares.items()):
        total = sum(s for _, s in users)
        if total > 1.0 + 1e-9:
            who = ", ".join(f"{n} ({s:g})" for n, s in users)
            raise ValueError(f"GPU {gpu} is over-committed: gpu-memory-utilization of {who} adds up to "
                             f"{total:g} > 1; lower the shares of these services so they sum to at most 1")

