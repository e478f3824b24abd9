"""Helpers of the tests against the `hardened` deployment (tests/e2e/conftest.py): keys, raw HTTP
with headers, instance addresses, block counters."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import pytest

from tests.e2e import system
from tests.e2e.conftest import HARDENED_KEYS


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


def engines_idle(insts: dict, timeout: float = 20.0) -> bool:
    """Every engine's KV blocks back to zero (nothing leaked, nothing pinned) within `timeout`."""
    return bool(system.wait_for(lambda: all(blocks_in_use(insts[r]) == 0 for r in ("prefill", "decode")),
                                timeout=timeout))


# fixtures of the modules on the `hardened` deployment (import them into a test module)
@pytest.fixture(scope="module")
def url(hardened) -> str:
    return hardened.url


@pytest.fixture(scope="module")
def insts(hardened) -> dict:
    return instances(hardened)
