"""Helpers of the tests against the `hardened` deployment (its fixture: tests/e2e/conftest.py): keys and bounds,
raw HTTP with headers, instance addresses, block counters."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from tests.helpers import system

# one deployment with small admission bounds and API keys (test_overload, test_security, test_fuzz)
HARDENED_KEYS = {"alpha": ("sk-alpha-1", "sk-alpha-2"), "beta": ("sk-beta-1",)}
HARDENED_LIMITS = {"router_inflight": 3, "decode_inflight": 2, "prefill_inflight": 3, "kvstore_open": 4,
                   "max_body_bytes": 65536, "max_n": 4}


def auth(tenant: str = "alpha", which: int = 0) -> dict[str, str]:
    return {"authorization": f"Bearer {HARDENED_KEYS[tenant][which]}"}


def request(url: str, path: str, body: dict | bytes | None = None, headers: dict | None = None,
            timeout: float = 120) -> tuple[int, dict, Any]:
    """(status, parsed JSON body, headers) of one HTTP call; POST when there is a body."""
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}"), r.headers  # case-insensitive
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}"), e.headers


def instances(dep) -> dict:
    return {i.role: i for i in system.with_state(dep.redis_url, lambda s: s.instances())}


def blocks_in_use(inst) -> float:
    return system.metric(inst.metrics_address, "pdserve:kv_cache_usage_perc")


def engines_idle(insts: dict, timeout: float = 60.0) -> bool:
    """Every engine's KV blocks back to zero (nothing leaked, nothing pinned) within `timeout`."""
    return bool(system.wait_for(lambda: all(blocks_in_use(insts[r]) == 0 for r in ("prefill", "decode")),
                                timeout=timeout))

