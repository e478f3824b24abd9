"""`pdserve scale SERVICE N`: add or remove replicas of a service of a running `pdserve up` deployment.

    more replicas   planned from the topology `up` started (stored in the run directory's state.json), replica
                    indices after the highest running one, on their own ports; the command returns once they
                    answer health checks. They register in Redis themselves, so routers start using them at once.
    fewer replicas  the highest replicas get SIGTERM: each leaves the registry and drains (it finishes its
                    requests, up to its --shutdown-timeout: docs/failures.md, "Drain and migration") before it
                    exits; a multi-rank replica is signalled through its rank 0 and its other ranks leave with it.

On Kubernetes the same is `kubectl scale` (or an autoscaler: deploy/k8s/autoscaling); this is the one-host form.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

from services.launch import launcher
from services.launch import topology as topo_mod
from services.launch.launcher import Deployment, ProcessRecord
from services.launch.process_specs import plan_service
from services.launch.schema import ROOT
from services.rpc.procs import stop_pid

_REPLICA = re.compile(r"^(?P<kind>[a-z]+)-(?P<replica>\d+)(\.rank(?P<rank>\d+))?$")
DRAIN_MARGIN_S = 30.0  # beyond the services' own --shutdown-timeout, before scale-in gives up on a process


def replicas_of(dep: Deployment, kind: str) -> dict[int, list[ProcessRecord]]:
    """Running replica index -> its processes (rank 0 first)."""
    out: dict[int, list[ProcessRecord]] = {}
    for rec in dep.processes:
        m = _REPLICA.match(rec.name)
        if m and m["kind"] == kind and launcher._is_ours(rec):
            out.setdefault(int(m["replica"]), []).append(rec)
    for recs in out.values():
        recs.sort(key=lambda r: r.name)
    return dict(sorted(out.items()))


def scale(run_dir: str | Path, kind: str, n: int, *, timeout_s: float = 300.0, drain_s: float = 630.0,
          echo: Callable[[str], None] = lambda s: None) -> Deployment:
    """Bring service `kind` of the deployment in `run_dir` to `n` replicas (see the module docstring)."""
    dep = Deployment.load(run_dir)
    if not dep.topology:
        raise ValueError(f"{run_dir}: this deployment's state has no topology (started by an older pdserve)")
    topo = topo_mod.load(dep.topology)
    spec = topo.service(kind)
    if spec is None:
        raise ValueError(f"the deployment has no {kind!r} service (it has {', '.join(s.kind for s in topo.services)})")
    if n < 0:
        raise ValueError(f"replicas must be >= 0, got {n}")
    running = replicas_of(dep, kind)
    if n > len(running):
        _add(topo, spec, dep, running, n, timeout_s, echo)
    for replica in list(running)[n:]:
        _remove(dep, running[replica], drain_s, echo)
    dep.save()
    return dep


def _add(topo, spec, dep: Deployment, running: dict, n: int, timeout_s: float, echo) -> None:
    first = max(running, default=-1) + 1
    wanted = dataclasses.replace(spec, replicas=first + n - len(running))
    started = []
    for proc in plan_service(topo, wanted, dep.redis_url, launcher._ports):
        m = _REPLICA.match(proc.name)
        if int(m["replica"]) < first:
            continue  # a running replica's plan: skipped (its ports are its own)
        rec = ProcessRecord(proc.name, spec.kind, 0, proc.cmd, str(Path(dep.run_dir, f"{proc.name}.log")),
                            address=proc.address, http=proc.http)
        rec.pid = launcher._spawn(proc.cmd, rec.log, proc.env)
        dep.processes.append(rec)
        started.append(rec)
    dep.save()
    try:
        launcher._wait_ready(started, time.monotonic() + timeout_s)
    except BaseException:
        launcher._stop_group(started, 10.0)
        dep.processes = [p for p in dep.processes if all(p is not r for r in started)]
        dep.save()
        raise
    echo(f"{spec.kind}: {', '.join(r.http or r.address for r in started if r.address)} healthy")


def _remove(dep: Deployment, recs: list[ProcessRecord], drain_s: float, echo) -> None:
    """SIGTERM to the replica's rank 0 (it drains its group), then wait for every rank; SIGKILL past drain_s."""
    head, rest = recs[0], recs[1:]
    stop_pid(head.pid, drain_s + DRAIN_MARGIN_S, launcher._children.get(head.pid))  # SIGTERM, then SIGKILL
    deadline = time.monotonic() + 30.0
    while rest and time.monotonic() < deadline:
        rest = [r for r in rest if launcher._is_ours(r)]
        time.sleep(0.1)
    if rest:
        launcher._stop_group(rest, 10.0)
    dep.processes = [p for p in dep.processes if all(p is not r for r in recs)]
    echo(f"{head.name}: drained and stopped")


def scale_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="pdserve scale", description=__doc__.split("\n\n")[0])
    p.add_argument("service", choices=("router", "prefill", "decode", "kvstore"))
    p.add_argument("replicas", type=int)
    p.add_argument("--run-dir", default=str(ROOT / ".run"))
    p.add_argument("--timeout", type=float, default=300.0, help="seconds for new replicas to become healthy")
    p.add_argument("--drain-timeout", type=float, default=630.0,
                   help="seconds a removed replica may drain before it is killed (above its --shutdown-timeout)")
    a = p.parse_args(argv)
    try:
        dep = scale(a.run_dir, a.service, a.replicas, timeout_s=a.timeout, drain_s=a.drain_timeout, echo=print)
    except (RuntimeError, ValueError, OSError) as exc:
        print(f"pdserve scale failed: {exc}", file=sys.stderr)
        return 1
    print(f"{a.service}: {len(replicas_of(dep, a.service))} replica(s)")
    return 0
