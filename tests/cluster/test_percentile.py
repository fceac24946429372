"""The one percentile function, each method against values computed by hand and against numpy."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cluster.percentile import METHODS, percentile

NUMPY_NAME = {"linear": "linear", "nearest_rank": "inverted_cdf", "nearest": "nearest"}


def test_percentile_linear_interpolation():
    xs = [4.0, 1.0, 3.0, 2.0]  # sorted 1 2 3 4; p50 at rank 1.5 -> 2.5; p90 at 2.7 -> 3.7; p99 at 2.97 -> 3.97
    assert percentile(xs, 50) == pytest.approx(2.5)
    assert percentile(xs, 90) == pytest.approx(3.7)
    assert percentile(xs, 99) == pytest.approx(3.97)
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))


def test_nearest_rank_is_an_observed_value():
    values = [float(v) for v in range(100, 0, -1)]
    assert [percentile(values, q, "nearest_rank") for q in (0, 50, 99, 100)] == [1.0, 50.0, 99.0, 100.0]
    assert percentile([0.2, 0.5, 0.1], 99, "nearest_rank") == 0.5
    assert math.isnan(percentile([], 50, "nearest_rank"))
    with pytest.raises(ValueError, match="method"):
        percentile([1.0], 50, "midpoint")


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=50), st.floats(0, 100), st.sampled_from(METHODS))
def test_percentile_matches_numpy(xs, q, method):
    np = pytest.importorskip("numpy")
    expected = float(np.percentile(xs, q, method=NUMPY_NAME[method]))
    assert percentile(xs, q, method) == pytest.approx(expected, rel=1e-9, abs=1e-6)
