"""Fixtures of the e2e tier: a private Redis per test session (never the machine's shared one)."""

from __future__ import annotations

import pytest

from services.cluster.redis_server import RedisServer


@pytest.fixture(scope="session")
def redis_server():
    server = RedisServer.start(die_with_parent=True)
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server):
    """The private server's URL, flushed before each test."""
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url


# ---- one deployment with small admission bounds and API keys (test_overload, test_security, test_fuzz) ----
HARDENED_KEYS = {"alpha": ("sk-alpha-1", "sk-alpha-2"), "beta": ("sk-beta-1",)}
HARDENED_LIMITS = {"router_inflight": 3, "decode_inflight": 2, "prefill_inflight": 3, "kvstore_open": 4,
                   "max_body_bytes": 65536, "max_n": 4}


@pytest.fixture(scope="session")
def hardened(tmp_path_factory):
    """The CPU topology with tenants' API keys and small bounds, so that overload is cheap to reach.
    Shared by the modules of xdist group "hardened" (one worker runs them all)."""
    from services.deploy import launcher
    from tests.e2e import system

    run_dir = tmp_path_factory.mktemp("hardened")
    keys_file = run_dir / "api-keys"
    keys_file.write_text("".join(f"{k}:{t}\n" for t, ks in HARDENED_KEYS.items() for k in ks))
    lim = HARDENED_LIMITS
    dep = system.up(run_dir,
                    router={"api-keys-file": str(keys_file), "max-inflight-requests": lim["router_inflight"],
                            "max-body-bytes": lim["max_body_bytes"], "max-n": lim["max_n"]},
                    prefill={"max-inflight-requests": lim["prefill_inflight"]},
                    decode={"max-inflight-requests": lim["decode_inflight"], "max-queued-requests": 1},
                    kvstore={"max-open-transfers": lim["kvstore_open"]})
    yield dep
    launcher.down(dep)
