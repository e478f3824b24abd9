"""The Redis `pdserve up` starts binds the address its URL names (other hosts of a multi-host topology
reach it there), and is never started for an address of another machine."""

from __future__ import annotations

import pytest

from engine.parallel.dist import free_port
from services.cluster.redis_server import ensure_redis, ping
from services.rpc.net import is_local_address, routable_address


def test_redis_is_started_on_the_hosts_own_address(tmp_path):
    host = routable_address()
    if host.startswith("127.") or not is_local_address(host):
        pytest.skip(f"this machine has no routable address of its own ({host})")
    url = f"redis://{host}:{free_port(host)}/0"
    got, server = ensure_redis(url, workdir=str(tmp_path / "redis"), die_with_parent=True)
    try:
        assert got == url and server is not None and ping(url)
        assert not ping(url.replace(host, "127.0.0.1"))  # bound to that address, not to every interface
    finally:
        server.stop()
    assert not ping(url)


def test_no_redis_is_started_for_another_machine(tmp_path):
    assert not is_local_address("203.0.113.7")  # TEST-NET-3: never an address of this machine
    with pytest.raises(ConnectionError, match="only at an address of this host"):
        ensure_redis("redis://203.0.113.7:6390/0", workdir=str(tmp_path / "redis"))
    assert not (tmp_path / "redis").exists()
