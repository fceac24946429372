"""A pool of the cluster config (`pools:`): `PoolConfig`, a set of identical engine replicas of one target
model with one speculative method; the sections it holds, its autoscaling (`AutoscalingConfig`) and its
proposer's cold-start cost (`DraftCostPrior`); and the sets of methods its checks name.
`cluster.config.ClusterConfig` assembles the pools with the models and drafters; a pool's SuffixDecoding
section is `cluster.config_suffix`."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field, field_validator, model_validator

from cluster.config_base import Strict
from cluster.config_suffix import SuffixConfig, check_prior_alpha, check_prior_draft_rate
from cluster.speculation import SpecMode

# Methods that run on vLLM's CPU build here; the rest are passed through to vLLM on GPUs.
CPU_METHODS = {SpecMode.NONE, SpecMode.NGRAM, SpecMode.SUFFIX, SpecMode.DRAFT_MODEL, SpecMode.EAGLE, SpecMode.REMOTE_DRAFT}
# Methods whose proposer is a separate set of weights named by `drafter`.
DRAFTER_METHODS = {SpecMode.DRAFT_MODEL, SpecMode.EAGLE, SpecMode.EAGLE3}
# Methods whose drafts come from lookup in the context (and, for suffix, earlier outputs).
LOOKUP_METHODS = {SpecMode.NGRAM, SpecMode.SUFFIX}


class AutoscalingConfig(Strict):
    """Replicas of a pool between min and max. With `policy: goodput` (the default) the decision is
    specserve's (`cluster.autoscale.policy`): SLOs and what a replica carries without speculation, from the
    router's tuning state; with `policy: queue_length` it is Ray Serve's default policy."""

    min_replicas: int = Field(1, ge=0, description="Lower bound on engine replicas.")
    max_replicas: int = Field(1, ge=1, description="Upper bound on engine replicas.")
    target_ongoing_requests: float = Field(
        8.0, gt=0,
        description=("Requests in flight one replica carries. queue_length: Ray Serve's target. goodput: what a "
                     "replica carries without speculation until the tuning state has measured it (slo_tpot_s)."),
    )
    upscale_delay_s: float = Field(30.0, ge=0, description="Sustained load needed before scaling up.")
    downscale_delay_s: float = Field(300.0, ge=0, description="Sustained idleness before scaling down.")
    policy: Literal["goodput", "queue_length"] = Field(
        "goodput",
        description=("goodput: specserve's policy (SLOs, speculative goodput, capacity without speculation; its last "
                     "decision and reason in Redis for the router and `specserve status`). queue_length: Ray's default."),
    )
    slo_tpot_s: Optional[float] = Field(
        None, gt=0, description="goodput: p99 time per output token objective; a replica above it scales the pool up.")
    slo_ttft_s: Optional[float] = Field(
        None, gt=0, description="goodput: p99 time-to-first-token objective (at the engine); above it scales up.")
    downscale_headroom: float = Field(
        0.6, gt=0, le=1,
        description="goodput: scale down only when the load fits in fewer replicas at this fraction of what each carries.")
    metrics_window_s: float = Field(
        30.0, gt=0, description="goodput: window of the engines' latency percentiles and token rates.")
    look_back_period_s: float = Field(
        10.0, gt=0, description="Ray Serve averages the replicas' reported metrics over this period.")
    min_samples: int = Field(
        4, ge=1, description="goodput: requests a replica must finish in the window before its percentiles count.")

    @model_validator(mode="after")
    def _bounds(self) -> "AutoscalingConfig":
        if self.max_replicas < self.min_replicas:
            raise ValueError("max_replicas must be >= min_replicas")
        return self



class DraftCostPrior(Strict):
    """A proposer's cost, relative to one plain target step at batch 1 (verification not included)."""

    per_step: float = Field(0.0, ge=0, le=10, description="Fixed cost of a step that drafts anything.")
    per_token: float = Field(0.0, ge=0, le=10, description="Cost per draft token.")



class PoolConfig(Strict):
    """A set of identical engine replicas: one target model, one speculative method, K up to max_k."""

    model: str = Field(description="Name of the target model (a key of `models`).")
    method: SpecMode = Field(SpecMode.NONE, description="Speculative method of this pool's engines.")
    drafter: Optional[str] = Field(
        None, description="Drafter model (a key of `models`) for draft_model / eagle / eagle3."
    )
    remote_drafter: Optional[str] = Field(
        None, description="method remote_draft: the drafter deployment (a key of `drafters`) its engines call."
    )
    remote_timeout_s: float = Field(
        0.25, gt=0, le=10,
        description=(
            "method remote_draft: a step waits at most this for its drafts, then runs without them "
            "(set it above the drafter's p99 call time, or drafts are wasted)."
        ),
    )
    remote_reprobe_s: float = Field(
        2.0, gt=0, description="method remote_draft: while the drafter is failing, try it again this often."
    )
    max_k: int = Field(0, ge=0, le=16, description="Largest K a request may ask of this pool (0 for method none).")
    step_k_max_batch: Optional[int] = Field(
        None, ge=0, le=4096,
        description="The batch bound the engine starts from: above this many running requests, requests whose K it "
                    "chooses per step decode plainly (a caller's K is kept); with step_k_explore > 0 it then learns "
                    "per batch size which is faster (cluster/engine/draft_gate.py). Unset: drafting everywhere at first.",
    )
    step_k_explore: float = Field(
        0.2, ge=0.0, le=1.0,
        description=("The chance a step tries the arm (drafting or plain) the bound does not pick, "
                     "until a batch size has steps of both; then their measured tokens/s decide. 0: the bound alone."),
    )
    stream_chunks_per_step: Optional[int] = Field(
        4, ge=1, le=4096,
        description=(
            "An engine replica sends at most about this many chunks per engine step across its running "
            "requests: with b running, a streamed request's tokens go out ceil(b / this) at a time (at "
            "most 16); the first token and the last chunk go at once; a request that is not streamed "
            "gets its first token, then one final chunk; nothing waits more than 1 s (cluster/engine/coalesce.py). "
            "Bounds the serving path's per-chunk work as the batch grows (null: every engine output is "
            "sent as it comes)."
        ),
    )
    engine_core_wait: Literal["spin", "block"] = Field(
        "spin",
        description="How the engine core waits for its workers in a step: spin (vLLM's own: a core busy all the "
                    "while) or block, where it shares a core with the serving path (cluster/engine/worker_wait.py).")
    auto: bool = Field(
        True,
        description=(
            "The router's auto policy may send requests here. false: the pool serves only requests that "
            "ask for its mode (e.g. a method that does not pay on this hardware, or a canary)."
        ),
    )
    ngram_min: int = Field(2, ge=1, description="n-gram method: shortest prompt match.")
    ngram_max: int = Field(5, ge=1, description="n-gram method: longest prompt match.")
    suffix: Optional[SuffixConfig] = Field(
        None,
        description=(
            "method ngram: the same engine also serves mode `suffix` (SuffixDecoding), chosen per request "
            "(needs arctic-inference, which scripts/bootstrap.sh builds). method suffix: its settings (unset: "
            "vLLM's defaults)."
        ),
    )
    replicas: int = Field(1, ge=1, description="Replicas when autoscaling is not set.")
    autoscaling: Optional[AutoscalingConfig] = Field(None, description="Ray Serve autoscaling of replicas.")
    max_ongoing_requests: int = Field(
        64, ge=1, description="Requests one replica admits at once (Ray Serve backpressure)."
    )
    max_queued_requests: int = Field(
        128, ge=-1, description="Requests queued for this pool before callers get 'overloaded' (-1: no bound)."
    )
    max_model_len: int = Field(2048, ge=64, description="Context length of the engines.")
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM tensor parallelism of the target.")
    bundles: list[dict[str, float]] = Field(
        default_factory=lambda: [{"CPU": 1}],
        description=(
            "Placement-group bundles of one replica, e.g. [{CPU: 1, GPU: 1}, {GPU: 1}] for TP=2; "
            "the replica actor takes the first bundle, vLLM workers the rest."
        ),
    )
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "STRICT_PACK", description="Ray placement-group strategy for a replica's bundles."
    )
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Extra vLLM AsyncEngineArgs, passed through as given."
    )
    openai_server_args: list[str] = Field(default_factory=list, description=(
        "vLLM's OpenAI server options for the pool's serving layer (--chat-template, --tool-call-parser, ...)."))
    env: dict[str, str] = Field(default_factory=dict, description="Environment of the replica's process.")
    startup_timeout_s: float = Field(
        600.0, gt=0, description=(
            "One replica's model preparation and vLLM engine start must finish within this; past it the "
            "replica fails with EngineStartTimeout naming this field and Serve tries another."))
    health_probe_interval_s: float = Field(
        30.0, ge=0, description="At most this often, the health check runs a real 1-token generation (0: every check)."
    )
    health_probe_timeout_s: float = Field(
        20.0, gt=0, description="A health probe generation slower than this marks the replica unhealthy."
    )
    drain_grace_s: float = Field(
        60.0, ge=0, description="On scale-down or upgrade, a replica finishes its requests for at most this long."
    )
    hardware_group: Optional[str] = Field(
        None,
        description=(
            "Pools with the same group run on the same hardware (e.g. every pool of a one-machine "
            "cluster): the router sees their load as one, and consolidates plain decoding instead of "
            "spreading it, since another engine on the same cores is not spare capacity."
        ),
    )
    prior_alpha: dict[str, float] = Field(
        default_factory=dict,
        description=(
            "Cold-start acceptance rate α per workload class for this pool's method, measured on this "
            "target (`*` for every class not listed); live traffic outweighs it. Empty: built-in priors."
        ),
    )
    prior_draft_rate: dict[str, float] = Field(
        default_factory=dict,
        description=(
            "Cold-start share of steps in which a lookup proposer finds a draft, per workload class "
            "(`*` for the rest), measured with `prior_alpha`. Empty: every step drafts (a model drafter)."
        ),
    )

    prior_draft_cost: Optional[DraftCostPrior] = Field(
        None,
        description=(
            "Cold-start cost of this pool's proposer, relative to one plain target step at batch 1 and "
            "without verification: `per_step` (paid once by a step that drafts, whatever K) and "
            "`per_token` (per draft token), measured on this hardware; measured step times replace "
            "it as traffic comes. Unset: built-in priors (GPU-like figures)."
        ),
    )

    @field_validator("bundles")
    @classmethod
    def _bundles(cls, v: list[dict[str, float]]) -> list[dict[str, float]]:
        if not v:
            raise ValueError("needs at least one bundle")
        for b in v:
            for res, amount in b.items():
                if amount < 0:
                    raise ValueError(f"resource {res!r} must be >= 0, got {amount}")
        return v

    @field_validator("prior_alpha")
    @classmethod
    def _prior_alpha(cls, v: dict[str, float]) -> dict[str, float]:
        return check_prior_alpha(v)

    @field_validator("prior_draft_rate")
    @classmethod
    def _prior_draft_rate(cls, v: dict[str, float]) -> dict[str, float]:
        return check_prior_draft_rate(v)

    @model_validator(mode="after")
    def _method(self) -> "PoolConfig":
        if self.method == SpecMode.NONE and self.max_k != 0:
            raise ValueError("max_k must be 0 when method is 'none'")
        if self.method != SpecMode.NONE and self.max_k < 1:
            raise ValueError(f"max_k must be >= 1 for method {self.method.value!r}")
        if self.method in DRAFTER_METHODS and not self.drafter:
            raise ValueError(f"method {self.method.value!r} needs `drafter`")
        if self.method not in DRAFTER_METHODS and self.drafter:
            raise ValueError(f"`drafter` is only used by {sorted(m.value for m in DRAFTER_METHODS)}")
        if (self.method == SpecMode.REMOTE_DRAFT) != bool(self.remote_drafter):
            raise ValueError("`remote_drafter` is needed by, and only used by, method 'remote_draft'")
        if "trust_remote_code" in self.engine_kwargs:
            raise ValueError("engine_kwargs.trust_remote_code: set models.<model>.trust_remote_code on the model that needs it")
        if self.ngram_max < self.ngram_min:
            raise ValueError("ngram_max must be >= ngram_min")
        if self.suffix is not None and self.method not in LOOKUP_METHODS:
            raise ValueError(f"suffix: only pools with method 'ngram' or 'suffix' draft from a suffix tree, "
                             f"not {self.method.value!r}")
        return self

    @property
    def least_replicas(self) -> int:
        """Replicas the pool runs at its smallest (autoscaling's min_replicas, else replicas)."""
        return self.autoscaling.min_replicas if self.autoscaling else self.replicas

    @property
    def most_replicas(self) -> int:
        """Replicas the pool runs at its largest (autoscaling's max_replicas, else replicas)."""
        return self.autoscaling.max_replicas if self.autoscaling else self.replicas

    @property
    def uses_step_k(self) -> bool:
        """Whether the pool drafts at all: then the requests the policy sends it get their K from the
        engine at every step, up to max_k (`cluster.engine.step_k`)."""
        return self.max_k > 0 and self.method != SpecMode.NONE

    @property
    def uses_lookup_proposer(self) -> bool:
        """Whether the engine drafts with specserve's lookup proposer (n-gram and suffix per request)
        instead of vLLM's own: every pool that drafts from a suffix tree."""
        return self.method == SpecMode.SUFFIX or (self.method == SpecMode.NGRAM and self.suffix is not None)

    @property
    def suffix_settings(self) -> SuffixConfig:
        return self.suffix if self.suffix is not None else SuffixConfig()

    @property
    def modes(self) -> list[SpecMode]:
        """Modes a request can get from this pool: its method (n-gram pools with `suffix` set: and
        suffix), and plain decoding (K = 0)."""
        if self.method == SpecMode.NONE:
            return [SpecMode.NONE]
        extra = [SpecMode.SUFFIX] if self.method == SpecMode.NGRAM and self.suffix is not None else []
        return [self.method, *extra, SpecMode.NONE]

    def mode_max_k(self, mode: SpecMode) -> int:
        """The largest K a request of `mode` may have in this pool (0 for mode none)."""
        if mode == SpecMode.NONE:
            return 0
        if mode == SpecMode.SUFFIX and self.method == SpecMode.NGRAM and self.suffix is not None:
            return self.suffix.max_k
        return self.max_k

    @property
    def engine_max_k(self) -> int:
        """The engine's K_max (vLLM's num_speculative_tokens): the largest K of any of its modes."""
        return max(self.mode_max_k(m) for m in self.modes)

    def mode_prior_alpha(self, mode: SpecMode) -> dict[str, float]:
        """The cold-start α table of one of the pool's modes."""
        if mode == SpecMode.SUFFIX and self.method != SpecMode.SUFFIX:
            return dict(self.suffix_settings.prior_alpha)
        return dict(self.prior_alpha)

    def mode_prior_draft_rate(self, mode: SpecMode) -> dict[str, float]:
        """The cold-start draft-rate table of one of the pool's modes."""
        if mode == SpecMode.SUFFIX and self.method != SpecMode.SUFFIX:
            return dict(self.suffix_settings.prior_draft_rate)
        return dict(self.prior_draft_rate)
