"""The per-step cap table: `k_cap_table` derives a pool's `k_cap_by_batch` (the largest K per batch size, which the engine applies at every step) from the same model as the choice."""

from __future__ import annotations

from typing import Mapping, Optional

from cluster.policy.cells import LOAD_BUCKETS, MAX_K, TuningView
from cluster.policy.cost import best_k, score_at, step_overheads
from cluster.policy.model import class_model, class_runs, expected_tokens
from cluster.policy.params import DEFAULT_PARAMS, PolicyParams
from cluster.speculation import WORKLOAD_CLASSES, SpecMode


def class_weights(view: Optional[TuningView], mode: str) -> dict[str, float]:
    """Traffic share of each workload class for a pool of `mode` (steps over all buckets, plain
    steps included); uniform when there is no traffic yet."""
    steps = {c: 0.0 for c in WORKLOAD_CLASSES}
    if view is not None:
        for (m, c, _), cell in view.cells.items():
            if c in steps and m in (mode, SpecMode.NONE.value):
                steps[c] += cell.steps
    total = sum(steps.values())
    if total <= 0:
        return {c: 1.0 / len(WORKLOAD_CLASSES) for c in WORKLOAD_CLASSES}
    return {c: s / total for c, s in steps.items() if s > 0}


def k_cap_table(
    mode: str, max_k: int, view: Optional[TuningView], params: PolicyParams = DEFAULT_PARAMS,
    priors: Mapping[str, float] | tuple = (), draft_cost: Optional[tuple[float, float]] = None,
    rate_priors: Mapping[str, float] | tuple = (),
) -> list[tuple[int, int]]:
    """`k_cap_by_batch` for a pool: [(min_batch_size, k_cap), ...], the format the engine reads.

    For each load bucket the cap maximises the traffic-weighted score of requests admitted at
    batch 1 (each class at its own best K there) that now run at that bucket's batch: the cap that
    a long request meeting a load spike should obey. At batch 1 the cap is the largest admitted K.
    Non-increasing with load; entries whose cap equals the previous one are dropped."""
    max_k = min(max(int(max_k), 0), MAX_K)
    if mode == SpecMode.NONE.value or max_k == 0:
        return [(1, 0)]
    weights = class_weights(view, mode)

    tokens = {}  # class -> [E(K) for K in 0..max_k]
    for c in weights:
        alpha, _, p = class_model(view, mode, c, priors, params, rate_priors)
        runs, draftless = class_runs(view, mode, c)
        tokens[c] = [expected_tokens(alpha, k, p, runs, draftless, params) for k in range(max_k + 1)]
    (first, idle), *loaded = LOAD_BUCKETS  # the classes are admitted at the first bucket, batch 1
    overheads = step_overheads(view, mode, idle, max_k, params, draft_cost)
    admitted = {c: best_k({k: score_at(tokens[c][k], overheads[k]) for k in range(max_k + 1)}, params.tie_tol)
                for c in weights}
    # At the bucket the classes were admitted at, each already runs at its own best K, so no cap
    # below the largest of them can do better: only tie. (Scoring caps there too, best_k's
    # smaller-wins tie-break would cap a K = 6 choice to 5 at batch 1.)
    table = [(first, max(admitted.values()))]
    for start, bucket in loaded:
        overheads = step_overheads(view, mode, bucket, max_k, params, draft_cost)
        totals = {
            cap: sum(w * score_at(tokens[c][min(admitted[c], cap)], overheads[min(admitted[c], cap)])
                     for c, w in weights.items())
            for cap in range(table[-1][1] + 1)
        }
        cap = best_k(totals, params.tie_tol)
        if cap != table[-1][1]:
            table.append((start, cap))
    return table
