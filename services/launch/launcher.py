"""What `pdserve up` / `pdserve down` do (their flags: services/launch/commands.py): run a topology
(services/launch/topology.py) as local processes.

    handle = up("configs/topology.cpu.yaml")   # or a dict; returns once every service is healthy
    handle.endpoints()                          # {"kvstore": ["127.0.0.1:50060"], "router": [...]}
    down(handle)                                # or down() / down(".run") from another process

`up` starts Redis when none answers at the topology's URL, then kvstore, prefill (one process per
rank), decode and router, each `python -m <module> <flags>` in its own session (process group) with
its log in the run directory, and waits after each kind for gRPC health (+ HTTP /health of the
router). The run directory's state.json lets `down` stop everything from any process: SIGTERM to
each process group in reverse order, SIGKILL after a grace period, then the Redis it started.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from engine.parallel.dist import free_port
from services.cluster.redis_server import ensure_redis
from services.launch import topology as topo_mod
from services.launch.placement import check_placement
from services.launch.process_specs import plan_service
from services.launch.topology import ROOT, Ports, ServiceSpec, Topology
from services.rpc.grpc_server import check_health_sync
from services.rpc.net import PORT_IN_USE_EXIT
from services.rpc.procs import stop_pid, tie_to_parent

STATE_FILE = "state.json"
_children: dict[int, subprocess.Popen] = {}  # processes this interpreter started (to reap them)


@dataclass
class ProcessRecord:
    name: str  # e.g. kvstore-0, prefill-0.rank1
    kind: str
    pid: int
    cmd: list[str]
    log: str
    address: str = ""  # gRPC host:port checked for health ('' for ranks > 0)
    http: str = ""  # router HTTP host:port


@dataclass
class Deployment:
    """The handle of a running topology (what state.json holds)."""

    run_dir: str
    redis_url: str = ""
    redis_pid: int = 0  # non-zero when `up` started Redis (and `down` must stop it)
    redis_workdir: str = ""
    processes: list[ProcessRecord] = field(default_factory=list)
    topology: dict = field(default_factory=dict)  # what `up` started (`pdserve scale` plans new replicas from it)

    def endpoints(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {"redis": [self.redis_url]}
        for p in self.processes:
            if p.address:
                out.setdefault(p.kind, []).append(f"http://{p.http}" if p.http else p.address)
                if p.http:
                    out.setdefault("router_grpc", []).append(p.address)
        return out

    @property
    def url(self) -> str:
        """The router's HTTP base URL (what benchmarks and clients talk to)."""
        routers = self.endpoints().get("router", [])
        if not routers:
            raise RuntimeError("this deployment has no router")
        return routers[0]

    def save(self) -> None:
        Path(self.run_dir, STATE_FILE).write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, run_dir: str | Path) -> Deployment:
        raw = json.loads(Path(run_dir, STATE_FILE).read_text())
        return cls(**{**raw, "processes": [ProcessRecord(**p) for p in raw["processes"]]})


def up(topology: str | Path | dict, *, run_dir: str | Path | None = None, timeout_s: float = 300.0,
       die_with_parent: bool = False, echo: Callable[[str], None] = lambda s: None) -> Deployment:
    """Start a topology; returns once everything answers health checks. On any failure, stops what
    it started and raises RuntimeError with the failing service's log tail. `die_with_parent`: every
    process (and Redis) gets SIGTERM if the calling thread's process dies (tests, benchmarks)."""
    topo = topo_mod.load(topology)
    check_placement(topo)  # GPUs beyond this host's, over-committed GPUs: refused before anything starts
    run = Path(run_dir) if run_dir else topo.path(topo.run_dir)
    run.mkdir(parents=True, exist_ok=True)
    _refuse_if_running(run)
    dep = Deployment(run_dir=str(run), topology=topo_mod.raw(topology))
    deadline = time.monotonic() + timeout_s
    try:
        dep.redis_url, server = ensure_redis(topo.redis_url, workdir=str(run / "redis"),
                                             die_with_parent=die_with_parent)
        if server is not None:
            dep.redis_pid, dep.redis_workdir = server.pid, server.workdir
            echo(f"started redis-server at {dep.redis_url}")
        dep.save()
        # The engines and the kvstore start together (none needs another to start: they meet in Redis);
        # the router once they answer, so that its first request finds them registered.
        routers = [s for s in topo.services if s.kind == "router"]
        for wave in ([s for s in topo.services if s.kind != "router"], routers):
            started = [(spec, _start_service(topo, spec, dep, die_with_parent)) for spec in wave]
            dep.save()
            for spec, records in started:
                records = _ready(topo, spec, records, dep, die_with_parent, deadline, echo)
                echo(f"{spec.kind}: {', '.join(p.http or p.address for p in records if p.address)} healthy")
    except BaseException:
        down(dep)
        raise
    return dep


def down(handle: Deployment | str | Path | None = None, *, timeout_s: float = 10.0) -> None:
    """Stop a deployment (a handle, or the run directory of one; default .run). Idempotent.

    The routers first (no new requests reach the engines), then every other process at once: what the
    engines and the kvstore still hold goes away with all of them, and each takes a second or two to stop,
    so waiting for them one kind at a time only adds those seconds up."""
    if not isinstance(handle, Deployment):
        run = Path(handle) if handle else ROOT / ".run"
        if not (run / STATE_FILE).exists():
            return
        handle = Deployment.load(run)
    live = [p for p in handle.processes if _is_ours(p)]
    _stop_group([p for p in live if p.kind == "router"], timeout_s)
    _stop_group([p for p in live if p.kind != "router"], timeout_s)
    if handle.redis_pid:
        stop_pid(handle.redis_pid, timeout_s)
        shutil.rmtree(handle.redis_workdir, ignore_errors=True)
    Path(handle.run_dir, STATE_FILE).unlink(missing_ok=True)


def status(handle: Deployment | str | Path | None = None) -> dict[str, bool]:
    """name -> whether that process is alive."""
    dep = handle if isinstance(handle, Deployment) else Deployment.load(Path(handle) if handle else ROOT / ".run")
    return {p.name: _is_ours(p) for p in dep.processes}


# ---- starting -----------------------------------------------------------------------------------

def _start_service(topo: Topology, spec: ServiceSpec, dep: Deployment, tied: bool) -> list[ProcessRecord]:
    started = []
    for proc in plan_service(topo, spec, dep.redis_url, _ports):
        rec = ProcessRecord(proc.name, spec.kind, 0, proc.cmd, str(Path(dep.run_dir, f"{proc.name}.log")),
                            address=proc.address, http=proc.http)
        rec.pid = _spawn(tie_to_parent(proc.cmd) if tied else proc.cmd, rec.log, proc.env)
        dep.processes.append(rec)
        started.append(rec)
    return started


def _ports(topo: Topology, spec: ServiceSpec, replica: int) -> Ports:
    def pick(base: int) -> int:
        return base + replica if base else free_port(topo.host)

    grpc_port = pick(spec.extra.get("grpc_port", 0)) if spec.kind == "router" else 0
    master_port = free_port(topo.host) if spec.ranks > 1 else 0
    return Ports(port=pick(spec.port), metrics_port=pick(spec.metrics_port), grpc_port=grpc_port,
                 master_port=master_port)


def _spawn(cmd: list[str], log: str, extra_env: dict[str, str]) -> int:
    env = {**os.environ, **extra_env}  # the launcher's environment, passed on to the service it starts
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    _children[proc.pid] = proc
    return proc.pid


PORT_RETRIES = 3  # new ports for a service whose auto-picked port was taken before it could bind it


class ExitedAtStart(RuntimeError):
    def __init__(self, rec: ProcessRecord, returncode: int | None):
        super().__init__(f"{rec.name} exited during startup ({' '.join(rec.cmd[:3])} ...); "
                         f"last lines of {rec.log}:\n{_tail(rec.log)}")
        self.returncode = returncode


def _ready(topo: Topology, spec: ServiceSpec, records: list[ProcessRecord], dep: Deployment, tied: bool,
           deadline: float, echo: Callable[[str], None]) -> list[ProcessRecord]:
    """Wait until a service's processes answer. The ports the launcher picks (`free_port`) are free when picked
    and bound seconds later by the process: another process may take one in between. Such a process exits
    with PORT_IN_USE_EXIT; when the launcher chose its ports, the whole service (every rank: they share the
    rendezvous port) starts again on new ones. Ports the topology names are not changed: that exit is an error."""
    for attempt in range(PORT_RETRIES + 1):
        try:
            _wait_ready(records, deadline)
            return records
        except ExitedAtStart as exc:
            if exc.returncode != PORT_IN_USE_EXIT or attempt == PORT_RETRIES or not _picks_ports(spec):
                raise
            echo(f"{spec.kind}: a port picked for it was taken before it bound it; starting it on new ports")
            _stop_group(records, 10.0)
            dep.processes = [p for p in dep.processes if all(p is not r for r in records)]
            records = _start_service(topo, spec, dep, tied)
            dep.save()
    raise AssertionError("unreachable")


def _picks_ports(spec: ServiceSpec) -> bool:
    return not spec.port or not spec.metrics_port or spec.ranks > 1 or (
        spec.kind == "router" and not spec.extra.get("grpc_port", 0))


def _wait_ready(records: list[ProcessRecord], deadline: float) -> None:
    pending = list(records)
    while pending:
        for rec in list(pending):
            if not _is_ours(rec):  # a rank that lost its rank 0 may exit too: a taken port wins
                codes = [c.poll() for c in (_children.get(r.pid) for r in records) if c is not None]
                raise ExitedAtStart(rec, PORT_IN_USE_EXIT if PORT_IN_USE_EXIT in codes else
                                    next((c for c in codes if c is not None), None))
            if not rec.address or (check_health_sync(rec.address, timeout=0.5)
                                   and (not rec.http or _http_ok(f"http://{rec.http}/health"))):
                pending.remove(rec)
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"{pending[0].name} not healthy before the deadline; last lines of "
                               f"{pending[0].log}:\n{_tail(pending[0].log)}")
        time.sleep(0.1)


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=0.5) as r:
            return r.status == 200
    except OSError:
        return False


def _refuse_if_running(run: Path) -> None:
    if (run / STATE_FILE).exists():
        dep = Deployment.load(run)
        alive = [p.name for p in dep.processes if _is_ours(p)]
        if alive:
            raise RuntimeError(f"{run} already runs {alive}: `pdserve down --run-dir {run}` first")
        down(dep)


def _tail(path: str, num_lines: int = 30) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-num_lines:])
    except OSError:
        return "(no log)"


# ---- stopping -----------------------------------------------------------------------------------

def _is_ours(rec: ProcessRecord) -> bool:
    """Alive, and still the process we started (a recycled pid runs another command line)."""
    child = _children.get(rec.pid)
    if child is not None:
        return child.poll() is None
    try:
        with open(f"/proc/{rec.pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")[:-1] == [c.encode() for c in rec.cmd]
    except OSError:
        return False


def _stop_group(records: list[ProcessRecord], timeout_s: float) -> None:
    for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
        for rec in records:
            try:
                os.killpg(rec.pid, sig)  # the whole session: a service's own children too
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + wait
        while records and time.monotonic() < deadline:
            records = [r for r in records if _is_ours(r)]
            time.sleep(0.05)
        if not records:
            break
    for rec in records:
        _children.pop(rec.pid, None)
