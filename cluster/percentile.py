"""One percentile function for serving code and the tools alike: `percentile(values, q, method)`."""

from __future__ import annotations

import math
from typing import Iterable

METHODS = ("linear", "nearest_rank", "nearest")


def percentile(values: Iterable[float], q: float, method: str = "linear") -> float:
    """The q-th percentile (q in 0..100) of `values`, in any order; nan when there are none.

    `method` (numpy's `np.percentile` name in brackets):
    - "linear" interpolates between the two closest ranks ("linear", numpy's default): distributions
      reported as numbers (the bench tables).
    - "nearest_rank" is the smallest value with at least q% of the values at or below it
      ("inverted_cdf"): always a value that was observed, as a p99 objective reads (autoscaling, the
      classifier's latency).
    - "nearest" is the value at the rank closest to (n - 1)·q/100, halves to even ("nearest").

    >>> xs = [4.0, 1.0, 3.0, 2.0]
    >>> [percentile(xs, 50), percentile(xs, 90), percentile(xs, 0), percentile(xs, 100)]
    [2.5, 3.7, 1.0, 4.0]
    >>> [percentile(xs, 50, "nearest_rank"), percentile(xs, 51, "nearest_rank"), percentile(xs, 99, "nearest_rank")]
    [2.0, 3.0, 4.0]
    >>> [percentile(xs, 50, "nearest"), percentile(xs, 99, "nearest"), percentile([], 50), percentile([7.0], 99)]
    [3.0, 4.0, nan, 7.0]
    """
    if method not in METHODS:
        raise ValueError(f"method: {method!r} is not one of {METHODS}")
    xs = sorted(values)
    if not xs:
        return math.nan
    if method == "nearest_rank":
        return xs[min(max(math.ceil(len(xs) * q / 100.0), 1), len(xs)) - 1]
    pos = (len(xs) - 1) * q / 100.0
    if method == "nearest":
        return xs[round(pos)]
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
