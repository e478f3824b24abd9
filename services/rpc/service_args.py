"""Flags the services share (the launcher passes them; see configs/README.md), and their logging set-up."""

from __future__ import annotations

import argparse
import logging

from engine import envs


def add_instance_args(p: argparse.ArgumentParser, default_port: int) -> argparse._ArgumentGroup:
    """Binding, identity and registration flags of any registered service (kvstore included)."""
    g = p.add_argument_group("service")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to bind gRPC and /metrics (loopback by default; 0.0.0.0 to serve other hosts)")
    g.add_argument("--port", type=int, default=default_port, help="gRPC port (0 = any free port)")
    g.add_argument("--metrics-port", type=int, default=0, help="HTTP /metrics port (0 = any free port)")
    g.add_argument("--redis-url", default=envs.redis_url())
    g.add_argument("--instance-id", default=None, help="default: <role>-<advertised host>-<port>")
    g.add_argument("--advertise-host", default=None, help="address others dial (default: this host's IP)")
    g.add_argument("--heartbeat-s", type=float, default=1.0)
    g.add_argument("--instance-ttl-s", type=float, default=5.0)
    g.add_argument("--block-ttl-s", type=float, default=600.0)
    return g


def add_service_args(p: argparse.ArgumentParser, default_port: int) -> None:
    """`add_instance_args` plus admission bounds and the rank flags of an engine-hosting service."""
    g = add_instance_args(p, default_port)
    g.add_argument("--max-inflight-requests", type=int, default=1024,
                   help="RPCs (Prefill / Generate) served at once; beyond: RESOURCE_EXHAUSTED")
    g.add_argument("--max-queued-requests", type=int, default=256,
                   help="requests waiting (engine queue, KV room) before RESOURCE_EXHAUSTED")
    r = p.add_argument_group("ranks (multi-process engines)")
    r.add_argument("--rank", type=int, default=0)
    r.add_argument("--world-size", type=int, default=1)
    r.add_argument("--master-addr", default="127.0.0.1")
    r.add_argument("--master-port", type=int, default=0)


def setup_logging() -> None:
    logging.basicConfig(level=envs.log_level(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
