"""The words of speculative decoding, defined once; everything in specserve is named after them.

One *step* of a request is one forward pass of the target over that request. In a step:

- **draft tokens** (``drafted``): the K tokens a proposer guessed for the request (n-gram lookup,
  a draft model, MTP/EAGLE heads). ``K`` is the request's *speculation length* for that step;
  K = 0 means plain decoding. A proposer may find fewer than K (n-gram finds none on novel text).
- **accepted tokens** (``accepted``): the leading draft tokens the target agreed with
  (0 <= accepted <= drafted). Rejection sampling makes the output distribution exactly the
  target's, so speculation is lossless; under greedy decoding the text is identical.
- **bonus token**: the one token the target itself produces after the accepted prefix
  (the recovered token at the first rejection, or the extra token when all drafts were accepted).
- output tokens of a step = accepted + 1 (the bonus).
- **acceptance length** = output tokens per step = accepted / steps + 1, averaged over steps.
  1.0 means speculation bought nothing; K + 1 is the ceiling.
- **acceptance rate** = accepted / drafted.
- **goodput**: output tokens per second that meet the request's latency objective.

A request's *speculative mode* is the proposer family (``SpecMode``); its K is the caller's, fixed,
or chosen by its engine at every step up to a ceiling (``cluster.engine.step_k``). ``SpecStats`` is what every response
reports about what was used and what happened.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

# Key under SamplingParams.extra_args that carries the per-request K into the engine's scheduler:
# a fixed K, or, with EXTRA_ARGS_K_STEP, the ceiling of the K the engine chooses per step.
EXTRA_ARGS_K = "specserve_k"
# α of the request's workload class (a float in [0, 1]): the engine's scheduler chooses this
# request's K at every step, up to its `specserve_k`, from the batch as it is then
# (`cluster.engine.step_k`; set by the router when the policy, not the caller, chose K).
EXTRA_ARGS_K_STEP = "specserve_k_step"
# The drafting method of a request in an engine that has more than one (n-gram and suffix lookup,
# `cluster.engine.lookup_proposer`); absent: the pool's method.
EXTRA_ARGS_MODE = "specserve_mode"

# vLLM's sampling epsilon: a min_p at or below it is off, a temperature below it is greedy.
SAMPLING_EPS = 1e-5


def plain_field(body: Any) -> Optional[str]:
    """The field of an OpenAI body (or `SamplingParams`-like object) that needs K = 0, or None:
    vLLM refuses `logit_bias` and `min_p` in an engine with speculation, and specserve serves them
    at K = 0 (`cluster.engine.plain_params`).

    >>> plain_field({"logit_bias": {"28": 5}}), plain_field({"min_p": 0.1}), plain_field({"min_p": 0, "logit_bias": {}})
    ('logit_bias', 'min_p', None)
    >>> plain_field({"min_p": "0.2"}), plain_field({"min_p": "x"})  # vLLM names a malformed value itself
    ('min_p', None)
    """
    get = body.get if isinstance(body, dict) else lambda name: getattr(body, name, None)
    if get("logit_bias"):
        return "logit_bias"
    try:
        min_p = float(get("min_p") or 0)
    except (TypeError, ValueError):
        return None
    return "min_p" if min_p > SAMPLING_EPS else None


# Accepted runs longer than this are counted as this long (`accepted_runs`); 4 x the largest K
# here, so the cap changes no step count the policy compares.
RUN_CAP = 32


class SpecMode(str, enum.Enum):
    """Proposer families. ``none`` is plain decoding; the GPU-only ones pass through to vLLM."""

    NONE = "none"
    NGRAM = "ngram"
    DRAFT_MODEL = "draft_model"
    EAGLE = "eagle"
    EAGLE3 = "eagle3"
    MTP = "mtp"
    SUFFIX = "suffix"
    # A draft model in its own deployment, called once per target step (deployments/drafter.py).
    REMOTE_DRAFT = "remote_draft"

    @classmethod
    def parse(cls, value: str) -> "SpecMode":
        try:
            return cls(value)
        except ValueError:
            allowed = ", ".join(m.value for m in cls)
            raise ValueError(f"unknown speculative mode {value!r}; allowed: {allowed}") from None


@dataclass
class SpecStats:
    """What one request used and what happened, summed over its steps."""

    mode: str = SpecMode.NONE.value
    k: int = 0  # K asked for at admission
    steps: int = 0  # decode steps (target forward passes) after the first token
    spec_steps: int = 0  # of those, steps that verified at least one draft token
    drafted: int = 0  # draft tokens verified (after per-request K trimming)
    accepted: int = 0  # draft tokens accepted and delivered (a stop inside an accepted run cuts it)
    # accepted_per_position[i] = steps in which draft position i (0-based) was accepted;
    # drafted_per_position[i] = steps in which position i was drafted (its denominator).
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    # run_lengths[L] = accepted runs of L tokens (`accepted_runs`): what the text lets the proposer
    # guess in a row, whatever K cut it into; empty when the engine did not report steps in order.
    run_lengths: list[int] = field(default_factory=list)

    @property
    def acceptance_length(self) -> float:
        """Output tokens per step: accepted / steps + 1 (1.0 with no steps)."""
        return 1.0 + (self.accepted / self.steps if self.steps else 0.0)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["acceptance_length"] = round(self.acceptance_length, 4)
        d["acceptance_rate"] = round(self.acceptance_rate, 4)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "SpecStats":
        return cls(
            mode=str(d.get("mode", SpecMode.NONE.value)),
            k=int(d.get("k", 0)),
            steps=int(d.get("steps", 0)),
            spec_steps=int(d.get("spec_steps", 0)),
            drafted=int(d.get("drafted", 0)),
            accepted=int(d.get("accepted", 0)),
            accepted_per_position=[int(x) for x in d.get("accepted_per_position", [])],
            drafted_per_position=[int(x) for x in d.get("drafted_per_position", [])],
            run_lengths=[int(x) for x in d.get("run_lengths", [])],
        )


def accepted_runs(per_step_accepted, per_step_drafted, cap: int = RUN_CAP) -> list[int]:
    """Histogram of accepted runs from a request's steps in order: [L] = runs of L tokens.

    A run is what the proposer guessed right in a row. A step that accepted all it drafted does
    not end its run: its bonus token was the next token of the run and the next step's drafts go
    on from it (n-gram lookup follows the same match; a drafter keeps predicting), so the run is
    the sum over such steps of (drafted + 1), plus the accepted drafts of the step that ends it (a
    rejection). A run that ends because the next step drafts nothing (or the request ends) does
    not count the last full step's bonus token. Steps that draft nothing start no run (the draft
    rate counts them). Runs are a property of the text and the proposer, not of K: with K a run of
    L tokens takes ceil((L + 1) / (K + 1)) steps and yields L + 1 tokens, which the policy uses
    instead of treating steps as independent (n-gram drafts come in bursts).

    >>> accepted_runs([4, 4, 2, 0, 0, 1], [4, 4, 4, 0, 3, 3])
    [1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]
    """
    hist = [0] * (cap + 1)
    top, run, open_run = 0, 0, False
    for acc, dr in zip(per_step_accepted, per_step_drafted):
        acc, dr = int(acc), int(dr)
        if dr <= 0:
            if open_run:  # the run ended with the last full step (its bonus is not counted)
                length = min(max(run - 1, 0), cap)
                hist[length] += 1
                top = max(top, length)
                run, open_run = 0, False
            continue
        acc = min(max(acc, 0), dr)
        if acc == dr:
            run, open_run = run + dr + 1, True
            continue
        length = min(run + acc, cap)
        hist[length] += 1
        top = max(top, length)
        run, open_run = 0, False
    if open_run:
        length = min(max(run - 1, 0), cap)
        hist[length] += 1
        top = max(top, length)
    return hist[:top + 1] if any(hist) else []


# Workload classes the router tells apart (cluster/routing/classifier.py assigns them; a request may name one).
WORKLOAD_CLASSES = (
    "chat",
    "code",
    "math",
    "summarization",
    "rag",
    "translation",
    "qa",
    "structured",
    "creative",
    "reasoning",
    "extraction",
)
