import pytest

from cluster.speculation import EXTRA_ARGS_K
from cluster.vllm_scheduler import effective_k, k_cap_for_batch, requested_k

TABLE = [(1, 6), (4, 3), (16, 0)]


@pytest.mark.parametrize("batch, cap", [(1, 6), (3, 6), (4, 3), (15, 3), (16, 0), (500, 0)])
def test_cap_table_lookup(batch, cap):
    assert k_cap_for_batch(batch, TABLE) == cap


def test_cap_table_absent_or_starting_late():
    assert k_cap_for_batch(3, None) is None
    assert k_cap_for_batch(3, []) is None
    assert k_cap_for_batch(1, [(2, 1)]) is None


@pytest.mark.parametrize(
    "extra, k_max, want",
    [(None, 6, 6), ({}, 6, 6), ({EXTRA_ARGS_K: 2}, 6, 2), ({EXTRA_ARGS_K: 0}, 6, 0),
     ({EXTRA_ARGS_K: 9}, 6, 6), ({EXTRA_ARGS_K: -3}, 6, 0), ({EXTRA_ARGS_K: "x"}, 6, 0),
     ({EXTRA_ARGS_K: "3"}, 6, 3)],
)
def test_requested_k(extra, k_max, want):
    assert requested_k(extra, k_max) == want


@pytest.mark.parametrize(
    "k, k_max, batch, table, want",
    [(4, 6, 1, None, 4), (4, 6, 8, TABLE, 3), (4, 6, 20, TABLE, 0), (9, 6, 1, None, 6), (2, 6, 8, TABLE, 2),
     (0, 6, 1, TABLE, 0), (5, 6, 2, [(1, -1)], 0)],
)
def test_effective_k(k, k_max, batch, table, want):
    assert effective_k(k, k_max, batch, table) == want


def test_scheduler_class_resolves_for_vllm():
    from vllm.v1.core.sched.scheduler import Scheduler

    from cluster import vllm_scheduler

    assert issubclass(vllm_scheduler.PerRequestKScheduler, Scheduler)


@pytest.mark.parametrize(
    "extra, want",
    [(None, None), ({}, None), ({"specserve_k_cap": [[1, 4], [8, 1]]}, [(1, 4), (8, 1)]),
     ({"specserve_k_cap": [[8, 1], [1, 4]]}, [(1, 4), (8, 1)]), ({"specserve_k_cap": "x"}, None),
     ({"specserve_k_cap": [[0, 4]]}, None), ({"specserve_k_cap": [[1, -2]]}, None),
     ({"specserve_k_cap": [["a", 1]]}, None), ({"specserve_k_cap": [[1, 1]] * 65}, None)],
)
def test_cap_table_from_request(extra, want):
    from cluster.vllm_scheduler import cap_table_from

    assert cap_table_from(extra) == want
