"""free_port draws below the OS's ephemeral range (where no client socket is given a local port meanwhile),
returns bindable ports, and falls back to the OS's choice when that range is full."""

from __future__ import annotations

import socket

from engine.parallel import dist


def test_ports_come_from_below_the_ephemeral_range_and_bind():
    low = dist._ephemeral_low()
    ports = {dist.free_port() for _ in range(50)}
    assert all(max(1024, low - 12000) <= p < low for p in ports), sorted(ports)
    assert len(ports) > 40, "drawn at random, not in sequence"
    for p in list(ports)[:5]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", p))


def test_a_crowded_range_falls_back_to_the_os(monkeypatch):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        monkeypatch.setattr(dist, "_ephemeral_low", lambda: taken + 1)
        monkeypatch.setattr(dist._PORTS, "randrange", lambda lo, hi: taken)  # every draw hits the held port
        port = dist.free_port()
    assert port != taken and port > 0
