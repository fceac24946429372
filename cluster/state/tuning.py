"""Tuning state in Redis: written from every response's SpecStats, read back as a `TuningView`.

Contract: nothing here touches Redis on the request path. `TuningStore.record(...)` appends to
bounded in-memory buffers; `snapshot(model)` returns the latest
validated in-memory view. One background thread flushes the buffers in batches (a MULTI pipeline
of HINCRBY / HINCRBYFLOAT, so router replicas add up, with a TTL on every key) and refreshes the
views from Redis. Redis down, slow or poisoned: requests still get a view (priors when empty);
writes are kept (aggregated per key, bounded) and resume by themselves when Redis answers again.

Keys: `{prefix}:{model}:{mode}:{class}:{bucket}` (prefix `specserve:v3` from RedisConfig), one hash
per tuning cell with the count fields of `cluster.policy.CellStats` (`a{i}` / `e{i}` are the
per-position accepted / exposed steps, `r{L}` the accepted runs of L tokens, `s{K}` / `t{K}` the
steps and decode seconds of the requests that ran at K) and `updated` (unix s).
The fields and their validation are `cluster.state.tuning_cells`'; reading the cells back is
`cluster.state.tuning_read`'s. A cell that is the wrong type, too big, has
unknown fields, non-numeric or out-of-range values, or is stale is ignored with a (rate-limited) warning and
a counter, and deleted so writers can rebuild it.
Any Redis error (no connection, timeout, or an error reply such as OOM, READONLY or NOPERM) is survived
the same way: counted (`on_redis_error`), warned about, the batch kept, and retried at the next flush.

Only the store's models are tracked (those it was built with; a store built without any registers
up to MAX_MODELS names as they come), so a caller-chosen name never grows a cache.
"""

from __future__ import annotations

import collections
import logging
import random
import threading
import time
from typing import Callable, Optional

import redis

from cluster.config import RedisConfig
from cluster.policy import BUCKET_NAMES, CellKey, TuningView, load_bucket, tuning_rows
from cluster.speculation import WORKLOAD_CLASSES, SpecStats
from cluster.state.redis_client import redis_client_from
from cluster.state.tuning_cells import FLOAT_FIELDS, MODES, add_increments, cell_key, increments_from_stats
from cluster.state.tuning_read import read_cells

log = logging.getLogger("specserve.tuning")

MAX_MODELS = 16  # models a store built without a list registers as they come; later names are refused
REDIS_ERRORS = (redis.RedisError, OSError)  # every failure of a Redis call, error replies included


def redis_error_kind(e: BaseException) -> str:
    """A bounded label for a Redis failure: redis-py's exception class (OutOfMemoryError, ReadOnlyError,
    NoPermissionError, ResponseError, ConnectionError, TimeoutError, ...) or the OSError's."""
    return type(e).__name__


class TuningStore:
    """Buffered writer and cached reader of the tuning cells of one or more models (see module doc)."""

    def __init__(
        self,
        config: RedisConfig,
        models: tuple[str, ...] = (),
        *,
        flush_interval_s: float = 0.5,
        refresh_interval_s: float = 1.0,
        buffer_size: int = 10000,
        ttl_s: int = 7 * 86400,
        io_timeout_s: Optional[float] = None,
        rng_seed: Optional[int] = None,
        repair_malformed: bool = True,
        on_malformed: Optional[Callable[[str], None]] = None,
        on_redis_error: Optional[Callable[[str, str], None]] = None,
        clock: Callable[[], float] = time.time,
        start: bool = True,
    ):
        self.prefix = config.key_prefix
        self.ttl_s = int(ttl_s)
        self.flush_interval_s, self.refresh_interval_s = flush_interval_s, refresh_interval_s
        self.repair_malformed = repair_malformed
        self.on_malformed = on_malformed  # called with the reason's kind (e.g. a Prometheus counter)
        self.on_redis_error = on_redis_error  # called with (operation, redis_error_kind) of every failed call
        self._clock = clock
        # Off the request path, so a little more than the per-call budget; never any retry.
        timeout = io_timeout_s if io_timeout_s is not None else max(config.socket_timeout_s, 0.25)
        self._redis = redis_client_from(config, timeout)
        self._rng = random.Random(rng_seed)
        self._records: collections.deque = collections.deque()
        self._buffer_size = buffer_size
        self._lock = threading.Lock()  # guards the buffers (held for microseconds)
        self._io_lock = threading.Lock()  # one flush / refresh at a time
        self._pending: dict[str, dict[str, float]] = {}  # key -> increments not yet in Redis
        self._to_delete: set[str] = set()
        self._models: set[str] = set(models)
        self._open = not models  # no list given: register names as they come, up to MAX_MODELS
        self._views: dict[str, TuningView] = {}
        self._key_cache: dict[str, dict[str, CellKey]] = {}
        self._last_ok_mono = 0.0
        self._last_fail_mono = 0.0
        self._failing: set[str] = set()  # of flush / refresh: those whose last call failed
        self._last_warn: dict[tuple, float] = {}
        self.counters = collections.Counter()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        if start:
            self.start()

    @classmethod
    def from_config(cls, config, **kwargs) -> "TuningStore":
        """A started store for a ClusterConfig: its Redis section and its served models."""
        return cls(config.redis, models=tuple(config.served_models()), **kwargs)

    # -- the request path: memory only -------------------------------------------------------

    def record_completion(self, model: str, decision, completion, batch_per_replica: float = 0.0) -> bool:
        """`record` from a routing Decision and a wire Completion (stats = SpecStats.to_dict()).
        The load bucket is the one the policy decided in; else that of `batch_per_replica` + 1."""
        stats = SpecStats.from_dict(completion.stats or {})
        detail = decision.detail or {}
        bucket = detail.get("load_bucket") or load_bucket(batch_per_replica + 1.0)
        return self.record(model, stats.mode, decision.pool, decision.workload_class, bucket, stats,
                           latency_s=completion.latency_s, ttft_s=completion.ttft_s or None,
                           output_tokens=completion.completion_tokens or None)

    def record(
        self, model: str, mode: str, pool: str, workload_class: str, load_bucket: str, stats: SpecStats,
        latency_s: float, ttft_s: Optional[float] = None, output_tokens: Optional[int] = None,
    ) -> bool:
        """Queue one finished request's stats (non-blocking). False if rejected as invalid.
        `pool` is for the log only: cells are shared by the pools of a mode."""
        if not self._track(model):
            self.counters["records_invalid"] += 1
            self._warn(("record-model",), "record for untracked model %.64r ignored", model)
            return False
        if mode not in MODES or workload_class not in WORKLOAD_CLASSES or load_bucket not in BUCKET_NAMES:
            self.counters["records_invalid"] += 1
            self._warn(("record", mode, workload_class), "record from pool %s: unknown mode/class/bucket %r/%r/%r",
                       pool, mode, workload_class, load_bucket)
            return False
        try:
            inc = increments_from_stats(stats, latency_s, ttft_s, output_tokens)
        except (TypeError, ValueError) as e:
            self.counters["records_invalid"] += 1
            self._warn(("record", pool), "record from pool %s ignored: %s", pool, e)
            return False
        with self._lock:
            if len(self._records) >= self._buffer_size:
                self._records.popleft()
                self.counters["records_dropped"] += 1
            self._records.append((cell_key(self.prefix, model, mode, workload_class, load_bucket), inc))
            self.counters["records"] += 1
        return True

    def snapshot(self, model: str) -> TuningView:
        """The latest validated view of `model` (empty until the first refresh, and for a model the
        store does not track; never blocks)."""
        view = self._views.get(model)
        if view is None:
            self._track(model)  # an open store registers the name (up to MAX_MODELS)
            return TuningView(model=model, rng=self._rng)
        return view

    def tracks(self, model: str) -> bool:
        """Whether `model` is one of the store's models (never registers it)."""
        return model in self._models

    def _track(self, model: str) -> bool:
        """Whether `model` is tracked, registering it if the store is open and has room."""
        if model in self._models:
            return True
        if not self._open or len(self._models) >= MAX_MODELS:
            return False
        self._models.add(model)
        return True

    @property
    def healthy(self) -> bool:
        """True when the last Redis call succeeded, within the last few intervals, and neither the
        writer's last flush nor its last refresh failed (reads that work while Redis refuses the
        writes, as under `maxmemory`, are not health)."""
        window = 3 * max(self.flush_interval_s, self.refresh_interval_s) + 1.0
        ok = self._last_ok_mono
        return (ok > 0 and not self._failing and ok >= self._last_fail_mono
                and time.monotonic() - ok < window)

    # -- background I/O ---------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="specserve-tuning", daemon=True)
            self._thread.start()

    def close(self, flush: bool = True) -> None:
        """Stop the thread (one last flush attempt when `flush`) and the connections."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if flush:
            self.flush_now()
        self._redis.close()

    def _run(self) -> None:
        next_flush = next_refresh = time.monotonic()
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                if now >= next_flush:
                    next_flush = time.monotonic() + self.flush_interval_s
                    self.flush_now()
                if now >= next_refresh:
                    next_refresh = time.monotonic() + self.refresh_interval_s
                    for model in list(self._models):
                        self.refresh_now(model)
            except Exception as e:  # noqa: BLE001 - a bug must not end the writer for good; logged, counted
                self.counters["thread_errors"] += 1
                self._warn(("thread", type(e).__name__), "tuning thread: unexpected %s: %s (it carries on)",
                           type(e).__name__, e)
            self._stop.wait(max(min(next_flush, next_refresh) - time.monotonic(), 0.01))

    def flush_now(self) -> bool:
        """Write buffered records in one MULTI pipeline; on failure keep them (aggregated) for later."""
        with self._io_lock:
            return self._flush()

    def _flush(self) -> bool:
        with self._lock:
            drained = list(self._records)
            self._records.clear()
            for key, inc in drained:
                add_increments(self._pending.setdefault(key, {}), inc)
            if len(self._pending) > 4 * len(MODES) * len(WORKLOAD_CLASSES) * len(BUCKET_NAMES) * max(len(self._models), 1):
                self.counters["pending_dropped"] += len(self._pending)
                self._pending.clear()
            pending, delete = dict(self._pending), set(self._to_delete)
        if not (pending or delete):
            self._failing.discard("flush")  # nothing is waiting to be written (dropped, if it was)
            return True
        now = self._clock()
        pipe = self._redis.pipeline(transaction=True)
        order = []
        for key in delete:
            pipe.delete(key)
            order.append((key, None))
        for key, increments in pending.items():
            for f, v in increments.items():
                (pipe.hincrbyfloat if f in FLOAT_FIELDS else pipe.hincrby)(key, f, v if f in FLOAT_FIELDS else int(v))
                order.append((key, f))
            pipe.hset(key, mapping={"updated": repr(now)})
            pipe.expire(key, self.ttl_s)
            order += [(key, "updated"), (key, "expire")]
        try:
            results = pipe.execute(raise_on_error=False)
        except REDIS_ERRORS as e:  # no connection, or an error reply that aborted the whole MULTI (OOM, ...)
            self._redis_failed("flush", e, "tuning flush failed (%d keys kept for later)", len(pending))
            return False
        bad = {key for (key, _), r in zip(order, results) if isinstance(r, Exception)}
        for key in bad:  # a poisoned key refused HINCRBY: drop its batch, delete it next flush
            self.counters["flush_key_errors"] += 1
            self._warn(("flush-key", key), "tuning key %s refused an update; it will be reset", key)
        with self._lock:
            for key in pending:
                self._pending.pop(key, None)
            self._to_delete = (self._to_delete - delete) | bad
        self.counters["flushes"] += 1
        self.counters["keys_written"] += len(pending)
        self._failing.discard("flush")
        self._last_ok_mono = time.monotonic()
        return True

    def _cell_keys(self, model: str) -> dict[str, CellKey]:
        """Every possible key of `model` -> its cell (computed once per tracked model)."""
        keys = self._key_cache.get(model)
        if keys is None:
            keys = {cell_key(self.prefix, model, m, c, b): (m, c, b)
                    for m in MODES for c in WORKLOAD_CLASSES for b in BUCKET_NAMES}
            if model in self._models:
                self._key_cache[model] = keys
        return keys

    def fetch_view(self, model: str) -> TuningView:
        """Read and validate every cell of `model` from Redis now (raises redis errors): the three
        round trips of `cluster.state.tuning_read.read_cells`, with a malformed cell ignored and, when
        `repair_malformed`, deleted (`_malformed`)."""
        cells, now = read_cells(self._redis, self.prefix, model, self._cell_keys(model), self._clock,
                                self.ttl_s + 3600, self._malformed)
        self.counters["refreshes"] += 1
        return TuningView(model=model, cells=cells, fetched_unix_s=now, rng=self._rng)

    def refresh_now(self, model: str) -> bool:
        """Replace the cached view of `model` from Redis; keep the old one on failure."""
        try:
            with self._io_lock:
                view = self.fetch_view(model)
        except REDIS_ERRORS as e:
            self._redis_failed("refresh", e, "tuning refresh of %s failed, serving the cached view", model)
            return False
        if not self._track(model):
            return True
        self._views[model] = view
        self._failing.discard("refresh")
        self._last_ok_mono = time.monotonic()
        return True

    def table(self, model: str, fresh: bool = True) -> list[dict]:
        """Rows of the table of a tracked model (else none). `fresh`: read from Redis now (for
        `specserve tuning`), falling back to the cached view when Redis fails; otherwise the cached
        view the background thread keeps (GetTuning: no I/O on the caller's thread)."""
        if not self._track(model):
            return []
        view = self._views.get(model) or TuningView(model=model)
        if fresh:
            try:
                view = self.fetch_view(model)
            except REDIS_ERRORS as e:
                self._redis_failed("table", e, "tuning table of %s from the cached view", model)
        return tuning_rows(view)

    # -- helpers ----------------------------------------------------------------------------

    def _malformed(self, key: str, reason: str, kind: str) -> None:
        """A key that failed validation: ignored (warning, counter, metric hook), deleted on the
        next flush when `repair_malformed`. `kind` is one of type / fields / size / value."""
        self.counters["malformed_cells"] += 1
        self._warn(("malformed", key), "ignoring tuning key %s: %s", key, reason)
        if self.on_malformed is not None:
            try:
                self.on_malformed(kind)
            except Exception:  # noqa: BLE001 - a metrics hook must not break the refresh
                log.debug("on_malformed hook failed", exc_info=True)
        if self.repair_malformed:
            with self._lock:
                self._to_delete.add(key)

    def _redis_failed(self, op: str, e: BaseException, msg: str, *args) -> None:
        """A failed Redis call of `op` (flush / refresh / table): counted, hooked, warned about."""
        kind = redis_error_kind(e)
        self.counters[f"{op}_errors"] += 1
        self.counters[f"redis_error:{kind}"] += 1
        self._last_fail_mono = time.monotonic()
        if op in ("flush", "refresh"):
            self._failing.add(op)
        self._warn((op, kind), msg + " (%s: %s)", *args, kind, str(e)[:200])
        if self.on_redis_error is not None:
            try:
                self.on_redis_error(op, kind)
            except Exception:  # noqa: BLE001 - a metrics hook must not break the writer
                log.debug("on_redis_error hook failed", exc_info=True)

    def _warn(self, what: tuple, msg: str, *args) -> bool:
        """Log a warning at most once a minute per `what`; True when it was logged."""
        now = time.monotonic()
        if now - self._last_warn.get(what, -1e9) >= 60.0:
            self._last_warn[what] = now
            log.warning(msg, *args)
            return True
        return False

