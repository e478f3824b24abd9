"""Bringing the whole system up for e2e tests: the default CPU topology on free ports, a private Redis."""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request
from pathlib import Path

import yaml

from engine.parallel.dist import free_port
from services.cluster.redis_state import RedisState
from services.launch import launcher
from tests.helpers import ROOT
from tests.helpers.pace import pinned

TOPOLOGY = ROOT / "configs" / "topology.cpu.yaml"
START_S = 300.0  # a deployment's start on a loaded machine: ~12 s when idle, each kind in turn


def topology(run_dir: Path, **overrides) -> dict:
    """The shipped CPU topology with free ports and a Redis of its own (the launcher starts it)."""
    topo = yaml.safe_load(TOPOLOGY.read_text())
    topo["run_dir"] = str(run_dir)
    topo["redis_url"] = f"redis://127.0.0.1:{free_port()}/0"
    for kind, spec in topo["services"].items():
        spec["port"] = 0
        spec["metrics_port"] = 0
        if kind == "router":
            spec["grpc_port"] = 0
        spec.setdefault("args", {}).update(overrides.get(kind, {}))
    return topo


def up(run_dir: Path, **overrides):
    return launch(topology(run_dir, **overrides))


def launch(topo: dict, timeout_s: float = START_S) -> launcher.Deployment:
    """`pdserve up` of a topology, tied to this process, its services on PDSERVE_TEST_PIN_CPU's CPUs if set."""
    with pinned():
        return launcher.up(topo, timeout_s=timeout_s, die_with_parent=True)


def post(url: str, path: str, body: dict | bytes, timeout: float = 120, headers: dict | None = None):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def metric(address: str, name: str) -> float:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


def admitted_per_rank(address: str, num_ranks: int) -> list[float]:
    """Requests each DP rank of a decode engine admitted (pdserve:dp_rank_requests_total; 0 before any)."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    out = []
    for r in range(num_ranks):
        m = re.search(rf'^pdserve:dp_rank_requests_total{{dp_rank="{r}"}} (\S+)$', text, re.M)
        out.append(float(m.group(1)) if m else 0.0)
    return out


def dp_steps(address: str) -> dict[str, float]:
    """A DP x EP decode group's steps by kind (pdserve:dp_steps_total{kind}: planned, dynamic)."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    return {kind: float(m.group(1)) if (m := re.search(rf'^pdserve:dp_steps_total{{kind="{kind}"}} (\S+)$', text, re.M))
            else 0.0 for kind in ("planned", "dynamic")}


def wait_for(fn, timeout: float = 60.0, period: float = 0.2):
    """Poll `fn` until it returns something true, or `timeout` passed; returns its last value. The deadline is
    generous (a loaded machine is slow): it bounds how long a failure takes to report, not how fast the system
    must be; a latency the product promises is asserted apart, scaled (tests/helpers/pace.py)."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(period)


def with_state(redis_url: str, fn):
    """`await fn(state)` on a RedisState of its own (closed after), from synchronous test code."""
    async def run():
        state = RedisState(redis_url)
        try:
            return await fn(state)
        finally:
            await state.close()
    return asyncio.run(run())
