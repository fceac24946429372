"""The pure helpers the engine-tier tests judge with."""

from __future__ import annotations

from tests.e2e.helpers import crowded_share


def test_crowded_share_is_the_share_of_each_interval_above_the_bound():
    assert crowded_share([(0, 4), (0, 2), (1, 4)], 2) == [0.25, 0.5, 1 / 3]
    together = [(0.0, 10.0)] * 14
    assert crowded_share(together, 11) == [1.0] * 14
    staggered = [(i * 1.0, i * 1.0 + 2.0) for i in range(14)]  # at most 2 or 3 at once
    assert crowded_share(staggered, 11) == [0.0] * 14
    assert crowded_share([(1.0, 1.0)], 0) == [0.0]
