"""The policy's knobs (`PolicyParams`) and its cold-start priors of acceptance and draft cost per mode."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.speculation import SpecMode

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
    tie_tol: float = 0.01  # scores within this fraction count as equal; the smaller K wins
    eps_max: float = 0.20  # exploration probability with no data
    eps_min: float = 0.02  # ... and with plenty
    eps_scale_trials: float = 2000.0  # ε halves (towards eps_min) after this many trials
    # An exploration draw may only take a (pool, K) that could plausibly score within explore_regret
    # of the exploiting choice: its score at the upper explore_z-sigma α (`explorable_ks`).
    explore_regret: float = 0.05
    explore_z: float = 2.0


DEFAULT_PARAMS = PolicyParams()
