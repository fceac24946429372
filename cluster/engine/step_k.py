"""Per-step K: at every engine step, the drafts that raise the whole batch's goodput, per request.

Contract: `choose_step_ks(requests, cost)` returns each request's K for the next step from the
batch as it is now; `StepCost` learns the engine's step time from its own steps; `next_acceptance`
moves one request's acceptance after a step. Pure functions over plain data (no vLLM, no clock):
`cluster.engine.vllm_scheduler` wires them into vLLM. Words are those of `cluster.speculation`, plus:

- **step time** T(B, D, s) = a + c·B + b·D + f·s seconds: B requests in the step, D draft tokens
  it verifies (sum of K_i), s = 1 when any request drafts. a is the fixed cost of a step, c the
  cost of one more request (its KV reads, sampling), b of one more draft token verified in a
  request already there (cheap: it shares the request's KV reads), f of a step that verifies
  drafts at all (rejection sampling). Fitted online by least squares over the engine's decode
  steps, with exponential forgetting so it follows the load, anchored by weak prior
  pseudo-steps so it is always defined (`StepCost`).
- **acceptance** α_i of request i: the chance its next draft is accepted given the ones before
  it were (geometric), so draft j (1-based) is accepted with probability α_i^j and adds that many
  expected tokens. α_i starts at its class's α (learned by the router across requests, sent with
  the request) and follows the request's own recent steps (`next_acceptance`): a request copying
  a span drafts deep while it copies, a request writing new text stops paying for drafts.
- **batch goodput** R = (B + Σ_i Σ_{j ≤ K_i} α_i^j) / T(B, Σ K_i, any K_i > 0): expected output
  tokens per second of the whole step. A draft that raises one request's speed but slows the
  step for everyone is rejected: the batch, not the request, is the unit.

`choose_step_ks` maximises R exactly. R is a ratio, so Dinkelbach's iteration solves it: given a
rate R, the best set of drafts takes every draft whose value α_i^j exceeds R·b (its time at that
rate); recompute R over the set; repeat until the set is stable (R rises each round, a handful of
rounds). Each request's values fall with j, so its K is a prefix: K_i = the count of its values
above R·b, bounded by its ceiling and by the drafts the proposer actually found. The drafting set
is then compared with plain decoding (which does not pay f). At batch 1 on a GPU-like cost (b, f
small against a) every likely draft pays; at a large batch on a CPU (c·B dominates, b not small)
only drafts that are almost sure to be accepted do, which is what a K-by-batch-size table
approximates for all requests at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

# Parameters (a, c, b, f) of the step-time line, relative to a, used until steps are measured:
# one more request costs 0.5 of the fixed step cost, a draft token 0.1, a drafting step 0.1.
# Weak on purpose: 8 pseudo-steps against a forgetting window of ~400 real ones.
PRIOR_RELATIVE_COST = (1.0, 0.5, 0.1, 0.1)
PRIOR_WEIGHT = 8.0
FORGET = 0.9975  # per measured step: a window of ~400 steps
OUTLIER, OUTLIER_AFTER_STEPS = 4.0, 30  # a step 4x its predicted time is not a decode step's cost
ACCEPT_PRIOR_WEIGHT = 3.0  # trials the class's α counts as in a request's own acceptance
ACCEPT_OPTIMISM = 1.0  # standard deviations above the posterior mean at batch 1 (`batch_optimism`)
ACCEPT_FORGET = 0.6  # per drafting step: a request's acceptance follows its last ~2-3 steps


@dataclass(frozen=True)
class RequestDrafts:
    """One request of the next step, as the K choice sees it."""

    alpha: float  # α_i: acceptance of its next draft given the ones before it were
    drafts: int  # drafts the proposer found for it (0: it cannot draft this step)
    ceiling: int  # largest K it may have (the caller's or the pool's)
    fixed: bool = False  # its K is the caller's and not for the policy to change (K = min(ceiling, drafts))


@dataclass(frozen=True)
class StepCostLine:
    """T(B, D, s) = a + c·B + b·D + f·s seconds (see module doc)."""

    a: float
    c: float
    b: float
    f: float

    def time_s(self, requests: int, drafts: int) -> float:
        return self.a + self.c * requests + self.b * drafts + (self.f if drafts > 0 else 0.0)


def batch_rate(alphas: Sequence[float], ks: Sequence[int], line: StepCostLine) -> float:
    """Expected output tokens per second of a step where request i verifies ks[i] drafts.

    >>> line = StepCostLine(a=1.0, c=0.0, b=0.1, f=0.0)
    >>> round(batch_rate([0.5], [0], line), 4), round(batch_rate([0.5], [2], line), 4)
    (1.0, 1.4583)
    """
    tokens = sum(1.0 + _tokens(a, k) for a, k in zip(alphas, ks))
    return tokens / max(line.time_s(len(alphas), sum(ks)), 1e-12)


def _tokens(alpha: float, k: int) -> float:
    """Expected accepted drafts out of k at acceptance α: α + α^2 + ... + α^k."""
    alpha = min(max(alpha, 0.0), 1.0)
    if alpha >= 1.0:
        return float(k)
    return alpha * (1.0 - alpha ** k) / (1.0 - alpha)


def choose_step_ks(requests: Sequence[RequestDrafts], line: StepCostLine, max_rounds: int = 16) -> list[int]:
    """Each request's K for the next step: the drafts that maximise the batch's goodput.

    Fixed requests keep min(ceiling, drafts) and count in the step's cost.

    >>> line = StepCostLine(a=1.0, c=0.5, b=0.1, f=0.1)  # a CPU-like step
    >>> choose_step_ks([RequestDrafts(0.8, 6, 6)], line)  # one request: deep drafts pay
    [6]
    >>> choose_step_ks([RequestDrafts(0.2, 6, 6)], line)  # one request at low acceptance: one draft
    [1]
    >>> dear = StepCostLine(a=1.0, c=0.5, b=0.3, f=0.1)  # drafts dearer against a request
    >>> batch = [RequestDrafts(0.5, 6, 6)] * 15 + [RequestDrafts(0.95, 6, 6)]
    >>> ks = choose_step_ks(batch, dear); ks[0], ks[-1]  # 16 requests: only the near-sure copier drafts
    (0, 6)
    >>> choose_step_ks([RequestDrafts(0.5, 6, 6)], dear)  # alone, the same request drafts
    [2]
    >>> choose_step_ks([RequestDrafts(0.9, 2, 6), RequestDrafts(0.9, 0, 6)], line)  # bounded by drafts found
    [2, 0]
    >>> choose_step_ks([RequestDrafts(0.0, 6, 3, fixed=True), RequestDrafts(0.9, 6, 6)], line)  # fixed K stays
    [3, 6]
    """
    n = len(requests)
    alphas = [min(max(r.alpha, 0.0), 1.0) for r in requests]
    limit = [max(0, min(r.ceiling, r.drafts)) for r in requests]
    fixed = [r.fixed for r in requests]
    base = [limit[i] if fixed[i] else 0 for i in range(n)]
    if n == 0:
        return []
    plain_rate = batch_rate(alphas, base, line)
    if all(limit[i] == 0 or fixed[i] for i in range(n)):
        return base
    rate, ks = plain_rate, list(base)
    for _ in range(max_rounds):
        threshold = rate * line.b
        new = [limit[i] if fixed[i] else _count_above(alphas[i], limit[i], threshold) for i in range(n)]
        new_rate = batch_rate(alphas, new, line)
        if new == ks or new_rate <= rate * (1.0 + 1e-12):
            if new_rate > rate:
                ks, rate = new, new_rate
            break
        ks, rate = new, new_rate
    return ks if batch_rate(alphas, ks, line) > plain_rate else base


def _count_above(alpha: float, limit: int, threshold: float) -> int:
    """The largest j <= limit with α^j > threshold (0 when none).

    >>> _count_above(0.5, 6, 0.1), _count_above(0.5, 2, 0.1), _count_above(0.5, 6, 0.6), _count_above(1.0, 4, 0.9)
    (3, 2, 0, 4)
    """
    if limit <= 0 or alpha <= threshold:
        return 0
    if alpha >= 1.0 or threshold <= 0.0:
        return limit
    # α^j > t  <=>  j < log t / log α
    j = math.ceil(math.log(threshold) / math.log(alpha)) - 1
    return max(0, min(limit, j))


# -- the step-time line, learned from the engine's own steps ------------------------------------

@dataclass
class StepCost:
    """Online least squares of step time on (1, B, D, s) with forgetting, anchored by a prior.

    The prior's scale is unknown until the first step is measured (seconds on a CPU, milliseconds
    on a GPU): the first measured step sets a so that the prior line passes through it, and the
    prior then counts as `prior_weight` pseudo-steps spread over batches 1..16 (never forgotten,
    so the fit is always defined; real steps outweigh it within a few dozen).

    >>> cost = StepCost()
    >>> for b in (1, 2, 4, 8, 16):
    ...     for d in (0, 2, 4):
    ...         for _ in range(40):
    ...             _ = cost.observe(b, d, 0.01 + 0.004 * b + 0.001 * d + (0.002 if d else 0.0))
    >>> line = cost.line()
    >>> [round(x, 3) for x in (line.a, line.c, line.b, line.f)]  # the weak prior pulls f by ~5%
    [0.01, 0.004, 0.001, 0.002]
    """

    relative_prior: tuple[float, float, float, float] = PRIOR_RELATIVE_COST
    prior_weight: float = PRIOR_WEIGHT
    forget: float = FORGET
    _xtx: list[list[float]] = field(default_factory=lambda: [[0.0] * 4 for _ in range(4)])
    _xty: list[float] = field(default_factory=lambda: [0.0] * 4)
    _prior_xtx: Optional[list[list[float]]] = None
    _prior_xty: Optional[list[float]] = None
    steps: int = 0
    outliers: int = 0

    def observe(self, requests: int, drafts: int, time_s: float) -> bool:
        """Add one measured decode step: `requests` in the batch, `drafts` verified, `time_s` long.

        A step over `OUTLIER` times the fitted line's time is left out once the line rests on
        real steps (a JIT compile, a neighbour taking the core: least squares would chase it for a
        whole window). Returns whether the step was added."""
        if requests <= 0 or not (time_s > 0.0) or math.isinf(time_s):
            return False
        if self.steps >= OUTLIER_AFTER_STEPS:
            line = self.line()
            if line is not None and time_s > OUTLIER * line.time_s(requests, drafts):
                self.outliers += 1
                return False
        x = (1.0, float(requests), float(drafts), 1.0 if drafts > 0 else 0.0)
        if self._prior_xtx is None:
            self._set_prior(x, time_s)
        g = self.forget
        for i in range(4):
            self._xty[i] = g * self._xty[i] + x[i] * time_s
            for j in range(4):
                self._xtx[i][j] = g * self._xtx[i][j] + x[i] * x[j]
        self.steps += 1
        return True

    def _set_prior(self, x: tuple[float, ...], time_s: float) -> None:
        rel = self.relative_prior
        a = time_s / sum(r * xi for r, xi in zip(rel, x))
        theta = [r * a for r in rel]
        points = [(1.0, float(bsz), float(d), 1.0 if d else 0.0) for bsz in (1, 2, 4, 8, 16) for d in (0, 1, 4)]
        w = self.prior_weight / len(points)
        xtx = [[0.0] * 4 for _ in range(4)]
        xty = [0.0] * 4
        for p in points:
            y = sum(t * pi for t, pi in zip(theta, p))
            for i in range(4):
                xty[i] += w * p[i] * y
                for j in range(4):
                    xtx[i][j] += w * p[i] * p[j]
        self._prior_xtx, self._prior_xty = xtx, xty

    def line(self) -> Optional[StepCostLine]:
        """The fitted line (None before any step); coefficients are kept non-negative."""
        if self._prior_xtx is None:
            return None
        m = [[self._xtx[i][j] + self._prior_xtx[i][j] for j in range(4)] for i in range(4)]
        v = [self._xty[i] + self._prior_xty[i] for i in range(4)]
        theta = _solve(m, v)
        if theta is None:
            return None
        a, c, b, f = (max(t, 0.0) for t in theta)
        return StepCostLine(a=max(a, 1e-9), c=c, b=b, f=f)


def _solve(m: list[list[float]], v: list[float]) -> Optional[list[float]]:
    """Gaussian elimination with partial pivoting; None when singular.

    >>> _solve([[2.0, 0.0], [0.0, 4.0]], [2.0, 2.0])
    [1.0, 0.5]
    """
    n = len(v)
    a = [row[:] + [v[i]] for i, row in enumerate(m)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[piv][col]) < 1e-18:
            return None
        a[col], a[piv] = a[piv], a[col]
        for r in range(col + 1, n):
            factor = a[r][col] / a[col][col]
            for k in range(col, n + 1):
                a[r][k] -= factor * a[col][k]
    out = [0.0] * n
    for r in range(n - 1, -1, -1):
        out[r] = (a[r][n] - sum(a[r][k] * out[k] for k in range(r + 1, n))) / a[r][r]
    return out


# -- one request's acceptance ------------------------------------------------------------------

def acceptance(prior_alpha: float, successes: float, failures: float,
               prior_weight: float = ACCEPT_PRIOR_WEIGHT, optimism: float = ACCEPT_OPTIMISM) -> float:
    """α_i for the K choice: the class's α counted as `prior_weight` trials plus the request's own
    recent trials, a Beta posterior, read `optimism` standard deviations above its mean. Only
    verified drafts teach a request its acceptance, so a request held at K = 0 by a low mean would
    never learn that it has started to copy; the optimism keeps one draft in play while the
    request's own evidence is thin, and fades as it grows.

    >>> round(acceptance(0.5, 0.0, 0.0, optimism=0.0), 3), round(acceptance(0.5, 9.0, 0.0, optimism=0.0), 3)
    (0.5, 0.875)
    >>> round(acceptance(0.4, 0.0, 0.0), 3), round(acceptance(0.4, 0.0, 10.0), 3)  # thin evidence: optimistic
    (0.645, 0.17)
    """
    prior_alpha = min(max(prior_alpha, 0.0), 1.0)
    a = prior_weight * prior_alpha + max(successes, 0.0)
    b = prior_weight * (1.0 - prior_alpha) + max(failures, 0.0)
    n = a + b
    if n <= 0.0:
        return prior_alpha
    mean = a / n
    sd = math.sqrt(a * b / (n * n * (n + 1.0)))
    return min(1.0, mean + optimism * sd)


def batch_optimism(batch_size: int, optimism: float = ACCEPT_OPTIMISM) -> float:
    """The optimism of `acceptance` for a request in a batch of `batch_size`: spread over the batch.

    An optimistic draft is exploration: what it may teach helps only its own request, while a
    rejected one costs the step, that is every request in the batch. At batch 1 the request pays
    alone; at batch 16 a draft that explores must pay on its own evidence. (On the tune half, batch
    16, one engine: a fixed 1-sigma optimism kept chat requests drafting one token they rarely had
    accepted, 0.93 of plain decoding. Spreading it did not close the gap alone: see
    `cluster.engine.draft_gate`.)

    >>> batch_optimism(1), batch_optimism(4), batch_optimism(0)
    (1.0, 0.25, 1.0)
    """
    return optimism / max(batch_size, 1)


def next_acceptance(successes: float, failures: float, drafted: int, accepted: int,
                    forget: float = ACCEPT_FORGET) -> tuple[float, float]:
    """A request's (successes, failures) after a step that verified `drafted` drafts and accepted
    the first `accepted`: each accepted draft is a success, a rejection one failure (the drafts
    after it were never tried); older steps fade by `forget`. A step without drafts changes nothing.

    >>> next_acceptance(0.0, 0.0, 4, 4), next_acceptance(0.0, 0.0, 4, 1), next_acceptance(5.0, 1.0, 0, 0)
    ((4.0, 0.0), (1.0, 1.0), (5.0, 1.0))
    """
    if drafted <= 0:
        return successes, failures
    accepted = max(0, min(accepted, drafted))
    return forget * successes + accepted, forget * failures + (1.0 if accepted < drafted else 0.0)
