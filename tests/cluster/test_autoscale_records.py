"""Autoscale records read from Redis: whatever a key holds (1e999, NaN, deep nesting, wrong types,
megabytes), the router's request path does not raise and the reader thread does not die; only
records that validate are used, the rest are ignored, warned about and counted."""

from __future__ import annotations

import json
import time

import pytest

from cluster.autoscale.policy import MAX_REPLICAS, effective_replicas, with_capacity
from cluster.autoscale.ray_policy import MAX_RECORD_BYTES, AutoscaleRecords, MalformedRecord, parse_record, record_key
from cluster.routing.route import PoolView
from cluster.speculation import SpecMode

NOW = 1_000_000.0
GOOD = {"pool": "ngram", "time_unix_s": NOW, "running": 1, "target": 2, "reason": "load 9 > 1 x 8",
        "snapshot": {"replicas": [{"replica": "r1", "tpot_p99_s": 0.1}]}}

HOSTILE = {
    "inf target": b'{"target": 1e999, "time_unix_s": 1000000.0}',
    "inf time": b'{"target": 2, "time_unix_s": 1e999}',
    "nan": b'{"target": NaN, "time_unix_s": 1000000.0}',
    "infinity elsewhere": b'{"target": 2, "time_unix_s": 1000000.0, "load": -Infinity}',
    "nested array": b"[" * 100_000 + b"]" * 100_000,
    "nested in a field": b'{"target": 2, "time_unix_s": 1000000.0, "x": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
    "just too deep": json.dumps({"target": 2, "time_unix_s": NOW, "a": [[[[[[1]]]]]]}).encode(),
    "top-level number": b"1e999",
    "top-level list": b"[1, 2]",
    "string target": b'{"target": "2", "time_unix_s": 1000000.0}',
    "bool target": b'{"target": true, "time_unix_s": 1000000.0}',
    "float target": b'{"target": 2.5, "time_unix_s": 1000000.0}',
    "negative target": b'{"target": -1, "time_unix_s": 1000000.0}',
    "huge target": b'{"target": ' + str(10**30).encode() + b', "time_unix_s": 1000000.0}',
    "huge int": b'{"target": ' + b"9" * 5000 + b', "time_unix_s": 1000000.0}',
    "no time": b'{"target": 2}',
    "string time": b'{"target": 2, "time_unix_s": "now"}',
    "not utf-8": b'{"target": 2, "time_unix_s": 1000000.0, "r": "\xff"}',
    "not json": b"{'target': 2}",
    "too big": json.dumps({**GOOD, "pad": "x" * MAX_RECORD_BYTES}).encode(),
}


def test_a_published_record_validates():
    assert parse_record(json.dumps(GOOD).encode()) == GOOD
    assert parse_record(json.dumps(GOOD)) == GOOD


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_records_are_refused_with_a_reason(name):
    with pytest.raises(MalformedRecord) as e:
        parse_record(HOSTILE[name])
    assert str(e.value)


@pytest.mark.parametrize("record", [
    {"target": float("inf"), "time_unix_s": NOW}, {"target": float("nan"), "time_unix_s": NOW},
    {"target": 10**30, "time_unix_s": NOW}, {"target": 2, "time_unix_s": float("nan")},
    {"target": 2, "time_unix_s": float("inf")}, {"target": [2], "time_unix_s": NOW}, {"target": 2.5, "time_unix_s": NOW},
    {"target": MAX_REPLICAS + 1, "time_unix_s": NOW}, {"target": "x", "time_unix_s": NOW}, [1, 2], "x", 7,
])
def test_effective_replicas_never_raises_and_falls_back_to_the_config(record):
    """The request path's side: even a record that skipped validation cannot raise or inflate capacity."""
    assert effective_replicas(record, 3, NOW) == 3


def test_with_capacity_keeps_the_static_view_for_a_bad_record():
    views = [PoolView(name="ngram", model="m", method=SpecMode.NGRAM, max_k=6, replicas=1)]
    assert with_capacity(views, {"ngram": {"target": float("inf"), "time_unix_s": NOW}}, NOW)[0].replicas == 1
    assert with_capacity(views, {"ngram": GOOD}, NOW)[0].replicas == 2


# -- the reader against a real redis-server ------------------------------------------------------------

@pytest.mark.redis
def test_the_reader_keeps_good_records_and_survives_hostile_ones(redis_server, redis_client, caplog):
    pools = ["good"] + [f"bad{i}" for i in range(len(HOSTILE))]
    malformed = []
    reader = AutoscaleRecords({"url": redis_server.url, "password_env": None}, pools, interval_s=0.05,
                              on_malformed=malformed.append)
    try:
        redis_client.set(record_key("specserve:v3", "good"), json.dumps({**GOOD, "time_unix_s": time.time()}))
        for i, raw in enumerate(HOSTILE.values()):
            redis_client.set(record_key("specserve:v3", f"bad{i}"), raw)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and reader.counters["malformed"] < 3 * len(HOSTILE):
            time.sleep(0.05)
        assert reader.counters["malformed"] >= 3 * len(HOSTILE) and reader.counters["thread_errors"] == 0
        assert set(reader.records()) == {"good"} and sorted(set(malformed)) == sorted(pools[1:])
        json.dumps(reader.records(), allow_nan=False)  # what status serves is valid JSON
        assert any("ignoring the autoscale record of pool bad" in r.getMessage() for r in caplog.records)
        redis_client.set(record_key("specserve:v3", "bad0"), json.dumps({**GOOD, "time_unix_s": time.time()}))
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and "bad0" not in reader.records():
            time.sleep(0.05)
        assert "bad0" in reader.records()  # the thread is alive and reading
    finally:
        reader.close()


def test_the_policy_publishes_no_non_finite_number():
    """Ray's averaged metrics may hold NaN or inf; the snapshot (and so the record) keeps only finite
    values, so what the controller publishes is a record the readers accept."""
    from types import SimpleNamespace

    from cluster.autoscale.policy import AutoscalingConfig, decide
    from cluster.autoscale.ray_policy import snapshot_from_context

    ctx = SimpleNamespace(aggregated_metrics={"tpot_p99_s": {"r1": float("nan")}, "unfinished": {"r1": float("inf")},
                                              "tokens_per_s": {"r1": 12.5}},
                          current_time=NOW, current_num_replicas=1, target_num_replicas=1, total_num_requests=3)
    snap = snapshot_from_context(ctx)
    (r,) = snap.replicas
    assert r.tpot_p99_s == -1.0 and r.unfinished == 0.0 and r.tokens_per_s == 12.5
    verdict, _ = decide(snap, AutoscalingConfig())
    raw = json.dumps({**verdict.record("ngram", snap), "snapshot": snap.to_dict()}, allow_nan=False)
    assert parse_record(raw)["target"] == 1


def test_the_pool_load_counts_the_calls_on_local_lanes():
    """Serve counts only its handles' calls; each replica's `lane_ongoing` (its local lane's calls,
    deployments/engine_lane.py) is added, non-finite reports left out."""
    from types import SimpleNamespace

    from cluster.autoscale.ray_policy import snapshot_from_context

    ctx = SimpleNamespace(aggregated_metrics={"lane_ongoing": {"r1": 5.0, "r2": 2.5, "r3": float("nan")},
                                              "unfinished": {"r1": 7.0}},
                          current_time=NOW, current_num_replicas=2, target_num_replicas=2, total_num_requests=3)
    assert snapshot_from_context(ctx).load == 10.5
    ctx.aggregated_metrics = {"unfinished": {"r1": 7.0}}
    assert snapshot_from_context(ctx).load == 3.0
