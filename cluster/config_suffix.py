"""A pool's SuffixDecoding section (`suffix:`, `SuffixConfig`, with the drafting knobs it may set again
for a step in which one request runs) and the checks of the cold-start tables keyed by workload class
(`check_prior_alpha`, `check_prior_draft_rate`) that it and the pools use; `cluster.config_pool.PoolConfig`
assembles it.
"""

from __future__ import annotations

from typing import Annotated, Optional

from pydantic import AfterValidator, Field

from cluster.config_base import Strict
from cluster.speculation import WORKLOAD_CLASSES


def _check_class_table(v: dict[str, float], what: str, hi: float) -> dict[str, float]:
    """A cold-start table: workload classes (or `*`) to a value within 0..hi."""
    for c, x in v.items():
        if c != "*" and c not in WORKLOAD_CLASSES:
            raise ValueError(f"unknown workload class {c!r}; classes: {sorted(WORKLOAD_CLASSES)} or '*'")
        if not 0.0 <= x <= hi:
            raise ValueError(f"{c}: {what} must be within 0..{hi:g}, got {x}")
    return v


def check_prior_alpha(v: dict[str, float]) -> dict[str, float]:
    """A cold-start α table: workload classes (or `*`) to α within 0..0.99."""
    return _check_class_table(v, "α", 0.99)


def check_prior_draft_rate(v: dict[str, float]) -> dict[str, float]:
    """A cold-start draft-rate table: workload classes (or `*`) to the share of steps that draft, 0..1."""
    return _check_class_table(v, "the draft rate", 1.0)


class SuffixKnobsConfig(Strict):
    """How far a SuffixDecoding draft may run (vLLM's `suffix_decoding_*` knobs); `SuffixConfig.solo`
    sets them again for a step in which one request runs."""

    max_spec_factor: float = Field(
        1.0, gt=0, le=64, description="A draft is at most this times the matched length long (and at most the request's K).")
    max_spec_offset: float = Field(
        0.0, ge=0, le=64,
        description="A draft may run this many tokens past max_spec_factor x the matched length (still bounded "
                    "by min_token_prob and the request's K).")
    min_token_prob: float = Field(
        0.1, ge=0, le=1, description="A draft stops at a token whose estimated probability is below this.")


class SuffixConfig(SuffixKnobsConfig):
    """SuffixDecoding beside prompt lookup in one engine (`cluster/engine/lookup_proposer.py`): a
    suffix tree over each prompt and over earlier requests' outputs (arctic-inference's), whose
    drafts follow the match length. The knobs are vLLM's `suffix_decoding_*` settings."""

    max_tree_depth: int = Field(24, ge=1, le=1024, description="Longest suffix matched, and depth of the trees.")
    max_k: int = Field(
        16, ge=1, le=16,
        description=(
            "Largest K of a suffix request (the pool's `max_k` bounds its n-gram requests). A suffix draft "
            "is only as long as the match makes it likely (max_spec_factor, min_token_prob), so a deep "
            "bound costs nothing where the match is short; vLLM's own suffix method defaults to the tree depth."))
    max_cached_requests: int = Field(
        10000, ge=0, description="Earlier requests whose outputs the global tree keeps (0: the prompt's tree only).")
    solo: Optional[SuffixKnobsConfig] = Field(
        None,
        description=(
            "Drafting knobs for a step whose batch holds one request (unset: the knobs above for every step). "
            "Alone in a step, extra verified tokens cost little; beside batchmates every extra token lengthens "
            "the step for all of them, so a setting that drafts further can pay at one stream and lose under load."))
    auto_ngram: bool = Field(
        True,
        description=(
            "Pools of method ngram: whether the auto policy may also choose n-gram lookup here (false: suffix or "
            "none only; a request that asks for mode ngram still gets it). Where the suffix tree drafts at least "
            "as well on every class, n-gram choices only cost exploration and cold-start mistakes."))
    prior_alpha: Annotated[dict[str, float], AfterValidator(check_prior_alpha)] = Field(
        default_factory=dict,
        description="Cold-start α per workload class of suffix drafts (`*` for the rest); empty: built-in priors.")
    prior_draft_rate: Annotated[dict[str, float], AfterValidator(check_prior_draft_rate)] = Field(
        default_factory=dict,
        description="Cold-start share of steps that find a suffix draft, per workload class (`*` for the rest); "
                    "empty: every step drafts.")
