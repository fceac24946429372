"""The choice: `choose_auto` scores every pool's K for one request and returns the `Decision` of the best
(pool, method), each scored at its best K, with bounded exploration. The engine then chooses K per step
(`cluster.routing.route.per_step_k`)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from cluster.config import RouterConfig
from cluster.policy.decision import Decision, PoolView
from cluster.policy.cells import MAX_K, TuningView, load_bucket
from cluster.policy.cost import best_k, joining_step_rel, score, score_at, step_cost, step_overheads
from cluster.policy.model import class_model, class_runs, expected_tokens
from cluster.policy.params import DEFAULT_PARAMS, PolicyParams
from cluster.speculation import SpecMode


def exploration_rate(trials: float, params: PolicyParams = DEFAULT_PARAMS) -> float:
    """ε: eps_max with no data, halving its excess over eps_min every eps_scale_trials."""
    excess = (params.eps_max - params.eps_min) * params.eps_scale_trials / (params.eps_scale_trials + max(trials, 0.0))
    return params.eps_min + excess


@dataclass(frozen=True)
class Candidate:
    """One pool scored for one request."""

    pool: PoolView
    bucket: str
    alpha: float  # posterior mean (0 for plain pools)
    alpha_beta: tuple[float, float]
    draft_rate: float  # p, posterior mean (1 for plain pools: unused there)
    cost: float
    step_rel: float
    scores: Mapping[int, float]  # K -> score, K in 0..pool.max_k
    k: int  # the best K: its score stands for the candidate
    fixed_cost: float = 0.0  # f: the proposer's fixed cost of a drafting step
    runs: tuple[int, ...] = ()  # measured accepted runs of the class ([L] = runs of L tokens)
    draftless: float = 0.0  # ... and its steps that drafted nothing
    overheads: tuple[float, ...] = (0.0,)  # [K] = extra step time at K (`step_overheads`)

    def expected(self, k: int, alpha: Optional[float] = None, runs=None,
                 params: "PolicyParams" = None) -> float:
        """E(K) of this candidate (at its posterior mean α unless one is given)."""
        return expected_tokens(self.alpha if alpha is None else alpha, k, self.draft_rate,
                               self.runs if runs is None else runs, self.draftless, params)

    @property
    def mode(self) -> str:
        return self.pool.method.value

    @property
    def speculative(self) -> bool:
        return self.pool.method != SpecMode.NONE and self.pool.max_k > 0


_SCORE_CACHE: dict[tuple, tuple] = {}  # (mode, class, bucket, max_k, step_rel, priors, draft cost, params) -> (cells, result)
_SCORE_CACHE_MAX = 4096


def _pool_scores(view, mode, workload_class, bucket, max_k, step_rel, priors, params, draft_cost=None, rate_priors=()):
    """(alpha, (a, b), p, (f, c), runs, overheads, {K: score}) of one cell. α, p and the runs are learned per (mode, class) over every
    load bucket; the cost per K per bucket. Memoised per view refresh: the result depends only on
    the view's cells (replaced as a whole on each refresh), so the request path pays the posterior
    and cost arithmetic once per cell and refresh, not once per request."""
    cells = view.cells if view is not None else None
    key = (mode, workload_class, bucket, max_k, step_rel, priors, draft_cost, params, rate_priors)
    hit = _SCORE_CACHE.get(key)
    if hit is not None and hit[0] is cells:
        return hit[1]
    alpha, (a, b), p = class_model(view, mode, workload_class, priors, params, rate_priors)
    runs, draftless = class_runs(view, mode, workload_class)
    fixed, cost = step_cost(view, mode, bucket, params, draft_cost)
    overheads = step_overheads(view, mode, bucket, max_k, params, draft_cost, line=(fixed, cost))
    result = (alpha, (a, b), p, (fixed, cost), (runs, draftless), overheads,
              {k: score_at(expected_tokens(alpha, k, p, runs, draftless, params), overheads[k], step_rel)
               for k in range(max_k + 1)})
    if len(_SCORE_CACHE) >= _SCORE_CACHE_MAX:
        _SCORE_CACHE.clear()
    _SCORE_CACHE[key] = (cells, result)
    return result


def score_pool(pool: PoolView, workload_class: str, view: Optional[TuningView], params: PolicyParams = DEFAULT_PARAMS) -> Candidate:
    """Score K = 0..max_k of `pool` for one request of `workload_class` at the pool's live load."""
    bucket = load_bucket(pool.load_batch + 1.0)
    mode = pool.method.value
    step_rel = joining_step_rel(pool, view, params)
    max_k = min(max(int(pool.max_k), 0), MAX_K)
    if pool.method == SpecMode.NONE or max_k == 0:
        return Candidate(pool, bucket, 0.0, (0.0, 1.0), 1.0, 0.0, step_rel, {0: score(0.0, 0, 0.0, step_rel)}, 0)
    alpha, (a, b), p, (fixed, cost), (runs, draftless), overheads, scores = _pool_scores(
        view, mode, workload_class, bucket, max_k, step_rel, pool.prior_alpha, params, pool.prior_draft_cost,
        pool.prior_draft_rate)
    return Candidate(pool, bucket, alpha, (a, b), p, cost, step_rel, scores, best_k(scores, params.tie_tol),
                     fixed, runs, draftless, overheads)


def beta_upper(a: float, b: float, z: float) -> float:
    """α at z standard deviations above the mean of Beta(a, b) (normal approximation), in [0, 1].

    >>> round(beta_upper(40.0, 60.0, 2.0), 3), beta_upper(1e6, 1.0, 2.0)
    (0.497, 1.0)
    """
    n = a + b
    if n <= 0:
        return 1.0
    mean = a / n
    return min(max(mean + z * math.sqrt(a * b / (n * n * (n + 1.0))), 0.0), 1.0)


def explorable_ks(cand: Candidate, floor: float, params: PolicyParams = DEFAULT_PARAMS) -> frozenset[int]:
    """The Ks of `cand` an exploration draw may take: those whose score at the optimistic α (the
    posterior mean + `explore_z` sigma, the measured runs at their mean) is at least `floor`, the
    exploiting choice's score less `explore_regret`. A K that even an optimistic α prices well below
    the best is a near-certain loss that teaches little: K = 0 (plain decoding, the same price at any
    α) drafts nothing, so it says nothing about α, and plain step times come from the traffic that
    chooses them. One such draw decodes a translation request plainly in 3.43 s where n-gram drafts
    are accepted at α = 0.66 and K = 3 takes 1.40 s.

    >>> pool = PoolView(name="p", model="m", method=SpecMode.NGRAM, max_k=4)
    >>> cand = Candidate(pool, "1", 0.6, (60.0, 40.0), 1.0, 0.0, 1.0, {0: 1.0, 1: 1.6, 2: 1.96, 3: 2.18, 4: 2.31}, 4,
    ...                  overheads=(0.0,) * 5)
    >>> sorted(explorable_ks(cand, 2.31 * 0.95))
    [3, 4]
    """
    if not cand.speculative:
        return frozenset(k for k, s in cand.scores.items() if s >= floor)
    hi = beta_upper(*cand.alpha_beta, params.explore_z)
    return frozenset(k for k in cand.scores
                     if k == 0 and cand.scores[0] >= floor
                     or k > 0 and score_at(cand.expected(k, hi, params=params), cand.overheads[k], cand.step_rel) >= floor)


def _sampled(cand: Candidate, rng: random.Random, params: PolicyParams,
             allowed: Optional[frozenset[int]] = None) -> Optional[tuple[float, int]]:
    """Thompson sampling: (score, K) of the K that is best for an α drawn from its Beta posterior
    and run shares drawn from their Dirichlet posterior (each run length's share ~ Gamma(count)),
    among the `allowed` Ks (all when None); None when no K is allowed."""
    allowed = frozenset(cand.scores) if allowed is None else allowed & frozenset(cand.scores)
    if not allowed:
        return None
    if not cand.speculative:
        return cand.scores[0], 0
    alpha = rng.betavariate(*cand.alpha_beta)
    runs = cand.runs
    if runs:
        n = float(sum(runs))
        draws = [rng.gammavariate(g, 1.0) if g > 0 else 0.0 for g in runs]
        total = sum(draws)
        runs = tuple(d * n / total for d in draws) if total > 0 else runs
    scores = {k: score_at(cand.expected(k, alpha, runs, params), cand.overheads[k], cand.step_rel)
              for k in cand.scores if k in allowed}
    k = best_k(scores, params.tie_tol)
    return scores[k], k


def _pick(options: list[tuple[Candidate, int, float]], tie_tol: float) -> tuple[Candidate, int, float]:
    """The best (candidate, K, score). Scores within tie_tol of the best are equal; among them plain
    decoding goes to the pool with the cheapest proposer; then pools with their own hardware take
    the less loaded one (spreading adds capacity) while pools that share hardware take the busier
    one (another engine on the same cores adds no capacity, and one batch verifies cheaper than
    two); then by name (deterministic)."""
    top = max(s for _, _, s in options)

    def order(o: tuple[Candidate, int, float]) -> tuple:
        c, k, s = o
        load = -c.pool.batch_per_replica if c.pool.hardware_group is not None else c.pool.batch_per_replica
        return (c.pool.proposer_rank if k == 0 else 0, load, -s, c.pool.name)

    return min((o for o in options if o[2] >= top * (1.0 - tie_tol)), key=order)


def choose_auto(
    pools: Sequence[PoolView],
    router: RouterConfig,
    workload_class: str,
    tuning: Optional[TuningView] = None,
    rng: Optional[random.Random] = None,
    params: PolicyParams = DEFAULT_PARAMS,
) -> Decision:
    """Pool, mode and K that maximise the request's expected goodput (see module doc).

    Exploits the posterior means; with probability ε (when an RNG is given, or
    `tuning.rng`) explores by Thompson sampling: every pool draws α from its posterior and the
    best sampled (pool, K) wins, so a pool whose posterior is confidently worse is almost never
    tried while an uncertain one is. K is always within 0..pool.max_k; K = 0 means mode none.
    `router` is accepted for the routing contract (its default_k is not used: priors replace it)."""
    del router
    rng = rng if rng is not None else (tuning.rng if tuning is not None else None)
    # A pool whose engine serves two drafting methods (n-gram and suffix) is two candidates, less
    # those the pool keeps out of auto's choice.
    cands = [score_pool(v, workload_class, tuning, params)
             for p in pools for v in p.by_method() if v.method not in p.auto_skips]
    chosen, k, best = _pick([(c, c.k, c.scores[c.k]) for c in cands], params.tie_tol)
    explore = False
    if rng is not None:
        trials = sum(sum(c.alpha_beta) - params.prior_trials for c in cands if c.speculative)
        if rng.random() < exploration_rate(trials, params):
            floor = best * (1.0 - params.explore_regret)
            draws = [(c, _sampled(c, rng, params, explorable_ks(c, floor, params))) for c in cands]
            # The exploiting (pool, K) is always explorable, so at least one draw is there.
            chosen, k, _ = _pick([(c, d[1], d[0]) for c, d in draws if d is not None], params.tie_tol)
            explore = True
    k = min(k, chosen.pool.max_k)
    detail = {
        "load_bucket": chosen.bucket, "pool_mode": chosen.mode, "explore": explore,
        "join_batch": round(chosen.pool.batch_per_replica + 1.0, 3),  # the engine batch it joins
        "alpha": round(chosen.alpha, 4), "draft_rate": round(chosen.draft_rate, 4),
        "cost_per_k": round(chosen.cost, 4), "cost_per_step": round(chosen.fixed_cost, 4),
        "step_overhead": round(chosen.overheads[k] if k < len(chosen.overheads) else 0.0, 4),
        "expected_tokens_per_step": round(chosen.expected(k, params=params), 4),
        "score": round(chosen.scores[k], 4),
        "scores": {(c.pool.name if c.pool.method == p.method else f"{c.pool.name}:{c.mode}"): round(c.scores[c.k], 4)
                   for p in pools for c in cands if c.pool.name == p.name},
    }
    mode = chosen.pool.method if k > 0 else SpecMode.NONE
    return Decision(pool=chosen.pool.name, mode=mode, k=k, decided_by="policy",
                    workload_class=workload_class, detail=detail)
