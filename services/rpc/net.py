"""Addresses: free loopback ports, the host address a service advertises, `host:port` parsing."""

from __future__ import annotations

import socket

from engine import envs


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the OS may hand it out again: bind soon)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def advertise_host(explicit: str | None = None, bind_host: str | None = None) -> str:
    """The address other processes should dial to reach this one. A service bound to loopback
    advertises loopback (its host IP would not answer).

    In a container the hostname resolves to the container's IP on the compose network, which is
    what scaled replicas (no fixed name or host port) must register in Redis.
    """
    host = explicit or envs.advertise_host()
    if host:
        return host
    if bind_host in LOOPBACK:
        return "127.0.0.1"
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def split_address(address: str) -> tuple[str, int]:
    """'host:port' -> (host, port), with a ValueError that names the bad address."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"expected host:port, got {address!r}")
    return host, int(port)
