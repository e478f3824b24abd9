"""Fixtures of the e2e tier: a private Redis per test session (never the machine's shared one), the default
deployment, the `hardened` deployment and its addresses, the offline engine and corpus the fault tests compare
with."""

from __future__ import annotations

import pytest

from services.cluster.redis_server import RedisServer
from tests.helpers.chaos import corpus_ids
from tests.helpers.hardened import HARDENED_KEYS, HARDENED_LIMITS, instances
from tests.helpers.pace import pinned


@pytest.fixture(scope="session")
def redis_server():
    with pinned():
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


# ---- the default topology, as `pdserve up` starts it (test_system, test_agent_api, test_anthropic,
# test_structured_outputs) ----
@pytest.fixture(scope="session")
def default_deployment(tmp_path_factory):
    """The shipped CPU topology on free ports. Shared by the modules of xdist group "default": their tests
    leave nothing behind that another could see (requests end, blocks are freed, metrics are read as
    deltas or lower bounds), so one start serves them all."""
    from services.launch import launcher
    from tests.helpers import system

    dep = system.up(tmp_path_factory.mktemp("default"))
    yield dep
    launcher.down(dep)


# ---- one deployment with small admission bounds and API keys (test_overload, test_security, test_fuzz) ----
@pytest.fixture(scope="session")
def hardened(tmp_path_factory):
    """The CPU topology with tenants' API keys and small bounds, so that overload is cheap to reach.
    Shared by the modules of xdist group "hardened" (one worker runs them all)."""
    from services.launch import launcher
    from tests.helpers import system

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


# A shared deployment stops as soon as the worker's next test no longer uses it, not at the end of the
# session: a group's tests run one after another on one worker (--dist loadgroup), and an idle deployment
# keeps polling (its NIXL agents, ~17% of a core together) while the rest of the suite runs. Finishing the
# fixture also tears down what depends on it (`url`, `insts`); a later test that asks for it starts it again.
_SHARED_DEPLOYMENTS = ("default_deployment", "hardened")


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    for name in _SHARED_DEPLOYMENTS:
        if name in item.fixturenames and (nextitem is None or name not in nextitem.fixturenames):
            for fixturedef in item._fixtureinfo.name2fixturedefs.get(name, ()):
                fixturedef.finish(item._request)


@pytest.fixture(scope="module")
def url(hardened) -> str:
    """The hardened deployment's router URL (test modules with their own deployment define their own `url`)."""
    return hardened.url


@pytest.fixture(scope="module")
def insts(hardened) -> dict:
    """The hardened deployment's instances by role."""
    return instances(hardened)


@pytest.fixture(scope="module")
def offline(tiny_code):
    """The offline engine the fault tests compare outputs with."""
    from engine import LLM

    return LLM(str(tiny_code), kv_cache_dtype="fp8_ds_mla", num_blocks=256)


@pytest.fixture(scope="module")
def corpus(offline) -> list[int]:
    return corpus_ids(offline.tokenizer)
