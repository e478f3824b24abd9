"""Stopping and starting the services of a running deployment the way an operator's rolling restart does, for
`pdserve bench restart`: a signal to one service, its exit, the same command started again (same ports, same
instance id, same environment), and the wait until it serves and is registered again.

Only processes this deployment started are signalled, by pid, after checking the pid still runs the recorded
command line; a restarted process goes into the launcher's own records, so that `launcher.down` stops it too.
It is started from the thread that runs the restarts (the caller's), because the launcher ties every service to
the thread that started it (PR_SET_PDEATHSIG): a helper thread that ended would take the service down with it.
"""

from __future__ import annotations

import os
import re
import signal
import time
import urllib.request
from collections.abc import Callable
from datetime import datetime

from bench.serving.restart_report import Restart
from services.cluster.redis_state import registered_instances
from services.launch import launcher
from services.rpc.grpc_server import check_health_sync
from services.rpc.procs import tie_to_parent

MIGRATIONS = "pdserve:request_migrations_total"
SIGNALS = {"term": signal.SIGTERM, "kill": signal.SIGKILL}
START_TIMEOUT_S = 600.0  # a service's start on a loaded 2-core machine: tens of seconds; this only bounds a failure


def record(dep: launcher.Deployment, name: str) -> launcher.ProcessRecord:
    found = [p for p in dep.processes if p.name == name]
    if not found:
        raise ValueError(f"no process {name!r} in this deployment: {[p.name for p in dep.processes]}")
    return found[-1]


def counter(address: str, name: str) -> float:
    """A counter or gauge from a service's /metrics (0 before it was ever set)."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def router_metrics_address(redis_url: str) -> str:
    routers = registered_instances(redis_url, "router")
    if not routers:
        raise RuntimeError("no router is registered")
    return routers[0].metrics_address


def _environment(pid: int) -> dict[str, str]:
    """The environment a process started with, so that it starts again with the same one."""
    raw = open(f"/proc/{pid}/environ", "rb").read()
    return dict(kv.decode(errors="replace").split("=", 1) for kv in raw.split(b"\0") if b"=" in kv)


def wait_until(pred: Callable[[], bool], timeout_s: float, period_s: float = 0.1) -> bool:
    """Poll `pred` until it holds (True) or `timeout_s` passed (False): the bound only limits how long a failure
    takes to show; a slow machine just waits longer."""
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(period_s)
    return True


def _serving(dep: launcher.Deployment, rec: launcher.ProcessRecord) -> bool:
    if not launcher._is_ours(rec):
        raise RuntimeError(f"{rec.name} exited while starting again; log: {rec.log}\n{tail(rec.log)}")
    return (check_health_sync(rec.address, timeout=0.5)
            and any(i.instance_id == rec.name for i in registered_instances(dep.redis_url)))


def restart_one(dep: launcher.Deployment, name: str, mode: str, exit_timeout_s: float,
                echo: Callable[[str], None] = lambda s: None) -> Restart:
    """Signal one service, wait for its exit (SIGTERM: its drain, up to its --shutdown-timeout), start its
    command again, and return once it answers gRPC health SERVING and is in the Redis registry. A service
    that outlives `exit_timeout_s` after SIGTERM is killed (and the exit code says so)."""
    rec = record(dep, name)
    if not launcher._is_ours(rec):
        raise RuntimeError(f"{name} is not running")
    env = _environment(rec.pid)
    r = Restart(mode, name, time.perf_counter())
    os.kill(rec.pid, SIGNALS[mode])
    if not wait_until(lambda: not launcher._is_ours(rec), exit_timeout_s):
        echo(f"{name} still runs {exit_timeout_s:.0f} s after SIG{mode.upper()}: killing it")
        os.kill(rec.pid, signal.SIGKILL)
        wait_until(lambda: not launcher._is_ours(rec), 60)
    r.t_exited = time.perf_counter()
    child = launcher._children.pop(rec.pid, None)
    r.exit_code = None if child is None else child.poll()
    rec.pid = launcher._spawn(tie_to_parent(rec.cmd), rec.log, env)
    dep.save()
    if not wait_until(lambda: _serving(dep, rec), START_TIMEOUT_S, period_s=0.25):
        raise RuntimeError(f"{name} did not serve again within {START_TIMEOUT_S:.0f} s; log: {rec.log}\n"
                           f"{tail(rec.log)}")
    r.t_ready = time.perf_counter()
    echo(f"  {mode} {name}: exited {r.exit_code} after {r.t_exited - r.t_signal:.1f} s, "
         f"serving again after {r.t_ready - r.t_signal:.1f} s")
    return r


# ---- service logs ------------------------------------------------------------------------------------------

def tail(path: str, num_lines: int = 30) -> str:
    try:
        with open(path, errors="replace") as f:
            return "\n".join(f.read().splitlines()[-num_lines:])
    except OSError as e:
        return f"(no log: {e})"


_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def lines_between(text: str, wall_from: float, wall_to: float, limit: int = 40) -> list[str]:
    """The log lines stamped within [wall_from, wall_to] (epoch seconds; the services log local time), with
    the unstamped lines (tracebacks) that follow them."""
    out, keep = [], False
    for line in text.splitlines():
        m = _STAMP.match(line)
        if m:
            t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            keep = wall_from <= t <= wall_to
        if keep:
            out.append(line)
    return out[:limit]


def lines_naming(text: str, needle: str, limit: int = 20) -> list[str]:
    return [line for line in text.splitlines() if needle in line][:limit]
