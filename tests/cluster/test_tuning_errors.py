"""Tuning store under Redis error replies (OOM, NOPERM, ...) and caller-chosen model names: the
writer thread survives every Redis error, counts it, and resumes writing when Redis recovers; no
cache grows with the number of distinct names asked about."""

from __future__ import annotations

import time

import pytest
import redis

from cluster.config import RedisConfig
from cluster.speculation import SpecStats
from cluster.state.tuning import MAX_MODELS, TuningStore, redis_error_kind
from tests.waiting import wait_until

PREFIX = "specserve:v3"


def stats() -> SpecStats:
    return SpecStats(mode="ngram", k=3, steps=10, drafted=30, accepted=12, accepted_per_position=[6, 4, 2],
                     drafted_per_position=[10, 10, 10])




def requests_in(client, model="m") -> int:
    return sum(int(client.hget(k, "requests") or 0) for k in client.scan_iter(f"{PREFIX}:{model}:*"))


# -- pure ----------------------------------------------------------------------------------------------

def test_redis_error_kind_names_the_reply():
    assert redis_error_kind(redis.exceptions.OutOfMemoryError("OOM")) == "OutOfMemoryError"
    assert redis_error_kind(redis.exceptions.ReadOnlyError("READONLY")) == "ReadOnlyError"
    assert redis_error_kind(redis.exceptions.NoPermissionError("NOPERM")) == "NoPermissionError"
    assert redis_error_kind(redis.ConnectionError("x")) == "ConnectionError"
    assert redis_error_kind(ConnectionRefusedError()) == "ConnectionRefusedError"


# -- bounded caches ----------------------------------------------------------------------------------

def test_a_store_with_models_never_registers_another_name():
    store = TuningStore(RedisConfig(url="redis://127.0.0.1:1/0"), models=("m",), start=False)
    for i in range(1000):
        name = f"x{i}" * 100
        assert store.snapshot(name).cells == {}
        assert store.table(name, fresh=False) == []
        assert not store.record(name, "ngram", "ngram", "chat", "1", stats(), latency_s=1.0)
    assert store._models == {"m"} and set(store._key_cache) <= {"m"}
    assert store.counters["records_invalid"] == 1000 and not store._records
    assert store.tracks("m") and not store.tracks("x0")


def test_an_open_store_registers_at_most_max_models():
    store = TuningStore(RedisConfig(url="redis://127.0.0.1:1/0"), start=False)
    for i in range(MAX_MODELS * 10):
        store.snapshot(f"m{i}")
    assert len(store._models) == MAX_MODELS


def test_the_cached_table_does_no_redis_io():
    store = TuningStore(RedisConfig(url="redis://127.0.0.1:1/0"), models=("m",), start=False)
    t = time.perf_counter()
    assert store.table("m", fresh=False) == []
    assert time.perf_counter() - t < 0.05 and store.counters["table_errors"] == 0


# -- error replies from a real redis-server --------------------------------------------------------

@pytest.mark.redis
def test_oom_replies_do_not_end_the_writer_and_writing_resumes(redis_server, redis_client):
    """`maxmemory 1` (with `noeviction`, so the keys stay): every write is refused with OOM inside the
    MULTI batch (EXECABORT). The thread lives on, counts the errors through the metric hook, keeps
    the batch, and writes it once the limit is lifted: nothing recorded during the refusal is lost."""
    errors = []
    store = TuningStore(RedisConfig(url=redis_server.url), models=("m",), flush_interval_s=0.05,
                        refresh_interval_s=0.1, on_redis_error=lambda op, kind: errors.append((op, kind)))
    try:
        assert store.record("m", "ngram", "ngram", "chat", "1", stats(), latency_s=1.0)
        assert wait_until(lambda: requests_in(redis_client) == 1, 5.0)
        limit, policy = redis_client.config_get("maxmemory")["maxmemory"], redis_client.config_get(
            "maxmemory-policy")["maxmemory-policy"]
        redis_client.config_set("maxmemory-policy", "noeviction")
        redis_client.config_set("maxmemory", 1)
        try:
            for _ in range(5):
                assert store.record("m", "ngram", "ngram", "chat", "1", stats(), latency_s=1.0)
            assert wait_until(lambda: store.counters["flush_errors"] >= 3, 5.0)
            assert ("flush", "OutOfMemoryError") in errors
            assert store._thread is not None and store._thread.is_alive()
            # Refreshes (reads) keep succeeding meanwhile: the store stays unhealthy through them.
            seen = []
            for _ in range(25):
                seen.append(store.healthy)
                time.sleep(0.02)
            assert not any(seen) and store.counters["refreshes"] > 0
            assert requests_in(redis_client) == 1
        finally:
            redis_client.config_set("maxmemory", limit)
            redis_client.config_set("maxmemory-policy", policy)
        assert wait_until(lambda: requests_in(redis_client) == 6, 5.0)  # the kept batch, written once
        assert wait_until(lambda: store.healthy, 3.0) and store._thread.is_alive()
        time.sleep(0.3)
        assert requests_in(redis_client) == 6
    finally:
        store.close(flush=False)


@pytest.mark.redis
def test_noperm_replies_on_reads_and_writes_are_survived(redis_server, redis_client, monkeypatch):
    """An ACL user that may not touch the keys: every flush and refresh fails with NOPERM (a key it
    may not read is not taken for a malformed one); the thread lives on and serves the cached view;
    granting the keys lets the kept batch land."""
    redis_client.hset(f"{PREFIX}:m:ngram:chat:1", mapping={"requests": 1, "updated": repr(time.time())})
    redis_client.acl_setuser("tuner", enabled=True, passwords=["+pw"], commands=["+@all"], keys=["other:*"])
    monkeypatch.setenv("SPECSERVE_TEST_REDIS_PASSWORD", "pw")
    errors = []
    store = TuningStore(RedisConfig(url=f"redis://tuner@127.0.0.1:{redis_server.port}/0",
                                    password_env="SPECSERVE_TEST_REDIS_PASSWORD"),
                        models=("m",), flush_interval_s=0.05, refresh_interval_s=0.05,
                        on_redis_error=lambda op, kind: errors.append((op, kind)))
    try:
        assert store.record("m", "ngram", "ngram", "chat", "1", stats(), latency_s=1.0)
        assert wait_until(lambda: {op for op, _ in errors} >= {"flush", "refresh"}, 5.0), errors
        assert {kind for _, kind in errors} == {"NoPermissionError"}
        assert store._thread.is_alive() and store.snapshot("m").cells == {}
        assert store.counters["malformed_cells"] == 0 and not store._to_delete
        redis_client.acl_setuser("tuner", keys=[f"{PREFIX}:*"])
        assert wait_until(lambda: requests_in(redis_client) == 2, 5.0)
        assert wait_until(lambda: store.snapshot("m").cells != {}, 3.0) and store._thread.is_alive()
    finally:
        store.close(flush=False)


def test_an_unexpected_error_in_the_thread_is_logged_and_survived(monkeypatch, caplog):
    store = TuningStore(RedisConfig(url="redis://127.0.0.1:1/0"), models=("m",), flush_interval_s=0.02,
                        refresh_interval_s=0.02, start=False)
    calls = []

    def broken():
        calls.append(1)
        raise KeyError("a bug")

    monkeypatch.setattr(store, "flush_now", broken)
    with caplog.at_level("WARNING", logger="specserve.tuning"):
        store.start()
        try:
            assert wait_until(lambda: len(calls) >= 3, 3.0)
            assert store._thread.is_alive() and store.counters["thread_errors"] >= 3
        finally:
            store.close(flush=False)
    assert any("unexpected KeyError" in r.getMessage() for r in caplog.records)
