"""free_port draws below the OS's ephemeral range (where no client socket is given a local port meanwhile) or in
PDSERVE_PORT_RANGE, returns bindable ports, never hands out a port twice while its taker may not have bound it,
and falls back to the OS's choice when that range is full."""

from __future__ import annotations

import socket

import pytest

from engine import settings
from engine.parallel import dist


@pytest.fixture
def fresh(monkeypatch):
    """No port handed out yet; PDSERVE_PORT_RANGE unset (the test workers set one each)."""
    monkeypatch.setattr(dist, "_HANDED_OUT", {})
    monkeypatch.delenv("PDSERVE_PORT_RANGE", raising=False)


def test_ports_come_from_below_the_ephemeral_range_and_bind(fresh):
    low = dist._ephemeral_low()
    ports = {dist.free_port() for _ in range(50)}
    assert all(max(1024, low - 12000) <= p < low for p in ports), sorted(ports)
    assert len(ports) > 40, "drawn at random, not in sequence"
    for p in list(ports)[:5]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", p))


def test_a_port_is_never_handed_out_twice_before_its_taker_binds(fresh, monkeypatch):
    """A launcher picks every port of a deployment before any process binds one: each pick is still free, so
    only the memory of what was handed out keeps two services off the same port."""
    monkeypatch.setenv("PDSERVE_PORT_RANGE", "29000-29039")
    ports = [dist.free_port() for _ in range(40)]
    assert sorted(ports) == list(range(29000, 29040))  # 40 draws from 40 ports: each exactly once
    monkeypatch.setattr(dist, "_ephemeral_low", lambda: 33000)  # the range is spent: the OS chooses, still new
    assert dist.free_port() not in ports


def test_a_promise_expires(fresh, monkeypatch):
    monkeypatch.setenv("PDSERVE_PORT_RANGE", "29100-29100")
    port = dist.free_port()
    assert port == 29100
    dist._HANDED_OUT[port] -= dist._PROMISE_S + 1
    assert dist.free_port() == 29100


@pytest.mark.parametrize("raw", ["29000", "a-b", "29010-29000", "80-90", "60000-70000"])
def test_a_bad_port_range_is_named(monkeypatch, raw):
    monkeypatch.setenv("PDSERVE_PORT_RANGE", raw)
    with pytest.raises(ValueError, match="PDSERVE_PORT_RANGE"):
        settings.port_range()


def test_a_crowded_range_falls_back_to_the_os(fresh, monkeypatch):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        monkeypatch.setattr(dist, "_ephemeral_low", lambda: taken + 1)
        monkeypatch.setattr(dist._PORTS, "randrange", lambda lo, hi: taken)  # every draw hits the held port
        port = dist.free_port()
    assert port != taken and port > 0
