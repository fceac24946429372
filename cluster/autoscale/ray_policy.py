"""Ray Serve and Redis around `cluster.autoscale.policy`: the custom autoscaling policy that runs in the
Serve controller, and the Redis record of its decisions that the router and `specserve status` read.

Contract: `GoodputPolicy(ctx) -> (replicas, policy_state)` is Ray Serve 2.60's class-callable policy
(`AutoscalingConfig.policy`, instantiated once per deployment with JSON-able kwargs); it turns Ray's
`AutoscalingContext` into a `PoolSnapshot`, asks `cluster.autoscale.policy.decide`, and hands the verdict to
a publisher thread. Nothing here blocks the controller's loop on Redis: the tuning state is read by
a `TuningStore` thread and records are written by a thread of their own, with short timeouts and no
retries; with Redis down the policy decides on the config's carry and publishes nothing (fail open).

Redis key (one per pool, JSON, TTL `RECORD_TTL_S`): `{key_prefix}:autoscale:{pool}` holding
`Verdict.record(...)` plus `last_change` (the last up/down and its reason) and `snapshot` (the
input of the decision, so runs can be replayed as test fixtures). A reader takes a record only when
`parse_record` accepts it (size, JSON, nesting, finite numbers, the fields the router reads); any
other is ignored with a (rate-limited) warning and a counter, as tuning cells are.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import threading
import time
import weakref
from typing import Any, Callable, Mapping, Optional

from cluster.autoscale.policy import MAX_REPLICAS, PolicyState, PoolSnapshot, ReplicaMetrics, decide, plain_step_points
from cluster.config import RedisConfig
from cluster.config_pool import AutoscalingConfig

log = logging.getLogger("specserve.autoscale")

RECORD_TTL_S = 60
MAX_RECORD_BYTES = 64 * 1024  # a published record is ~1-4 KiB
MAX_RECORD_DEPTH = 6  # record -> snapshot -> replicas -> one replica's metrics: 4 levels
LANE_METRIC = "lane_ongoing"
CUSTOM_METRICS = ("unfinished", "finished", "tokens_per_s", "accepted_per_s", "tpot_p99_s", "ttft_p99_s", "mean_k")


def record_key(prefix: str, pool: str) -> str:
    return f"{prefix}:autoscale:{pool}"


class MalformedRecord(ValueError):
    """An autoscale record that failed validation; the message says why."""


def _finite(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"number {text[:20]!r} is not finite")
    return v


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a number")


def _depth(value: Any, limit: int) -> int:
    """Nesting depth of parsed JSON, stopping past `limit`."""
    if limit < 0 or not isinstance(value, (dict, list)):
        return 0
    items = value.values() if isinstance(value, dict) else value
    return 1 + max((_depth(v, limit - 1) for v in items), default=0)


def parse_record(raw: Any) -> dict:
    """Validate one autoscale record as read from Redis (bytes or str) into a dict; raise
    MalformedRecord. Accepted: at most MAX_RECORD_BYTES of JSON, an object nested at most
    MAX_RECORD_DEPTH deep, every number finite (no NaN, Infinity or 1e999), and the fields the
    router reads well-typed: `target` a whole number within 0..MAX_REPLICAS, `time_unix_s` a number."""
    if not isinstance(raw, (bytes, str)):
        raise MalformedRecord(f"a {type(raw).__name__}, not a string")
    if len(raw) > MAX_RECORD_BYTES:
        raise MalformedRecord(f"{len(raw)} bytes (at most {MAX_RECORD_BYTES})")
    try:
        rec = json.loads(raw, parse_float=_finite, parse_constant=_refuse_constant)
    except RecursionError:
        raise MalformedRecord("JSON nested too deeply") from None
    except ValueError as e:  # not JSON, not UTF-8, a non-finite number
        raise MalformedRecord(f"not valid JSON: {str(e)[:80]}") from None
    if not isinstance(rec, dict):
        raise MalformedRecord(f"a JSON {type(rec).__name__}, not an object")
    if _depth(rec, MAX_RECORD_DEPTH) > MAX_RECORD_DEPTH:
        raise MalformedRecord(f"nested deeper than {MAX_RECORD_DEPTH}")
    target, when = rec.get("target"), rec.get("time_unix_s")
    if isinstance(target, bool) or not isinstance(target, int) or not 0 <= target <= MAX_REPLICAS:
        raise MalformedRecord(f"target: {str(target)[:20]!r} is not a whole number within 0..{MAX_REPLICAS}")
    if isinstance(when, bool) or not isinstance(when, (int, float)) or not math.isfinite(when):
        raise MalformedRecord(f"time_unix_s: {str(when)[:20]!r} is not a finite number")
    return rec


def _redis_client(redis_cfg: Mapping[str, Any], timeout_s: float):
    from cluster.state.redis_client import redis_client_from

    return redis_client_from(redis_cfg, timeout_s)


def snapshot_from_context(ctx: Any, plain_step_s: tuple = ()) -> "Any":
    """Ray's AutoscalingContext -> PoolSnapshot (per-replica custom metrics as averaged by Ray); the
    pool's load is Serve's count of calls plus the replicas' calls on their local lanes."""
    agg = ctx.aggregated_metrics or {}
    ids = {rid for m in CUSTOM_METRICS for rid in agg.get(m, {})}
    replicas = []
    for rid in sorted(ids, key=str):
        vals = {m: float(agg[m][rid]) for m in CUSTOM_METRICS if rid in agg.get(m, {})}
        vals = {m: v for m, v in vals.items() if math.isfinite(v)}  # readers refuse records with NaN / inf
        name = getattr(rid, "unique_id", None) or str(rid)
        replicas.append(ReplicaMetrics(replica=str(name), **vals))
    # Serve counts the calls its handles made; the calls on the replicas' local lanes, which it does not
    # see, each replica reports itself (`lane_ongoing`, deployments/engine_lane.py).
    lane = sum(float(v) for v in agg.get(LANE_METRIC, {}).values() if math.isfinite(float(v)))
    return PoolSnapshot(now_s=float(ctx.current_time or time.time()), running_replicas=int(ctx.current_num_replicas),
                        target_replicas=int(ctx.target_num_replicas), load=float(ctx.total_num_requests) + lane,
                        replicas=tuple(replicas), plain_step_s=tuple(plain_step_s))


class _Publisher:
    """Writes the latest record of a pool to Redis about once a second, from its own thread."""

    def __init__(self, redis_cfg: Mapping[str, Any], key: str, interval_s: float = 1.0):
        self.key = key
        self.interval_s = interval_s
        self._client = _redis_client(redis_cfg, timeout_s=max(float(redis_cfg.get("socket_timeout_s", 0.05)), 0.25))
        self._latest: Optional[dict] = None
        self._lock = threading.Lock()
        self.stop = threading.Event()
        self.failures = 0
        threading.Thread(target=self._run, name="specserve-autoscale-publish", daemon=True).start()

    def offer(self, record: dict) -> None:
        with self._lock:
            self._latest = record

    def _run(self) -> None:
        import redis

        last_warn = 0.0
        while not self.stop.wait(self.interval_s):
            with self._lock:
                record, self._latest = self._latest, None
            if record is None:
                continue
            try:
                self._client.set(self.key, json.dumps(record, allow_nan=False), ex=RECORD_TTL_S)
            except (redis.RedisError, OSError, ValueError) as e:  # ValueError: a non-finite number
                self.failures += 1
                if time.monotonic() - last_warn > 60:
                    last_warn = time.monotonic()
                    log.warning("autoscale record %s not published (%d failures): %s", self.key, self.failures, e)


def _previous_last_change(redis_cfg: Mapping[str, Any], key: str) -> Optional[dict]:
    """The last change a previous instance published (a restarted controller keeps the history)."""
    import redis

    try:
        raw = _redis_client(redis_cfg, timeout_s=0.5).get(key)
        last = parse_record(raw).get("last_change") if raw else None
    except (redis.RedisError, OSError, MalformedRecord):
        return None
    return last if isinstance(last, dict) else None


class GoodputPolicy:
    """Ray Serve custom autoscaling policy of one engine pool (see module doc)."""

    def __init__(self, pool: str, model: str, autoscaling: dict, redis: Optional[dict] = None,
                 max_carry: float = 64.0):
        self.pool, self.model, self.max_carry = pool, model, max_carry
        self.cfg = AutoscalingConfig.model_validate(autoscaling)
        self.tuning = self.publisher = None
        self.last_change: Optional[dict] = None
        if redis is not None:
            from cluster.state.tuning import TuningStore

            rc = RedisConfig.model_validate(redis)
            self.tuning = TuningStore(rc, models=(model,), refresh_interval_s=5.0, flush_interval_s=60.0)
            self.publisher = _Publisher(redis, record_key(rc.key_prefix, pool))
            self.last_change = _previous_last_change(redis, record_key(rc.key_prefix, pool))
            weakref.finalize(self, self.publisher.stop.set)
            weakref.finalize(self, self.tuning.close, False)
        log.info("pool %s: goodput autoscaling policy, %s", pool, self.cfg.model_dump())

    def __call__(self, ctx: Any) -> tuple[int, dict]:
        plain = plain_step_points(self.tuning.snapshot(self.model)) if self.tuning is not None else ()
        snap = snapshot_from_context(ctx, plain)
        state = PolicyState.from_dict(ctx.policy_state or {})
        verdict, new_state = decide(snap, self.cfg, state, max_carry=self.max_carry)
        if verdict.action in ("up", "down"):
            self.last_change = {"action": verdict.action, "reason": verdict.reason, "time_unix_s": snap.now_s,
                                "from": snap.target_replicas, "to": verdict.replicas}
            log.info("pool %s: %s", self.pool, verdict.reason)
        if self.publisher is not None:
            self.publisher.offer({**verdict.record(self.pool, snap), "last_change": self.last_change,
                                  "snapshot": snap.to_dict(), "state_in": state.to_dict()})
        return verdict.replicas, {**(ctx.policy_state or {}), **new_state.to_dict()}


class AutoscaleRecords:
    """The router's (and status's) reader of the autoscaler's records: one MGET per second from a
    thread; `records()` never touches Redis. Unreachable Redis: the last records age out and the
    router falls back to its static view (`cluster.autoscale.policy.effective_replicas`). A record that
    `parse_record` refuses is left out (warning, `counters`, `on_malformed` hook with the pool)."""

    def __init__(self, redis_cfg: Mapping[str, Any], pools: list[str], interval_s: float = 1.0, start: bool = True,
                 on_malformed: Optional[Callable[[str], None]] = None):
        self.pools = list(pools)
        self.keys = [record_key(redis_cfg.get("key_prefix", "specserve:v3"), p) for p in self.pools]
        self.interval_s = interval_s
        self.on_malformed = on_malformed
        self._client = _redis_client(redis_cfg, timeout_s=max(float(redis_cfg.get("socket_timeout_s", 0.05)), 0.25))
        self._records: dict[str, dict] = {}
        self._last_warn: dict[tuple, float] = {}
        self.counters: collections.Counter = collections.Counter()
        self.stop = threading.Event()
        if start and self.pools:
            threading.Thread(target=self._run, name="specserve-autoscale-read", daemon=True).start()

    def records(self) -> dict[str, dict]:
        return self._records

    def fetch(self) -> dict[str, dict]:
        """Read every pool's valid record now (raises redis errors)."""
        out = {}
        for pool, raw in zip(self.pools, self._client.mget(self.keys)):
            if raw is None:
                continue
            try:
                out[pool] = parse_record(raw)
            except MalformedRecord as e:
                self.counters["malformed"] += 1
                self._warn(("malformed", pool), "ignoring the autoscale record of pool %s: %s", pool, e)
                if self.on_malformed is not None:
                    self.on_malformed(pool)
        return out

    def _run(self) -> None:
        import redis

        while not self.stop.is_set():
            try:
                self._records = self.fetch()
            except (redis.RedisError, OSError) as e:  # keep the last records; they age out in effective_replicas
                self.counters["redis_errors"] += 1
                self._warn(("redis", type(e).__name__), "autoscale records not read (%d failures): %s: %s",
                           self.counters["redis_errors"], type(e).__name__, e)
            except Exception as e:  # noqa: BLE001 - a bug must not end the reader for good; logged, counted
                self.counters["thread_errors"] += 1
                self._warn(("thread", type(e).__name__), "autoscale reader: unexpected %s: %s (it carries on)",
                           type(e).__name__, e)
            self.stop.wait(self.interval_s)

    def _warn(self, what: tuple, msg: str, *args) -> None:
        now = time.monotonic()
        if now - self._last_warn.get(what, -1e9) >= 60.0:
            self._last_warn[what] = now
            log.warning(msg, *args)

    def close(self) -> None:
        self.stop.set()
        self._client.close()
