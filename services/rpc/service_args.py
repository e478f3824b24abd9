"""The flags the services share, declared once (the launcher passes them; see configs/README.md), the rank
flags of a multi-process engine and what they become (torchrun's environment), and logging set-up.

    every service           add_endpoint_args   --host --port --metrics-port --redis-url --instance-id
                                                --advertise-host --shutdown-timeout
    registered in Redis     add_instance_args   + --heartbeat-s --instance-ttl-s --block-ttl-s
    engine-hosting          add_service_args    + --max-inflight-requests --max-queued-requests, the rank flags
    KV block layout         engine.config.arg_utils.add_kv_layout_args (engines and the kvstore must agree)
"""

from __future__ import annotations

import argparse
import logging

from engine import settings
from services.rpc.drain import DEFAULT_SHUTDOWN_TIMEOUT_S


def add_endpoint_args(p: argparse.ArgumentParser, default_port: int, *, host: str = "127.0.0.1",
                      host_help: str = "address to bind gRPC and /metrics (loopback by default; 0.0.0.0 to serve "
                                       "other hosts)",
                      port_help: str = "gRPC port (0 = any free port)",
                      metrics_help: str = "HTTP /metrics port (0 = any free port)") -> argparse._ArgumentGroup:
    """Binding, identity and the shared state's address: the flags of every service (the router included)."""
    g = p.add_argument_group("service")
    g.add_argument("--host", default=host, help=host_help)
    g.add_argument("--port", type=int, default=default_port, help=port_help)
    g.add_argument("--metrics-port", type=int, default=0, help=metrics_help)
    g.add_argument("--redis-url", default=settings.redis_url())
    g.add_argument("--instance-id", default=None, help="default: <role>-<advertised host>-<port>")
    g.add_argument("--advertise-host", default=None, help="address others dial (default: this host's IP)")
    g.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                   help="on SIGTERM: stop taking work and finish what is in flight for up to this many seconds, "
                        "then hand the rest to other instances and exit (a second SIGTERM: at once; "
                        "services/rpc/drain.py)")
    return g


def add_instance_args(p: argparse.ArgumentParser, default_port: int) -> argparse._ArgumentGroup:
    """`add_endpoint_args` plus the registration flags of a service registered in Redis (kvstore included)."""
    g = add_endpoint_args(p, default_port)
    g.add_argument("--heartbeat-s", type=float, default=1.0)
    g.add_argument("--instance-ttl-s", type=float, default=5.0)
    g.add_argument("--block-ttl-s", type=float, default=600.0)
    return g


def add_admission_args(g: argparse._ArgumentGroup, inflight_help: str, queued_help: str | None = None,
                       aliases: tuple[str, ...] = ()) -> None:
    """The bounds of services/rpc/admission.py: requests served at once (and, for engines, waiting)."""
    g.add_argument("--max-inflight-requests", *aliases, dest="max_inflight_requests", type=int, default=1024,
                   help=inflight_help)
    if queued_help is not None:
        g.add_argument("--max-queued-requests", type=int, default=256, help=queued_help)


def add_service_args(p: argparse.ArgumentParser, default_port: int) -> None:
    """`add_instance_args` plus admission bounds and the rank flags of an engine-hosting service."""
    g = add_instance_args(p, default_port)
    add_admission_args(g, "RPCs (Prefill / Generate) served at once; beyond: RESOURCE_EXHAUSTED",
                       "requests waiting (engine queue, KV room) before RESOURCE_EXHAUSTED")
    r = p.add_argument_group("ranks (multi-process engines)")
    r.add_argument("--rank", type=int, default=0)
    r.add_argument("--world-size", type=int, default=1)
    r.add_argument("--master-addr", default="127.0.0.1")
    r.add_argument("--master-port", type=int, default=0)


def rank_flags(rank: int, world_size: int, master_addr: str, master_port: int) -> list[str]:
    """The flags that place one process in its engine's torch.distributed group (read by add_service_args)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world size {world_size}")
    return ["--rank", str(rank), "--world-size", str(world_size), "--master-addr", master_addr,
            "--master-port", str(master_port)]


def set_rank_environ(args: argparse.Namespace) -> None:
    """A service process started rank by rank (the launcher, services.launch.ranks): its rank flags become
    torchrun's environment, the one contract every rank of an engine is started with (engine.parallel.spawn)."""
    # here, not at the top: the router imports this module too, and must not load torch (test_router_imports)
    import torch

    from engine.parallel.dist import DistEnv

    # The launcher names each rank's GPU (LOCAL_RANK within its CUDA_VISIBLE_DEVICES); else rank r uses GPU r.
    env = DistEnv.for_rank(args.rank, args.world_size, args.master_addr, args.master_port,
                           cuda=torch.cuda.is_available(), local_rank=settings.assigned_local_rank())
    settings.set_torchrun_environ(env.to_environ())


def setup_logging() -> None:
    logging.basicConfig(level=settings.log_level(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
