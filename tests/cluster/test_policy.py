"""The policy's pure functions: expected tokens, cost model, posterior, bandit.

Three layers, as in vLLM's sampler tests: hand-computed cases, seeded determinism, and statistical
checks (convergence from simulated traffic drawn with a known acceptance rate)."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.config import RouterConfig
from cluster.policy import (
    BUCKET_BATCH, BUCKET_NAMES, LOAD_BUCKETS, CellStats, PolicyParams, TuningView, alpha_posterior, best_k, choose_auto,
    cost_per_k, draft_rate, expected_tokens, expected_tokens_per_step, exploration_rate, explorable_ks, score_pool,
    load_bucket, measured_overheads, prior_alpha, prior_cost_per_k, prior_step_cost, run_tokens_per_step,
    score, step_cost, step_overheads,
    step_time_rel, tuning_rows,
)
from cluster.routing.route import PoolView
from cluster.speculation import WORKLOAD_CLASSES, SpecMode, SpecStats
from cluster.state.tuning_cells import cell_from_requests, parse_cell
from tests.paths import LOCAL_CPU

ROUTER = RouterConfig()
P = PolicyParams()


def _priors(prior):
    return prior if isinstance(prior, tuple) else ((("*", prior),) if prior is not None else ())


def ngram(running=0.0, max_k=6, name="ngram", prior=None):
    return PoolView(name=name, model="m", method=SpecMode.NGRAM, max_k=max_k, running=running,
                    prior_alpha=_priors(prior))


def plain(running=0.0, name="plain"):
    return PoolView(name=name, model="m", method=SpecMode.NONE, max_k=0, running=running)


def draft(running=0.0, max_k=4, name="draft", prior=None):
    return PoolView(name=name, model="m", method=SpecMode.DRAFT_MODEL, max_k=max_k, running=running,
                    prior_alpha=_priors(prior))


def simulate(alpha: float, k: int, steps: int, rng: random.Random, drafted_len=None) -> SpecStats:
    """One request's stats with i.i.d. acceptance `alpha` per draft position (geometric prefix)."""
    acc_pos, dr_pos = [0] * k, [0] * k
    accepted = drafted = 0
    for _ in range(steps):
        n = k if drafted_len is None else drafted_len(rng)
        drafted += n
        for i in range(n):
            dr_pos[i] += 1
        a = 0
        while a < n and rng.random() < alpha:
            acc_pos[a] += 1
            a += 1
        accepted += a
    return SpecStats(mode="ngram", k=k, steps=steps, drafted=drafted, accepted=accepted,
                     accepted_per_position=acc_pos, drafted_per_position=dr_pos)


def cell_from(requests: list[SpecStats], step_s: float = 0.01) -> CellStats:
    """Aggregate requests through the real increments and hash validation (what Redis would hold)."""
    return cell_from_requests((s, step_s * s.steps) for s in requests)


# -- load buckets ---------------------------------------------------------------------------------

@pytest.mark.parametrize("batch,bucket", [
    (0, "1"), (1, "1"), (1.9, "1"), (2, "2-3"), (3.99, "2-3"), (4, "4-7"), (7, "4-7"), (8, "8-15"),
    (15, "8-15"), (16, "16+"), (1000, "16+"),
])
def test_load_bucket(batch, bucket):
    assert load_bucket(batch) == bucket


def test_buckets_are_the_cap_table_starts():
    assert [s for s, _ in LOAD_BUCKETS] == [1, 2, 4, 8, 16] and BUCKET_NAMES == ("1", "2-3", "4-7", "8-15", "16+")


# -- expected tokens and priors ---------------------------------------------------------------------

@pytest.mark.parametrize("alpha,k,expected", [
    (0.0, 5, 1.0), (1.0, 4, 5.0), (0.5, 1, 1.5), (0.5, 2, 1.75), (0.8, 0, 1.0), (0.5, 3, 1.875),
])
def test_expected_tokens_per_step_by_hand(alpha, k, expected):
    assert expected_tokens_per_step(alpha, k) == pytest.approx(expected)


@given(st.floats(0, 0.999), st.integers(0, 16))
def test_expected_tokens_is_the_geometric_sum_and_grows_with_k(alpha, k):
    e = expected_tokens_per_step(alpha, k)
    assert e == pytest.approx(sum(alpha ** i for i in range(k + 1)), rel=1e-9)
    assert 1.0 <= e <= k + 1
    assert expected_tokens_per_step(alpha, k + 1) >= e


def test_priors_follow_spec_bench():
    for high in ("summarization", "rag", "code", "extraction"):
        for low in ("translation", "creative"):
            assert prior_alpha("ngram", high) >= 0.5 > 0.1 >= prior_alpha("ngram", low)
    assert all(0 <= prior_alpha(m.value, c) < 1 for m in SpecMode for c in WORKLOAD_CLASSES)
    assert prior_alpha("none", "chat") == 0.0


def test_prior_cost_grows_with_batch_and_drafter_weight():
    assert prior_cost_per_k("ngram", 16) > prior_cost_per_k("ngram", 1)
    assert prior_cost_per_k("draft_model", 1) > prior_cost_per_k("eagle", 1) > prior_cost_per_k("ngram", 1)


def test_prior_reproduces_the_measured_batch_16_loss():
    # Measured here: batch 16, n-gram on a Spec-Bench-like mix: 63.8 vs 70.1 tok/s (ratio 0.91).
    # At a mixed alpha ~0.3 and K=3 the prior must predict a loss of that order at batch 16 and a gain at batch 1.
    ratio_16 = score(0.3, 3, prior_cost_per_k("ngram", 16)) / score(0.3, 0, 0.0)
    ratio_1 = score(0.3, 3, prior_cost_per_k("ngram", 1)) / score(0.3, 0, 0.0)
    assert 0.85 < ratio_16 < 0.97 and ratio_1 > 1.2


# -- posterior and costs --------------------------------------------------------------------------

def test_posterior_is_the_prior_without_data_and_the_data_with_much():
    a, b = alpha_posterior(CellStats(), 0.2)
    assert a / (a + b) == pytest.approx(0.2) and a + b == pytest.approx(P.prior_trials)
    a, b = alpha_posterior(CellStats(accepted=3000, rejected_steps=1000), 0.2)
    assert a / (a + b) == pytest.approx(0.75, abs=0.02)


def test_posterior_counts_are_capped_so_exploration_never_freezes():
    a, b = alpha_posterior(CellStats(accepted=10**9, rejected_steps=10**9), 0.5)
    assert a + b == pytest.approx(P.prior_trials + P.max_effective_trials)


@pytest.mark.parametrize("true_alpha", [0.1, 0.5, 0.85])
def test_alpha_estimate_recovers_the_simulated_rate(true_alpha):
    rng = random.Random(7)
    cell = cell_from([simulate(true_alpha, 4, 200, rng) for _ in range(20)])
    assert cell.alpha == pytest.approx(true_alpha, abs=0.03)
    # and the per-position acceptance follows alpha^(i+1)
    for i, q in enumerate(cell.per_position_acceptance):
        assert q == pytest.approx(true_alpha ** (i + 1), abs=0.04)


def test_alpha_and_draft_rate_with_short_ngram_drafts():
    # n-gram drafts 0..4 tokens: a quarter of the steps draft nothing. Those go to the draft rate p,
    # not into alpha as rejections: alpha is the proposer's 0.6, p is 0.75.
    rng = random.Random(3)
    reqs = [simulate(0.6, 4, 300, rng, drafted_len=lambda r: r.choice([0, 2, 4, 4])) for _ in range(10)]
    cell = cell_from(reqs)
    assert cell.alpha == pytest.approx(0.6, abs=0.04)
    assert cell.draft_rate == pytest.approx(0.75, abs=0.03)
    assert draft_rate(cell) == pytest.approx((cell.drafting_steps + P.prior_draft_steps) / (3000 + P.prior_draft_steps))


def test_expected_tokens_scale_the_accepted_drafts_by_the_draft_rate():
    assert expected_tokens_per_step(0.5, 2, 0.2) == pytest.approx(1 + 0.2 * 0.75)
    assert expected_tokens_per_step(1.0, 4, 0.5) == pytest.approx(3.0)
    assert expected_tokens_per_step(0.7, 0, 0.5) == 1.0


def test_sparse_ngram_drafts_get_a_large_k():
    """Measured here (bench 2026-11-22 17:08, math at one stream): n-gram drafted in 22% of the steps,
    and accepted drafted tokens at alpha 0.65; K = 4 was the fastest static K (1.36x against 1.11x
    for K = 1), verify cost about 0.025 per K. Folded into one alpha (0.22) the model chose K = 1."""
    rng = random.Random(5)
    reqs = [simulate(0.65, 6, 400, rng, drafted_len=lambda r: 6 if r.random() < 0.22 else 0) for _ in range(8)]
    cell = cell_from(reqs)
    plain_step, spec_step = 0.0760, 0.0760 * (1 + 0.025 * 6)  # enough steps for a measured cost
    view = TuningView("m", cells={
        ("ngram", "math", "1"): CellStats(**{**cell.__dict__, "decode_s": spec_step * cell.steps,
                                              "k_steps": 6 * cell.steps}),
        ("none", "math", "1"): CellStats(steps=10**6, decode_s=plain_step * 10**6)})
    d = choose_auto([ngram(prior=0.25)], ROUTER, "math", view)
    assert d.k >= 3 and d.detail["draft_rate"] == pytest.approx(0.22, abs=0.03), d.detail
    folded = cell.accepted / (cell.accepted + cell.rejected_steps)  # the old single alpha
    assert folded < 0.3
    cost = cost_per_k(view, "ngram", "1")
    assert best_k({k: score(folded, k, cost) for k in range(7)}) <= 2  # what the old model chose


def _cost_view(spec_step_s, plain_step_s, steps, mean_k=3, bucket="1"):
    spec = CellStats(steps=steps, k_steps=mean_k * steps, decode_s=spec_step_s * steps)
    none = CellStats(steps=steps, decode_s=plain_step_s * steps)
    return TuningView("m", cells={("ngram", "chat", bucket): spec, ("none", "chat", bucket): none})


def test_cost_is_the_prior_until_enough_steps():
    view = _cost_view(0.020, 0.010, steps=P.min_cost_steps - 1)
    assert cost_per_k(view, "ngram", "1") == pytest.approx(prior_cost_per_k("ngram", 1))


def test_cost_converges_to_the_measured_step_time_ratio():
    # spec steps take 13 ms at mean K 3, plain 10 ms: c = (1.3 - 1) / 3 = 0.1
    assert cost_per_k(_cost_view(0.013, 0.010, steps=10**7), "ngram", "1") == pytest.approx(0.1, abs=0.001)
    mid = cost_per_k(_cost_view(0.013, 0.010, steps=2000), "ngram", "1")
    assert prior_cost_per_k("ngram", 1) < mid < 0.1


def test_measured_cost_is_clamped_for_absurd_data():
    assert cost_per_k(_cost_view(10.0, 0.001, steps=10**7), "ngram", "1") <= 2.0
    assert cost_per_k(_cost_view(0.001, 10.0, steps=10**7), "ngram", "1") >= 0.0


def test_step_time_rel_prior_and_measured():
    assert step_time_rel(None, "1") == 1.0 < step_time_rel(None, "4-7") < step_time_rel(None, "16+")
    cells = {("none", "chat", "1"): CellStats(steps=10**7, decode_s=0.01 * 10**7),
             ("none", "chat", "16+"): CellStats(steps=10**7, decode_s=0.05 * 10**7)}
    assert step_time_rel(TuningView("m", cells=cells), "16+") == pytest.approx(5.0, rel=0.01)


# -- best K and exploration ---------------------------------------------------------------------------

def test_best_k_prefers_the_smaller_k_within_tie_tolerance():
    assert best_k({0: 1.0, 1: 1.005, 2: 1.2, 3: 1.2}) == 2
    assert best_k({0: 1.0, 1: 1.005}) == 0


def _recorded_view(path: Path) -> TuningView:
    doc = json.loads(path.read_text())
    cells = {}
    for key, fields in doc["cells"].items():
        mode, wclass, bucket = key.split(":")
        cells[(mode, wclass, bucket)] = parse_cell({f: v for f, v in fields.items() if f != "chosen_k"},
                                                   now_unix_s=2e9, max_age_s=1e9)
    return TuningView("smollm2-135m", cells=cells)


def test_plain_steps_measured_under_other_load_do_not_erase_the_cost_of_k():
    # A recorded tuning state (bucket 1) whose plain steps were recorded while other work loaded
    # the machine, so every K reads cheaper than a plain step. Clamping each K at 0 would make
    # K = 1..6 all free and K = 6 (5% dearer per step than K = 4 wherever measured here) the best
    # for RAG, summarization and translation; the cheapest K as the baseline keeps their differences.
    view = _recorded_view(Path(__file__).parent / "data" / "tuning-plain-steps-under-load-bucket1.json")
    over = {k: o for k, (o, _) in measured_overheads(view, "ngram", "1").items()}
    assert set(over) == {1, 2, 3, 4, 5, 6} and min(over.values()) == 0.0
    assert over[6] > over[5] + 0.03 and over[1] > over[2] + 0.03  # the shape every run here measured
    for wclass in ("rag", "summarization", "translation"):
        assert best_k(score_pool(ngram(max_k=6), wclass, view).scores) < 6


def test_exploration_rate_decays_within_bounds():
    rates = [exploration_rate(n) for n in (0, 100, 2000, 10**5, 10**9)]
    assert rates[0] == pytest.approx(P.eps_max) and rates[2] == pytest.approx((P.eps_max + P.eps_min) / 2)
    assert all(a > b for a, b in zip(rates, rates[1:])) and rates[-1] >= P.eps_min


# -- choose_auto ------------------------------------------------------------------------------------

def test_plain_pool_only_gives_k0():
    d = choose_auto([plain()], ROUTER, "summarization")
    assert (d.pool, d.mode, d.k, d.decided_by) == ("plain", SpecMode.NONE, 0, "policy")


@pytest.mark.parametrize("cls", ["summarization", "rag", "code", "extraction"])
def test_cold_start_speculates_on_copying_classes_at_low_load(cls):
    d = choose_auto([ngram(), plain()], ROUTER, cls)
    assert d.pool == "ngram" and d.mode == SpecMode.NGRAM and d.k >= 2


@pytest.mark.parametrize("cls", ["translation", "creative"])
def test_cold_start_does_not_speculate_ngram_where_it_is_useless(cls):
    d = choose_auto([ngram(), plain()], ROUTER, cls)
    assert d.k == 0 and d.mode == SpecMode.NONE and d.pool == "plain"


def test_k_never_grows_with_load():
    for cls in WORKLOAD_CLASSES:
        ks = [choose_auto([ngram(running=b)], ROUTER, cls).k for b in (0, 2, 5, 10, 20, 60)]
        assert all(a >= b for a, b in zip(ks, ks[1:])), (cls, ks)
    assert choose_auto([ngram(running=0)], ROUTER, "chat").k > choose_auto([ngram(running=40)], ROUTER, "chat").k


def test_equal_scores_go_to_the_less_loaded_pool():
    d = choose_auto([plain(running=5, name="a"), plain(running=1, name="b")], ROUTER, "chat")
    assert d.pool == "b"


def test_live_traffic_overrides_the_prior():
    # The drafter is untrained here: measured alpha ~0.02 must move chat traffic off it.
    cold = choose_auto([draft(), ngram()], ROUTER, "chat")
    assert cold.pool == "draft"  # the prior believes a draft model
    rng = random.Random(1)
    cell = cell_from([simulate(0.02, 3, 100, rng) for _ in range(30)])
    view = TuningView("m", cells={("draft_model", "chat", "1"): cell})
    warm = choose_auto([draft(), ngram()], ROUTER, "chat", view)
    assert warm.pool == "ngram"


def test_converges_from_simulated_traffic():
    # True n-gram alpha for chat is 0.8 here (prior 0.2): feeding the chosen K's outcomes back raises K.
    rng = random.Random(11)
    reqs: list[SpecStats] = []
    ks = []
    for _ in range(30):
        view = TuningView("m", cells={("ngram", "chat", "1"): cell_from(reqs)} if reqs else {})
        d = choose_auto([ngram()], ROUTER, "chat", view)
        ks.append(d.k)
        reqs.append(simulate(0.8, max(d.k, 1), 50, rng))
    assert ks[0] <= 2 and ks[-1] >= 5 and abs(ks[-1] - ks[-5]) <= 1


@settings(max_examples=200, deadline=None)
@given(
    loads=st.lists(st.floats(0, 500), min_size=1, max_size=3),
    max_ks=st.lists(st.integers(0, 16), min_size=3, max_size=3),
    cls=st.sampled_from(WORKLOAD_CLASSES + ("unknown-class",)),
    seed=st.integers(0, 2**32),
)
def test_k_is_always_within_the_pools_max(loads, max_ks, cls, seed):
    pools = [ngram(running=l, max_k=max(mk, 1), name=f"p{i}") for i, (l, mk) in enumerate(zip(loads, max_ks))]
    pools.append(plain())
    view = TuningView("m", rng=random.Random(seed))
    d = choose_auto(pools, ROUTER, cls, view)
    pool = next(p for p in pools if p.name == d.pool)
    assert 0 <= d.k <= pool.max_k and (d.mode == SpecMode.NONE) == (d.k == 0)
    assert d.detail["load_bucket"] == load_bucket(pool.batch_per_replica + 1)


def test_no_rng_means_no_exploration_and_same_answer():
    decisions = {choose_auto([ngram(), draft(), plain()], ROUTER, "qa") for _ in range(50)}
    assert len(decisions) == 1 and not next(iter(decisions)).detail["explore"]


def test_exploration_is_seeded_and_deterministic():
    pools = [ngram(), draft(), plain()]
    run = lambda seed: [  # noqa: E731
        (d.pool, d.k, d.detail["explore"])
        for d in (choose_auto(pools, ROUTER, "chat", rng=r) for r in [random.Random(seed)] for _ in range(300))
    ]
    assert run(5) == run(5) and run(5) != run(6)


def test_exploration_rate_and_thompson_coverage_at_cold_start():
    pools = [ngram(), draft(), plain()]
    rng = random.Random(2)
    ds = [choose_auto(pools, ROUTER, "chat", TuningView("m", rng=rng)) for _ in range(4000)]
    explored = [d for d in ds if d.detail["explore"]]
    assert len(explored) / len(ds) == pytest.approx(P.eps_max, abs=0.02)
    # With priors only, both speculative pools are plausible winners and both get tried.
    assert {d.pool for d in explored} >= {"ngram", "draft"}
    assert len({d.k for d in explored}) >= 2  # Thompson samples vary K


def test_exploration_spares_a_pool_that_is_confidently_worse():
    # draft: 20k trials at α≈0.04 (the truncated drafter here); ngram: 20k trials at α≈0.4.
    rng = random.Random(3)
    cells = {("draft_model", "chat", "1"): cell_from([simulate(0.04, 2, 10000, rng)]),
             ("ngram", "chat", "1"): cell_from([simulate(0.4, 3, 10000, rng)])}
    view = TuningView("m", cells=cells, rng=random.Random(4))
    ds = [choose_auto([ngram(), draft()], ROUTER, "chat", view) for _ in range(3000)]
    explored = [d for d in ds if d.detail["explore"]]
    assert explored  # ε > 0 ...
    assert sum(d.pool == "draft" and d.k > 0 for d in explored) == 0  # ... but never on the losing drafter
    assert all(d.pool == "ngram" for d in ds if not d.detail["explore"])


def test_uncertain_pool_is_explored_more_than_a_confidently_worse_one():
    rng = random.Random(5)
    known_bad = {("draft_model", "chat", "1"): cell_from([simulate(0.04, 2, 10000, rng)]),
                 ("ngram", "chat", "1"): cell_from([simulate(0.3, 3, 3000, rng)])}
    unknown = {k: v for k, v in known_bad.items() if k[0] == "ngram"}

    def draft_share(cells, seed):
        view = TuningView("m", cells=cells, rng=random.Random(seed))
        ds = [choose_auto([ngram(), draft()], ROUTER, "chat", view) for _ in range(3000)]
        return sum(d.pool == "draft" and d.k > 0 for d in ds) / len(ds)

    assert draft_share(unknown, 6) > draft_share(known_bad, 6) + 0.01


def _explored(pools, cls, view_cells, params, n=5000, seed=1):
    rng = random.Random(seed)
    view = TuningView("m", cells=view_cells)
    ds = [choose_auto(pools, ROUTER, cls, view, rng=rng, params=params) for _ in range(n)]
    return [d for d in ds if d.detail["explore"]], [d for d in ds if not d.detail["explore"]]


def test_exploration_never_buys_plain_decoding_where_speculation_is_expected_to_pay():
    # A wide posterior (2 pseudo-trials) around α = 0.4: the mean says n-gram K = 2 beats plain
    # decoding by far more than explore_regret, but Thompson draws of a low α pick the plain pool.
    unbounded = replace(P, prior_trials=2.0, explore_regret=100.0)
    bounded = replace(P, prior_trials=2.0)
    pools = [ngram(prior=0.4), plain()]
    explored, exploited = _explored(pools, "chat", {}, unbounded)
    assert sum(d.k == 0 for d in explored) > 30  # what the bound removes (one held-out prompt: plain 3.43 s vs 1.40 s)
    explored, exploited = _explored(pools, "chat", {}, bounded)
    assert len(explored) > 500 and not [d for d in explored if d.k == 0]
    assert {d.k for d in exploited} == {2} and len({d.k for d in explored}) >= 4  # K still explored


def test_exploration_keeps_to_the_ks_that_could_be_within_the_regret_of_the_best():
    # 20k trials at α = 0.6: the posterior is tight, so only the Ks whose optimistic score comes within
    # explore_regret of the best are drawn; K = 1 (far below at batch 1) never is.
    rng = random.Random(7)
    cells = {("ngram", "rag", "1"): cell_from([simulate(0.6, 4, 20000, rng)])}
    explored, exploited = _explored([ngram(), plain()], "rag", cells, P)
    best = {d.k for d in exploited}
    assert len(best) == 1 and explored
    cand = score_pool(ngram(), "rag", TuningView("m", cells=cells))
    floor = cand.scores[cand.k] * (1 - P.explore_regret)
    allowed = explorable_ks(cand, floor)
    assert {d.k for d in explored} <= allowed and 1 not in allowed and 0 not in allowed
    assert cand.k in allowed


def test_the_exploiting_choice_is_always_explorable():
    for cls in ("chat", "code", "translation", "creative"):
        for running in (0.0, 3.0, 15.0, 40.0):
            for c in (score_pool(ngram(running=running), cls, None), score_pool(plain(running=running), cls, None)):
                assert c.k in explorable_ks(c, c.scores[c.k])


# -- the k_cap_by_batch table -----------------------------------------------------------------------

def _check_table(table, max_k):
    starts = [s for s, _ in table]
    caps = [c for _, c in table]
    assert starts[0] == 1 and starts == sorted(set(starts))
    assert all(0 <= c <= max_k for c in caps) and all(a > b for a, b in zip(caps, caps[1:]))


# -- observability ------------------------------------------------------------------------------------

def test_tuning_rows_have_the_tuning_entry_fields():
    rng = random.Random(9)
    cells = {("ngram", "code", "4-7"): cell_from([simulate(0.5, 3, 100, rng)]), ("none", "chat", "1"): cell_from(
        [SpecStats(mode="none", k=0, steps=100)])}
    rows = tuning_rows(TuningView("m", cells=cells))
    assert [(r["mode"], r["workload_class"], r["load_bucket"]) for r in rows] == [("ngram", "code", "4-7"), ("none", "chat", "1")]
    r = rows[0]
    assert r["mean_k"] == 3 and r["samples"] == 1 and len(r["acceptance_per_position"]) == 3
    assert r["acceptance_length"] == pytest.approx(cells[("ngram", "code", "4-7")].acceptance_length, abs=1e-4)
    assert r["step_ms_at_k"] == {3: 10.0} and rows[1]["step_ms_at_k"] == {0: 10.0}  # cell_from: 10 ms per step
    for row in rows:
        for key in ("model", "mode", "workload_class", "load_bucket", "acceptance_length",
                    "acceptance_per_position", "tokens_per_s", "samples", "mean_k"):
            assert row[key] is not None


# -- shared hardware, pooled acceptance, measured priors ---------------------------------------------

def test_plain_decoding_consolidates_on_shared_hardware_and_spreads_on_separate():
    from dataclasses import replace

    from cluster.routing.route import with_load

    # Nothing pays for speculation (α = 0): K = 0 everywhere, so only the tie-breaks decide.
    priors = (("*", 0.0),)
    a = PoolView(name="a", model="m", method=SpecMode.NGRAM, max_k=4, prior_alpha=priors)
    b = PoolView(name="b", model="m", method=SpecMode.NGRAM, max_k=4, prior_alpha=priors)
    separate = with_load([a, b], {"a": 5, "b": 1})
    assert choose_auto(separate, ROUTER, "chat").pool == "b"  # own hardware: the less loaded one
    shared = with_load([replace(a, hardware_group="box"), replace(b, hardware_group="box")], {"a": 5, "b": 1})
    assert [p.group_load for p in shared] == [6.0, 6.0]
    d = choose_auto(shared, ROUTER, "chat")
    assert d.pool == "a" and d.k == 0  # shared: the busier engine, not a second batch on the same cores
    assert d.detail["load_bucket"] == load_bucket(7)  # the group's load, not the pool's


def test_plain_decoding_prefers_the_cheapest_proposer_at_a_tie():
    d = choose_auto([draft(prior=0.0), ngram(prior=0.0)], ROUTER, "chat")
    assert (d.pool, d.k) == ("ngram", 0)


def test_acceptance_is_learned_across_load_buckets():
    # Traffic only at batch 1 says translation copies (α≈0.7); a request at batch 5 uses that.
    rng = random.Random(7)
    cells = {("ngram", "translation", "1"): cell_from([simulate(0.7, 6, 3000, rng)])}
    view = TuningView("m", cells=cells)
    d = choose_auto([ngram(running=4)], ROUTER, "translation", view)
    assert d.detail["load_bucket"] == "4-7"
    assert d.detail["alpha"] == pytest.approx(0.7, abs=0.03)
    assert d.k >= 4


def test_measured_priors_replace_the_builtin_table():
    assert prior_alpha("ngram", "translation") < 0.1  # built-in: Spec-Bench's large models
    assert prior_alpha("ngram", "translation", (("translation", 0.65), ("*", 0.2))) == 0.65
    assert prior_alpha("ngram", "qa", (("translation", 0.65), ("*", 0.2))) == 0.2
    cold = choose_auto([ngram()], ROUTER, "translation")
    measured = choose_auto([ngram(prior=(("translation", 0.65),))], ROUTER, "translation")
    assert cold.k <= 1 < 5 <= measured.k


def test_pool_config_validates_priors():
    from cluster.config import ConfigError, parse_config

    raw = {"models": {"m": {"source": "hub/x"}},
           "pools": {"p": {"model": "m", "method": "ngram", "max_k": 2, "prior_alpha": {"translation": 0.6}}}}
    assert parse_config(raw).pools["p"].prior_alpha == {"translation": 0.6}
    for bad, words in (({"poetry": 0.5}, "poetry"), ({"chat": 1.5}, "0.99")):
        raw["pools"]["p"]["prior_alpha"] = bad
        with pytest.raises(ConfigError, match=words) as e:
            parse_config(raw)
        assert "prior_alpha" in str(e.value)


# -- pools that time-share one machine (hardware_group) ---------------------------------------------

def _grouped(ng_running: float, dr_running: float, dr_prior: float):
    from cluster.routing.route import with_load

    views = [replace(ngram(prior=0.05), hardware_group="hw"), replace(draft(prior=dr_prior), hardware_group="hw")]
    return with_load(views, {"ngram": ng_running, "draft": dr_running})


def test_joining_step_rel_adds_the_other_engines_step_when_it_is_busy():
    from cluster.policy import joining_step_rel

    ng, dr = _grouped(4, 0, 0.5)
    t = lambda b: 1.0 + P.step_time_per_batch * (BUCKET_BATCH[load_bucket(b)] - 1.0)  # the prior  # noqa: E731
    assert joining_step_rel(ng, None) == pytest.approx(t(5))  # one batch of 5 in the busy engine
    assert joining_step_rel(dr, None) == pytest.approx(t(1) + t(4))  # its own step, then the other's
    idle_ng, idle_dr = _grouped(0, 0, 0.5)
    assert joining_step_rel(idle_dr, None) == pytest.approx(t(1)) == joining_step_rel(idle_ng, None)
    alone = replace(draft(running=3), hardware_group=None)  # no group: its own batch, as before
    assert joining_step_rel(alone, None) == pytest.approx(t(4))


def test_a_busy_shared_machine_keeps_traffic_on_the_busy_engine():
    """The draft pool would win on an idle machine (α 0.6 against n-gram's 0.05) but not while the
    n-gram engine on the same cores has four requests: it would add its steps to theirs."""
    idle = choose_auto(_grouped(0, 0, 0.6), ROUTER, "chat", None)
    assert idle.pool == "draft" and idle.k > 0
    busy = choose_auto(_grouped(4, 0, 0.6), ROUTER, "chat", None)
    assert busy.pool == "ngram"
    # and the other way round: with the draft engine busy, requests join it rather than wake n-gram
    assert choose_auto(_grouped(0, 4, 0.6), ROUTER, "chat", None).pool == "draft"


# -- the proposer's fixed cost per drafting step (prior_draft_cost) -------------------------------

def eagle(running=0.0, max_k=3, name="eagle", prior=0.19, draft_cost=(0.32, 0.02)):
    return PoolView(name=name, model="m", method=SpecMode.EAGLE, max_k=max_k, running=running,
                    prior_alpha=_priors(prior), prior_draft_cost=draft_cost)


def test_fixed_cost_is_paid_by_drafting_steps_only():
    assert score(0.5, 0, 0.1, fixed=0.3) == score(0.5, 0, 0.1) == 1.0
    assert score(0.5, 2, 0.1, fixed=0.3) == pytest.approx(1.75 / 1.5)
    assert score(0.5, 2, 0.1, fixed=0.3) < score(0.5, 2, 0.1)
    assert prior_step_cost("eagle", 1, draft_cost=(0.32, 0.02)) == (0.32, pytest.approx(0.05))
    assert prior_step_cost("none", 1, draft_cost=(0.32, 0.02)) == (0.0, 0.0)
    assert prior_step_cost("ngram", 1)[0] == 0.0 < prior_step_cost("eagle", 1)[0]
    # the per-token part still grows with the batch (verification), the fixed part does not
    f1, c1 = prior_step_cost("eagle", 1, draft_cost=(0.32, 0.02))
    f16, c16 = prior_step_cost("eagle", 16, draft_cost=(0.32, 0.02))
    assert f1 == f16 and c16 > c1


def test_measured_eagle_costs_reproduce_what_vllm_measured_here():
    """BENCHMARKS 9.3: K = 1 and K = 3 steps cost 1.37 and 1.47 plain steps; with the local config's
    prior the model says the same, where the linear built-in said 1.08 and 1.24."""
    f, c = prior_step_cost("eagle", 1, draft_cost=(0.32, 0.02))
    assert 1.0 + f + c * 1 == pytest.approx(1.37, abs=0.01)
    assert 1.0 + f + c * 3 == pytest.approx(1.47, abs=0.01)
    # and so the scores say what vLLM measured: eagle:1..3 below plain decoding at the head's α
    assert all(score(0.19, k, c, fixed=f) < 1.0 for k in (1, 2, 3))


def test_low_acceptance_model_drafter_is_not_chosen_cold():
    """With a GPU-like 0.05 per token the cold EAGLE pool (α 0.19) scored 1.10 at K = 1
    and took creative / chat traffic at 4 streams from the n-gram engine; with its measured cost it
    scores below plain decoding and traffic stays on the n-gram pool."""
    ng = replace(ngram(prior=0.62), hardware_group="hw")
    builtin = replace(eagle(draft_cost=None), hardware_group="hw")
    measured = replace(eagle(), hardware_group="hw")
    view = TuningView("m", cells={("ngram", "creative", "1"): CellStats(steps=10**4, exposed_at=(200,))})
    assert choose_auto([ng, builtin], ROUTER, "creative", view).pool == "eagle"  # the old fault
    d = choose_auto([ng, measured], ROUTER, "creative", view)
    assert d.pool == "ngram", d.detail
    # a high-acceptance class still goes to EAGLE when its α pays for the fixed cost
    good = replace(eagle(prior=0.8), hardware_group="hw")
    assert choose_auto([replace(ngram(prior=0.05), hardware_group="hw"), good], ROUTER, "math", None).pool == "eagle"


def _eagle_view(overhead, mean_k, steps):
    spec = CellStats(steps=steps, k_steps=mean_k * steps, decode_s=0.01 * (1 + overhead) * steps)
    plain_cell = CellStats(steps=steps, decode_s=0.01 * steps)
    return TuningView("m", cells={("eagle", "chat", "1"): spec, ("none", "chat", "1"): plain_cell})


def test_measured_overhead_scales_both_terms_and_keeps_the_priors_shape():
    prior = (0.32, 0.02)
    f0, c0 = prior_step_cost("eagle", 1, draft_cost=prior)
    # below min_cost_steps: the prior
    assert step_cost(_eagle_view(1.0, 1, P.min_cost_steps - 1), "eagle", "1", draft_cost=prior) == (f0, c0)
    # plenty of steps at mean K 2 measuring an overhead of 0.84 (twice the prior's 0.42)
    f, c = step_cost(_eagle_view(0.84, 2, 10**7), "eagle", "1", draft_cost=prior)
    assert f + 2 * c == pytest.approx(0.84, rel=1e-3) and f / c == pytest.approx(f0 / c0)
    # few steps: between the prior and the measurement
    fm, cm = step_cost(_eagle_view(0.84, 2, 500), "eagle", "1", draft_cost=prior)
    assert f0 < fm < f and c0 < cm < c
    # absurd data is clamped; free drafting reads as no cost, not negative
    assert sum(step_cost(_eagle_view(1000.0, 1, 10**7), "eagle", "1", draft_cost=prior)) <= 2 + 2 * 0.32 + 1e-9
    assert step_cost(_eagle_view(-0.5, 1, 10**7), "eagle", "1", draft_cost=prior)[0] >= 0.0
    # n-gram (no fixed cost): the same c = overhead / mean K as before
    assert cost_per_k(_cost_view(0.013, 0.010, steps=10**7), "ngram", "1") == pytest.approx(0.1, abs=0.001)


def test_pool_config_prior_draft_cost():
    from cluster.config import ConfigError, parse_config
    from cluster.routing.route import pool_views

    raw = {"models": {"m": {"source": "hub/x"}, "d": {"source": "hub/d"}},
           "pools": {"p": {"model": "m", "method": "eagle", "drafter": "d", "max_k": 2,
                           "prior_draft_cost": {"per_step": 0.3, "per_token": 0.02}}}}
    cfg = parse_config(raw)
    assert [v.prior_draft_cost for v in pool_views(cfg)] == [(0.3, 0.02)]
    for bad, words in (({"per_step": -1}, "per_step"), ({"fixed": 0.3}, "fixed")):
        raw["pools"]["p"]["prior_draft_cost"] = bad
        with pytest.raises(ConfigError, match=words) as e:
            parse_config(raw)
        assert "prior_draft_cost" in str(e.value)


def test_local_config_cold_start_keeps_low_acceptance_classes_off_the_eagle_pool():
    """The shipped local config, cold (no tuning state): no class goes to the EAGLE pool at K > 0 at
    any batch, because its priors say it measured below plain decoding on this CPU (BENCHMARKS 9.3)."""
    from pathlib import Path

    from cluster.config import load_config
    from cluster.routing.route import explain_choices, pool_views

    cfg = load_config(LOCAL_CPU)
    rows = explain_choices(pool_views(cfg), cfg.router, None, WORKLOAD_CLASSES, (1, 4, 16))
    assert rows and all(r["mode"] != "eagle" for r in rows), [r for r in rows if r["mode"] == "eagle"]
    assert any(r["mode"] in ("ngram", "suffix") and r["k"] >= 3 for r in rows if r["batch"] == 1)


def test_cell_sum_keeps_exposure_without_acceptance():
    # a cell whose drafts were never accepted still records how often it drafted (its p)
    a = CellStats(steps=100, exposed_at=(20, 5))
    b = CellStats(steps=100, accepted_at=(1,), exposed_at=(10,))
    assert (a + b).exposed_at == (30, 5) and (a + b).accepted_at == (1, 0)
    assert (a + CellStats()).draft_rate == pytest.approx(0.2)


def _plain_steps(ms_by_bucket):
    return TuningView("m", cells={("none", "chat", b): CellStats(steps=10**6, decode_s=ms * 1e-3 * 10**6)
                                  for b, ms in ms_by_bucket.items()})


def test_step_time_never_falls_with_load():
    # measured cells: 2-3 read slower than 4-7 (noise); the larger bucket takes the smaller's
    view = _plain_steps({"1": 100, "2-3": 172, "4-7": 136, "8-15": 363, "16+": 664})
    rel = [step_time_rel(view, b) for b in BUCKET_NAMES]
    assert rel == sorted(rel) and rel[2] == pytest.approx(rel[1])
    assert rel[4] == pytest.approx(6.64, abs=0.01)


def test_splitting_a_shared_machine_is_never_cheaper_than_one_batch():
    """Measured buckets at 32 streams (8-15 at 3.6 plain steps, 16+ at 6.6): summed bucket step
    times would price a request joining the idle EAGLE engine while the n-gram engine holds 15 at
    t(1) + t(15) = 4.6 against t(16) = 6.6, and send plain-decoding requests to a second engine on
    the same two cores."""
    from cluster.policy import joining_step_rel
    from cluster.routing.route import with_load

    view = _plain_steps({"1": 100, "2-3": 172, "4-7": 136, "8-15": 363, "16+": 664})
    views = [replace(ngram(prior=0.62), hardware_group="hw"), replace(eagle(name="draft"), hardware_group="hw")]
    for busy in (1, 3, 7, 15, 20, 31):
        ng, dr = with_load(views, {"ngram": busy, "draft": 0})
        assert joining_step_rel(dr, view) >= joining_step_rel(ng, view), busy
        for wc in ("math", "chat", "summarization", "creative"):
            assert choose_auto([ng, dr], ROUTER, wc, view).pool == "ngram", (busy, wc)


# -- accepted runs: drafts come in bursts ---------------------------------------------------------

def _copy_text(rng: random.Random, segments: int, draftless=0.4, runs=((0, .6), (1, .1), (2, .1), (12, .2))):
    """A text as the proposer sees it: per segment either a token it cannot draft (None) or a run of
    L tokens it guesses in a row (then one it gets wrong). The shape of n-gram lookup on
    summarization: mostly nothing, sometimes a copied span of a dozen tokens."""
    out = []
    for _ in range(segments):
        if rng.random() < draftless:
            out.append(None)
            continue
        x = rng.random()
        for length, w in runs:
            x -= w
            if x < 0:
                break
        out.append(length)
    return out


def _decode(text, k: int) -> tuple[SpecStats, int, int]:
    """Decode `text` with K as the engine does (a run of L takes ceil((L + 1) / (K + 1)) steps) and
    report it through the engine's own `stats_from_output`: (stats, steps, tokens)."""
    from types import SimpleNamespace

    from deployments.engine import stats_from_output

    acc, dr, steps, tokens = [], [], 0, 0
    for length in text:
        if length is None:
            steps, tokens = steps + 1, tokens + 1
            continue
        left = length
        while True:
            a = min(left, k)
            acc.append(a), dr.append(k)
            steps, tokens = steps + 1, tokens + a + 1
            if left <= k:
                break
            left -= k + 1
    hist = [acc.count(j) for j in range(k + 1)]
    m = SimpleNamespace(histogram=hist, num_draft_tokens=sum(dr), per_step_drafted=dr, per_step_accepted=acc)
    return stats_from_output("ngram", k, tokens + 1, m), steps, tokens


def _runs_view(stats: SpecStats, cls: str, per_k_cost: float, k: int) -> TuningView:
    cell = cell_from([stats])
    plain_step = 0.08
    decode_s = plain_step * (1 + per_k_cost * k) * cell.steps
    return TuningView("m", cells={
        ("ngram", cls, "1"): replace(cell, decode_s=decode_s, decode_s_at_k=(0.0,) * k + (decode_s,)),
        ("none", cls, "1"): CellStats(steps=10**6, decode_s=plain_step * 10**6)})


def test_runs_predict_tokens_per_step_at_every_k_where_the_geometric_model_does_not():
    text = _copy_text(random.Random(3), 2000)
    truth = {k: (lambda st: st[2] / st[1])(_decode(text, k)) for k in range(8)}
    for observed_k in (6, 4, 3, 2):
        cell = cell_from([_decode(text, observed_k)[0]])
        predicted = {k: run_tokens_per_step(cell.runs, cell.draftless_steps, k) for k in range(8)}
        if observed_k >= 3:  # exact: no run here ends exactly at the observed K
            assert predicted == pytest.approx(truth, rel=1e-9)
        else:
            # A run that ends exactly at K (a full step whose bonus was the miss) cannot be told
            # from one that goes on, so it is merged with the next: runs read long, by at most 6%.
            assert all(truth[k] <= predicted[k] <= 1.06 * truth[k] for k in range(8))
    cell = cell_from([_decode(text, 6)[0]])
    _, steps5, tokens5 = _decode(text, 5)
    # K = 5 makes as many steps as K = 4 (a copy of 12 takes 3 either way); the geometric model
    # fitted at K = 6 expects 9% more tokens per step from K = 5.
    assert _decode(text, 4)[1] == steps5
    assert expected_tokens_per_step(cell.alpha, 5, cell.draft_rate) > 1.08 * tokens5 / steps5


def test_bursty_drafts_choose_the_k_that_is_fastest_not_the_one_geometry_prefers():
    text = _copy_text(random.Random(3), 2000)
    cost = 0.05
    true = {k: (lambda st: st[2] / st[1] / (1 + cost * k))(_decode(text, k)) for k in range(7)}
    assert max(true, key=true.get) == 6
    view = _runs_view(_decode(text, 6)[0], "summarization", cost, 6)
    d = choose_auto([ngram()], ROUTER, "summarization", view)
    assert d.k == 6 and d.detail["expected_tokens_per_step"] == pytest.approx(_decode(text, 6)[2] / _decode(text, 6)[1], rel=0.01)
    # Without the runs (a cell of counts per position only) the geometric model picks K = 5: 6% slower.
    geometric = TuningView("m", cells={key: replace(c, runs=()) for key, c in view.cells.items()})
    assert choose_auto([ngram()], ROUTER, "summarization", geometric).k == 5
    assert true[5] < 0.95 * true[6]


def test_runs_are_learned_from_a_few_requests_and_the_geometric_prior_fades():
    text = _copy_text(random.Random(4), 40)  # about one request's worth
    stats = _decode(text, 6)[0]
    cell = cell_from([stats])
    n = sum(cell.runs)
    w = n / (n + P.prior_runs)
    for k in (1, 4, 6):
        geo = expected_tokens_per_step(0.7, k, 0.6)
        run = run_tokens_per_step(cell.runs, cell.draftless_steps, k)
        assert expected_tokens(0.7, k, 0.6, cell.runs, cell.draftless_steps) == pytest.approx(w * run + (1 - w) * geo)
    assert expected_tokens(0.7, 4, 0.6) == expected_tokens_per_step(0.7, 4, 0.6)  # no runs: the prior
    assert expected_tokens(0.7, 0, 0.6, cell.runs, cell.draftless_steps) == 1.0


def test_thompson_draws_over_runs_stay_in_range_and_mostly_agree_with_the_mean():
    text = _copy_text(random.Random(3), 2000)
    view = replace(_runs_view(_decode(text, 6)[0], "summarization", 0.05, 6), rng=random.Random(9))
    ks = [choose_auto([ngram(), plain()], ROUTER, "summarization", view).k for _ in range(400)]
    assert all(0 <= k <= 6 for k in ks) and ks.count(6) > 0.9 * len(ks)


def test_the_score_of_a_pool_uses_the_runs():
    text = _copy_text(random.Random(3), 2000)
    view = _runs_view(_decode(text, 6)[0], "summarization", 0.05, 6)
    geometric = TuningView("m", cells={key: replace(c, runs=()) for key, c in view.cells.items()})
    assert score_pool(ngram(max_k=6), "summarization", view).k == 6
    assert score_pool(ngram(max_k=6), "summarization", geometric).k == 5


# -- step cost: the fixed and the per-token part apart --------------------------------------------

def _timed(k: int, steps: int) -> SpecStats:
    return SpecStats(mode="ngram", k=k, steps=steps, drafted=k * steps, accepted=0,
                     accepted_per_position=[0] * k, drafted_per_position=[steps] * k)


def _cost_cells(groups, plain_step_s=0.1, bucket="4-7"):
    """Cells of requests at several K with step time plain * (1 + f + c·K), through the real
    increments and validation; `groups` = [(K, requests, step time relative to plain)]."""
    cell = cell_from_requests((_timed(k, 100), plain_step_s * rel * 100) for k, n, rel in groups for _ in range(n))
    return TuningView("m", cells={("ngram", "code", bucket): cell,
                                  ("none", "code", bucket): CellStats(steps=10**6, decode_s=plain_step_s * 10**6)})


@pytest.mark.parametrize("f,c", [(0.2, 0.02), (0.0, 0.08), (0.05, 0.0), (0.4, 0.1)])
def test_step_cost_separates_the_fixed_and_the_per_token_cost(f, c):
    view = _cost_cells([(1, 20, 1 + f + c), (2, 20, 1 + f + 2 * c), (4, 20, 1 + f + 4 * c), (6, 20, 1 + f + 6 * c)])
    fixed, per_k = step_cost(view, "ngram", "4-7")
    w = 8000 / (8000 + P.prior_cost_steps)  # 80 requests of 100 steps against the prior's weight
    prior_f, prior_c = prior_step_cost("ngram", BUCKET_BATCH["4-7"])
    assert fixed == pytest.approx(w * f + (1 - w) * prior_f, abs=1e-6)
    assert per_k == pytest.approx(w * c + (1 - w) * prior_c, abs=1e-6)


def test_step_cost_without_a_spread_of_k_scales_the_prior():
    view = _cost_cells([(4, 50, 1.3)])  # one K: f and c cannot be told apart
    fixed, per_k = step_cost(view, "ngram", "4-7")
    assert fixed == 0.0 and 4 * per_k == pytest.approx(0.3, rel=0.1)


def test_step_cost_regression_clamps_negative_terms():
    # Cheaper per step at higher K (noise, or batches that mixed K = 0 requests in): no negative f.
    fixed, per_k = step_cost(_cost_cells([(1, 30, 1.3), (4, 30, 1.5)], bucket="16+"), "ngram", "16+")
    assert fixed >= 0 and per_k >= 0
    fixed, per_k = step_cost(_cost_cells([(1, 30, 1.3), (4, 30, 1.2)]), "ngram", "4-7")
    assert fixed >= 0 and per_k >= 0


def test_a_fixed_cost_at_load_makes_a_large_k_pay_where_the_mean_alone_did_not():
    """Measured at 4 streams: n-gram K = 4 steps cost 1.294 plain steps, K ~ 2 ones 1.247 (f 0.21,
    c 0.022); the overhead at the mean K alone reads 0.087 per token and chooses K = 1-2, which made
    0.934 of `ngram:4`."""
    # Tokens per step 1.40 at K = 2 and 1.54 at K = 4, as measured for summarization.
    text = _copy_text(random.Random(3), 3000, draftless=0.7, runs=((0, .5), (1, .15), (2, .1), (4, .15), (12, .1)))
    cell = cell_from([_decode(text, 6)[0]])
    steps = CellStats(steps=cell.steps, exposed_at=cell.exposed_at, accepted_at=cell.accepted_at,
                      accepted=cell.accepted, rejected_steps=cell.rejected_steps, runs=cell.runs)
    costs = _cost_cells([(2, 40, 1.254), (4, 40, 1.298)])
    view = TuningView("m", cells={**costs.cells, ("ngram", "summarization", "1"): steps})
    assert choose_auto([ngram(running=4)], ROUTER, "summarization", view).k >= 4
    # The same overhead at the mean K alone (without the regression or the step time per K)
    # chooses K <= 2.
    mean_only = TuningView("m", cells={key: replace(c, kk_steps=0, k_decode_s=0.0, steps_at_k=(), decode_s_at_k=())
                                       for key, c in view.cells.items()})
    assert choose_auto([ngram(running=4)], ROUTER, "summarization", mean_only).k <= 2


# -- step time per K: a cost that is not linear in K ----------------------------------------------

# Step time of `ngram:K` over `none` at one stream on the CPU box, K = 1..6 (`tools.bench.step_split`
# on a benchmark's samples: 80.6, 75.1, 74.9, 74.5, 75.8, 78.4 ms against 76.2; a repeat measured
# the same shape).
MEASURED_STEP_REL = {1: 1.058, 2: 0.986, 3: 0.983, 4: 0.978, 5: 0.995, 6: 1.029}


def _per_k_view(step_rel=MEASURED_STEP_REL, requests=4, plain_step_s=0.08, segments=3000):
    """Chat-like n-gram text (short copies, few runs past 4), decoded `requests` times at each K
    of `step_rel` with steps of plain * step_rel[K], through the real increments and validation."""
    text = _copy_text(random.Random(3), segments, draftless=0.6,
                      runs=((0, .5), (1, .15), (2, .1), (3, .1), (4, .08), (6, .07)))
    decoded = {k: _decode(text, k)[0] for k in step_rel}
    cell = cell_from_requests((decoded[k], plain_step_s * rel * decoded[k].steps)
                              for k, rel in step_rel.items() for _ in range(requests))
    plain = CellStats(steps=10**6, decode_s=plain_step_s * 10**6, steps_at_k=(10**6,), decode_s_at_k=(plain_step_s * 10**6,))
    return text, TuningView("m", cells={("ngram", "chat", "1"): cell, ("none", "chat", "1"): plain})


def _without_per_k(view):
    return TuningView("m", cells={key: replace(c, steps_at_k=(), decode_s_at_k=()) for key, c in view.cells.items()})


def test_step_time_per_k_chooses_the_k_a_linear_cost_cannot_see():
    """Measured: a K = 6 step costs ~5% more than a K = 4 one while the linear fit reads 0.004 per
    draft token, so a linear cost alone chose K = 6 for half the requests and lost ~1.5% per step
    to `ngram:4`."""
    text, view = _per_k_view()
    truth = {k: (lambda st: st[2] / st[1])(_decode(text, k)) / MEASURED_STEP_REL.get(k, 1.0) for k in range(7)}
    assert max(truth, key=truth.get) == 4 and truth[6] < 0.98 * truth[4]
    d = choose_auto([ngram()], ROUTER, "chat", view)
    assert d.k == 4 and d.detail["step_overhead"] < 0.01
    over = step_overheads(view, "ngram", "1", 6)
    assert over[1] > over[4] < over[6]  # the U a line through it flattens
    # Without the step time per K (cells without per-K step times) the line through every K is
    # nearly flat (steps below plain ones clamp its intercept to 0) and K = 6, with the most tokens
    # per step, wins.
    f, c = step_cost(_without_per_k(view), "ngram", "1")
    assert f + 6 * c < 0.02
    assert choose_auto([ngram()], ROUTER, "chat", _without_per_k(view)).k == 6


def test_step_time_per_k_needs_enough_steps_and_is_blended_with_the_linear_prior():
    _, few = _per_k_view(step_rel={3: 1.1, 6: 1.3}, requests=1, segments=150)
    steps = {k: few.cells[("ngram", "chat", "1")].steps_at_k[k] for k in (3, 6)}
    assert all(n < P.min_cost_steps for n in steps.values())  # too few: the linear model only
    assert measured_overheads(few, "ngram", "1") == {}
    f, c = step_cost(few, "ngram", "1")
    assert step_overheads(few, "ngram", "1", 6) == pytest.approx((0.0,) + tuple(f + c * k for k in range(1, 7)))
    _, some = _per_k_view(step_rel={3: 1.1, 6: 1.3}, requests=2, segments=150)
    n6 = some.cells[("ngram", "chat", "1")].steps_at_k[6]
    assert n6 >= P.min_cost_steps
    f, c = step_cost(some, "ngram", "1")
    w = n6 / (n6 + P.prior_cost_steps)
    assert step_overheads(some, "ngram", "1", 6)[6] == pytest.approx(w * 0.3 + (1 - w) * (f + 6 * c))
    _, many = _per_k_view(requests=400)  # the measurement dominates the prior
    # The measured K = 2..5 steps read cheaper than its plain ones: the cheapest (K = 4) is the baseline.
    expected = (0.0,) + tuple(MEASURED_STEP_REL[k] / MEASURED_STEP_REL[4] - 1.0 for k in range(1, 7))
    assert step_overheads(many, "ngram", "1", 6) == pytest.approx(expected, abs=2e-3)
    assert step_overheads(many, "ngram", "1", 3) == pytest.approx(expected[:4], abs=2e-3)  # cut at max_k
    assert step_overheads(many, "ngram", "4-7", 6) == step_overheads(TuningView("m"), "ngram", "4-7", 6)  # per bucket
    assert step_overheads(many, "none", "1", 0) == (0.0,)


def test_step_time_per_k_compares_each_class_with_its_own_plain_steps():
    """Summaries decode after long prompts (slow steps), chat after short ones; auto drafts the
    summaries at K = 6 and chat at K = 3. Pooled, K = 6 would read 30% dearer than K = 3 for the
    text's sake; per class, both steps cost what a plain step of their class costs (+2%)."""
    def at(k, n, s):
        return CellStats(steps=n, decode_s=n * s, steps_at_k=(0,) * k + (n,), decode_s_at_k=(0.0,) * k + (n * s,))
    cells = {("none", "chat", "1"): at(0, 5000, 0.100), ("none", "summarization", "1"): at(0, 5000, 0.130),
             ("ngram", "chat", "1"): at(3, 5000, 0.102), ("ngram", "summarization", "1"): at(6, 5000, 0.1326)}
    got = measured_overheads(TuningView("m", cells), "ngram", "1")
    assert got[3] == (pytest.approx(0.02), 5000) and got[6] == (pytest.approx(0.02), 5000)
    # A class without plain steps of its own is compared with the bucket's plain steps (pooled).
    del cells[("none", "summarization", "1")]
    assert measured_overheads(TuningView("m", cells), "ngram", "1")[6][0] == pytest.approx(0.326)
    # Drafting steps measured faster than plain ones are noise: 0, never a discount.
    cells[("ngram", "chat", "1")] = at(3, 5000, 0.09)
    assert measured_overheads(TuningView("m", cells), "ngram", "1")[3][0] == 0.0


def test_a_lookup_method_with_only_a_prior_does_not_win_by_drafting_every_step():
    """One engine serves n-gram and suffix requests. Suffix has evidence for `code` (α 0.70, a draft
    in half the steps); n-gram has only its prior. Read as drafting every step, that prior scored
    n-gram 2.02 against suffix's 1.94 and moved the class off suffix (BENCHMARKS.md 2.1); with the
    measured share of drafting steps (`prior_draft_rate`) the two compare like for like."""
    from cluster.policy.model import prior_draft_rate
    from cluster.policy.decision import OtherMethod

    rng = random.Random(7)
    reqs = [replace(simulate(0.74, 16, 60, rng, drafted_len=lambda r: r.choice([0, 0, 3, 8])), mode="suffix")
            for _ in range(4)]
    view = TuningView("m", cells={("suffix", "code", "1"): cell_from(reqs)})

    def pool(ngram_rate, suffix_rate):
        return PoolView(name="ngram", model="m", method=SpecMode.NGRAM, max_k=6, prior_alpha=(("code", 0.61),),
                        prior_draft_rate=ngram_rate, also=(OtherMethod(SpecMode.SUFFIX, (("code", 0.86),), 16, suffix_rate),))

    unmeasured = choose_auto([pool((), ())], ROUTER, "code", view)
    assert unmeasured.mode == SpecMode.NGRAM and unmeasured.detail["draft_rate"] == 1.0
    measured = choose_auto([pool((("*", 0.5),), (("*", 0.5),)), ], ROUTER, "code", view)
    assert measured.mode == SpecMode.SUFFIX and measured.detail["draft_rate"] == pytest.approx(0.51, abs=0.01)
    cold = choose_auto([pool((("*", 0.5),), (("code", 0.6), ("*", 0.5)))], ROUTER, "code", None)
    assert cold.mode == SpecMode.SUFFIX and cold.detail["draft_rate"] == 0.6
    assert prior_draft_rate("code", (("*", 0.5),)) == 0.5 and prior_draft_rate("code") == 1.0


def test_auto_skips_keeps_ngram_out_of_auto_choice_and_exploration():
    """A pool that keeps n-gram out of auto's choice (`suffix.auto_ngram: false`) gets suffix or none
    from the policy even where n-gram's priors score higher, exploring or not."""
    from cluster.policy.decision import OtherMethod

    def pool(skips):
        return PoolView(name="ngram", model="m", method=SpecMode.NGRAM, max_k=6, prior_alpha=(("*", 0.9),),
                        also=(OtherMethod(SpecMode.SUFFIX, (("*", 0.3),), 16),), auto_skips=skips)

    assert choose_auto([pool(())], ROUTER, "code", None).mode == SpecMode.NGRAM
    kept = choose_auto([pool((SpecMode.NGRAM,))], ROUTER, "code", None)
    assert kept.mode in (SpecMode.SUFFIX, SpecMode.NONE) and kept.pool == "ngram"
    assert set(kept.detail["scores"]) == {"ngram:suffix"}
    rng = random.Random(3)
    modes = {choose_auto([pool((SpecMode.NGRAM,))], ROUTER, "code", None, rng=rng).mode for _ in range(300)}
    assert SpecMode.NGRAM not in modes and SpecMode.SUFFIX in modes
