"""Adaptive choice of speculative mode and K: pure functions over plain data (no I/O, no clock).

Contract: `choose_auto(pools, router, workload_class, tuning, rng)` returns the `Decision` that
maximises the expected goodput of one request of `workload_class` at each pool's current load,
from the tuned state `tuning` (a `TuningView`, or None for priors only); `k_cap_table` derives a
pool's per-step `k_cap_by_batch` table from the same state. Words are those of
`cluster.speculation`; in addition:

- **alpha** (α): the chance that a drafted token is accepted given the ones before it were
  (a geometric model), in the steps that drafted anything.
- **draft rate** (p): the share of steps that drafted anything. A model drafter always drafts
  (p = 1); n-gram lookup drafts only where the text repeats (8-55% of steps per class for SmolLM2
  here) and a step without drafts costs nothing extra. Expected output tokens per step with K:
  E(α, K, p) = 1 + p·(α + ... + α^K) = 1 + p·((1 - α^(K+1)) / (1 - α) - 1).
  (Folding the draftless steps into α as rejections, as this module first did, put α for n-gram
  at 0.10-0.30 where the drafted tokens were accepted at 0.6-0.9, and the policy chose K = 1 where
  K = 4-5 was fastest.)
- **accepted runs**: drafts come in bursts (n-gram lookup copies a span whole or misses at once),
  not independently per position, and a run that K cuts short goes on in the next step. Each
  response reports its runs (`cluster.speculation.accepted_runs`: [L] = runs of L tokens, a
  property of the text and the proposer, not of K), the tuning state sums them per class, and
  E_run(K) = (D + sum (L + 1)·g_L) / (D + sum g_L·ceil((L + 1) / (K + 1))) (D: draftless steps)
  is exact where the geometric E is not: it knows that K = 5 saves no step over K = 4 on a copy of
  12 tokens. E(K) blends E_run with the geometric E (the prior) by the runs' count against
  `prior_runs`. (Fitted at K = 6, the geometric model expected ~10% more
  tokens per step from K = 6 than from K = 4 for summarization, where the same prompts measured
  1.88 and 1.83, so auto paid for two more draft tokens per step that bought nothing.)
- **rejected steps**: steps that ended on a rejected draft, or drafted nothing (the tuning state
  counts both). The draftless ones (steps minus the exposure of draft position 0) are taken out
  for α: its estimate is accepted / (accepted + rejected drafting steps), the maximum-likelihood
  estimate under the geometric model truncated at the drafted length
  (`cluster.tuning.increments_from_stats` counts the trials); p's is drafting steps / steps.
- **step cost** (f, c): extra time of one step, relative to a plain step at the same load:
  step time(K) / step time(0) = 1 + f + c·K for K > 0, where c (cost per K) = verify cost (grows
  with batch size: verifying K more tokens per request is nearly free at batch 1 and not at batch
  16) + the proposer's cost per draft token, and f is the proposer's fixed cost of a step that
  drafts at all (a model drafter's extra forward pass and its bookkeeping: here the distilled
  EAGLE head costs 0.32 of a plain step per step and 0.02 per token, n-gram lookup nothing). The
  prior is the pool's `prior_draft_cost` (measured on its hardware) or a built-in table. Measured
  decode seconds per step of a mode against plain decoding in the same load bucket fit both
  terms apart (regression of step time on K over the requests) when K varied, else scale the
  prior's f + c·K; blended with the prior by step counts. (With f = 0 for n-gram, the overhead
  read at the mean K charged 0.087 per draft token at 4 streams, where a batch that drafts at all
  pays ~0.2 of a step and a token ~0.02 more: auto chose K = 1-2 and lost to a static K = 4, r8.)
  (A linear 1 + c·K with a GPU-like c = 0.05 for EAGLE let K = 1 look 10% faster than plain
  decoding for classes the head drafts at α ≈ 0.2, where it measured 0.85x.)
  The line is the prior of a **step time per K**: every request adds its steps and decode time to
  its K's counters (`s{K}` / `t{K}`), and where a K has enough steps its measured overhead (each
  class against its own plain steps) replaces the line by step counts (`step_overheads`). The
  cost is not linear here: n-gram steps at K = 6 took ~5% more than at K = 4, and at K = 1 ~6%
  more than plain ones, in both r11 and r12, which the line fitted through auto's traffic read
  as 0.004 per draft token (auto chose K = 6 for half its requests, ~1.5% per step dearer than
  `ngram:4`).
- **score** of (pool, K): expected output tokens per unit of plain-step time at batch 1,
  E(K) / (step_rel(batch) · (1 + overhead(K))), overhead(K) = f + c·K or its measured value at K
  — proportional to the request's tokens per second.
- **load bucket**: the batch the request joins (`PoolView.load_batch + 1`: the pool's batch per
  replica, or the whole hardware group's load when pools share hardware) bucketed as
  1, 2-3, 4-7, 8-15, 16+. A request is decided in the bucket of its admission; its statistics are
  recorded in the bucket of the mean load it met over its life (`cluster.routing.LoadMeter`).
- **joining step time**: pools of one hardware group are engines time-sharing the same cores; a
  request joining an idle one while another is busy meets both engines' steps
  (`joining_step_rel`), so traffic stays on the busy engine unless the other is far better.

α, p and the runs are learned per (mode, workload class) from every load bucket's traffic (acceptance
depends on the text and the drafter, not on the batch); cost per K and step time per bucket. Cold
start uses priors (p = 1 until steps say otherwise): the pool's measured `prior_alpha` when
configured, else a Spec-Bench-like table (n-gram α
per class; at batch 16 speculation costs throughput, 63.8 vs 70.1 tok/s here), and converges
from live traffic as counts outweigh the prior's pseudo-counts. Exploration: with probability ε
(shrinking with data) every pool draws α from its Beta posterior and its run shares from their
Dirichlet posterior, and the best sampled (pool, K) wins (Thompson sampling), so a confidently
worse pool is almost never tried; the draw is bounded by its regret: only a (pool, K) whose score at
an optimistic α (2 sigma up) comes within 5% of the exploiting choice may be drawn, so a draw never
buys a request plain decoding (which teaches nothing about α) where speculation is known to pay;
counts are capped so the posterior never freezes. Hysteresis: the incumbent K of a (mode, class, bucket) is kept
unless another K beats it by a margin that shrinks with the class's data (5% cold, 2% at 5,000
trials). Ties (within `tie_tol`) go to the cheapest proposer for K = 0, then to the less loaded
pool, or, for pools that share hardware, to the busier one.
"""

from __future__ import annotations

import bisect
import math
import random
from dataclasses import dataclass, field
from typing import Mapping, Optional

from cluster.config import RouterConfig
from cluster.speculation import WORKLOAD_CLASSES, SpecMode

MAX_K = 16  # the largest K any pool may have (PoolConfig.max_k bound)

# (min batch size, bucket name); a bucket holds batch sizes from its minimum up to the next one's.
LOAD_BUCKETS: tuple[tuple[int, str], ...] = ((1, "1"), (2, "2-3"), (4, "4-7"), (8, "8-15"), (16, "16+"))
BUCKET_NAMES = tuple(name for _, name in LOAD_BUCKETS)
BUCKET_BATCH = {"1": 1.0, "2-3": 2.5, "4-7": 5.5, "8-15": 11.5, "16+": 24.0}  # representative batch

# Prior α (Spec-Bench-like): prompt lookup is strong where the output copies the input
# (summarization, RAG, code edits, extraction) and near useless for translation / creative text.
PRIOR_ALPHA_NGRAM = {
    "chat": 0.20, "code": 0.50, "math": 0.30, "summarization": 0.60, "rag": 0.55, "translation": 0.05,
    "qa": 0.30, "structured": 0.45, "creative": 0.05, "reasoning": 0.30, "extraction": 0.60,
}
PRIOR_ALPHA_BY_MODE = {  # learned drafters: roughly class independent
    SpecMode.DRAFT_MODEL.value: 0.55, SpecMode.EAGLE.value: 0.65, SpecMode.EAGLE3.value: 0.70,
    SpecMode.MTP.value: 0.70,
}
# Draft cost per draft token relative to one plain target step (proposer work only).
PRIOR_DRAFT_COST = {
    SpecMode.NONE.value: 0.0, SpecMode.NGRAM.value: 0.01, SpecMode.SUFFIX.value: 0.02,
    SpecMode.DRAFT_MODEL.value: 0.15, SpecMode.EAGLE.value: 0.05, SpecMode.EAGLE3.value: 0.06,
    SpecMode.MTP.value: 0.05,
}
# Fixed draft cost of a step that drafts (any K), relative to one plain target step: a model
# drafter's extra pass over the accepted tokens and its sampling. GPU-like defaults; a pool's
# measured `prior_draft_cost` replaces both tables (CPU here: EAGLE 0.32 per step, 0.02 per token).
PRIOR_DRAFT_STEP_COST = {
    SpecMode.NONE.value: 0.0, SpecMode.NGRAM.value: 0.0, SpecMode.SUFFIX.value: 0.0,
    SpecMode.DRAFT_MODEL.value: 0.05, SpecMode.EAGLE.value: 0.03, SpecMode.EAGLE3.value: 0.03,
    SpecMode.MTP.value: 0.03,
}


@dataclass(frozen=True)
class PolicyParams:
    """Knobs of the policy; the defaults are the priors for the CPU box (see module doc)."""

    prior_trials: float = 100.0  # pseudo-count of the α prior (accepted + rejected steps)
    prior_draft_steps: float = 100.0  # pseudo-count of the draft-rate prior p = 1 (steps)
    prior_runs: float = 30.0  # weight, in accepted runs, of the geometric model against the measured runs
    prior_cost_steps: float = 500.0  # pseudo-count of the cost prior (steps)
    min_cost_steps: int = 200  # steps a cell needs before its step time is used at all
    min_k_variance: float = 0.5  # variance of K over steps needed to fit f and c apart (step_cost)
    max_effective_trials: float = 5000.0  # counts are scaled down to this, so the posterior never freezes
    # verify cost per draft token = verify_cost_b1 + verify_cost_per_batch * (batch - 1), at most 1.
    # Calibrated so that n-gram K=3 at α≈0.3 loses ~9% at batch 16 (63.8 vs 70.1 tok/s).
    verify_cost_b1: float = 0.03
    verify_cost_per_batch: float = 0.0104
    step_time_per_batch: float = 0.08  # plain step time grows ~2.2x from batch 1 to 16 on this CPU
    margin: float = 0.05  # a new K must beat the incumbent's score by this fraction with no data, ...
    margin_min: float = 0.015  # ... shrinking towards this as the class's trials grow (hysteresis_margin)
    tie_tol: float = 0.01  # scores within this fraction count as equal; the smaller K wins
    eps_max: float = 0.20  # exploration probability with no data
    eps_min: float = 0.02  # ... and with plenty
    eps_scale_trials: float = 2000.0  # ε halves (towards eps_min) after this many trials
    # An exploration draw may only take a (pool, K) that could plausibly score within explore_regret
    # of the exploiting choice: its score at the upper explore_z-sigma α (`explorable_ks`).
    explore_regret: float = 0.05
    explore_z: float = 2.0


DEFAULT_PARAMS = PolicyParams()


@dataclass(frozen=True)
class CellStats:
    """Sums over the requests of one tuning cell (model, mode, workload class, load bucket)."""

    requests: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    rejected_steps: int = 0  # steps that ended on a rejected draft or drafted nothing
    k_steps: int = 0  # sum of K * steps (mean K = k_steps / steps)
    kk_steps: int = 0  # sum of K^2 * steps   } over requests: the regression of step time on K
    k_decode_s: float = 0.0  # sum of K * decode_s }
    tokens: int = 0  # output tokens
    decode_s: float = 0.0  # request time after the first token
    accepted_at: tuple[int, ...] = ()  # [i] = steps in which draft position i was accepted
    exposed_at: tuple[int, ...] = ()  # [i] = steps in which draft position i was drafted
    runs: tuple[int, ...] = ()  # [L] = accepted runs of L tokens (cluster.speculation.accepted_runs)
    steps_at_k: tuple[int, ...] = ()  # [K] = steps of the requests that ran at K } the measured
    decode_s_at_k: tuple[float, ...] = ()  # [K] = their decode seconds         } step time per K
    updated_unix_s: float = 0.0

    @property
    def acceptance_length(self) -> float:
        return 1.0 + (self.accepted / self.steps if self.steps else 0.0)

    @property
    def drafting_steps(self) -> int:
        """Steps that drafted anything: the exposure of draft position 0 (all steps when unrecorded)."""
        return min(self.exposed_at[0], self.steps) if self.exposed_at else self.steps

    @property
    def rejected_drafting_steps(self) -> int:
        """Rejected steps among those that drafted (rejected_steps also counts the draftless ones)."""
        return max(self.rejected_steps - (self.steps - self.drafting_steps), 0)

    @property
    def alpha(self) -> Optional[float]:
        """Measured α: acceptance of a drafted token given the earlier ones, in drafting steps."""
        trials = self.accepted + self.rejected_drafting_steps
        return self.accepted / trials if trials else None

    @property
    def draft_rate(self) -> Optional[float]:
        """Measured p: the share of steps that drafted anything."""
        return self.drafting_steps / self.steps if self.steps else None

    @property
    def tokens_per_s(self) -> Optional[float]:
        return self.tokens / self.decode_s if self.decode_s > 0 else None

    @property
    def step_s(self) -> Optional[float]:
        return self.decode_s / self.steps if self.steps else None

    @property
    def mean_k(self) -> float:
        return self.k_steps / self.steps if self.steps else 0.0

    @property
    def per_position_acceptance(self) -> list[Optional[float]]:
        """[i] = share of the steps that drafted position i in which drafts 0..i were all accepted."""
        return [a / e if e else None for a, e in zip(self.accepted_at, self.exposed_at)]

    def __add__(self, other: "CellStats") -> "CellStats":
        n = max(len(self.accepted_at), len(other.accepted_at), len(self.exposed_at), len(other.exposed_at))
        return CellStats(
            requests=self.requests + other.requests, steps=self.steps + other.steps,
            drafted=self.drafted + other.drafted, accepted=self.accepted + other.accepted,
            rejected_steps=self.rejected_steps + other.rejected_steps, k_steps=self.k_steps + other.k_steps,
            kk_steps=self.kk_steps + other.kk_steps, k_decode_s=self.k_decode_s + other.k_decode_s,
            tokens=self.tokens + other.tokens, decode_s=self.decode_s + other.decode_s,
            accepted_at=_add_counts(self.accepted_at, other.accepted_at, n),
            exposed_at=_add_counts(self.exposed_at, other.exposed_at, n),
            runs=_add_counts(self.runs, other.runs),
            steps_at_k=_add_counts(self.steps_at_k, other.steps_at_k),
            decode_s_at_k=_add_counts(self.decode_s_at_k, other.decode_s_at_k),
            updated_unix_s=max(self.updated_unix_s, other.updated_unix_s),
        )

    def step_s_at(self, k: int) -> Optional[float]:
        """Mean decode seconds per step of the requests that ran at K (None without steps there)."""
        if 0 <= k < len(self.steps_at_k) and self.steps_at_k[k] > 0 and k < len(self.decode_s_at_k):
            return self.decode_s_at_k[k] / self.steps_at_k[k]
        return None

    @property
    def draftless_steps(self) -> int:
        return self.steps - self.drafting_steps


def _add_counts(a: tuple, b: tuple, width: int = 0) -> tuple:
    """Element-wise sum, the shorter padded with zeros, at least `width` long."""
    n = max(len(a), len(b), width)
    return tuple(x + y for x, y in zip(tuple(a) + (0,) * (n - len(a)), tuple(b) + (0,) * (n - len(b))))


CellKey = tuple[str, str, str]  # (mode, workload class, load bucket)
_ZERO = CellStats()


@dataclass(frozen=True)
class TuningView:
    """What the policy knows of one model: validated cells and incumbent K per cell.

    `rng` is the router replica's seeded exploration RNG, carried with the view so that `route`
    needs no extra argument; None disables exploration (pure exploitation, deterministic)."""

    model: str
    cells: Mapping[CellKey, CellStats] = field(default_factory=dict)
    chosen_k: Mapping[CellKey, int] = field(default_factory=dict)
    fetched_unix_s: float = 0.0
    rng: Optional[random.Random] = field(default=None, compare=False)
    # (mode, bucket) -> sum over classes, (mode, class) -> sum over buckets; computed once from
    # `cells` (kept by dataclasses.replace).
    by_mode_bucket: Optional[Mapping[tuple[str, str], CellStats]] = field(default=None, compare=False, repr=False)
    by_mode_class: Optional[Mapping[tuple[str, str], CellStats]] = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.by_mode_bucket is None or self.by_mode_class is None:
            buckets: dict[tuple[str, str], CellStats] = {}
            classes: dict[tuple[str, str], CellStats] = {}
            for (mode, wclass, bucket), cell in self.cells.items():
                buckets[(mode, bucket)] = buckets.get((mode, bucket), CellStats()) + cell
                classes[(mode, wclass)] = classes.get((mode, wclass), CellStats()) + cell
            object.__setattr__(self, "by_mode_bucket", buckets)
            object.__setattr__(self, "by_mode_class", classes)

    def cell(self, mode: str, workload_class: str, bucket: str) -> CellStats:
        return self.cells.get((mode, workload_class, bucket), _ZERO)

    def merged(self, mode: str, bucket: str) -> CellStats:
        """The cells of `mode` at `bucket` summed over workload classes."""
        return self.by_mode_bucket.get((mode, bucket), _ZERO)

    def class_cell(self, mode: str, workload_class: str) -> CellStats:
        """The cells of `mode` for `workload_class` summed over load buckets: acceptance depends on
        what is drafted and the text, not on the batch, so every bucket learns from all traffic."""
        return self.by_mode_class.get((mode, workload_class), _ZERO)


# -- the model ------------------------------------------------------------------------------------

def load_bucket(batch_size: float) -> str:
    """Bucket name of a batch size (sizes below 1 count as 1).

    >>> [load_bucket(b) for b in (0, 1, 3, 4, 15.5, 16, 500)]
    ['1', '1', '2-3', '4-7', '8-15', '16+', '16+']
    """
    starts = [start for start, _ in LOAD_BUCKETS]
    return LOAD_BUCKETS[max(bisect.bisect_right(starts, batch_size) - 1, 0)][1]


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


def prior_step_cost(mode: str, batch: float, params: PolicyParams = DEFAULT_PARAMS,
                    draft_cost: Optional[tuple[float, float]] = None) -> tuple[float, float]:
    """Prior (f, c) of `mode` at `batch`: the proposer's fixed cost per drafting step, and verify
    cost per draft token at this batch + the proposer's cost per draft token. `draft_cost` is the
    pool's measured (per step, per token) prior (`PoolConfig.prior_draft_cost`), else built-in.

    >>> prior_step_cost("eagle", 1, draft_cost=(0.32, 0.02))
    (0.32, 0.05)
    """
    verify = min(params.verify_cost_b1 + params.verify_cost_per_batch * max(batch - 1.0, 0.0), 1.0)
    if mode == SpecMode.NONE.value:
        return 0.0, 0.0
    if draft_cost is not None:
        fixed, per_token = draft_cost
    else:
        fixed, per_token = PRIOR_DRAFT_STEP_COST.get(mode, 0.05), PRIOR_DRAFT_COST.get(mode, 0.1)
    return float(fixed), round(verify + float(per_token), 10)


def prior_cost_per_k(mode: str, batch: float, params: PolicyParams = DEFAULT_PARAMS) -> float:
    """Prior c(mode, batch) = verify cost per draft token at this batch + the proposer's draft cost."""
    return prior_step_cost(mode, batch, params)[1]


def _blend(measured: Optional[float], n: float, prior: float, n_prior: float) -> float:
    return prior if measured is None or n <= 0 else (n * measured + n_prior * prior) / (n + n_prior)


def alpha_posterior(cell: CellStats, alpha_prior: float, params: PolicyParams = DEFAULT_PARAMS) -> tuple[float, float]:
    """Beta(a, b) posterior of α: prior pseudo-counts plus accepted / rejected drafting steps,
    scaled down to at most `max_effective_trials` so that old traffic does not freeze the estimate."""
    s, f = float(cell.accepted), float(cell.rejected_drafting_steps)
    if s + f > params.max_effective_trials:
        scale = params.max_effective_trials / (s + f)
        s, f = s * scale, f * scale
    a0 = min(max(alpha_prior, 0.001), 0.999)
    return params.prior_trials * a0 + s, params.prior_trials * (1.0 - a0) + f


def draft_rate(cell: CellStats, params: PolicyParams = DEFAULT_PARAMS) -> float:
    """Posterior mean of p: drafting steps over steps, with the prior p = 1 worth prior_draft_steps
    steps (a cell without data drafts every step, as a model drafter does).

    >>> draft_rate(CellStats(steps=900, exposed_at=(180,)))
    0.28
    """
    n, d = float(cell.steps), float(cell.drafting_steps)
    if n > params.max_effective_trials:
        d, n = d * params.max_effective_trials / n, params.max_effective_trials
    return (d + params.prior_draft_steps) / (n + params.prior_draft_steps)


def class_model(view: Optional[TuningView], mode: str, workload_class: str, priors,
                params: PolicyParams = DEFAULT_PARAMS) -> tuple[float, tuple[float, float], float]:
    """(α posterior mean, its Beta (a, b), p) of `mode` for `workload_class`, from the class's cells
    over every load bucket (α and p depend on the text and the drafter, not on the batch)."""
    cell = view.class_cell(mode, workload_class) if view is not None else _ZERO
    a, b = alpha_posterior(cell, prior_alpha(mode, workload_class, priors), params)
    return a / (a + b), (a, b), draft_rate(cell, params)


def step_cost(view: Optional[TuningView], mode: str, bucket: str, params: PolicyParams = DEFAULT_PARAMS,
              draft_cost: Optional[tuple[float, float]] = None) -> tuple[float, float]:
    """(f, c) for `mode` at `bucket`, from step time / plain step time - 1 in the same bucket (all
    classes pooled). When the requests ran at K that differ enough (variance of K over steps at
    least `min_k_variance`), f and c are the intercept and slope of the steps-weighted regression of
    step time on K, each blended with its prior by step counts. Otherwise the overhead at the cells'
    mean K scales the prior's f + c·K (one mean K cannot separate the fixed and the per-token part,
    so the prior's shape is kept), the scale blended with 1 by step counts.

    >>> v = TuningView("m", {("eagle", "chat", "1"): CellStats(steps=10**6, k_steps=10**6, decode_s=1.5e5),
    ...                       ("none", "chat", "1"): CellStats(steps=10**6, decode_s=1e5)})
    >>> [round(x, 3) for x in step_cost(v, "eagle", "1", draft_cost=(0.2, 0.05))]  # prior 0.2 + 0.08 at K = 1
    [0.357, 0.143]

    Measured here (4 streams): n-gram steps at K = 4 took 1.294 plain steps and at mean K 1.86
    1.247, i.e. f = 0.21 and c = 0.022, where the overhead at the cells' mean K alone (f = 0) read
    c = 0.087 per token and made every K above 2 look too dear. Two groups at K = 1 and 4 of that
    shape:

    >>> k1 = CellStats(steps=10**5, k_steps=10**5, kk_steps=10**5, decode_s=123.0, k_decode_s=123.0)
    >>> k4 = CellStats(steps=10**5, k_steps=4 * 10**5, kk_steps=16 * 10**5, decode_s=129.0, k_decode_s=516.0)
    >>> v = TuningView("m", {("ngram", "chat", "4-7"): k1, ("ngram", "code", "4-7"): k4,
    ...                       ("none", "chat", "4-7"): CellStats(steps=10**6, decode_s=1000.0)})
    >>> [round(x, 3) for x in step_cost(v, "ngram", "4-7")]
    [0.209, 0.02]
    """
    fixed, per_k = prior_step_cost(mode, BUCKET_BATCH[bucket], params, draft_cost)
    if view is None or mode == SpecMode.NONE.value:
        return fixed, per_k
    spec, plain = view.merged(mode, bucket), view.merged(SpecMode.NONE.value, bucket)
    n = min(spec.steps, plain.steps)
    if n < params.min_cost_steps or spec.mean_k < 0.5 or not plain.step_s:
        return fixed, per_k
    fit = _cost_regression(spec, plain.step_s, params)
    if fit is not None:
        return (_blend(fit[0], n, fixed, params.prior_cost_steps), _blend(fit[1], n, per_k, params.prior_cost_steps))
    at_k = fixed + per_k * spec.mean_k
    if at_k <= 0:
        return fixed, per_k
    measured = min(max(spec.step_s / plain.step_s - 1.0, 0.0), 2.0 * spec.mean_k + 2.0 * fixed)
    scale = _blend(measured / at_k, n, 1.0, params.prior_cost_steps)
    return fixed * scale, per_k * scale


def _cost_regression(spec: CellStats, plain_step_s: float, params: PolicyParams) -> Optional[tuple[float, float]]:
    """(f, c) from the steps-weighted least squares of per-step time on K over the requests summed
    in `spec` (relative to the plain step), or None when K did not vary enough to separate them.
    A negative intercept or slope is clamped to 0 and the other term refitted through the mean."""
    s = float(spec.steps)
    if s <= 0 or not spec.kk_steps:
        return None
    mean_k, mean_t = spec.k_steps / s, spec.decode_s / s
    var = spec.kk_steps / s - mean_k ** 2
    if var < params.min_k_variance or mean_k <= 0:
        return None
    slope = (spec.k_decode_s / s - mean_k * mean_t) / var
    fixed, per_k = (mean_t - slope * mean_k) / plain_step_s - 1.0, slope / plain_step_s
    overhead = mean_t / plain_step_s - 1.0
    if fixed < 0:
        fixed, per_k = 0.0, max(overhead, 0.0) / mean_k
    if per_k < 0:
        fixed, per_k = max(overhead, 0.0), 0.0
    return min(fixed, 2.0), min(per_k, 1.0)


def cost_per_k(view: Optional[TuningView], mode: str, bucket: str, params: PolicyParams = DEFAULT_PARAMS,
               draft_cost: Optional[tuple[float, float]] = None) -> float:
    """c (cost per draft token) of `step_cost`."""
    return step_cost(view, mode, bucket, params, draft_cost)[1]


def measured_overheads(view: Optional[TuningView], mode: str, bucket: str,
                       params: PolicyParams = DEFAULT_PARAMS) -> dict[int, tuple[float, int]]:
    """{K: (overhead, steps)}: the measured extra time of a step of `mode` at K in `bucket`, relative
    to a plain step, for every K > 0 with at least `min_cost_steps` steps. Each class's steps at K
    are compared with that class's own plain steps in the bucket (else the bucket's plain steps,
    all classes pooled), and the ratios averaged by steps: classes decode at different lengths and
    the policy's K follows the class, so one pooled mean would charge K for the class's text.
    When a K reads faster than plain steps (impossible but for noise or drift in the plain steps), the
    cheapest K is the baseline instead, so the Ks keep their differences.

    Two classes whose plain steps differ by 20%, each drafted at its own K and 10% dearer there:

    >>> def c(k, n, s):
    ...     return CellStats(steps=n, decode_s=n * s, steps_at_k=(0,) * k + (n,), decode_s_at_k=(0.0,) * k + (n * s,))
    >>> v = TuningView("m", {("none", "chat", "1"): c(0, 1000, 0.10), ("none", "rag", "1"): c(0, 1000, 0.12),
    ...                       ("ngram", "chat", "1"): c(6, 1000, 0.11), ("ngram", "rag", "1"): c(3, 1000, 0.132)})
    >>> {k: (round(o, 3), n) for k, (o, n) in sorted(measured_overheads(v, "ngram", "1").items())}
    {3: (0.1, 1000), 6: (0.1, 1000)}
    """
    if view is None or mode == SpecMode.NONE.value:
        return {}
    pooled = view.merged(SpecMode.NONE.value, bucket).step_s
    sums: dict[int, list[float]] = {}  # K -> [sum of steps * ratio, steps]
    for (m, wclass, b), cell in view.cells.items():
        if m != mode or b != bucket or not cell.steps_at_k:
            continue
        plain = view.cell(SpecMode.NONE.value, wclass, bucket)
        base = plain.step_s if plain.steps >= params.min_cost_steps else pooled
        if not base:
            continue
        for k in range(1, len(cell.steps_at_k)):
            t = cell.step_s_at(k)
            if t is not None:
                acc = sums.setdefault(k, [0.0, 0])
                acc[0] += cell.steps_at_k[k] * (t / base)
                acc[1] += cell.steps_at_k[k]
    ratios = {k: (r / n, int(n)) for k, (r, n) in sums.items() if n >= params.min_cost_steps}
    # A drafting step does more work than a plain one: when some K reads cheaper than plain steps, the
    # plain steps are what is off (measured at other times, under other load), so the cheapest K
    # becomes the baseline and the differences between the Ks survive, instead of every K below
    # the baseline reading 0 (plain steps measured while the machine was loaded once put K = 1..6
    # all at 0, and K = 6's extra 5% went unseen).
    floor = min([1.0] + [ratio for ratio, _ in ratios.values()])
    return {k: (min(ratio / floor - 1.0, 2.0 + 0.5 * k), n) for k, (ratio, n) in ratios.items()}  # floor <= ratio


def step_overheads(view: Optional[TuningView], mode: str, bucket: str, max_k: int,
                   params: PolicyParams = DEFAULT_PARAMS,
                   draft_cost: Optional[tuple[float, float]] = None,
                   line: Optional[tuple[float, float]] = None) -> tuple[float, ...]:
    """[K] = extra time of a step at K relative to a plain step, for K = 0..max_k ([0] = 0): the
    linear f + c·K of `step_cost` (fitted over every K, or the prior) blended, at each K where
    requests ran, with that K's measured overhead (`measured_overheads`) by its steps against
    `prior_cost_steps`. The linear model cannot see a step cost that is not linear in K, and on
    this CPU it is not: in r11 and r12 n-gram steps at K = 6 took ~5% more than at K = 4 and those at
    K = 1 ~6% more than plain ones, where the fit over auto's traffic read 0.004 per draft token
    (auto chose K = 6 for half its requests and lost ~1.5% per step to `ngram:4`). `line` is the
    caller's `step_cost` of the same arguments, when it has one already.

    >>> def c(k, n, s):
    ...     return CellStats(steps=n, decode_s=n * s, steps_at_k=(0,) * k + (n,), decode_s_at_k=(0.0,) * k + (n * s,))
    >>> v = TuningView("m", {("none", "chat", "1"): c(0, 10**6, 0.100), ("ngram", "chat", "1"): c(4, 10**6, 0.100),
    ...                       ("ngram", "code", "1"): c(6, 10**6, 0.105)})
    >>> [round(x, 3) for x in step_overheads(v, "ngram", "1", 6)]  # K without steps: the prior, 0.04 per token
    [0.0, 0.04, 0.08, 0.12, 0.0, 0.2, 0.05]
    """
    fixed, per_k = line if line is not None else step_cost(view, mode, bucket, params, draft_cost)
    linear = [0.0] + [fixed + per_k * k for k in range(1, max(max_k, 0) + 1)]
    for k, (measured, n) in measured_overheads(view, mode, bucket, params).items():
        if k < len(linear):
            linear[k] = _blend(measured, float(n), linear[k], params.prior_cost_steps)
    return tuple(linear)


def _bucket_step_rel(view: Optional[TuningView], bucket: str, params: PolicyParams) -> float:
    prior = 1.0 + params.step_time_per_batch * (BUCKET_BATCH[bucket] - 1.0)
    if view is None or bucket == "1":
        return prior
    here, one = view.merged(SpecMode.NONE.value, bucket), view.merged(SpecMode.NONE.value, "1")
    n = min(here.steps, one.steps)
    if n < params.min_cost_steps or not here.step_s or not one.step_s:
        return prior
    return _blend(max(here.step_s / one.step_s, 0.1), n, prior, params.prior_cost_steps)


def step_time_rel(view: Optional[TuningView], bucket: str, params: PolicyParams = DEFAULT_PARAMS) -> float:
    """Plain step time at `bucket` relative to batch 1 (measured when both buckets have data), never
    below a smaller bucket's: a larger batch does not step faster, and noisy cells said so (1.72 at
    batch 2-3 against 1.36 at 4-7 in one measured table)."""
    order = BUCKET_NAMES.index(bucket)
    return max(_bucket_step_rel(view, b, params) for b in BUCKET_NAMES[:order + 1])


def score_at(tokens: float, overhead: float, step_rel: float = 1.0) -> float:
    """Expected tokens per unit of batch-1 plain-step time, E / (step_rel · (1 + overhead)), for a
    step whose extra time relative to a plain step is `overhead` (`step_overheads`)."""
    return tokens / (step_rel * (1.0 + max(overhead, 0.0)))


def score_tokens(tokens: float, k: int, cost: float, step_rel: float = 1.0, fixed: float = 0.0) -> float:
    """`score_at` with the linear overhead f + c·K, f (the proposer's fixed cost of a drafting step)
    paid only for K > 0."""
    return score_at(tokens, (max(fixed, 0.0) + max(cost, 0.0) * k) if k > 0 else 0.0, step_rel)


def score(alpha: float, k: int, cost: float, step_rel: float = 1.0, draft_rate: float = 1.0,
          fixed: float = 0.0) -> float:
    """`score_tokens` of the geometric E(α, K, p)."""
    return score_tokens(expected_tokens_per_step(alpha, k, draft_rate), k, cost, step_rel, fixed)


def class_runs(view: Optional[TuningView], mode: str, workload_class: str) -> tuple[tuple[int, ...], float]:
    """(accepted runs, draftless steps) of `mode` for `workload_class` over every load bucket."""
    cell = view.class_cell(mode, workload_class) if view is not None else _ZERO
    return (cell.runs, float(cell.draftless_steps)) if cell.runs else ((), 0.0)


def best_k(scores: Mapping[int, float], tie_tol: float = DEFAULT_PARAMS.tie_tol) -> int:
    """The smallest K whose score is within tie_tol of the best."""
    top = max(scores.values())
    return min(k for k, s in scores.items() if s >= top * (1.0 - tie_tol))


def hysteresis_margin(trials: float, params: PolicyParams = DEFAULT_PARAMS) -> float:
    """How much better than the incumbent K a new K must score: `margin` with no data, shrinking as
    the noise of the scores does (~ 1 / sqrt(trials)) towards `margin_min`, which stays above the
    tie tolerance so that K still does not flap between near-equal scores.

    A fixed 5% locked in whatever K a class got while its data was thin: with every K from 3 to 6
    within 5% at one stream here, the state after r14 and its load run kept math at K = 3 after
    4,098 steps said K = 4 scored 3.4% better (and summarization at 6, 3.3% below 4).

    >>> [round(hysteresis_margin(n), 3) for n in (0, 100, 1000, 5000)]
    [0.05, 0.04, 0.026, 0.02]
    """
    shrink = math.sqrt(params.prior_trials / (params.prior_trials + max(float(trials), 0.0)))
    return params.margin_min + (params.margin - params.margin_min) * shrink


def hysteresis_k(scores: Mapping[int, float], incumbent: Optional[int], params: PolicyParams = DEFAULT_PARAMS,
                 trials: float = 0.0) -> int:
    """Keep the incumbent K unless the best K beats it by more than `hysteresis_margin(trials)` (so K
    does not flap); `trials` is the evidence behind the scores (the class's observed drafting trials)."""
    best = best_k(scores, params.tie_tol)
    if incumbent is None or incumbent not in scores:
        return best
    return best if scores[best] > scores[incumbent] * (1.0 + hysteresis_margin(trials, params)) else incumbent


def exploration_rate(trials: float, params: PolicyParams = DEFAULT_PARAMS) -> float:
    """ε: eps_max with no data, halving its excess over eps_min every eps_scale_trials."""
    excess = (params.eps_max - params.eps_min) * params.eps_scale_trials / (params.eps_scale_trials + max(trials, 0.0))
    return params.eps_min + excess


# -- the choice -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Candidate:
    """One pool scored for one request."""

    pool: object  # cluster.routing.PoolView
    bucket: str
    alpha: float  # posterior mean (0 for plain pools)
    alpha_beta: tuple[float, float]
    draft_rate: float  # p, posterior mean (1 for plain pools: unused there)
    cost: float
    step_rel: float
    scores: Mapping[int, float]  # K -> score, K in 0..pool.max_k
    k: int  # chosen K after hysteresis
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


def _pool_scores(view, mode, workload_class, bucket, max_k, step_rel, priors, params, draft_cost=None):
    """(alpha, (a, b), p, (f, c), runs, overheads, {K: score}) of one cell. α, p and the runs are learned per (mode, class) over every
    load bucket; the cost per K per bucket. Memoised per view refresh: the result depends only on
    the view's cells (replaced as a whole on each refresh), so the request path pays the posterior
    and cost arithmetic once per cell and refresh, not once per request."""
    cells = view.cells if view is not None else None
    key = (mode, workload_class, bucket, max_k, step_rel, priors, draft_cost, params)
    hit = _SCORE_CACHE.get(key)
    if hit is not None and hit[0] is cells:
        return hit[1]
    alpha, (a, b), p = class_model(view, mode, workload_class, priors, params)
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


def joining_step_rel(pool, view: Optional[TuningView], params: PolicyParams = DEFAULT_PARAMS) -> float:
    """Plain step time, relative to batch 1, that a request joining `pool` meets.

    One engine: its step time at its batch with the request. Pools of one hardware group are
    separate engines time-sharing the same cores: while another engine of the group has requests,
    each step of this one waits for that engine's steps too, so the request meets the sum of both
    engines' step times, t(own batch + 1) + t(the others' batch), not the step time of one batch of
    the group's size. (Measured: at 4 streams, `auto` sending a quarter of its requests to an idle
    second pool on the same two cores read 0.71 of plain decoding in one engine.) Joining the engine
    that is already busy stays one batch, t(group + 1). Splitting is never cheaper than one batch of
    everything (the same cores do both engines' work, and a batch verifies more cheaply than two), so
    the split is at least t(group + 1): with bucketed step times, t(1) + t(15) read 4.6 plain steps
    against t(16) = 6.6 in r6 (batch 15 in the 8-15 bucket, 16 in 16+), and 37 of 256 requests at 32
    streams went to the idle EAGLE engine, 0.91 of plain decoding in one engine."""
    if pool.hardware_group is None or pool.group_load is None:
        return step_time_rel(view, load_bucket(pool.load_batch + 1.0), params)
    others = max(float(pool.group_load) - float(pool.running), 0.0)
    rel = step_time_rel(view, load_bucket(pool.batch_per_replica + 1.0), params)
    if others > 0:
        rel = max(rel + step_time_rel(view, load_bucket(others), params),
                  step_time_rel(view, load_bucket(float(pool.group_load) + 1.0), params))
    return rel


def score_pool(pool, workload_class: str, view: Optional[TuningView], params: PolicyParams = DEFAULT_PARAMS) -> Candidate:
    """Score K = 0..max_k of `pool` for one request of `workload_class` at the pool's live load."""
    bucket = load_bucket(pool.load_batch + 1.0)
    mode = pool.method.value
    step_rel = joining_step_rel(pool, view, params)
    max_k = min(max(int(pool.max_k), 0), MAX_K)
    if pool.method == SpecMode.NONE or max_k == 0:
        return Candidate(pool, bucket, 0.0, (0.0, 1.0), 1.0, 0.0, step_rel, {0: score(0.0, 0, 0.0, step_rel)}, 0)
    alpha, (a, b), p, (fixed, cost), (runs, draftless), overheads, scores = _pool_scores(
        view, mode, workload_class, bucket, max_k, step_rel, pool.prior_alpha, params, pool.prior_draft_cost)
    incumbent = view.chosen_k.get((mode, workload_class, bucket)) if view is not None else None
    trials = max(a + b - params.prior_trials, 0.0)  # observed drafting trials (capped with the posterior)
    return Candidate(pool, bucket, alpha, (a, b), p, cost, step_rel, scores, hysteresis_k(scores, incumbent, params, trials),
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
    chooses them. r20 lost its translation target to one such draw: a request decoded plainly (3.43 s
    against 1.40 s at K = 3) where n-gram drafts were accepted at α = 0.66.

    >>> from cluster.routing import PoolView
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


def _proposer_rank(c: Candidate) -> int:
    """Cost of the pool's proposer to a K = 0 request in its batches: none < lookup < model."""
    return {SpecMode.NONE: 0, SpecMode.NGRAM: 1, SpecMode.SUFFIX: 1}.get(c.pool.method, 2)


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
        return (_proposer_rank(c) if k == 0 else 0, load, -s, c.pool.name)

    return min((o for o in options if o[2] >= top * (1.0 - tie_tol)), key=order)


def choose_auto(
    pools,
    router: RouterConfig,
    workload_class: str,
    tuning: Optional[TuningView] = None,
    rng: Optional[random.Random] = None,
    params: PolicyParams = DEFAULT_PARAMS,
):
    """Pool, mode and K that maximise the request's expected goodput (see module doc).

    Exploits the posterior means with hysteresis; with probability ε (when an RNG is given, or
    `tuning.rng`) explores by Thompson sampling: every pool draws α from its posterior and the
    best sampled (pool, K) wins, so a pool whose posterior is confidently worse is almost never
    tried while an uncertain one is. K is always within 0..pool.max_k; K = 0 means mode none.
    `router` is accepted for the routing contract (its default_k is not used: priors replace it)."""
    from cluster.routing import Decision

    del router
    rng = rng if rng is not None else (tuning.rng if tuning is not None else None)
    cands = [score_pool(p, workload_class, tuning, params) for p in pools]
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
        "scores": {c.pool.name: round(c.scores[c.k], 4) for c in cands},
        "k_scores": {str(j): round(s, 4) for j, s in sorted(chosen.scores.items())},  # the chosen pool's
        # the incumbent K was kept though another K scored higher (within the hysteresis margin)
        "hysteresis": not explore and k != min(best_k(chosen.scores, params.tie_tol), chosen.pool.max_k),
    }
    mode = chosen.pool.method if k > 0 else SpecMode.NONE
    return Decision(pool=chosen.pool.name, mode=mode, k=k, decided_by="policy",
                    workload_class=workload_class, detail=detail)


# -- the per-step cap table -----------------------------------------------------------------------

def class_weights(view: Optional[TuningView], mode: str) -> dict[str, float]:
    """Traffic share of each workload class for a pool of `mode` (steps over all buckets, plain
    steps included); uniform when there is no traffic yet."""
    steps = {c: 0.0 for c in WORKLOAD_CLASSES}
    if view is not None:
        for (m, c, _), cell in view.cells.items():
            if c in steps and m in (mode, SpecMode.NONE.value):
                steps[c] += cell.steps
    total = sum(steps.values())
    if total <= 0:
        return {c: 1.0 / len(WORKLOAD_CLASSES) for c in WORKLOAD_CLASSES}
    return {c: s / total for c, s in steps.items() if s > 0}


def k_cap_table(
    mode: str, max_k: int, view: Optional[TuningView], params: PolicyParams = DEFAULT_PARAMS,
    priors: Mapping[str, float] | tuple = (), draft_cost: Optional[tuple[float, float]] = None,
) -> list[tuple[int, int]]:
    """`k_cap_by_batch` for a pool: [(min_batch_size, k_cap), ...], the format the engine reads.

    For each load bucket the cap maximises the traffic-weighted score of requests admitted at
    batch 1 (each class at its own best K there) that now run at that bucket's batch: the cap that
    a long request meeting a load spike should obey. At batch 1 the cap is the largest admitted K.
    Non-increasing with load; entries whose cap equals the previous one are dropped."""
    max_k = min(max(int(max_k), 0), MAX_K)
    if mode == SpecMode.NONE.value or max_k == 0:
        return [(1, 0)]
    weights = class_weights(view, mode)

    tokens = {}  # class -> [E(K) for K in 0..max_k]
    for c in weights:
        alpha, _, p = class_model(view, mode, c, priors, params)
        runs, draftless = class_runs(view, mode, c)
        tokens[c] = [expected_tokens(alpha, k, p, runs, draftless, params) for k in range(max_k + 1)]
    (first, idle), *loaded = LOAD_BUCKETS  # the classes are admitted at the first bucket, batch 1
    overheads = step_overheads(view, mode, idle, max_k, params, draft_cost)
    admitted = {c: best_k({k: score_at(tokens[c][k], overheads[k]) for k in range(max_k + 1)}, params.tie_tol)
                for c in weights}
    # At the bucket the classes were admitted at, each already runs at its own best K, so no cap
    # below the largest of them can do better: only tie. (Scoring caps there too, best_k's
    # smaller-wins tie-break capped every K = 6 choice to 5 at batch 1 in r13.)
    table = [(first, max(admitted.values()))]
    for start, bucket in loaded:
        overheads = step_overheads(view, mode, bucket, max_k, params, draft_cost)
        totals = {
            cap: sum(w * score_at(tokens[c][min(admitted[c], cap)], overheads[min(admitted[c], cap)])
                     for c, w in weights.items())
            for cap in range(table[-1][1] + 1)
        }
        cap = best_k(totals, params.tie_tol)
        if cap != table[-1][1]:
            table.append((start, cap))
    return table


# -- observability --------------------------------------------------------------------------------

def tuning_rows(view: TuningView, params: PolicyParams = DEFAULT_PARAMS) -> list[dict]:
    """One row per cell with data, for `specserve tuning` and GetTuning. The keys model, mode,
    workload_class, load_bucket, chosen_k, acceptance_length, acceptance_per_position,
    tokens_per_s and samples match `TuningEntry` and are never None; the rest are extras."""
    order = {b: i for i, b in enumerate(BUCKET_NAMES)}
    rows = []
    for (mode, c, bucket), cell in sorted(view.cells.items(), key=lambda kv: (kv[0][0], kv[0][1], order.get(kv[0][2], 99))):
        a, b = alpha_posterior(cell, prior_alpha(mode, c), params)
        chosen = view.chosen_k.get((mode, c, bucket))
        rows.append({
            "model": view.model, "mode": mode, "workload_class": c, "load_bucket": bucket,
            "chosen_k": chosen if chosen is not None else 0, "chosen_k_set": chosen is not None,
            "acceptance_length": round(cell.acceptance_length, 4),
            "acceptance_per_position": [round(p, 4) for p in cell.per_position_acceptance if p is not None],
            "tokens_per_s": round(cell.tokens_per_s or 0.0, 3), "samples": cell.requests,
            "steps": cell.steps, "mean_k": round(cell.mean_k, 3),
            "alpha_measured": None if cell.alpha is None else round(cell.alpha, 4),
            "alpha_posterior": round(a / (a + b), 4) if mode != SpecMode.NONE.value else None,
            "draft_rate": None if cell.draft_rate is None or mode == SpecMode.NONE.value else round(cell.draft_rate, 4),
            "step_ms": None if cell.step_s is None else round(cell.step_s * 1e3, 3),
            "step_ms_at_k": {k: round(cell.step_s_at(k) * 1e3, 2) for k in range(len(cell.steps_at_k))
                             if cell.step_s_at(k) is not None},
            "cost_per_k": round(cost_per_k(view, mode, bucket, params), 4),
            "runs": sum(cell.runs),
            "mean_run": round(sum(i * g for i, g in enumerate(cell.runs)) / sum(cell.runs), 3) if cell.runs else None,
        })
    return rows
