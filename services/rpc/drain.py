"""Stopping a service without losing its requests: what every service does on SIGTERM.

    first SIGTERM (or SIGINT)   out of service: health NOT_SERVING, the instance leaves the Redis registry
                                (routers stop choosing it at once), new work is refused with UNAVAILABLE (a
                                router takes it elsewhere)
    drain                       what is in flight runs to its end, up to --shutdown-timeout
    second signal / timeout     the drain ends at once; whatever is still running is cut (its streams end
                                UNAVAILABLE: the router migrates each request to another instance, prompt +
                                the tokens already streamed), and the process exits 0

Kubernetes sends exactly this on a rolling update, a scale-in or a node drain: the manifests give a pod
`terminationGracePeriodSeconds` above its --shutdown-timeout (deploy/k8s), so the kubelet's SIGKILL never
comes first.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

DEFAULT_SHUTDOWN_TIMEOUT_S = 600.0  # a long generation (tens of thousands of tokens at tens of tokens/s)
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Drain:
    """One per service process: the signals, the state (`draining`) the servicers read, and the wait."""

    def __init__(self, timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S, poll_s: float = 0.05):
        if timeout_s < 0:
            raise ValueError(f"--shutdown-timeout must be >= 0, got {timeout_s}")
        self.timeout_s, self.poll_s = timeout_s, poll_s
        self.requested = asyncio.Event()  # the first signal (or request())
        self.now = asyncio.Event()  # a second signal: stop draining at once
        self._installed = False

    @property
    def draining(self) -> bool:
        return self.requested.is_set()

    def request(self) -> None:
        """The first signal's effect, from code (tests, a supervisor in the same process)."""
        if self.requested.is_set():
            self.now.set()
        self.requested.set()

    def install(self) -> None:
        """Handle SIGTERM / SIGINT on the running loop: the first one starts the drain, the next ends it."""
        loop = asyncio.get_running_loop()
        for sig in SIGNALS:
            loop.add_signal_handler(sig, self._on_signal, sig)
        self._installed = True

    def uninstall(self) -> None:
        if self._installed:
            loop = asyncio.get_running_loop()
            for sig in SIGNALS:
                loop.remove_signal_handler(sig)
            self._installed = False

    def _on_signal(self, sig: signal.Signals) -> None:
        if self.requested.is_set():
            log.warning("%s again: ending the drain now", signal.Signals(sig).name)
        else:
            log.info("%s: draining (up to %.0fs; the same signal again ends it at once)",
                     signal.Signals(sig).name, self.timeout_s)
        self.request()

    async def wait_for_signal(self) -> None:
        """Install the handlers (once) and return on the first signal."""
        if not self._installed:
            self.install()
        await self.requested.wait()

    async def until_idle(self, idle: Callable[[], bool], what: str) -> bool:
        """Wait until `idle()` (nothing of `what` left in flight), the timeout or a second signal. True when
        everything finished; False when the drain was cut short (the caller cuts the rest)."""
        t0 = time.monotonic()
        deadline = t0 + self.timeout_s
        while not idle():
            left = deadline - time.monotonic()
            if self.now.is_set() or left <= 0:
                log.warning("drain cut short after %.1fs with %s still in flight", time.monotonic() - t0, what)
                return False
            try:
                async with asyncio.timeout(min(self.poll_s, left)):
                    await self.now.wait()
            except TimeoutError:
                pass
        log.info("drained %s in %.1fs", what, time.monotonic() - t0)
        return True
