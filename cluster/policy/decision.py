"""The words routing and the policy share: what the router knows of a pool when it decides
(`PoolView`) and what it decides for one request (`Decision`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import NamedTuple, Optional

from cluster.speculation import SpecMode


class OtherMethod(NamedTuple):
    """A drafting method a pool's engine serves beside its own, with its cold-start priors and K bound."""

    mode: SpecMode
    prior_alpha: tuple[tuple[str, float], ...]
    max_k: int
    prior_draft_rate: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class PoolView:
    """What the router knows of one pool when it decides."""

    name: str
    model: str
    method: SpecMode
    max_k: int
    replicas: int = 1
    running: float = 0.0  # requests in flight over all replicas (live, sampled)
    waiting: float = 0.0  # requests queued in the engines
    max_ongoing_requests: int = 64  # per replica
    hardware_group: Optional[str] = None  # pools of one group share hardware (PoolConfig.hardware_group)
    group_load: Optional[float] = None  # requests in flight over every pool of the group (live)
    prior_alpha: tuple[tuple[str, float], ...] = ()  # (workload class or "*", α): measured cold-start priors
    prior_draft_rate: tuple[tuple[str, float], ...] = ()  # (workload class or "*", p): share of steps that draft
    prior_draft_cost: Optional[tuple[float, float]] = None  # (per step, per token): PoolConfig.prior_draft_cost
    auto: bool = True  # the auto policy may choose this pool (PoolConfig.auto)
    # Other drafting methods the same engine serves per request (an n-gram pool with `suffix` set).
    also: tuple[OtherMethod, ...] = ()
    # Drafting methods of this engine the auto policy does not choose (SuffixConfig.auto_ngram false).
    auto_skips: tuple[SpecMode, ...] = ()

    @property
    def modes(self) -> tuple[SpecMode, ...]:
        if self.method == SpecMode.NONE:
            return (SpecMode.NONE,)
        return (self.method, *(a.mode for a in self.also), SpecMode.NONE)

    def k_bound(self, mode: SpecMode) -> int:
        """The largest K of `mode` here."""
        return next((a.max_k for a in self.also if a.mode == mode), self.max_k)

    def by_method(self) -> tuple["PoolView", ...]:
        """One view per drafting method of the pool's engine (same name, load and K bound), for
        the policy to score each method as a candidate.

        >>> v = PoolView("ngram", "m", SpecMode.NGRAM, 6, also=(OtherMethod(SpecMode.SUFFIX, (("*", 0.5),), 16, (("*", 0.4),)),))
        >>> [(x.name, x.method.value, x.max_k, x.prior_alpha, x.prior_draft_rate, x.also) for x in v.by_method()]
        [('ngram', 'ngram', 6, (), (), ()), ('ngram', 'suffix', 16, (('*', 0.5),), (('*', 0.4),), ())]
        """
        return (replace(self, also=()),
                *(replace(self, method=a.mode, max_k=a.max_k, prior_alpha=a.prior_alpha,
                          prior_draft_rate=a.prior_draft_rate, also=()) for a in self.also))

    @property
    def proposer_rank(self) -> int:
        """Cost of the pool's proposer to a K = 0 request sharing its batches (drafts are trimmed, but
        a model-based proposer still runs for the batch): plain 0 < lookup-based 1 < model-based 2."""
        return {SpecMode.NONE: 0, SpecMode.NGRAM: 1, SpecMode.SUFFIX: 1}.get(self.method, 2)

    @property
    def batch_per_replica(self) -> float:
        return (self.running + self.waiting) / max(self.replicas, 1)

    @property
    def load_batch(self) -> float:
        """The batch whose step time a request joining this pool pays for: its replica's batch, or,
        when the pool shares hardware with others, everything in flight on that hardware."""
        if self.hardware_group is not None and self.group_load is not None:
            return max(self.group_load, self.batch_per_replica)
        return self.batch_per_replica


@dataclass(frozen=True)
class Decision:
    pool: str
    mode: SpecMode
    k: int
    decided_by: str  # "request" | "default" | "policy"
    workload_class: str = "chat"
    # Diagnostics of the choice (expected tokens/s per candidate etc.), for logs and stats.
    detail: dict = field(default_factory=dict, compare=False)
