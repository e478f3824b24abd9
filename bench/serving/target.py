"""The server a benchmark talks to: a given URL, or a fresh `pdserve up` per concurrency level.

Deployment contract (`services.launch.launcher`, imported only when `--fresh-server` is used):

    up(topology_path: str) -> handle      start every service of the topology and return once the
                                          router answers; raise on failure (with the reason)
    down(handle) -> None                  stop them all (idempotent; called even after a failed level)
    handle.url: str                       router base URL, e.g. "http://127.0.0.1:8000"
    handle.num_gpus: int   (optional)     GPUs the topology uses (for throughput per GPU)
"""

from __future__ import annotations

import asyncio
import importlib
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from bench.serving.client import server_info

READY_TIMEOUT_S = 600.0


@dataclass
class Endpoint:
    url: str
    num_gpus: int | None = None  # from the launcher handle when it says
    handle: Any = None


def _launcher():
    try:
        return importlib.import_module("services.launch.launcher")
    except ImportError as e:
        raise RuntimeError(f"--fresh-server needs services.launch.launcher (pdserve up), which is not available: "
                           f"{e}") from e


class FreshServer:
    """`with FreshServer(topology) as ep:` brings a topology up and always takes it down."""

    def __init__(self, topology: str):
        self.topology = topology
        self._launcher = _launcher()
        for name in ("up", "down"):
            if not callable(getattr(self._launcher, name, None)):
                raise RuntimeError(f"services.launch.launcher has no {name}() function; see bench/serving/target.py "
                                   "for the contract")
        self._handle = None

    def __enter__(self) -> Endpoint:
        self._handle = self._launcher.up(self.topology)
        url = getattr(self._handle, "url", None)
        if not url:
            self._launcher.down(self._handle)
            raise RuntimeError("services.launch.launcher.up() returned a handle without a .url")
        return Endpoint(url=url, num_gpus=getattr(self._handle, "num_gpus", None), handle=self._handle)

    def __exit__(self, *exc) -> None:
        if self._handle is not None:
            self._launcher.down(self._handle)
            self._handle = None


class GivenServer:
    def __init__(self, url: str):
        self.url = url

    def __enter__(self) -> Endpoint:
        return Endpoint(url=self.url)

    def __exit__(self, *exc) -> None:
        return None


async def wait_ready(url: str, timeout_s: float = READY_TIMEOUT_S) -> dict:
    """Poll `GET /v1/models` until it answers; returns server_info() (model, max_model_len, vocab_size)."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        while time.monotonic() < deadline:
            try:
                return await server_info(http, url)
            except (aiohttp.ClientError, ValueError, TimeoutError) as e:
                last = e
                await asyncio.sleep(1.0)
    raise RuntimeError(f"server at {url} did not answer GET /v1/models within {timeout_s:.0f} s: {last}")
