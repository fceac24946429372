"""Local redis-server lifecycle: find, start, PING, persist across restarts, stop, refuse clearly."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import redis

from cluster.state.redis_server import (
    RedisStartError, default_data_dir, ensure_local_redis, find_redis_server, free_port, parse_redis_url, ping,
    server_args, start_local_redis,
)


@pytest.mark.parametrize("url,expected", [
    ("redis://127.0.0.1:6390/0", ("127.0.0.1", 6390, 0)),
    ("redis://localhost:7000/3", ("localhost", 7000, 3)),
    ("redis://127.0.0.1", ("127.0.0.1", 6379, 0)),
])
def test_parse_redis_url(url, expected):
    assert parse_redis_url(url) == expected


def test_parse_redis_url_rejects_other_schemes():
    with pytest.raises(ValueError, match="redis://"):
        parse_redis_url("http://127.0.0.1:6390")


def test_default_data_dir_follows_specserve_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    assert default_data_dir() == tmp_path / "redis"
    monkeypatch.delenv("SPECSERVE_CACHE")
    assert default_data_dir() == Path(os.path.expanduser("~")) / ".cache" / "specserve" / "redis"


def test_server_args_bind_loopback_and_persist(tmp_path):
    args = server_args("/bin/redis-server", 7001, tmp_path)
    pairs = dict(zip(args[1::2], args[2::2]))
    assert pairs["--bind"] == "127.0.0.1" and pairs["--port"] == "7001"
    assert pairs["--appendonly"] == "yes" and pairs["--save"] and pairs["--dir"] == str(tmp_path)
    assert pairs["--daemonize"] == "no"


def test_find_redis_server_returns_an_executable():
    path = find_redis_server()
    assert os.access(path, os.X_OK)


def test_ping_false_when_nothing_listens():
    assert ping("127.0.0.1", free_port(), timeout_s=0.2) is False


@pytest.mark.redis
def test_start_ping_stop(tmp_path):
    server = start_local_redis(free_port(), data_dir=tmp_path)
    try:
        assert server.alive and ping(server.host, server.port)
        assert redis.Redis.from_url(server.url).ping()
    finally:
        server.stop()
    assert not server.alive and not ping(server.host, server.port)


@pytest.mark.redis
def test_data_survives_a_restart_on_the_same_dir(tmp_path):
    port = free_port()
    server = start_local_redis(port, data_dir=tmp_path)
    redis.Redis(port=port).hset("specserve:v3:test", mapping={"steps": 42})
    server.stop()
    server = start_local_redis(port, data_dir=tmp_path)
    try:
        assert redis.Redis(port=port).hget("specserve:v3:test", "steps") == b"42"
    finally:
        server.stop()


@pytest.mark.redis
def test_data_survives_a_kill_through_the_aof(tmp_path):
    port = free_port()
    server = start_local_redis(port, data_dir=tmp_path)
    redis.Redis(port=port).hincrby("specserve:v3:test", "steps", 7)
    import time
    time.sleep(1.5)  # appendfsync everysec
    server.kill()
    server = start_local_redis(port, data_dir=tmp_path)
    try:
        assert redis.Redis(port=port).hget("specserve:v3:test", "steps") == b"7"
    finally:
        server.stop()


@pytest.mark.redis
def test_ensure_local_redis_starts_only_when_nothing_answers(tmp_path):
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    assert ensure_local_redis(url, start_local=False) is None and not ping("127.0.0.1", port)
    server = ensure_local_redis(url, data_dir=tmp_path)
    try:
        assert server is not None and ping("127.0.0.1", port)
        assert ensure_local_redis(url, data_dir=tmp_path) is None  # already answering: left alone
    finally:
        server.stop()


def test_ensure_local_redis_refuses_a_remote_url():
    with pytest.raises(RedisStartError, match="not loopback"):
        ensure_local_redis("redis://192.0.2.1:6390/0")  # TEST-NET: nothing answers


@pytest.mark.redis
def test_start_fails_clearly_when_the_port_is_taken(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(RedisStartError, match="exited|did not answer"):
            start_local_redis(port, data_dir=tmp_path, startup_timeout_s=5)
