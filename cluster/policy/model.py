"""The acceptance model: expected output tokens per step of a mode at K for a workload class, from the priors and the tuned cells."""

from __future__ import annotations

from typing import Mapping, Optional

from cluster.policy.cells import CellStats, TuningView
from cluster.policy.params import DEFAULT_PARAMS, PRIOR_ALPHA_BY_MODE, PRIOR_ALPHA_NGRAM, PolicyParams
from cluster.speculation import SpecMode


def expected_tokens_per_step(alpha: float, k: int, draft_rate: float = 1.0) -> float:
    """E(α, K, p) = 1 + p·((1 - α^(K+1)) / (1 - α) - 1): the bonus token + accepted drafts, per step.

    >>> round(expected_tokens_per_step(0.5, 2), 3), round(expected_tokens_per_step(0.5, 2, 0.2), 3)
    (1.75, 1.15)
    """
    alpha = min(max(alpha, 0.0), 1.0)
    p = min(max(draft_rate, 0.0), 1.0)
    if k <= 0:
        return 1.0
    if alpha >= 1.0:
        return 1.0 + p * k
    return 1.0 + p * ((1.0 - alpha ** (k + 1)) / (1.0 - alpha) - 1.0)


def run_tokens_per_step(runs, draftless: float, k: int) -> float:
    """Output tokens per step with K from measured accepted runs ([L] = runs of L tokens) and the
    steps that drafted nothing: a run of L takes ceil((L + 1) / (K + 1)) steps for its L + 1 tokens
    (the bonus token included), a draftless step 1 for 1, so
    E_run(K) = (D + sum (L + 1)·g_L) / (D + sum g_L·ceil((L + 1) / (K + 1))).
    Unlike the geometric model it knows that drafts come in bursts: a run K cuts short goes on in
    the next step, so a K past the typical run saves few steps.

    >>> round(run_tokens_per_step([0, 0, 0, 0, 0, 0, 0, 0, 0, 1], 0, 4), 3)  # 10 tokens in 2 steps
    5.0
    >>> round(run_tokens_per_step([0, 0, 0, 0, 0, 0, 0, 0, 0, 1], 0, 6), 3)  # K = 6 also takes 2
    5.0
    >>> run_tokens_per_step([5, 1], 4.0, 0)
    1.0
    """
    if k <= 0:
        return 1.0
    tokens = float(draftless) + sum((length + 1) * g for length, g in enumerate(runs))
    steps = float(draftless) + sum(g * -(-(length + 1) // (k + 1)) for length, g in enumerate(runs))
    return tokens / steps if steps > 0 else 1.0


def expected_tokens(alpha: float, k: int, draft_rate: float = 1.0, runs=(), draftless: float = 0.0,
                    params: "PolicyParams" = None) -> float:
    """E(K): the geometric E(α, K, p) blended with the measured runs' E_run(K), the runs weighted by
    their count against `prior_runs` (the geometric model is the prior; with no runs it is E).

    Bursty drafts, 100 runs (60 rejected at once, 20 copies of 12 tokens) and 150 draftless steps:
    K = 5 buys nothing over K = 4 (a 12-token copy takes 3 steps with either), which the geometric
    model (α 0.77, p 0.35) cannot see:

    >>> runs = [60, 10, 5, 5] + [0] * 8 + [20]
    >>> [round(expected_tokens(0.77, k, 0.35), 3) for k in (4, 5)]
    [1.76, 1.855]
    >>> [round(expected_tokens(0.77, k, 0.35, runs, 150.0), 3) for k in (4, 5)]
    [1.799, 1.821]
    """
    params = params if params is not None else DEFAULT_PARAMS
    geometric = expected_tokens_per_step(alpha, k, draft_rate)
    n = float(sum(runs))
    if k <= 0 or n <= 0:
        return geometric
    w = n / (n + params.prior_runs)
    return w * run_tokens_per_step(runs, draftless, k) + (1.0 - w) * geometric


def prior_alpha(mode: str, workload_class: str, measured: Mapping[str, float] | tuple = ()) -> float:
    """Cold-start α of `mode` for `workload_class`: the pool's measured prior (`PoolConfig.prior_alpha`,
    by class or `*`) when it has one, else the built-in Spec-Bench-like table."""
    measured = dict(measured)
    if workload_class in measured or "*" in measured:
        return float(measured.get(workload_class, measured.get("*")))
    if mode in (SpecMode.NGRAM.value, SpecMode.SUFFIX.value):
        a = PRIOR_ALPHA_NGRAM.get(workload_class, 0.2)
        return min(a + 0.05, 0.95) if mode == SpecMode.SUFFIX.value else a
    return PRIOR_ALPHA_BY_MODE.get(mode, 0.0)


def prior_draft_rate(workload_class: str, measured: Mapping[str, float] | tuple = ()) -> float:
    """Cold-start p of a mode for `workload_class`: the pool's measured share of drafting steps
    (`PoolConfig.prior_draft_rate`, by class or `*`), else 1 (a model drafter drafts every step).
    A lookup method without one reads as drafting every step, which its measured rate never beats:
    a method with evidence then loses to one with only a prior.

    >>> prior_draft_rate("code", {"code": 0.7, "*": 0.4}), prior_draft_rate("qa", {"*": 0.4}), prior_draft_rate("qa")
    (0.7, 0.4, 1.0)
    """
    measured = dict(measured)
    return float(measured.get(workload_class, measured.get("*", 1.0)))


def alpha_posterior(cell: CellStats, alpha_prior: float, params: PolicyParams = DEFAULT_PARAMS) -> tuple[float, float]:
    """Beta(a, b) posterior of α: prior pseudo-counts plus accepted / rejected drafting steps,
    scaled down to at most `max_effective_trials` so that old traffic does not freeze the estimate."""
    s, f = float(cell.accepted), float(cell.rejected_drafting_steps)
    if s + f > params.max_effective_trials:
        scale = params.max_effective_trials / (s + f)
        s, f = s * scale, f * scale
    a0 = min(max(alpha_prior, 0.001), 0.999)
    return params.prior_trials * a0 + s, params.prior_trials * (1.0 - a0) + f


def draft_rate(cell: CellStats, params: PolicyParams = DEFAULT_PARAMS, prior: float = 1.0) -> float:
    """Posterior mean of p: drafting steps over steps, with the prior p (1 unless measured:
    `prior_draft_rate`) worth prior_draft_steps steps.

    >>> draft_rate(CellStats(steps=900, exposed_at=(180,))), draft_rate(CellStats(), prior=0.6)
    (0.28, 0.6)
    """
    n, d = float(cell.steps), float(cell.drafting_steps)
    if n > params.max_effective_trials:
        d, n = d * params.max_effective_trials / n, params.max_effective_trials
    return (d + params.prior_draft_steps * min(max(prior, 0.0), 1.0)) / (n + params.prior_draft_steps)


def class_model(view: Optional[TuningView], mode: str, workload_class: str, priors,
                params: PolicyParams = DEFAULT_PARAMS, rate_priors=()) -> tuple[float, tuple[float, float], float]:
    """(α posterior mean, its Beta (a, b), p) of `mode` for `workload_class`, from the class's cells
    over every load bucket (α and p depend on the text and the drafter, not on the batch)."""
    cell = view.class_cell(mode, workload_class) if view is not None else CellStats()
    a, b = alpha_posterior(cell, prior_alpha(mode, workload_class, priors), params)
    return a / (a + b), (a, b), draft_rate(cell, params, prior_draft_rate(workload_class, rate_priors))


def class_runs(view: Optional[TuningView], mode: str, workload_class: str) -> tuple[tuple[int, ...], float]:
    """(accepted runs, draftless steps) of `mode` for `workload_class` over every load bucket."""
    cell = view.class_cell(mode, workload_class) if view is not None else CellStats()
    return (cell.runs, float(cell.draftless_steps)) if cell.runs else ((), 0.0)
