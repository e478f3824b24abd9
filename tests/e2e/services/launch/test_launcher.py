"""`pdserve up`/`down` with real processes: a private Redis it starts itself, the real kvstore, a
2-rank prefill stand-in and a router stand-in (stand-ins: they start at once and record their flags; the real
services run in tests/e2e/test_system.py)."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import pytest

from engine.parallel.dist import free_port
from services.cluster.redis_server import ping
from services.cluster.redis_state import RedisState
from services.launch import launcher
from services.rpc.grpc_server import check_health_sync
from tests.helpers.pace import pinned

pytestmark = pytest.mark.timeout(300)

STANDIN = "tests.helpers.standin_service"


def _topology(run_dir: Path, redis_port: int, **services) -> dict:
    return {"model": "checkpoints/tiny-code", "host": "127.0.0.1", "run_dir": str(run_dir),
            "redis_url": f"redis://127.0.0.1:{redis_port}/0", "services": services}


def test_up_health_and_down(tmp_path, monkeypatch):
    monkeypatch.setenv("STANDIN_ARGV_DIR", str(tmp_path))
    redis_port = free_port()
    topo = _topology(tmp_path / "run", redis_port,
                     kvstore={"args": {"pool-gib": 0.01, "heartbeat-s": 0.2}},
                     prefill={"module": STANDIN, "prefill_context_parallel_size": 2,
                              "decode_context_parallel_size": 2, "args": {"enable-expert-parallel": True}},
                     router={"module": STANDIN})
    with pinned():
        dep = launcher.up(topo, timeout_s=240, die_with_parent=True)
    try:
        assert dep.redis_pid and ping(dep.redis_url)  # none answered there: it started one
        names = [p.name for p in dep.processes]
        assert names == ["kvstore-0", "prefill-0.rank0", "prefill-0.rank1", "router-0"]
        ends = dep.endpoints()
        assert all(check_health_sync(a) for a in ends["kvstore"] + ends["prefill"] + ends["router_grpc"])
        assert ends["router"][0].startswith("http://127.0.0.1:")
        assert all(launcher.status(dep.run_dir).values())
        argv = json.loads((tmp_path / "prefill-0.rank1.json").read_text())
        for flag, value in (("--rank", "1"), ("--world-size", "2"), ("--prefill-context-parallel-size", "2"),
                            ("--redis-url", dep.redis_url), ("--instance-id", "prefill-0")):
            assert argv[argv.index(flag) + 1] == value
        assert "--enable-expert-parallel" in argv
        assert Path(dep.run_dir, "kvstore-0.log").exists()

        async def registered():
            state = RedisState(dep.redis_url)
            try:
                return [i.instance_id for i in await state.instances("kvstore")]
            finally:
                await state.close()
        assert asyncio.run(registered()) == ["kvstore-0"]
        with pytest.raises(RuntimeError, match="already runs"):
            launcher.up(topo, timeout_s=10)
    finally:
        launcher.down(dep.run_dir)  # from the state file, as `pdserve down` does
    assert not any(launcher._is_ours(p) for p in dep.processes)
    assert not ping(dep.redis_url) and not Path(dep.run_dir, "state.json").exists()


def test_up_fails_cleanly_when_a_service_crashes(tmp_path, redis_server):
    topo = _topology(tmp_path / "run", 0, prefill={"module": STANDIN, "args": {"crash": True}})
    topo["redis_url"] = redis_server.url  # answers: used as is, not stopped by down
    with pytest.raises(RuntimeError, match="stand-in told to crash"), pinned():
        launcher.up(topo, timeout_s=240, die_with_parent=True)
    assert ping(redis_server.url)
    assert not Path(tmp_path, "run", "state.json").exists()


def test_down_without_state_is_a_no_op(tmp_path):
    launcher.down(tmp_path)


def test_a_picked_port_taken_before_the_service_binds_it_gets_new_ports(tmp_path, redis_server, monkeypatch):
    """Another process takes the port the launcher picked for the kvstore before the kvstore binds it: the
    kvstore exits with PORT_IN_USE_EXIT and the launcher starts it again on new ports."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        picks = iter([port])
        monkeypatch.setattr(launcher, "free_port", lambda host="127.0.0.1": next(picks, None) or free_port(host))
        topo = _topology(tmp_path / "run", 0, kvstore={"args": {"pool-gib": 0.01}})
        topo["redis_url"] = redis_server.url
        said: list[str] = []
        with pinned():
            dep = launcher.up(topo, timeout_s=240, die_with_parent=True, echo=said.append)
    try:
        (rec,) = dep.processes
        assert not rec.address.endswith(f":{port}") and check_health_sync(rec.address)
        assert any("new ports" in line for line in said), said
        log = Path(rec.log).read_text()
        assert f"could not bind gRPC port 127.0.0.1:{port}: in use" in log
    finally:
        launcher.down(dep)


def test_a_taken_port_the_topology_names_is_an_error(tmp_path, redis_server):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        topo = _topology(tmp_path / "run", 0, kvstore={"port": port, "metrics_port": free_port(),
                                                       "args": {"pool-gib": 0.01}})
        topo["redis_url"] = redis_server.url
        with pytest.raises(RuntimeError, match=f"could not bind gRPC port 127.0.0.1:{port}: in use"), pinned():
            launcher.up(topo, timeout_s=240, die_with_parent=True)
    assert not Path(tmp_path, "run", "state.json").exists()
