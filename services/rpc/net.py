"""Addresses: the host address a service advertises (never a wildcard), local addresses, `host:port`
parsing, listening sockets and the exit status for a taken port (free ports: engine.parallel.dist)."""

from __future__ import annotations

import errno
import socket

from engine import settings

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def advertise_host(explicit: str | None = None, bind_host: str | None = None) -> str:
    """The address other processes should dial to reach this one (never a wildcard such as 0.0.0.0).
    A service bound to loopback advertises loopback (its host IP would not answer); one bound to a
    wildcard advertises this host's routable address; one bound to an address advertises it.

    In a container the hostname resolves to the container's IP on the compose network, which is
    what scaled replicas (no fixed name or host port) must register in Redis.
    """
    host = explicit or settings.advertise_host()
    if host and host not in WILDCARDS:
        return host
    if bind_host in LOOPBACK:
        return "127.0.0.1"
    if bind_host and bind_host not in WILDCARDS:
        return bind_host
    return routable_address()


WILDCARDS = ("0.0.0.0", "::", "")


def routable_address() -> str:
    """This host's address on its default route (what other hosts dial), else its hostname's address.
    Connecting a UDP socket sends nothing; it only selects the outgoing interface."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            addr = s.getsockname()[0]
            if addr and addr not in WILDCARDS:
                return addr
    except OSError:
        pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def is_local_address(host: str) -> bool:
    """True when `host` names an address of this machine (a socket can bind it)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            return True
    except OSError:
        return False


def split_address(address: str) -> tuple[str, int]:
    """'host:port' -> (host, port), with a ValueError that names the bad address."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"expected host:port, got {address!r}")
    return host, int(port)


PORT_IN_USE_EXIT = 98  # a service's exit status when a port it was told to listen on is taken (EADDRINUSE)


class PortInUse(OSError):
    """A port this service was told to listen on is taken. `services.rpc.grpc_server.run` turns it into exit
    status PORT_IN_USE_EXIT, on which the launcher starts the service again on new ports when it chose them."""


def raise_if_port_in_use(exc: OSError, what: str, host: str, port: int) -> None:
    """PortInUse naming the `what` port host:port when `exc` says that it is taken (EADDRINUSE)."""
    if exc.errno == errno.EADDRINUSE:
        raise PortInUse(exc.errno, f"could not bind {what} port {host}:{port}: in use") from exc


def bind_listener(host: str, port: int, what: str) -> socket.socket:
    """A TCP socket bound to host:port (SO_REUSEADDR, as servers set it), for a server to listen on; raises
    PortInUse naming `what` when the port is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise_if_port_in_use(exc, what, host, port)
        raise
    return sock
