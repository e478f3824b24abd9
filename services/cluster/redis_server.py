"""A Redis for pdserve: use the one answering at a URL, or start a private `redis-server`.

The private server listens on the address its URL names (loopback by default), keeps no snapshot or AOF
(`--save "" --appendonly no`: everything in pdserve's Redis is rebuilt by the instances after a restart),
and lives in its own
temporary directory and process group so it can be stopped cleanly, even by another process
(`pdserve down`) that only knows its pid.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from urllib.parse import urlparse

import redis

from engine.parallel.dist import free_port
from services.rpc.net import is_local_address
from services.rpc.procs import stop_pid, tie_to_parent

LOOPBACK = ("127.0.0.1", "localhost", "::1")


class PortTaken(RuntimeError):
    """The port a redis-server was started on is held by another process."""


def _server_pid(url: str) -> int | None:
    """The process id of the Redis answering at `url` (INFO server), or None."""
    client = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5)
    try:
        return int(client.info("server")["process_id"])
    except (redis.RedisError, OSError, KeyError, ValueError):
        return None
    finally:
        client.close()


def ping(url: str, timeout: float = 0.5) -> bool:
    """True if a Redis answers PING at `url` (synchronous: used before any event loop exists)."""
    client = redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):  # no answer, or something that is not Redis answering
        return False
    finally:
        client.close()


@dataclass
class RedisServer:
    """A private redis-server process. `url` is where it answers."""

    url: str
    pid: int
    workdir: str
    _proc: subprocess.Popen | None = None

    @classmethod
    def start(cls, port: int | None = None, *, host: str = "127.0.0.1", binary: str | None = None,
              workdir: str | None = None, timeout: float = 10.0, die_with_parent: bool = False) -> RedisServer:
        """Start redis-server; `die_with_parent` makes it exit when the calling thread's process dies
        (tests, benchmarks) instead of outliving it (`pdserve up`)."""
        binary = binary or shutil.which("redis-server") or "/usr/bin/redis-server"
        if not os.path.exists(binary):
            raise FileNotFoundError("redis-server not found: install Redis (apt-get install redis-server) "
                                    "or point --redis-url at a running one")
        if port is None or port == 0:  # a free port: another process may take it first, then try another
            for attempt in range(3):
                try:
                    return cls.start(free_port(host), host=host, binary=binary, workdir=workdir, timeout=timeout,
                                     die_with_parent=die_with_parent)
                except PortTaken:
                    if attempt == 2:
                        raise
        workdir = workdir or tempfile.mkdtemp(prefix="pdserve-redis-")
        os.makedirs(workdir, exist_ok=True)
        cmd = [binary, "--port", str(port), "--bind", host, "--save", "", "--appendonly", "no",
               "--dir", workdir, "--protected-mode", "no", "--daemonize", "no",
               "--logfile", os.path.join(workdir, "redis.log")]
        # own process group (start_new_session): a Ctrl-C of the parent spares it
        proc = subprocess.Popen(tie_to_parent(cmd) if die_with_parent else cmd, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        server = cls(url=f"redis://{host}:{port}/0", pid=proc.pid, workdir=workdir, _proc=proc)
        server._wait_ready(timeout)
        return server

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ping(self.url, timeout=0.2):
                owner = _server_pid(self.url)
                if owner == self.pid:
                    return
                self.stop()  # another Redis holds the port (ours could not bind it): never report that one as ours
                raise PortTaken(f"{self.url} is answered by another redis-server (pid {owner}), not the one started")
            if self._proc is not None and self._proc.poll() is not None:
                break
            time.sleep(0.02)
        log = os.path.join(self.workdir, "redis.log")
        tail = open(log).read()[-2000:] if os.path.exists(log) else ""
        self.stop()
        raise RuntimeError(f"redis-server did not answer at {self.url} within {timeout:.0f}s; log:\n{tail}")

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after `timeout`; removes the work directory. Idempotent."""
        stop_pid(self.pid, timeout, self._proc)
        shutil.rmtree(self.workdir, ignore_errors=True)


def ensure_redis(url: str | None, **start_kwargs) -> tuple[str, RedisServer | None]:
    """(url, server): the Redis at `url` if it answers; else a private one we started.

    A URL naming this machine (loopback, or one of its own addresses) that does not answer gets a
    private server on that very address and port, so the URL the topology names stays right (and
    other hosts reach it); a URL of another machine that does not answer is an error.
    """
    if url and ping(url):
        return url, None
    if url:
        parsed = urlparse(url)
        host = parsed.hostname or "127.0.0.1"
        if host in LOOPBACK:
            host = "127.0.0.1"
        elif not is_local_address(host):
            raise ConnectionError(f"no Redis answers at {url} (a Redis is started automatically only at an "
                                  "address of this host)")
        server = RedisServer.start(parsed.port or 6379, host=host, **start_kwargs)
        return url, server
    server = RedisServer.start(**start_kwargs)
    return server.url, server
