"""cluster.engine.step_k: the per-step K choice is the batch-goodput optimum, and its inputs are learned."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.engine.step_k import (RequestDrafts, StepCost, StepCostLine, acceptance, batch_optimism, batch_rate,
                                   choose_step_ks,
                                   next_acceptance)

lines = st.builds(StepCostLine, a=st.floats(0.01, 1.0), c=st.floats(0.0, 1.0), b=st.floats(0.0, 0.5),
                  f=st.floats(0.0, 0.5))
requests = st.builds(RequestDrafts, alpha=st.floats(0.0, 1.0), drafts=st.integers(0, 4), ceiling=st.integers(0, 4),
                     fixed=st.booleans())


def _brute_force_best(reqs: list[RequestDrafts], line: StepCostLine) -> float:
    ranges = [[min(r.ceiling, r.drafts)] if r.fixed else range(min(r.ceiling, r.drafts) + 1) for r in reqs]
    return max(batch_rate([r.alpha for r in reqs], ks, line) for ks in itertools.product(*ranges))


@settings(max_examples=300, deadline=None)
@given(st.lists(requests, min_size=1, max_size=3), lines)
def test_the_choice_is_the_exact_optimum_of_batch_goodput(reqs, line):
    ks = choose_step_ks(reqs, line)
    assert batch_rate([r.alpha for r in reqs], ks, line) == pytest.approx(_brute_force_best(reqs, line), rel=1e-9)


@settings(max_examples=200, deadline=None)
@given(st.lists(requests, min_size=0, max_size=8), lines)
def test_ks_respect_ceiling_drafts_and_fixed_requests(reqs, line):
    ks = choose_step_ks(reqs, line)
    assert len(ks) == len(reqs)
    for r, k in zip(reqs, ks):
        assert 0 <= k <= min(r.ceiling, r.drafts)
        if r.fixed:
            assert k == min(r.ceiling, r.drafts)


@settings(max_examples=200, deadline=None)
@given(lines, st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_a_more_accepted_request_drafts_no_less(line, a1, a2):
    lo, hi = sorted((a1, a2))
    k_lo = choose_step_ks([RequestDrafts(lo, 6, 6)], line)[0]
    k_hi = choose_step_ks([RequestDrafts(hi, 6, 6)], line)[0]
    assert k_hi >= k_lo


@pytest.mark.parametrize("alpha", [0.3, 0.5, 0.7, 0.9])
def test_a_larger_batch_drafts_no_more(alpha):
    line = StepCostLine(a=0.02, c=0.012, b=0.004, f=0.003)  # CPU-like: requests dear, drafts not free
    ks = [choose_step_ks([RequestDrafts(alpha, 6, 6)] * n, line)[0] for n in (1, 2, 4, 8, 16, 32, 64)]
    assert ks == sorted(ks, reverse=True)
    assert ks[0] >= 1


def test_gpu_like_costs_keep_drafting_at_large_batches():
    """On a GPU a step is memory bound: a draft token costs almost nothing against the weights' read."""
    line = StepCostLine(a=0.010, c=0.00005, b=0.00005, f=0.0005)
    assert choose_step_ks([RequestDrafts(0.6, 6, 6)] * 32, line)[0] >= 3


def test_empty_and_draftless_batches():
    line = StepCostLine(1.0, 0.5, 0.1, 0.1)
    assert choose_step_ks([], line) == []
    assert choose_step_ks([RequestDrafts(0.9, 0, 6), RequestDrafts(0.9, 5, 0)], line) == [0, 0]


def test_step_cost_recovers_a_noisy_line_and_follows_a_change():
    rng = random.Random(0)
    cost = StepCost()
    truth = StepCostLine(a=0.02, c=0.012, b=0.004, f=0.003)
    for _ in range(2000):
        b, d = rng.choice([1, 2, 4, 8, 16]), rng.choice([0, 1, 3, 6, 12])
        cost.observe(b, d, truth.time_s(b, d) * rng.uniform(0.95, 1.05))
    line = cost.line()
    assert line.c == pytest.approx(truth.c, rel=0.1) and line.b == pytest.approx(truth.b, rel=0.25)
    # The machine gets twice as slow (a neighbour takes the core): the line follows within a window.
    for _ in range(1500):
        b, d = rng.choice([1, 2, 4, 8, 16]), rng.choice([0, 1, 3, 6, 12])
        cost.observe(b, d, 2 * truth.time_s(b, d))
    assert cost.line().c == pytest.approx(2 * truth.c, rel=0.1)


def test_step_cost_is_defined_from_the_first_step_and_ignores_nonsense():
    cost = StepCost()
    assert cost.line() is None
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        cost.observe(1, 0, bad)
    cost.observe(0, 0, 0.1)
    assert cost.line() is None and cost.steps == 0
    cost.observe(1, 0, 0.03)  # one plain step: the prior line through it
    line = cost.line()
    assert line.time_s(1, 0) == pytest.approx(0.03, rel=1e-6)
    assert line.c > 0 and line.b > 0


def test_acceptance_moves_from_the_class_prior_to_the_requests_own_steps():
    mean = lambda s, f: acceptance(0.4, s, f, optimism=0.0)  # noqa: E731
    s = f = 0.0
    assert mean(s, f) == pytest.approx(0.4)
    for _ in range(3):  # copying a span: every draft accepted
        s, f = next_acceptance(s, f, 6, 6)
    copying = mean(s, f)
    assert copying > 0.75
    for _ in range(3):  # the span ends: the first draft rejected each step
        s, f = next_acceptance(s, f, 6, 0)
    assert mean(s, f) < 0.55
    for _ in range(3):
        s, f = next_acceptance(s, f, 6, 0)
    assert mean(s, f) < 0.4


def test_thin_evidence_keeps_a_draft_in_play_and_evidence_takes_it_away():
    """A request held at K = 0 learns nothing about its own text: the optimistic α lets a low
    class α still try one draft at a cheap batch, and the request's rejections end that."""
    line = StepCostLine(a=1.0, c=0.5, b=0.05, f=0.05)
    fresh = acceptance(0.05, 0.0, 0.0)
    assert fresh > 0.05
    assert choose_step_ks([RequestDrafts(acceptance(0.05, 0.0, 0.0, optimism=0.0), 6, 6)], line) == [0]
    assert choose_step_ks([RequestDrafts(fresh, 6, 6)], line)[0] >= 1
    s = f = 0.0
    for _ in range(2):
        s, f = next_acceptance(s, f, 1, 0)
    assert acceptance(0.05, s, f) < fresh


def test_a_step_far_slower_than_the_line_is_left_out():
    cost = StepCost()
    for _ in range(100):
        cost.observe(1, 0, 0.03)
        cost.observe(1, 3, 0.033)
    assert not cost.observe(1, 3, 5.0)  # a JIT compile or a stolen core, not what drafting costs
    assert cost.outliers == 1 and cost.line().f < 0.01


def test_exploration_is_spread_over_the_batch():
    """An optimistic draft explores for one request and costs the whole step: in a full batch a
    request with thin evidence and a middling class α does not draft on optimism, alone it does."""
    line = StepCostLine(a=0.040, c=0.004, b=0.003, f=0.001)  # the CPU line measured on the tune half
    alpha = 0.45
    alone = acceptance(alpha, 0.0, 0.0, optimism=batch_optimism(1))
    assert choose_step_ks([RequestDrafts(alone, 6, 6)], line)[0] >= 2
    crowded = acceptance(alpha, 0.0, 0.0, optimism=batch_optimism(16))
    assert crowded < alone
    assert choose_step_ks([RequestDrafts(crowded, 6, 6)] * 16, line) == [0] * 16
    # a request whose own steps show it copying still drafts in the full batch
    s = f = 0.0
    for _ in range(4):
        s, f = next_acceptance(s, f, 6, 6)
    copier = acceptance(alpha, s, f, optimism=batch_optimism(16))
    ks = choose_step_ks([RequestDrafts(crowded, 6, 6)] * 15 + [RequestDrafts(copier, 6, 6)], line)
    assert ks[:15] == [0] * 15 and ks[15] >= 2
