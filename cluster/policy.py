"""Adaptive choice of speculative mode and K (first version: a static rule; see issue 4)."""

from __future__ import annotations

from cluster.config import RouterConfig
from cluster.speculation import SpecMode


def choose_auto(pools, router: RouterConfig, workload_class: str, tuning=None):
    """Static rule until the tuned policy lands: n-gram (or the first speculative pool) at its
    default K while the pool is lightly loaded, plain decoding otherwise."""
    from cluster.routing import Decision

    spec = [p for p in pools if p.method == SpecMode.NGRAM] or [p for p in pools if p.method != SpecMode.NONE]
    if spec:
        pool = min(spec, key=lambda p: (p.batch_per_replica, p.name))
        if pool.batch_per_replica < 8:
            k = min(router.default_k.get(pool.method.value, 1), pool.max_k)
            return Decision(pool=pool.name, mode=pool.method, k=k, decided_by="policy", workload_class=workload_class)
    pool = min(pools, key=lambda p: (p.method != SpecMode.NONE, p.batch_per_replica, p.name))
    return Decision(pool=pool.name, mode=SpecMode.NONE, k=0, decided_by="policy", workload_class=workload_class)
