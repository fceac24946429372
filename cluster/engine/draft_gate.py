"""Whether a step verifies drafts at all, learned per batch size from the engine's own steps.

Contract: `DraftGate.allows(batch_size)` says whether the next step of a batch that large runs the
*draft arm* (requests whose K the engine chooses verify the drafts `cluster.engine.step_k` picks)
or the *plain arm* (they decode plainly and the proposer is not asked); `DraftGate.observe(...)`
adds one measured decode step. Pure: no vLLM, no clock; the only randomness is the gate's own
seeded `random.Random`. `cluster.engine.vllm_scheduler` wires it into vLLM.

Words are those of `cluster.speculation`, plus:

- **bucket**: a range of batch sizes that share what they learn (`BUCKET_STARTS`: 1, 2-3, 4-5,
  ..., 64+); the break-even of drafting moves with the batch, not within a few requests.
- **arm rate**: output tokens per second of the decode steps an arm ran in a bucket, Σ tokens /
  Σ seconds (the engine's throughput, as a benchmark counts it), over its last ~`window` steps
  there (exponential forgetting). Its standard error comes from the steps' spread (delta method
  for a ratio of sums). While one arm runs, the other's evidence fades too, at a quarter of the
  rate (`OTHER_FADE`), so an arm left aside is tried again once its estimate has grown stale: a
  workload whose drafts start to pay is found within ~1,500 steps of a bucket (simulated).
- **prior**: before both arms have `min_steps` steps in a bucket, the verdict of the nearest
  bucket that has them (the lower one when two are as near) decides, and the arm with fewer steps
  is tried with probability `explore`. Until some bucket has compared, the pool's
  `step_k_max_batch` decides (draft at or below it; None: draft everywhere). A burst climbs
  through buckets faster than each can measure both arms, and the break-even of drafting moves
  little from one bucket to the next, so a neighbour's measurement is a better guess than a bound
  fixed from other prompts.

Why: on a CPU a verified draft costs about what a whole request does in a large batch, so whether
drafting pays at batch 16 depends on how often this workload's drafts are accepted, and a bound
fixed from one set of prompts is wrong for another (docs/benchmarks/draft-gate/: stock suffix
decoding 1.04-1.06x plain decoding at 16 streams on unseen prompts, 0.94x at 32; the tune half
tied at 16). The gate measures the two arms where they run and keeps the faster one.

How: Thompson sampling per bucket: each arm's rate is drawn from a normal around its estimate
with its standard error, and the larger draw wins. Arms far apart are almost never swapped (a
one-stream engine keeps drafting); arms within noise share the steps, which costs nothing because
they are equally fast. `explore` = 0 turns learning off: the prior alone, a static batch bound.
"""

from __future__ import annotations

import bisect
import math
import random
from dataclasses import dataclass, field
from typing import Optional

BUCKET_STARTS = (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64)
WINDOW = 500  # steps an arm remembers in a bucket
MIN_STEPS = 8.0  # steps (forgetting-weighted) of both arms before Thompson sampling takes over from the prior
OTHER_FADE = 0.25  # per step of one arm, the other arm's evidence fades this many steps' worth
SE_FLOOR = 0.005  # relative: no arm's rate is ever read as surer than +-0.5%
EXPLORE = 0.2  # chance of the less-tried arm while a bucket warms up


# Per bucket, every bucket from the nearest to the farthest (the lower first when two are as near).
NEAREST = tuple(tuple(sorted(range(len(BUCKET_STARTS)), key=lambda o, b=b: (abs(o - b), o)))
                for b in range(len(BUCKET_STARTS)))


def bucket_of(batch_size: int) -> int:
    """The index of the bucket a batch size falls in.

    >>> [bucket_of(b) for b in (0, 1, 3, 4, 11, 12, 16, 63, 64, 500)]
    [0, 0, 1, 2, 4, 5, 6, 9, 10, 10]
    """
    return max(bisect.bisect_right(BUCKET_STARTS, batch_size) - 1, 0)


def bucket_label(index: int) -> str:
    """'1', '2-3', ..., '64+'.

    >>> [bucket_label(i) for i in (0, 1, 10)]
    ['1', '2-3', '64+']
    """
    lo = BUCKET_STARTS[index]
    if index + 1 >= len(BUCKET_STARTS):
        return f"{lo}+"
    hi = BUCKET_STARTS[index + 1] - 1
    return str(lo) if hi == lo else f"{lo}-{hi}"


@dataclass
class ArmRate:
    """Forgetting sums of one arm's decode steps in one bucket: n steps, Σ tokens, Σ seconds and
    their second moments."""

    n: float = 0.0
    tokens: float = 0.0
    seconds: float = 0.0
    tokens2: float = 0.0
    seconds2: float = 0.0
    cross: float = 0.0

    def add(self, tokens: float, seconds: float, forget: float) -> None:
        self.fade(forget)
        self.n += 1.0
        self.tokens += tokens
        self.seconds += seconds
        self.tokens2 += tokens * tokens
        self.seconds2 += seconds * seconds
        self.cross += tokens * seconds

    def fade(self, forget: float) -> None:
        """Older steps count `forget` times less (the mean is kept; the evidence shrinks)."""
        for name in ("n", "tokens", "seconds", "tokens2", "seconds2", "cross"):
            setattr(self, name, forget * getattr(self, name))

    def rate(self) -> Optional[float]:
        """Tokens per second, None before any step."""
        return self.tokens / self.seconds if self.seconds > 0.0 else None

    def stderr(self) -> float:
        """Standard error of `rate` (delta method for Σ tokens / Σ seconds), at least SE_FLOOR of it;
        infinite below two steps.

        >>> a = ArmRate()
        >>> for t, s in ((10, 1.0), (12, 1.0), (8, 1.0), (10, 1.0)):
        ...     a.add(t, s, 1.0)
        >>> a.rate(), round(a.stderr(), 3)  # spread of tokens sqrt(2) at equal seconds: sqrt(2 / 4)
        (10.0, 0.707)
        """
        r = self.rate()
        if r is None or self.n < 2.0:
            return math.inf
        n = self.n
        mean_t, mean_s = self.tokens / n, self.seconds / n
        var_t = max(self.tokens2 / n - mean_t * mean_t, 0.0)
        var_s = max(self.seconds2 / n - mean_s * mean_s, 0.0)
        cov = self.cross / n - mean_t * mean_s
        var = max(var_t - 2.0 * r * cov + r * r * var_s, 0.0) / (n * mean_s * mean_s)
        return max(math.sqrt(var), SE_FLOOR * r)


@dataclass
class DraftGate:
    """The two arms' rates per bucket and the choice between them (see module doc).

    >>> gate = DraftGate(prior_max_batch=11, explore=0.0)  # learning off: a static bound
    >>> gate.allows(11), gate.allows(12)
    (True, False)
    """

    prior_max_batch: Optional[int] = None  # the pool's step_k_max_batch: draft at or below it (None: always)
    explore: float = EXPLORE
    window: int = WINDOW
    min_steps: float = MIN_STEPS
    other_fade: float = OTHER_FADE
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    arms: dict[tuple[int, bool], ArmRate] = field(default_factory=dict)  # (bucket, drafting) -> rate

    def prior(self, batch_size: int) -> bool:
        """The arm of a bucket that has not compared its arms: its nearest compared neighbour's
        faster arm, else the static bound (and the static bound alone when learning is off).

        >>> gate = DraftGate(prior_max_batch=11)
        >>> for _ in range(20):  # batch 8-11 measured drafting faster
        ...     _ = gate.observe(9, True, 13, 0.1), gate.observe(9, False, 9, 0.1)
        >>> gate.prior(16), gate.prior(64), DraftGate(prior_max_batch=11).prior(16)
        (True, True, False)
        """
        static = self.prior_max_batch is None or batch_size <= self.prior_max_batch
        if self.explore <= 0.0:
            return static
        for o in NEAREST[bucket_of(batch_size)]:
            if self._compared(o):
                return (self.arms[(o, True)].rate() or 0.0) > (self.arms[(o, False)].rate() or 0.0)
        return static

    def arm(self, bucket: int, drafting: bool) -> ArmRate:
        return self.arms.setdefault((bucket, drafting), ArmRate())

    def compares(self, batch_size: int) -> bool:
        """Whether both arms have `min_steps` steps at this batch size (measurement decides, not the prior)."""
        return self._compared(bucket_of(batch_size))

    def _compared(self, bucket: int) -> bool:
        draft, plain = self.arms.get((bucket, True)), self.arms.get((bucket, False))
        return draft is not None and plain is not None and min(draft.n, plain.n) >= self.min_steps

    def allows(self, batch_size: int) -> bool:
        """Whether the next step of `batch_size` requests runs the draft arm.

        >>> gate = DraftGate(prior_max_batch=4)
        >>> for _ in range(100):  # at 16: drafting measured 1.3x faster than plain decoding
        ...     _ = gate.observe(16, True, 26, 0.1), gate.observe(16, False, 16, 0.08)
        >>> sum(gate.allows(16) for _ in range(200)) >= 199, gate.allows(3)
        (True, True)
        """
        if self.explore <= 0.0:
            return self.prior(batch_size)
        b = bucket_of(batch_size)
        draft, plain = self.arm(b, True), self.arm(b, False)
        if not self.compares(batch_size):
            prior = self.prior(batch_size)
            fewer = draft.n < plain.n or (draft.n == plain.n and not prior)  # the arm to try
            return fewer if self.rng.random() < self.explore else prior
        return self._draw(draft) > self._draw(plain)

    def _draw(self, a: ArmRate) -> float:
        return self.rng.gauss(a.rate() or 0.0, a.stderr())

    def observe(self, batch_size: int, drafting: bool, tokens: int, seconds: float) -> bool:
        """Add one decode step of `batch_size` requests that ran the draft arm (`drafting`) or the
        plain one, yielding `tokens` output tokens in `seconds`. Returns whether it was added (not a
        step of no requests, no tokens or no time)."""
        if batch_size <= 0 or tokens <= 0 or not (seconds > 0.0) or math.isinf(seconds):
            return False
        b, forget = bucket_of(batch_size), 1.0 - 1.0 / self.window
        self.arm(b, drafting).add(float(tokens), float(seconds), forget)
        self.arm(b, not drafting).fade(forget ** self.other_fade)
        return True

    def table(self) -> list[dict]:
        """Per bucket with steps: each arm's steps, rate (tokens/s) and standard error, for logs."""
        out = []
        for b in sorted({k[0] for k, a in self.arms.items() if a.n > 0}):
            row: dict = {"batch": bucket_label(b)}
            for drafting, name in ((True, "draft"), (False, "plain")):
                a = self.arms.get((b, drafting))
                if a is not None and a.n > 0:
                    se = a.stderr()
                    row[name] = {"steps": round(a.n, 1), "tokens_per_s": round(a.rate() or 0.0, 2),
                                 "stderr": None if math.isinf(se) else round(se, 2)}
            out.append(row)
        return out
