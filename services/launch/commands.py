"""`pdserve up | down | status` (the command table is services/cli.py): flags, messages, exit status.
What they do is services/launch/launcher.py; `up --dry-run` prints services/launch/process_specs.py's plan."""

from __future__ import annotations

import argparse
import sys

from services.launch import topology
from services.launch.launcher import Deployment, down, status, up
from services.launch.placement import check_placement
from services.launch.process_specs import describe, plan
from services.launch.schema import ROOT


def up_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="pdserve up", description="start every service of a topology, wait until healthy")
    p.add_argument("--config", default=str(ROOT / "configs" / "topology.cpu.yaml"),
                   help="topology YAML (configs/README.md)")
    p.add_argument("--run-dir", default=None, help="logs + state (default: the topology's run_dir)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for health")
    p.add_argument("--dry-run", action="store_true",
                   help="print every process (command line, GPUs, host, ports) and start nothing")
    a = p.parse_args(argv)
    if a.dry_run:
        return _dry_run(a.config)
    dep = start(a.config, a.run_dir, a.timeout, "pdserve up")
    if dep is None:
        return 1
    print(f"logs in {dep.run_dir}; stop with `pdserve down --run-dir {dep.run_dir}`")
    return 0


def start(topology, run_dir: str | None, timeout_s: float, prog: str) -> Deployment | None:
    """`up`, then every endpoint printed; None (the reason printed) when it failed."""
    try:
        dep = up(topology, run_dir=run_dir, timeout_s=timeout_s, echo=print)
    except (RuntimeError, ValueError, OSError) as e:
        print(f"{prog} failed: {e}", file=sys.stderr)
        return None
    for kind, addresses in dep.endpoints().items():
        print(f"{kind:12s} {'  '.join(addresses)}")
    return dep


def _dry_run(config: str) -> int:
    try:
        topo = topology.load(config)
        check_placement(topo)
    except (ValueError, OSError) as e:
        print(f"pdserve up: {e}", file=sys.stderr)
        return 1
    print(describe(topo, topo.redis_url, plan(topo, topo.redis_url)))
    return 0


def _run_dir_arg(prog: str, argv: list[str]) -> str:
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("--run-dir", default=str(ROOT / ".run"))
    return p.parse_args(argv).run_dir


def down_main(argv: list[str]) -> int:
    down(_run_dir_arg("pdserve down", argv))
    return 0


def status_main(argv: list[str]) -> int:
    for name, alive in status(_run_dir_arg("pdserve status", argv)).items():
        print(f"{name:20s} {'running' if alive else 'stopped'}")
    return 0
