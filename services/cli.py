"""The `pdserve` command: `pdserve up [--config FILE]`, `pdserve down`, `pdserve status`."""

from __future__ import annotations

import argparse
import sys

from services.topology import ROOT

DEFAULT_CONFIG = ROOT / "configs" / "topology.cpu.yaml"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve")
    sub = p.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up", help="start every service of a topology and wait until healthy")
    u.add_argument("--config", default=str(DEFAULT_CONFIG), help="topology YAML (configs/README.md)")
    u.add_argument("--run-dir", default=None, help="logs + state (default: the topology's run_dir)")
    u.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for health")
    for name, text in (("down", "stop what `pdserve up` started"), ("status", "which processes are alive")):
        s = sub.add_parser(name, help=text)
        s.add_argument("--run-dir", default=str(ROOT / ".run"))
    a = p.parse_args(argv)

    from services import launcher

    if a.cmd == "up":
        try:
            dep = launcher.up(a.config, run_dir=a.run_dir, timeout_s=a.timeout, echo=print)
        except (RuntimeError, ValueError, OSError) as e:
            print(f"pdserve up failed: {e}", file=sys.stderr)
            return 1
        for kind, addresses in dep.endpoints().items():
            print(f"{kind:12s} {'  '.join(addresses)}")
        print(f"logs in {dep.run_dir}; stop with `pdserve down --run-dir {dep.run_dir}`")
    elif a.cmd == "down":
        launcher.down(a.run_dir)
    else:
        for name, alive in launcher.status(a.run_dir).items():
            print(f"{name:20s} {'running' if alive else 'stopped'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
