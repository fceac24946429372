"""The tuning state the policy reads: load buckets, one cell's sums (`CellStats`) and one model's cells (`TuningView`)."""

from __future__ import annotations

import bisect
import random
from dataclasses import dataclass, field
from typing import Mapping, Optional

MAX_K = 16  # the largest K any pool may have (PoolConfig.max_k bound)

# (min batch size, bucket name); a bucket holds batch sizes from its minimum up to the next one's.
LOAD_BUCKETS: tuple[tuple[int, str], ...] = ((1, "1"), (2, "2-3"), (4, "4-7"), (8, "8-15"), (16, "16+"))
BUCKET_NAMES = tuple(name for _, name in LOAD_BUCKETS)
BUCKET_BATCH = {"1": 1.0, "2-3": 2.5, "4-7": 5.5, "8-15": 11.5, "16+": 24.0}  # representative batch

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
    """What the policy knows of one model: its validated cells.

    `rng` is the router replica's seeded exploration RNG, carried with the view so that `route`
    needs no extra argument; None disables exploration (pure exploitation, deterministic)."""

    model: str
    cells: Mapping[CellKey, CellStats] = field(default_factory=dict)
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


def load_bucket(batch_size: float) -> str:
    """Bucket name of a batch size (sizes below 1 count as 1).

    >>> [load_bucket(b) for b in (0, 1, 3, 4, 15.5, 16, 500)]
    ['1', '1', '2-3', '4-7', '8-15', '16+', '16+']
    """
    starts = [start for start, _ in LOAD_BUCKETS]
    return LOAD_BUCKETS[max(bisect.bisect_right(starts, batch_size) - 1, 0)][1]
