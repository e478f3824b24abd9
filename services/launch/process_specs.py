"""The processes a topology runs, decided before any starts: name, command line, environment, GPUs,
advertised address and ports. `pdserve up` starts them; `pdserve up --dry-run` prints them.

    procs = plan(topo, redis_url, fixed_ports)       # fixed_ports: 0 stays 0 ("any free port")
    print(describe(topo, redis_url, procs))
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from services.launch import topology as topo_mod
from services.launch.placement import Placement, gpu_memory_share, placement
from services.launch.topology import Ports, ServiceSpec, Topology

PortsOf = Callable[[Topology, ServiceSpec, int], Ports]


@dataclass(frozen=True)
class PlannedProcess:
    name: str  # e.g. decode-3, prefill-0.rank5
    kind: str
    cmd: list[str]
    env: dict[str, str]  # on top of the launcher's own environment
    placement: Placement
    address: str = ""  # gRPC host:port checked for health ('' for ranks > 0)
    http: str = ""  # router HTTP host:port
    ports: Ports = field(default_factory=lambda: Ports(0, 0))


def fixed_ports(topo: Topology, spec: ServiceSpec, replica: int) -> Ports:
    """The ports the topology names (replica i: port + i); 0 stays 0, picked when the process starts."""
    def at(base: int) -> int:
        return base + replica if base else 0

    return Ports(port=at(spec.port), metrics_port=at(spec.metrics_port),
                 grpc_port=at(spec.extra.get("grpc_port", 0)) if spec.kind == "router" else 0)


def plan_service(topo: Topology, spec: ServiceSpec, redis_url: str, ports_of: PortsOf) -> list[PlannedProcess]:
    out = []
    host = topo.advertised
    for replica in range(spec.replicas):
        ports = ports_of(topo, spec, replica)
        for rank in range(spec.ranks):
            name = f"{spec.kind}-{replica}" + (f".rank{rank}" if spec.ranks > 1 else "")
            cmd = [sys.executable, "-m", spec.module_name, *topo_mod.flags(topo, spec, replica, rank, ports, redis_url)]
            where = placement(spec, replica, rank)
            out.append(PlannedProcess(name, spec.kind, cmd, {**topo.env, **spec.env, **where.env()}, where,
                                      address=f"{host}:{ports.grpc_port or ports.port}" if rank == 0 else "",
                                      http=f"{host}:{ports.port}" if spec.kind == "router" else "", ports=ports))
    return out


def plan(topo: Topology, redis_url: str, ports_of: PortsOf = fixed_ports) -> list[PlannedProcess]:
    return [p for spec in topo.services for p in plan_service(topo, spec, redis_url, ports_of)]


def describe(topo: Topology, redis_url: str, procs: list[PlannedProcess]) -> str:
    """What `pdserve up --dry-run` prints: one block per process."""
    lines = [f"redis       {redis_url} (used if it answers; else started here when it names this host)",
             f"host        binds {topo.host}, advertises {topo.advertised}"]
    specs = {s.kind: s for s in topo.services}
    for p in procs:
        ports = p.ports
        named = [f"port {ports.port or 'auto'}", f"metrics {ports.metrics_port or 'auto'}"]
        if p.kind == "router":
            named.append(f"grpc {ports.grpc_port or 'auto'}")
        gpu = "-" if p.placement.gpu is None else (f"{p.placement.gpu} (CUDA_VISIBLE_DEVICES="
                                                   f"{p.env['CUDA_VISIBLE_DEVICES']} LOCAL_RANK={p.env['LOCAL_RANK']}, "
                                                   f"memory share {gpu_memory_share(specs[p.kind]):g})")
        lines += [f"{p.name}", f"  host      {topo.advertised}   {'  '.join(named)}", f"  gpu       {gpu}",
                  f"  command   {shlex.join(p.cmd)}"]
        extra = {k: v for k, v in p.env.items() if k not in ("CUDA_VISIBLE_DEVICES", "LOCAL_RANK")}
        if extra:
            lines.append(f"  env       {' '.join(f'{k}={v}' for k, v in sorted(extra.items()))}")
    lines.append(f"{len(procs)} processes")
    return "\n".join(lines)
