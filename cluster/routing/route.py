"""The router's single choice function: which pool, which speculative mode and which K a request gets.

`route` is pure: it takes the validated request's wishes, the pools of the requested model (with
their live load) and the router config, and returns a `Decision` or raises `ApiError`. An explicit
override in the request wins (validated against the pools); otherwise the configured default mode,
or, with `default_mode: auto`, the adaptive policy (`cluster.policy.choose_auto`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from cluster.api.types import ApiError, ErrorCode
from cluster.config import ClusterConfig, RouterConfig
from cluster.config_pool import PoolConfig
from cluster.policy.decision import Decision, OtherMethod, PoolView
from cluster.policy import TuningView, choose_auto
from cluster.speculation import SpecMode


# What a response reports of its decision (`specserve.decision`, HTTP): who chose its K, the load
# bucket it was admitted at, the batch it joined and, for a policy decision, the scores behind the
# choice of pool and method.
DECISION_FIELDS = ("k_by",  # "engine": K per step up to `k` (`per_step_k`); "request" / "default": `k`, fixed
                   "load_bucket", "join_batch", "alpha", "draft_rate", "score", "scores",
                   "k_step_alpha",  # the class α a per-step-K request started from (`per_step_k`)
                   "plain_for")  # the sampling field that needs K = 0 (`cluster.speculation.plain_field`)


def decision_summary(d: Decision) -> dict:
    """The reported part of `d.detail`.

    >>> d = Decision("p", SpecMode.NGRAM, 6, "policy", detail={"load_bucket": "16+", "cost_per_k": 0.1,
    ...                                                      "k_by": "engine", "k_step_alpha": 0.5})
    >>> decision_summary(d)
    {'k_by': 'engine', 'load_bucket': '16+', 'k_step_alpha': 0.5}
    >>> decision_summary(Decision("p", SpecMode.NGRAM, 3, "request"))
    {'k_by': 'request'}
    """
    detail = {"k_by": d.decided_by, **(d.detail or {})}
    return {f: detail[f] for f in DECISION_FIELDS if f in detail}


def pool_views(config: ClusterConfig) -> list[PoolView]:
    """Static views of every pool (no load) from the config."""
    return [
        PoolView(
            name=name, model=p.model, method=p.method, max_k=p.max_k,
            replicas=p.least_replicas,
            max_ongoing_requests=p.max_ongoing_requests, hardware_group=p.hardware_group,
            prior_alpha=tuple(sorted(p.prior_alpha.items())),
            prior_draft_rate=tuple(sorted(p.prior_draft_rate.items())),
            prior_draft_cost=(p.prior_draft_cost.per_step, p.prior_draft_cost.per_token)
            if p.prior_draft_cost is not None else None,
            auto=p.auto,
            also=tuple(OtherMethod(m, tuple(sorted(p.mode_prior_alpha(m).items())), p.mode_max_k(m),
                                   tuple(sorted(p.mode_prior_draft_rate(m).items())))
                       for m in p.modes if m not in (p.method, SpecMode.NONE)),
            auto_skips=(SpecMode.NGRAM,) if p.suffix is not None and not p.suffix.auto_ngram else (),
        )
        for name, p in config.pools.items()
    ]


def pool_load(
    own_inflight: dict[str, float], reports: dict[str, dict[str, tuple[float, float]]], now_s: float,
    max_age_s: float = 2.0, finished: Optional[dict[str, dict[str, list[float]]]] = None,
) -> dict[str, float]:
    """Requests in flight per pool: this router's own count, or, when larger, the sum of the engine
    replicas' own reports (`reports[pool][replica] = (monotonic time the poll was sent, unfinished
    requests)`, sampled in the background) that are younger than `max_age_s` — which includes
    other routers' traffic. A report is older than the request it is read for: the requests this
    router saw finish on that replica since the report (`finished[pool][replica]`: monotonic
    completion times) are taken off it, or a single stream would read its previous request as a
    second one in the batch.

    >>> pool_load({"a": 1, "b": 0}, {"a": {"r1": (9.5, 3), "r2": (5.0, 7)}}, now_s=10.0)
    {'a': 3.0, 'b': 0.0}
    >>> pool_load({"a": 0}, {"a": {"r1": (9.5, 1)}}, now_s=10.0, finished={"a": {"r1": [9.4, 9.8]}})
    {'a': 0.0}
    """
    finished = finished or {}
    out = {}
    for pool, own in own_inflight.items():
        done = finished.get(pool, {})
        fresh = [max(n - sum(1 for f in done.get(replica, ()) if f > t), 0.0)
                 for replica, (t, n) in reports.get(pool, {}).items() if now_s - t <= max_age_s]
        out[pool] = max(float(own), float(sum(fresh))) if fresh else float(own)
    return out


def with_load(views: list[PoolView], inflight: dict[str, float]) -> list[PoolView]:
    """`views` with their live load: each pool's requests in flight, and its hardware group's total."""
    groups: dict[str, float] = {}
    for v in views:
        if v.hardware_group is not None:
            groups[v.hardware_group] = groups.get(v.hardware_group, 0.0) + float(inflight.get(v.name, 0))
    return [
        replace(v, running=float(inflight.get(v.name, 0)),
                group_load=groups.get(v.hardware_group) if v.hardware_group is not None else None)
        for v in views
    ]


def resolve_model(requested: Optional[str], served: list[str]) -> str:
    if not requested:
        if len(served) == 1:
            return served[0]
        raise ApiError(ErrorCode.INVALID_ARGUMENT, f"model: required; served models: {served}", field="model")
    if requested not in served:
        raise ApiError(ErrorCode.NOT_FOUND, f"model: {requested!r} is not served; served models: {served}", field="model")
    return requested


def _least_loaded(pools: list[PoolView]) -> PoolView:
    return min(pools, key=lambda p: (p.batch_per_replica, p.name))


def _pools_for_mode(pools: list[PoolView], mode: SpecMode) -> list[PoolView]:
    """Pools that serve `mode`; for plain decoding, those with the cheapest proposer."""
    if mode == SpecMode.NONE:
        best = min(p.proposer_rank for p in pools)
        return [p for p in pools if p.proposer_rank == best]
    return [p for p in pools if mode in p.modes]


def route(
    pools: list[PoolView],
    router: RouterConfig,
    workload_class: str,
    mode_override: Optional[str] = None,
    k_override: Optional[int] = None,
    tuning: Optional[TuningView] = None,
) -> Decision:
    """Choose pool, mode and K for one request among `pools` (all of the request's model)."""
    if not pools:
        raise ApiError(ErrorCode.UNAVAILABLE, "no engine pool serves this model")
    if mode_override is not None:
        mode = SpecMode.parse(mode_override)
        candidates = _pools_for_mode(pools, mode)
        if not candidates:
            served = sorted({m.value for p in pools for m in p.modes})
            raise ApiError(
                ErrorCode.INVALID_ARGUMENT,
                f"speculative.mode: {mode.value!r} is not served for this model; served modes: {served}",
                field="speculative.mode",
            )
        pool = _least_loaded(candidates)
        if mode == SpecMode.NONE:
            k = 0
            if k_override not in (None, 0):
                raise ApiError(ErrorCode.INVALID_ARGUMENT, "speculative.k: must be 0 for mode 'none'", field="speculative.k")
        elif k_override is None:
            k = min(router.default_k.get(mode.value, 1), pool.k_bound(mode))
        else:
            max_k = max(p.k_bound(mode) for p in candidates)
            if k_override > max_k:
                raise ApiError(
                    ErrorCode.INVALID_ARGUMENT,
                    f"speculative.k: {k_override} exceeds the largest K ({max_k}) of the pools serving {mode.value!r}",
                    field="speculative.k",
                )
            pool = _least_loaded([p for p in candidates if p.k_bound(mode) >= k_override])
            k = k_override
        if k == 0:
            mode = SpecMode.NONE
        return Decision(pool=pool.name, mode=mode, k=k, decided_by="request", workload_class=workload_class)

    if router.default_mode != "auto":
        mode = SpecMode.parse(router.default_mode)
        pool = _least_loaded(_pools_for_mode(pools, mode) or pools)
        k = 0 if mode == SpecMode.NONE else min(router.default_k.get(mode.value, 1), pool.k_bound(mode))
        return Decision(pool=pool.name, mode=mode if k else SpecMode.NONE, k=k, decided_by="default",
                        workload_class=workload_class)

    return choose_auto(_auto_pools(pools), router, workload_class, tuning)


def _auto_pools(pools: list[PoolView]) -> list[PoolView]:
    """The pools the auto policy chooses among (`PoolView.auto`; all, if a config turned off every one)."""
    return [p for p in pools if p.auto] or pools


def drafting_mode(decision: Decision, pool: PoolConfig) -> SpecMode:
    """The drafting method behind a decision on `pool`: its mode, or, for K = 0, the method of the
    candidate the policy scored (`detail["pool_mode"]`; a pool may serve two), else the pool's.

    >>> p = PoolConfig(model="m", method="ngram", max_k=6, suffix={})
    >>> drafting_mode(Decision("ngram", SpecMode.NONE, 0, "policy", detail={"pool_mode": "suffix"}), p).value
    'suffix'
    >>> drafting_mode(Decision("ngram", SpecMode.NONE, 0, "policy"), p).value
    'ngram'
    """
    if decision.mode != SpecMode.NONE:
        return decision.mode
    mode = decision.detail.get("pool_mode", pool.method.value)
    return SpecMode(mode) if mode in {m.value for m in pool.modes} and mode != SpecMode.NONE.value else pool.method


def per_step_k(decision: Decision, pool: PoolConfig, class_alpha: float) -> Decision:
    """A policy decision runs its pool's drafting method up to the pool's max_k, the engine choosing
    K at every step from the batch and the request's acceptance, which starts at its class's α
    (`cluster.engine.step_k`): the policy chose pool and method, the engine chooses K. Other
    decisions are unchanged: a K the caller named, or the configured default's, stays fixed.

    >>> p = PoolConfig(model="m", method="ngram", max_k=6)
    >>> d = per_step_k(Decision("ngram", SpecMode.NONE, 0, "policy"), p, 0.42); (d.mode.value, d.k, d.detail)
    ('ngram', 6, {'k_step_alpha': 0.42, 'k_by': 'engine'})
    >>> per_step_k(Decision("ngram", SpecMode.NGRAM, 3, "request"), p, 0.42).k
    3
    >>> per_step_k(Decision("plain", SpecMode.NONE, 0, "policy"), PoolConfig(model="m", method="none"), 0.4).k
    0
    """
    if decision.decided_by != "policy" or not pool.uses_step_k:
        return decision
    alpha = min(max(float(class_alpha), 0.0), 1.0)
    mode = drafting_mode(decision, pool)
    return replace(decision, mode=mode, k=pool.mode_max_k(mode),
                   detail={**decision.detail, "k_step_alpha": round(alpha, 4), "k_by": "engine"})


def explain_choices(
    views: list[PoolView], router: RouterConfig, tuning: Optional[TuningView], classes, batches,
) -> list[dict]:
    """What `auto` would choose, exploiting only (no exploration draw), for each workload class at
    each batch size, from the tuning view `tuning` (None for the cold-start priors): one row per
    (batch, class) with the chosen pool and method and the numbers behind it. `batches` are the
    batch a request would join (1 = an idle machine); every pool is given that load (pools of one
    hardware group share it). Pure: `specserve tuning --explain` prints it for a config, so an
    operator can read the router's choice before sending traffic. `k` is the ceiling the engine
    chooses each step's K under (`per_step_k`); `k_best` the K whose score stood for the pool."""
    if tuning is not None:
        tuning = replace(tuning, rng=None)
    by_name = {v.name: v for v in views}
    rows = []
    for batch in batches:
        others = max(float(batch) - 1.0, 0.0)
        loaded = [replace(v, running=others * max(v.replicas, 1), waiting=0.0,
                          group_load=others if v.hardware_group is not None else None) for v in views]
        for wclass in classes:
            d = choose_auto(_auto_pools(loaded), router, wclass, tuning, rng=None)
            mode = SpecMode(d.detail.get("pool_mode", d.mode.value))
            rows.append({"batch": batch, "workload_class": wclass, "pool": d.pool, "mode": mode.value,
                         "k": by_name[d.pool].k_bound(mode) if mode != SpecMode.NONE else 0, "k_best": d.k,
                         **{f: d.detail.get(f) for f in (
                             "load_bucket", "alpha", "draft_rate", "cost_per_k", "cost_per_step", "step_overhead",
                             "expected_tokens_per_step", "score", "scores")}})
    return rows


class LoadMeter:
    """Time-weighted in-flight count per load domain (a hardware group, or a pool): the mean load a
    request met over its life, which is what its step times were paid at.

    A request's statistics belong to the load it ran under, not the load it was admitted at: the
    first request of a burst is admitted to an idle engine and then runs in a batch of four (filed
    under its admission, such requests put loaded step times into the batch-1 cells: plain decoding
    reads 152 ms per step there after a load sweep against 73 ms at one stream, and the measured
    draft costs come out too low). Pure bookkeeping with explicit times; O(1) per event.

    >>> m = LoadMeter()
    >>> m.change("hw", +1, now=0.0); mark = m.mark("hw", now=0.0)
    >>> m.change("hw", +3, now=1.0)   # three more join after 1 s
    >>> m.mean_since("hw", mark, now=2.0)  # 1 for 1 s, then 4 for 1 s
    2.5
    """

    def __init__(self) -> None:
        self._level: dict[str, float] = {}
        self._area: dict[str, float] = {}
        self._t: dict[str, float] = {}

    def _advance(self, key: str, now: float) -> None:
        t = self._t.get(key)
        if t is not None and now > t:
            self._area[key] = self._area.get(key, 0.0) + self._level.get(key, 0.0) * (now - t)
        self._t[key] = max(now, t) if t is not None else now

    def change(self, key: str, delta: float, now: float) -> None:
        self._advance(key, now)
        self._level[key] = max(self._level.get(key, 0.0) + delta, 0.0)

    def mark(self, key: str, now: float) -> tuple[float, float]:
        """(area, time) now, to pass to `mean_since` when the request ends."""
        self._advance(key, now)
        return self._area.get(key, 0.0), self._t[key]

    def mean_since(self, key: str, mark: tuple[float, float], now: float) -> Optional[float]:
        """Mean in-flight count of `key` since `mark` (None for a zero-length interval)."""
        self._advance(key, now)
        area0, t0 = mark
        dt = self._t[key] - t0
        return (self._area.get(key, 0.0) - area0) / dt if dt > 0 else None


def load_domain(view: PoolView) -> str:
    """The key whose load a pool's requests share: its hardware group, or the pool itself."""
    return f"group:{view.hardware_group}" if view.hardware_group is not None else f"pool:{view.name}"
