"""Bounded admission: how many requests a service holds at once, and how many of those may wait.

    gate = Admission("prefill", max_inflight=1024, max_queued=256)
    with gate.inflight():          # Overloaded (RESOURCE_EXHAUSTED / HTTP 429) when full
        with gate.queued():        # the part spent waiting (for the engine, for KV room)
            ...

Every queue in front of an engine is bounded by these counters, so a burst beyond capacity is
answered at once with "retry after" instead of growing memory and latency without limit.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from services.rpc.grpc_server import Overloaded


class Admission:
    def __init__(self, name: str, max_inflight: int, max_queued: int | None = None, retry_after_s: float = 1.0):
        if max_inflight < 1 or (max_queued is not None and max_queued < 0):
            raise ValueError(f"{name}: max_inflight must be >= 1 and max_queued >= 0, got "
                             f"{max_inflight}, {max_queued}")
        self.name, self.retry_after_s = name, retry_after_s
        self.max_inflight = max_inflight
        self.max_queued = max_inflight if max_queued is None else max_queued
        self.num_inflight = 0
        self.num_queued = 0
        self.num_rejected = 0

    def _reject(self, what: str, limit: int) -> Overloaded:
        self.num_rejected += 1
        return Overloaded(f"{self.name} is at capacity: {limit} {what} (retry in {self.retry_after_s:g}s or "
                          "elsewhere)", self.retry_after_s)

    def acquire(self, n: int = 1) -> None:
        """Take `n` in-flight slots at once (all or none)."""
        if self.num_inflight + n > self.max_inflight:
            raise self._reject("requests in flight", self.max_inflight)
        self.num_inflight += n

    def release(self, n: int = 1) -> None:
        self.num_inflight = max(self.num_inflight - n, 0)

    def check_waiting(self, num_waiting: int) -> None:
        """Reject when a queue this gate does not own (an engine's waiting queue) is already full."""
        if num_waiting >= self.max_queued:
            raise self._reject("requests waiting", self.max_queued)

    @contextmanager
    def inflight(self, n: int = 1) -> Iterator[None]:
        self.acquire(n)
        try:
            yield
        finally:
            self.release(n)

    @contextmanager
    def queued(self) -> Iterator[None]:
        if self.num_queued >= self.max_queued:
            raise self._reject("requests waiting", self.max_queued)
        self.num_queued += 1
        try:
            yield
        finally:
            self.num_queued -= 1
