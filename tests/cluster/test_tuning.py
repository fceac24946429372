"""Tuning state: pure increments and validation, then the store against a real redis-server
(batched writes that add up across replicas, TTLs, poisoned keys ignored, fail-open when Redis is
down or hung, writes resuming by themselves when it returns)."""

from __future__ import annotations

import logging
import os
import signal
import statistics
import time

import pytest
import redis

from cluster.config import RedisConfig, RouterConfig
from cluster.policy import TuningView, choose_auto
from cluster.state.redis_server import free_port, start_local_redis
from cluster.routing.route import Decision, PoolView
from cluster.speculation import SpecMode, SpecStats
from cluster.state.tuning import TuningStore
from cluster.state.tuning_cells import (
    MAX_FIELDS, MalformedCell, cell_from_requests, cell_key, increments_from_stats, parse_cell,
)
from cluster.api.wire import Completion
from tests.waiting import wait_until

PREFIX = "specserve:v3"
POOLS = [PoolView(name="ngram", model="m", method=SpecMode.NGRAM, max_k=6),
         PoolView(name="plain", model="m", method=SpecMode.NONE, max_k=0)]


def stats(k=3, steps=10, accepted=12, drafted=30, per_pos=(6, 4, 2), dr_pos=(10, 10, 10), mode="ngram", runs=()):
    return SpecStats(mode=mode, k=k, steps=steps, drafted=drafted, accepted=accepted,
                     accepted_per_position=list(per_pos), drafted_per_position=list(dr_pos), run_lengths=list(runs))


def p99_ms(samples_s):
    return statistics.quantiles(samples_s, n=100)[98] * 1e3




# -- pure: keys, increments, validation -----------------------------------------------------------

def test_cell_key_is_namespaced_and_quoted():
    assert cell_key(PREFIX, "smollm2-135m", "ngram", "chat", "16+") == "specserve:v3:smollm2-135m:ngram:chat:16+"
    assert cell_key(PREFIX, "org/a:b c", "ngram", "chat", "1") == "specserve:v3:org/a%3Ab%20c:ngram:chat:1"


def test_increments_by_hand():
    inc = increments_from_stats(stats(), latency_s=1.5, ttft_s=0.5, output_tokens=23)
    # trials: 10 steps at position 0, min(10, 6) at 1, min(10, 4) at 2 -> 20; rejected = 20 - 12
    assert inc == {"requests": 1, "steps": 10, "drafted": 30, "accepted": 12, "rejected_steps": 8, "k_steps": 30,
                   "kk_steps": 90, "tokens": 23, "decode_s": 1.0, "k_decode_s": 3.0, "s3": 10, "t3": 1.0,
                   "e0": 10, "e1": 10, "e2": 10, "a0": 6, "a1": 4, "a2": 2}


def test_increments_carry_the_accepted_runs_and_drop_impossible_ones():
    s = stats()
    s.run_lengths = [3, 0, 2, 1]
    inc = increments_from_stats(s, latency_s=1.0)
    assert (inc["r0"], inc["r2"], inc["r3"]) == (3, 2, 1) and "r1" not in inc
    s.run_lengths = [11]  # 11 runs in 10 steps: every run takes a step, so the report is not trusted
    assert not any(f.startswith("r") and f[1:].isdigit() for f in increments_from_stats(s, latency_s=1.0))
    s.run_lengths = [0] * 40 + [1]  # longer than the cap: the counts past it are not kept
    assert not any(f.startswith("r") and f[1:].isdigit() for f in increments_from_stats(s, latency_s=1.0))


def test_parse_cell_reads_the_step_time_per_k_and_rejects_more_than_the_cell_has():
    cell = parse_cell(_fields(s3="12", t3="1.5", s5="8", t5="1.0"), now_unix_s=1001.0, max_age_s=100)
    assert cell.steps_at_k == (0, 0, 0, 12, 0, 8) and cell.decode_s_at_k == (0.0, 0.0, 0.0, 1.5, 0.0, 1.0)
    assert cell.step_s_at(3) == pytest.approx(0.125) and cell.step_s_at(4) is None and cell.step_s_at(9) is None
    assert parse_cell(_fields(), now_unix_s=1001.0, max_age_s=100).steps_at_k == ()  # a cell without them
    with pytest.raises(MalformedCell, match="at K"):
        parse_cell(_fields(s3="15", s4="6"), now_unix_s=1001.0, max_age_s=100)  # 21 steps at K in a cell of 20
    with pytest.raises(MalformedCell, match="at K"):
        parse_cell(_fields(s3="5", t3="3.0"), now_unix_s=1001.0, max_age_s=100)  # 3 s at K of 2.5 s in all
    with pytest.raises(MalformedCell, match="unknown field"):
        parse_cell(_fields(s17="1"), now_unix_s=1001.0, max_age_s=100)  # K past MAX_K
    with pytest.raises(MalformedCell, match="not an integer"):
        parse_cell(_fields(s3="1.5"), now_unix_s=1001.0, max_age_s=100)


def test_step_time_per_k_adds_up_over_requests_as_redis_sums_it():
    a, b = stats(), stats(k=1, accepted=6, drafted=10, per_pos=(6,), dr_pos=(10,))
    cell = cell_from_requests([(a, 1.0), (a, 2.0), (b, 0.5)])
    assert cell.steps_at_k == (0, 10, 0, 20) and cell.decode_s_at_k == pytest.approx((0.0, 0.5, 0.0, 3.0))
    assert sum(cell.steps_at_k) == cell.steps


def test_parse_cell_reads_runs_and_rejects_more_runs_than_steps():
    cell = parse_cell(_fields(r0="5", r3="2", r32="1"), now_unix_s=1001.0, max_age_s=100)
    assert cell.runs == (5, 0, 0, 2) + (0,) * 28 + (1,) and cell.draftless_steps == 0
    assert parse_cell(_fields(), now_unix_s=1001.0, max_age_s=100).runs == ()
    with pytest.raises(MalformedCell, match="runs"):
        parse_cell(_fields(r1="15", r2="6"), now_unix_s=1001.0, max_age_s=100)
    with pytest.raises(MalformedCell, match="unknown field"):
        parse_cell(_fields(r33="1"), now_unix_s=1001.0, max_age_s=100)


def test_increments_without_drafted_per_position_count_all_k_as_drafted():
    inc = increments_from_stats(stats(dr_pos=()), latency_s=1.0)
    assert inc["rejected_steps"] == 10 - 2 and inc["e2"] == 10 and inc["decode_s"] == 1.0
    assert inc["tokens"] == 10 + 12 + 1


def test_increments_of_plain_decoding():
    inc = increments_from_stats(SpecStats(mode="none", k=0, steps=40), latency_s=2.0)
    assert inc["rejected_steps"] == 0 and inc["k_steps"] == 0 and not any(f[0] in "ae" and f[1:].isdigit() for f in inc)


@pytest.mark.parametrize("bad", [
    dict(k=17), dict(k=-1), dict(accepted=31), dict(steps=-1),
])
def test_increments_reject_impossible_stats(bad):
    with pytest.raises(ValueError):
        increments_from_stats(stats(**bad), latency_s=1.0)


@pytest.mark.parametrize("latency", [float("nan"), float("inf"), -1.0])
def test_increments_reject_bad_latency(latency):
    with pytest.raises(ValueError):
        increments_from_stats(stats(), latency_s=latency)


def _fields(**over):
    f = {"requests": "2", "steps": "20", "drafted": "60", "accepted": "24", "rejected_steps": "16",
         "k_steps": "60", "tokens": "46", "decode_s": "2.5", "a0": "12", "e0": "20",
         "updated": "1000.5"}
    f.update(over)
    return {k.encode(): str(v).encode() for k, v in f.items() if v is not None}


def test_parse_cell_valid():
    cell = parse_cell(_fields(), now_unix_s=1001.0, max_age_s=100)
    assert (cell.steps, cell.accepted, cell.rejected_steps, cell.decode_s) == (20, 24, 16, 2.5)
    assert cell.accepted_at == (12,) and cell.exposed_at == (20,) and cell.alpha == pytest.approx(0.6)


@pytest.mark.parametrize("over,reason", [
    (dict(steps="abc"), "not an integer"), (dict(steps="1.5"), "not an integer"), (dict(decode_s="nan"), "finite"),
    (dict(decode_s="inf"), "finite"), (dict(steps="-3"), "range"), (dict(accepted="61"), "inconsistent"),
    (dict(rejected_steps="21"), "inconsistent"), (dict(k_steps="1000"), "inconsistent"),
    (dict(chosen_k="3"), "unknown field"), (dict(a0="21"), "per-position"), (dict(e0="21"), "per-position"),
    (dict(kk_steps=str(16 * 16 * 20 + 1)), "inconsistent"), (dict(k_decode_s="40.1"), "inconsistent"),
    (dict(steps="9" * 40), "bytes"), (dict(tokens=str(10**14)), "range"), (dict(bogus="1"), "unknown field"),
    (dict(updated="999999999"), "future|range"), (dict(updated="1"), "stale"),
])
def test_parse_cell_rejects(over, reason):
    with pytest.raises(MalformedCell, match=reason):
        parse_cell(_fields(**over), now_unix_s=1001.0, max_age_s=100)


def test_parse_cell_rejects_too_many_fields():
    with pytest.raises(MalformedCell, match="fields"):
        parse_cell({f"x{i}": "1" for i in range(MAX_FIELDS + 1)}, now_unix_s=0, max_age_s=1)


# -- the store without Redis: memory only ---------------------------------------------------------

def _store(url="redis://127.0.0.1:1/0", **kw):
    kw.setdefault("start", False)
    return TuningStore(RedisConfig(url=url), **kw)


def test_record_buffer_drops_oldest_and_counts():
    store = _store(buffer_size=3)
    for _ in range(5):
        assert store.record("m", "ngram", "ngram", "chat", "1", stats(), latency_s=1.0)
    assert len(store._records) == 3 and store.counters["records_dropped"] == 2 and store.counters["records"] == 5


def test_record_rejects_unknown_cells_and_bad_stats():
    store = _store()
    assert not store.record("m", "warp", "p", "chat", "1", stats(), 1.0)
    assert not store.record("m", "ngram", "p", "poetry", "1", stats(), 1.0)
    assert not store.record("m", "ngram", "p", "chat", "3-5", stats(), 1.0)
    assert not store.record("m", "ngram", "p", "chat", "1", stats(accepted=99), 1.0)
    assert store.counters["records_invalid"] == 4 and not store._records


def test_snapshot_of_a_new_model_is_empty_and_registers_it():
    store = _store(models=())
    view = store.snapshot("m")
    assert view.cells == {} and "m" in store._models and view.rng is store._rng


def test_record_completion_uses_the_decision_bucket():
    store = _store()
    d = Decision(pool="ngram", mode=SpecMode.NGRAM, k=3, decided_by="policy", workload_class="code",
                 detail={"load_bucket": "8-15"})
    comp = Completion(request_id="r", model="m", completion_tokens=23, ttft_s=0.2, latency_s=1.2,
                      stats=stats().to_dict())
    assert store.record_completion("m", d, comp, batch_per_replica=0)
    key, inc = store._records[-1]
    assert key == "specserve:v3:m:ngram:code:8-15" and inc["decode_s"] == pytest.approx(1.0) and inc["tokens"] == 23


def test_table_falls_back_to_the_cached_view_when_redis_is_down():
    store = _store(url=f"redis://127.0.0.1:{free_port()}/0")
    assert store.table("m") == []


def test_fail_open_when_nothing_listens():
    store = _store(url=f"redis://127.0.0.1:{free_port()}/0", models=("m",), start=True)
    try:
        lat, errors = [], []
        _traffic(store, 2.0, lat, errors)
        assert errors == [] and len(lat) > 100
        assert p99_ms(lat) < 5.0, f"p99 {p99_ms(lat):.2f} ms"
        t = time.perf_counter()
        assert store.flush_now() is False and time.perf_counter() - t < 1.0
        assert not store.healthy and store.counters["flush_errors"] >= 1
    finally:
        store.close(flush=False)


# -- against a real redis-server ----------------------------------------------------------------------

@pytest.fixture
def store_for(redis_server):
    made = []

    def make(**kw):
        kw.setdefault("start", False)
        s = TuningStore(RedisConfig(url=redis_server.url), **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close(flush=False)


@pytest.mark.redis
def test_batched_writes_add_up_across_replicas_with_ttl(store_for, redis_client):
    a, b = store_for(ttl_s=600), store_for(ttl_s=600)
    for s in (a, b):
        for _ in range(3):
            s.record("m", "ngram", "ngram", "chat", "1", stats(runs=(0, 1, 1)), latency_s=1.5, ttft_s=0.5)
    assert a.flush_now() and b.flush_now()
    key = cell_key(PREFIX, "m", "ngram", "chat", "1")
    h = redis_client.hgetall(key)
    assert int(h[b"requests"]) == 6 and int(h[b"accepted"]) == 72 and int(h[b"a2"]) == 12 and int(h[b"r2"]) == 6
    assert float(h[b"decode_s"]) == pytest.approx(6.0)
    assert 0 < redis_client.ttl(key) <= 600
    view = a.fetch_view("m")
    assert view.cells[("ngram", "chat", "1")].steps == 60 and a.healthy
    assert view.cells[("ngram", "chat", "1")].runs == (0, 6, 6)
    # The step time per K: steps by HINCRBY, seconds by HINCRBYFLOAT (fractions kept).
    assert int(h[b"s3"]) == 60 and float(h[b"t3"]) == pytest.approx(6.0)
    a.record("m", "ngram", "ngram", "chat", "1", stats(), latency_s=0.75, ttft_s=0.5)
    assert a.flush_now() and a.fetch_view("m").cells[("ngram", "chat", "1")].decode_s_at_k[3] == pytest.approx(6.25)
    rows = a.table("m")
    assert [(r["mode"], r["workload_class"], r["load_bucket"], r["samples"]) for r in rows] == [("ngram", "chat", "1", 7)]


@pytest.mark.redis
def test_background_refresh_shares_state_and_it_survives_a_router_restart(store_for):
    writer = store_for()
    reader = store_for(models=("m",), refresh_interval_s=0.2, start=True)
    writer.record("m", "ngram", "ngram", "code", "2-3", stats(), latency_s=1.0)
    writer.flush_now()
    assert wait_until(lambda: ("ngram", "code", "2-3") in reader.snapshot("m").cells, 3.0)
    restarted = store_for()
    restarted.refresh_now("m")
    assert restarted.snapshot("m").cells[("ngram", "code", "2-3")] == reader.snapshot("m").cells[("ngram", "code", "2-3")]


@pytest.mark.redis
def test_poisoned_keys_are_ignored_counted_and_repaired(store_for, redis_client, caplog):
    key = lambda m, c, b="1": cell_key(PREFIX, "m", m, c, b)  # noqa: E731
    good = stats()
    honest = store_for()
    honest.record("m", "ngram", "ngram", "translation", "1", good, latency_s=1.0)
    honest.flush_now()
    now = str(time.time())
    redis_client.set(key("ngram", "chat"), "not a hash")
    redis_client.rpush(key("none", "chat"), "a", "b")
    redis_client.hset(key("ngram", "code"), mapping={f"f{i}": i for i in range(10000)})
    redis_client.hset(key("ngram", "rag"), mapping={"steps": "1" * (1 << 20)})
    redis_client.hset(key("ngram", "summarization"), mapping={"steps": 100, "k_steps": 3000, "updated": now})
    redis_client.hset(key("ngram", "qa"), mapping={"steps": -5, "updated": now})
    redis_client.hset(key("ngram", "math"), mapping={"steps": 10, "decode_s": "nan", "updated": now})
    redis_client.hset(key("ngram", "extraction"), mapping={"steps": 10, "evil": 1, "updated": now})
    redis_client.hset(key("ngram", "structured"), mapping={"steps": 10, "drafted": 1, "accepted": 10 ** 9, "updated": now})
    redis_client.hset(key("ngram", "creative"), mapping={"steps": 10, "a0": 10 ** 12, "e0": 10, "updated": now})
    poisoned = 10

    kinds: list[str] = []
    reader = store_for(rng_seed=0, on_malformed=kinds.append)
    with caplog.at_level(logging.WARNING, logger="specserve.tuning"):
        assert reader.refresh_now("m")
    assert sorted(kinds) == ["fields", "size", "type", "type"] + ["value"] * 6  # the metric hook, by reason
    view = reader.snapshot("m")
    assert set(view.cells) == {("ngram", "translation", "1")}
    assert reader.counters["malformed_cells"] == poisoned
    assert sum("ignoring tuning key" in r.getMessage() for r in caplog.records) == poisoned
    empty = TuningView("m")
    for cls in ("chat", "code", "rag", "summarization", "qa", "math", "extraction", "structured", "creative"):
        assert choose_auto(POOLS, RouterConfig(), cls, view) == choose_auto(POOLS, RouterConfig(), cls, empty)

    assert reader.flush_now()  # repair: the poisoned keys are deleted, so writers can rebuild them
    assert redis_client.exists(key("ngram", "chat"), key("ngram", "code"), key("ngram", "summarization")) == 0
    assert redis_client.exists(key("ngram", "translation")) == 1
    reader.record("m", "ngram", "ngram", "chat", "1", good, latency_s=1.0)
    assert reader.flush_now() and reader.refresh_now("m")
    assert reader.snapshot("m").cells[("ngram", "chat", "1")].steps == good.steps


@pytest.mark.redis
def test_a_key_that_refuses_hincrby_is_reset(store_for, redis_client):
    key = cell_key(PREFIX, "m", "ngram", "chat", "1")
    redis_client.hset(key, mapping={"steps": "abc"})
    store = store_for()
    store.record("m", "ngram", "ngram", "chat", "1", stats(), latency_s=1.0)
    assert store.flush_now() and store.counters["flush_key_errors"] >= 1
    store.record("m", "ngram", "ngram", "chat", "1", stats(), latency_s=1.0)
    assert store.flush_now()  # deletes the poisoned key, then rebuilds it from this batch
    assert int(redis_client.hget(key, "steps")) == 10


def _traffic(store, duration_s, lat, errors):
    """Request-path work (record + snapshot + policy) for duration_s; returns the records made."""
    n = 0
    end = time.monotonic() + duration_s
    while time.monotonic() < end:
        t = time.perf_counter()
        try:
            store.record("m", "ngram", "ngram", "chat", "1", stats(), latency_s=1.0)
            choose_auto(POOLS, RouterConfig(), "chat", store.snapshot("m"))
            n += 1
        except Exception as e:  # noqa: BLE001 - any exception here is a failed request
            errors.append(e)
        lat.append(time.perf_counter() - t)
        time.sleep(0.005)
    return n


def _requests_in_redis(port):
    try:
        v = redis.Redis(port=port, socket_timeout=0.5).hget(cell_key(PREFIX, "m", "ngram", "chat", "1"), "requests")
        return int(v or 0)
    except redis.RedisError:
        return -1


@pytest.mark.redis
def test_killing_redis_fails_no_request_and_writes_resume_within_10s(tmp_path):
    port, data = free_port(), tmp_path / "redis"
    server = start_local_redis(port, data_dir=data)
    store = TuningStore(RedisConfig(url=server.url), models=("m",), rng_seed=0)  # default intervals
    lat, errors = [], []
    try:
        before = _traffic(store, 1.0, lat, errors)
        assert wait_until(lambda: _requests_in_redis(port) == before, 5.0) and store.healthy
        time.sleep(1.2)  # appendfsync everysec: let the AOF hold them
        server.kill()
        during = _traffic(store, 2.0, lat, errors)
        assert not store.healthy or wait_until(lambda: not store.healthy, 5.0)
        server = start_local_redis(port, data_dir=data)
        restarted = time.monotonic()
        after = _traffic(store, 0.5, lat, errors)
        # nothing recorded during the outage is lost, and it all lands within 10 s of the restart
        total = before + during + after
        assert wait_until(lambda: _requests_in_redis(port) == total, 10.0 - (time.monotonic() - restarted)), \
            (_requests_in_redis(port), total)
        assert time.monotonic() - restarted < 10.0 and wait_until(lambda: store.healthy, 3.0)
        assert errors == [] and store.counters["records_dropped"] == 0
        assert p99_ms(lat) < 5.0, f"p99 {p99_ms(lat):.2f} ms"
    finally:
        store.close(flush=False)
        server.stop()


@pytest.mark.redis
def test_a_hung_redis_does_not_slow_requests(redis_server):
    store = TuningStore(RedisConfig(url=redis_server.url, socket_timeout_s=0.05), models=("m",),
                        io_timeout_s=0.2, rng_seed=0)  # default intervals
    lat, errors = [], []
    try:
        _traffic(store, 0.5, lat, errors)
        assert wait_until(lambda: store.healthy, 3.0)
        os.kill(redis_server.process.pid, signal.SIGSTOP)  # accepts connections, answers nothing
        try:
            _traffic(store, 2.0, lat, errors)
            assert store.counters["flush_errors"] + store.counters["refresh_errors"] >= 1 and not store.healthy
            t = time.perf_counter()  # no retries: one timeout, not redis-py's ~6 s of default retrying
            assert store.flush_now() is False and time.perf_counter() - t < 1.5
        finally:
            os.kill(redis_server.process.pid, signal.SIGCONT)
        assert wait_until(lambda: store.healthy and store.flush_now(), 5.0)
        assert errors == [] and p99_ms(lat) < 5.0, f"p99 {p99_ms(lat):.2f} ms"
    finally:
        store.close(flush=False)
