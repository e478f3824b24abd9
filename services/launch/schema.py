"""What a topology file parses into (services/launch/topology.py reads and checks the file): one
`ServiceSpec` per service kind, in start order, inside a `Topology`. Plain frozen records, so the
launcher, the GPU placement (placement.py) and the process plan (process_specs.py) share them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.rpc import net

ROOT = Path(__file__).resolve().parents[2]
ORDER = ("kvstore", "prefill", "decode", "router")  # start order
GPU_KINDS = ("prefill", "decode")  # the kinds that run engines, the only ones that may name GPUs
ANY_ADDRESS = ("0.0.0.0", "::", "")


@dataclass(frozen=True)
class ServiceSpec:
    kind: str
    replicas: int = 1
    port: int = 0
    metrics_port: int = 0
    args: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    module: str = ""
    extra: dict[str, int] = field(default_factory=dict)  # kind-specific keys (topology._KIND_KEYS)
    gpus: tuple[int, ...] = ()  # prefill / decode: one GPU per process, or one shared by all

    @property
    def module_name(self) -> str:
        return self.module or f"services.{self.kind}"

    @property
    def ranks(self) -> int:
        """Processes per replica: the prefill engine's ranks, a decode group's DP ranks, 1 for everything else."""
        if self.kind == "decode":
            return self.extra.get("data_parallel_size", 1)
        if self.kind != "prefill":
            return 1
        pcp = self.extra.get("prefill_context_parallel_size", 1)
        dcp = self.extra.get("decode_context_parallel_size", 1)
        return self.extra.get("ranks", max(pcp, dcp))

    @property
    def num_processes(self) -> int:
        return self.replicas * self.ranks


@dataclass(frozen=True)
class Topology:
    model: str
    host: str = "127.0.0.1"
    run_dir: str = ".run"
    redis_url: str = "redis://127.0.0.1:6379/0"
    env: dict[str, str] = field(default_factory=dict)
    services: tuple[ServiceSpec, ...] = ()
    advertise_host: str = ""
    host_gpus: int | None = None
    multi_host: bool = False

    @property
    def advertised(self) -> str:
        """The address the processes register in Redis: never a wildcard such as 0.0.0.0."""
        if self.advertise_host:
            return self.advertise_host
        if self.host in ANY_ADDRESS:
            return net.routable_address()
        return self.host

    def service(self, kind: str) -> ServiceSpec | None:
        return next((s for s in self.services if s.kind == kind), None)

    def path(self, p: str) -> Path:
        """A topology path, relative to the project root unless absolute."""
        return Path(p) if Path(p).is_absolute() else ROOT / p
