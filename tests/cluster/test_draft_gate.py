"""The draft gate: whether a step of a given batch size verifies drafts, learned from its steps.

Synthetic steps with known rates: the gate follows its prior while a bucket is cold, tries the
other arm at about `explore`, then keeps the measurably faster arm, shares steps between arms that
tie, and notices when the faster arm changes. Seeded, so every run sees the same draws."""

from __future__ import annotations

import math
import random

import pytest

from cluster.engine.draft_gate import MIN_STEPS, ArmRate, DraftGate, bucket_of, bucket_label


def _steps(gate: DraftGate, batch: int, n: int, draft_gain: float, seed: int = 1) -> list[bool]:
    """n steps at `batch` where the draft arm yields `draft_gain` times plain decoding's tokens per
    second on average, with noise of the size seen on a CPU: drafts found and accepted vary per
    step, plain steps' time varies by ~10%. Returns the arm of each step."""
    r = random.Random(seed)
    plain_rate = batch / 0.052
    chosen = []
    for _ in range(n):
        drafting = gate.allows(batch)
        if drafting:
            drafts = max(0.0, r.gauss(30, 12))
            seconds = 0.052 + 0.0024 * drafts
            tokens = (batch + drafts * r.uniform(0.2, 0.8)) * draft_gain * plain_rate / ((batch + 15) / (0.052 + 0.072))
        else:
            seconds, tokens = max(0.01, r.gauss(0.052, 0.005)), batch
        assert gate.observe(batch, drafting, tokens, seconds)
        chosen.append(drafting)
    return chosen


def test_buckets_cover_every_batch_size():
    assert [bucket_label(bucket_of(b)) for b in (1, 2, 3, 5, 9, 13, 20, 30, 40, 60, 100)] == [
        "1", "2-3", "2-3", "4-5", "8-11", "12-15", "16-23", "24-31", "32-47", "48-63", "64+"]


def test_without_learning_the_gate_is_the_static_bound():
    gate = DraftGate(prior_max_batch=11, explore=0.0)
    _steps(gate, 16, 200, draft_gain=1.5)  # even where drafting measures faster
    assert [gate.allows(b) for b in (1, 11, 12, 16, 64)] == [True, True, False, False, False]
    assert all(DraftGate(prior_max_batch=None, explore=0.0).allows(b) for b in (1, 64, 500))


def test_a_cold_bucket_follows_the_prior_and_tries_the_other_arm_at_the_explore_rate():
    gate = DraftGate(prior_max_batch=11, explore=0.2, rng=random.Random(3))
    above = [gate.allows(16) for _ in range(2000)]  # nothing observed: the bucket stays cold
    below = [gate.allows(4) for _ in range(2000)]
    assert 0.17 < sum(above) / 2000 < 0.23  # drafting tried above the bound
    assert 0.17 < 1 - sum(below) / 2000 < 0.23  # plain decoding tried below it


@pytest.mark.parametrize("gain, faster", [(1.4, True), (1.07, True), (0.93, False), (0.7, False)])
def test_the_measurably_faster_arm_wins_whichever_the_prior_says(gain, faster):
    for prior in (11, 64):  # above the bound (prior plain) and below it (prior draft)
        gate = DraftGate(prior_max_batch=prior, rng=random.Random(5))
        chosen = _steps(gate, 16, 3000, gain)
        late = chosen[1000:]
        right = sum(c == faster for c in late) / len(late)
        assert right > 0.95, (gain, prior, right)


def test_arms_that_tie_share_the_steps():
    gate = DraftGate(prior_max_batch=11, rng=random.Random(7))
    late = _steps(gate, 16, 3000, 1.0)[1000:]
    assert 0.2 < sum(late) / len(late) < 0.8


def test_the_gate_notices_when_drafting_starts_or_stops_paying():
    for before, after in ((0.9, 1.1), (1.1, 0.9)):
        gate = DraftGate(prior_max_batch=11, rng=random.Random(11))
        _steps(gate, 16, 3000, before, seed=2)
        later = _steps(gate, 16, 3000, after, seed=3)[1500:]
        assert sum(c == (after > 1) for c in later) / len(later) > 0.9, (before, after)


def test_buckets_learn_apart():
    gate = DraftGate(prior_max_batch=11, rng=random.Random(13))
    _steps(gate, 32, 2000, 0.85)
    _steps(gate, 4, 2000, 1.3)
    assert sum(gate.allows(32) for _ in range(500)) < 25 and sum(gate.allows(4) for _ in range(500)) > 475


def test_observe_refuses_steps_that_measure_nothing():
    gate = DraftGate()
    assert not gate.observe(0, True, 5, 0.1)
    assert not gate.observe(4, True, 0, 0.1)
    assert not gate.observe(4, True, 5, 0.0)
    assert not gate.observe(4, True, 5, math.inf)
    assert not gate.observe(4, True, 5, math.nan)
    assert gate.arms == {}


def test_arm_rate_is_a_ratio_of_sums_with_an_error_that_shrinks():
    a = ArmRate()
    assert a.rate() is None and math.isinf(a.stderr())
    a.add(10, 1.0, 1.0)
    assert a.rate() == 10.0 and math.isinf(a.stderr())  # one step: no spread yet
    r = random.Random(0)
    for _ in range(100):
        a.add(r.gauss(10, 2), 1.0, 1.0)
    se100 = a.stderr()
    for _ in range(900):
        a.add(r.gauss(10, 2), 1.0, 1.0)
    assert abs(a.rate() - 10) < 0.3 and 0.15 < se100 < 0.25 and a.stderr() < se100 / 2.5


def test_the_table_says_what_each_bucket_measured():
    gate = DraftGate(prior_max_batch=11, rng=random.Random(1))
    _steps(gate, 16, 400, 1.2)
    (row,) = gate.table()
    assert row["batch"] == "16-23" and row["draft"]["steps"] > MIN_STEPS and row["plain"]["steps"] >= 1
    assert row["draft"]["tokens_per_s"] > row["plain"]["tokens_per_s"]


def test_a_cold_bucket_takes_the_verdict_of_its_nearest_measured_neighbour():
    # A burst climbs from batch 8-11 into 16-23: where drafting measured faster below, the cold
    # bucket above starts drafting, though the static bound (11) says plain.
    gate = DraftGate(prior_max_batch=11, rng=random.Random(17))
    _steps(gate, 9, 300, 1.3)
    assert gate.compares(9) and not gate.compares(16)
    assert 0.75 < sum(gate.allows(16) for _ in range(2000)) / 2000 < 0.85  # prior draft, plain tried
    # Where plain decoding measured faster at 24-31, the cold buckets nearer to it start plain:
    # 12-15 is next to 8-11 (draft), 16-23 next to 24-31 (plain).
    _steps(gate, 26, 300, 0.8)
    assert gate.compares(26)
    assert [gate.prior(b) for b in (4, 12, 16, 40, 64)] == [True, True, False, False, False]
    _steps(gate, 50, 300, 1.3)  # 48-63 measured drafting faster: 32-47, as near to both, takes the lower
    assert not gate.prior(40) and gate.prior(64)
    assert gate.prior(1)  # no bucket below 8-11 has compared: its verdict reaches down to 1


def test_without_learning_no_neighbour_overrides_the_bound():
    gate = DraftGate(prior_max_batch=11, explore=0.0)
    for _ in range(50):
        gate.observe(9, True, 13, 0.1), gate.observe(9, False, 9, 0.1)
    assert not gate.prior(16) and not gate.allows(16)
