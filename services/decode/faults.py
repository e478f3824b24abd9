"""Fault injection, a debug facility kept out of the request path: `with_faults(puller)` wraps the decode
service's KV puller when `PDSERVE_FAULT_NIXL_FAIL_FIRST_N` (engine/settings.py) is set, so that its first
N pull attempts fail as a NIXL transfer error would (the e2e fault tests run real processes with it; see
docs/failures.md). Unset, the service runs its own puller untouched.
"""

from __future__ import annotations

from engine import settings
from services.transfer.nixl_agent import TransferError


class FailingFirstPulls:
    """A KV puller whose first `n` pulls raise TransferError; the rest go to the real puller."""

    def __init__(self, puller, n: int):
        self.puller, self.left = puller, n

    def __getattr__(self, name: str):  # spec, kv_cache, ...: the real puller's
        return getattr(self.puller, name)

    async def pull(self, *args, **kwargs):
        if self.left > 0:
            self.left -= 1
            raise TransferError("injected NIXL transfer failure (PDSERVE_FAULT_NIXL_FAIL_FIRST_N)")
        return await self.puller.pull(*args, **kwargs)


def with_faults(puller):
    """The puller itself, or, when the fault variable asks for failures, the puller behind FailingFirstPulls."""
    n = settings.fault_nixl_fail_first_n()
    return FailingFirstPulls(puller, n) if n > 0 else puller
