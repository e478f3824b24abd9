"""Fixtures of the e2e tier: a private Redis per test session (never the machine's shared one)."""

from __future__ import annotations

import pytest

from services.common.redis_server import RedisServer


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
