"""Prometheus metrics of the router, through Ray's metrics API (exported by each node's metrics
agent on `ray.metrics_export_port`, scraped like the rest of Ray Serve's metrics).

Per workload class and mode: requests, drafted and accepted tokens, acceptance length, chosen K,
and decisions made on defaults because the tuning state was unavailable; failed Redis calls of the
tuning state, finished requests kept out of it by reason (`cluster/policy/teaching.py`), and failures of
the router's background work and of GetTuning. No prompt or completion
text, and no caller-chosen name, ever reaches a label.
"""

from __future__ import annotations

from typing import Any, Optional

_TAGS = ("workload_class", "mode", "pool", "decided_by")


class RouterMetrics:
    def __init__(self):
        from ray.util.metrics import Counter, Histogram

        self.requests = Counter("specserve_requests", "Requests finished, by class, mode, pool, decider.",
                                tag_keys=_TAGS + ("status",))
        self.drafted = Counter("specserve_drafted_tokens", "Draft tokens verified.", tag_keys=_TAGS)
        self.accepted = Counter("specserve_accepted_tokens", "Draft tokens accepted.", tag_keys=_TAGS)
        self.acceptance_length = Histogram(
            "specserve_acceptance_length", "Output tokens per decode step of a request (accepted/steps + 1).",
            boundaries=[1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 7.0], tag_keys=_TAGS)
        self.chosen_k = Histogram("specserve_chosen_k", "K at admission: the caller's, fixed, or the ceiling of the engine's K per step.",
                                  boundaries=[0.5, 1.5, 2.5, 3.5, 4.5, 6.5, 8.5, 16.5], tag_keys=_TAGS)
        self.fallbacks = Counter("specserve_tuning_fallbacks",
                                 "Decisions taken on defaults/priors because Redis tuning state was unavailable.",
                                 tag_keys=("workload_class",))
        self.tuning_ignored = Counter(
            "specserve_tuning_ignored_keys",
            "Tuning keys in Redis ignored as malformed (wrong type, too many fields, too big, bad values).",
            tag_keys=("reason",))

        self.tuning_redis_errors = Counter(
            "specserve_tuning_redis_errors",
            "Failed Redis calls of the tuning state, by operation (flush, refresh, table) and error "
            "(OutOfMemoryError, ReadOnlyError, NoPermissionError, ConnectionError, TimeoutError, ...).",
            tag_keys=("op", "kind"))
        self.tuning_excluded_requests = Counter(
            "specserve_tuning_excluded",
            "Finished requests kept out of the tuning state, by reason (caller_mode, caller_class, ignore_eos, "
            "temperature, client_budget: cluster/policy/teaching.py).", tag_keys=("reason",))
        self.failures = Counter(
            "specserve_router_failures",
            "Failures off the request path, by what failed (load_poll, get_tuning, autoscale_record) and error type.",
            tag_keys=("what", "kind"))
        self.door_refused = Counter(
            "specserve_door_refused",
            "Calls and connections the router's own doors turned away, by reason: busy (every place taken: 503), "
            "body_timeout (api.limits.body_read_timeout_s: 408), per_client (api.limits.max_connections_per_client: "
            "429).", tag_keys=("reason",))

    def observe(self, decision: Any, stats: Optional[dict], status: str = "ok") -> None:
        tags = {"workload_class": decision.workload_class, "mode": decision.mode.value, "pool": decision.pool,
                "decided_by": decision.decided_by}
        self.requests.inc(1, {**tags, "status": status})
        self.chosen_k.observe(decision.k, tags)
        if stats:
            for counter, n in ((self.drafted, int(stats.get("drafted", 0))), (self.accepted, int(stats.get("accepted", 0)))):
                if n > 0:  # Ray's Counter.inc refuses 0
                    counter.inc(n, tags)
            if int(stats.get("steps", 0)) > 0:
                self.acceptance_length.observe(float(stats.get("acceptance_length", 1.0)), tags)

    def fallback(self, workload_class: str) -> None:
        self.fallbacks.inc(1, {"workload_class": workload_class})

    def tuning_key_ignored(self, reason: str) -> None:
        self.tuning_ignored.inc(1, {"reason": reason})

    def tuning_redis_error(self, op: str, kind: str) -> None:
        self.tuning_redis_errors.inc(1, {"op": op, "kind": kind})

    def tuning_excluded(self, reason: str) -> None:
        self.tuning_excluded_requests.inc(1, {"reason": reason})

    def failure(self, what: str, kind: str) -> None:
        self.failures.inc(1, {"what": what, "kind": kind})
