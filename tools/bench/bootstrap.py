"""Bootstrap intervals for the bench's ratios: units resampled with replacement, or clusters of
units (a round's requests) and then units within each drawn cluster. Pure and seeded.

>>> bootstrap_ci(1, lambda idx: 1.0) is None
True
"""

from __future__ import annotations

import math
import random
from typing import Any, Callable, Optional

from cluster.percentile import percentile

BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0


def bootstrap_ci(n_units: int, stat: Callable[[list[int]], float], resamples: int = BOOTSTRAP_RESAMPLES,
                 seed: int = BOOTSTRAP_SEED) -> Optional[list[float]]:
    """95% interval of `stat` over `resamples` draws of unit indices with replacement (None below
    two units or without a finite value)."""
    if n_units < 2:
        return None
    rng = random.Random(seed)
    values = []
    for _ in range(resamples):
        v = stat(rng.choices(range(n_units), k=n_units))
        if v is not None and math.isfinite(v):
            values.append(v)
    return [percentile(values, 2.5), percentile(values, 97.5)] if values else None


def clustered_bootstrap_ci(clusters: list[list[int]], stat: Callable[[list[int]], float],
                           resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED) -> Optional[list[float]]:
    """95% interval of `stat` when units come in clusters (the requests of one round): a draw takes
    clusters with replacement, then units within each drawn cluster with replacement. With one
    cluster it is `bootstrap_ci` over that cluster's units, draw for draw. None below two units.

    >>> spread = [[0, 1, 2], [3, 4, 5]]  # units 0-2 measured at 1.0, units 3-5 at 2.0
    >>> value = lambda idx: sum(1.0 if i < 3 else 2.0 for i in idx) / len(idx)
    >>> clustered_bootstrap_ci(spread, value, resamples=400)  # the rounds disagree: the interval spans both
    [1.0, 2.0]
    >>> clustered_bootstrap_ci([[0, 1, 2, 3, 4, 5]], value, resamples=400) == bootstrap_ci(6, value, resamples=400)
    True
    """
    groups = [c for c in clusters if c]
    if sum(len(c) for c in groups) < 2:
        return None
    rng = random.Random(seed)
    values = []
    for _ in range(resamples):
        drawn = rng.choices(groups, k=len(groups)) if len(groups) > 1 else groups
        v = stat([i for c in drawn for i in rng.choices(c, k=len(c))])
        if v is not None and math.isfinite(v):
            values.append(v)
    return [percentile(values, 2.5), percentile(values, 97.5)] if values else None


def clusters_by(keys: list[Any], cluster_of: Optional[Callable[[Any], Any]]) -> list[list[int]]:
    """Unit indices grouped by `cluster_of(key)` (one cluster of every unit when None)."""
    if cluster_of is None:
        return [list(range(len(keys)))]
    out: dict[Any, list[int]] = {}
    for i, k in enumerate(keys):
        out.setdefault(cluster_of(k), []).append(i)
    return [out[c] for c in sorted(out, key=repr)]


def paired_rate_ratio(units: list[tuple[float, ...]], idx: list[int]) -> float:
    """Over the drawn units (tokens a, latency a, tokens b, latency b): a's summed tokens / summed
    latency over b's (NaN where a side has no latency or b no tokens).

    >>> paired_rate_ratio([(10, 1.0, 10, 2.0), (30, 1.0, 10, 1.0)], [0, 1])  # 20 tok/s over 20/3
    3.0
    """
    at = sum(units[i][0] for i in idx)
    al = sum(units[i][1] for i in idx)
    bt = sum(units[i][2] for i in idx)
    bl = sum(units[i][3] for i in idx)
    return (at / al) / (bt / bl) if al > 0 and bl > 0 and bt > 0 else math.nan
