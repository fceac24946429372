"""Cluster config: one YAML file, validated by pydantic, that describes models, engine pools,
the router, Redis and the API ports. A bad file fails at load with a message naming the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

# The service sections live in cluster.config_sections; importers reach every section through here.
from cluster.config_sections import (  # noqa: F401
    ApiConfig, AuthConfig, DrafterWireConfig, LimitsConfig, RayConfig, RedisConfig, RouterConfig, Strict, SuffixConfig,
    TeachingConfig, TlsConfig, check_prior_alpha, check_prior_draft_rate,
)
from cluster.speculation import SpecMode

# Methods that run on vLLM's CPU build here; the rest are passed through to vLLM on GPUs.
CPU_METHODS = {SpecMode.NONE, SpecMode.NGRAM, SpecMode.SUFFIX, SpecMode.DRAFT_MODEL, SpecMode.EAGLE, SpecMode.REMOTE_DRAFT}
# Methods whose proposer is a separate set of weights named by `drafter`.
DRAFTER_METHODS = {SpecMode.DRAFT_MODEL, SpecMode.EAGLE, SpecMode.EAGLE3}
# Methods whose drafts come from lookup in the context (and, for suffix, earlier outputs).
LOOKUP_METHODS = {SpecMode.NGRAM, SpecMode.SUFFIX}
# Router calls of its own beside requests (status, models, tuning reads) in its admission bound.
ROUTER_OWN_CALLS = 64


class ConfigError(ValueError):
    """A cluster config that does not validate; the message names the field."""


class ModelConfig(Strict):
    source: str = Field(
        description=(
            "Where the weights come from: 'gguf-package:<module>/<file>.gguf' (a GGUF file shipped "
            "inside an installed Python package, converted once to a Hugging Face directory), "
            "'truncate:<model>:<layers>' (a drafter made from the first <layers> decoder layers of "
            "another model in this file), 'shipped:<model>:<dir>' (a distilled drafter shipped under "
            "the cluster package, e.g. data/drafters/smollm2-135m-eagle, completed with target <model>'s "
            "shared tensors), a local Hugging Face directory, or a hub id."
        )
    )
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field(
        "auto", description="Weights dtype for vLLM ('auto' takes the checkpoint's)."
    )
    trust_remote_code: bool = Field(
        False, description=(
            "Run the Python code shipped inside this model's checkpoint (its `auto_map`), with the engine's "
            "permissions: only for a model whose architecture needs it; say why beside it, and pin the revision. "
            "The only place it may be turned on (a pool's engine_kwargs may not)."))


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


class DrafterDeploymentConfig(Strict):
    """A drafter deployment (`deployments/drafter.py`): a draft model in its own replicas, placed
    apart from the targets, that pools with `method: remote_draft` call once per step."""

    model: str = Field(description="Draft model (a key of `models`); it must share the targets' tokenizer.")
    replicas: int = Field(1, ge=1, description="Drafter replicas (each target engine keeps to one of them).")
    resources: dict[str, float] = Field(
        default_factory=lambda: {"CPU": 1},
        description=(
            "Ray resources of one replica: CPU, GPU, and custom resources that only the drafters' worker "
            "group advertises (e.g. {GPU: 1, drafter_node: 1}) so that drafters land on their own nodes."
        ),
    )
    max_sequences: int = Field(256, ge=1, description="Sequences whose draft state one replica keeps (LRU beyond).")
    idle_ttl_s: float = Field(120.0, gt=0, description="A sequence idle this long is forgotten (its target died).")
    max_context: int = Field(8192, ge=16, description="Sequences longer than this get no drafts.")
    max_k: int = Field(16, ge=1, le=64, description="Most drafts per sequence per call (pools' max_k at most this).")
    port: int = Field(0, ge=0, le=65535, description="TCP port of the per-step draft endpoint (0: any free port).")
    wire: DrafterWireConfig = Field(default_factory=DrafterWireConfig)
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment of the replica's process (in Ray's GCS: not for secrets; the wire's comes "
                    "from SPECSERVE_DRAFTER_SECRET in the node's environment).")

    @field_validator("resources")
    @classmethod
    def _resources(cls, v: dict[str, float]) -> dict[str, float]:
        for res, amount in v.items():
            if amount < 0:
                raise ValueError(f"resource {res!r} must be >= 0, got {amount}")
        return v

    @model_validator(mode="after")
    def _wire_fits_context(self) -> "DrafterDeploymentConfig":
        # A sequence is sent whole after a resync: one call, one frame (ids take up to 5 bytes each).
        if self.wire.max_tokens_per_call < self.max_context:
            raise ValueError(f"wire.max_tokens_per_call ({self.wire.max_tokens_per_call}) must be at least "
                             f"max_context ({self.max_context})")
        if self.wire.max_frame_bytes < 5 * self.max_context + 4096:
            raise ValueError(f"wire.max_frame_bytes ({self.wire.max_frame_bytes}) must hold a sequence of "
                             f"max_context tokens: at least {5 * self.max_context + 4096}")
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

class ClusterConfig(Strict):
    name: str = Field("specserve", description="Ray Serve application name.")
    models: dict[str, ModelConfig] = Field(description="Models by served name.")
    pools: dict[str, PoolConfig] = Field(description="Engine pools by name.")
    drafters: dict[str, DrafterDeploymentConfig] = Field(
        default_factory=dict, description="Drafter deployments by name, for pools with method remote_draft."
    )
    router: RouterConfig = Field(default_factory=RouterConfig)
    redis: RedisConfig = Field(default_factory=RedisConfig)
    api: ApiConfig = Field(default_factory=ApiConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    ray: RayConfig = Field(default_factory=RayConfig)

    @model_validator(mode="after")
    def _refs(self) -> "ClusterConfig":
        if not self.pools:
            raise ValueError("pools: at least one pool is needed")
        for name, pool in self.pools.items():
            if pool.model not in self.models:
                raise ValueError(f"pools.{name}.model: unknown model {pool.model!r}; known: {sorted(self.models)}")
            if pool.drafter and pool.drafter not in self.models:
                raise ValueError(f"pools.{name}.drafter: unknown model {pool.drafter!r}; known: {sorted(self.models)}")
            if pool.remote_drafter and pool.remote_drafter not in self.drafters:
                raise ValueError(
                    f"pools.{name}.remote_drafter: unknown drafter {pool.remote_drafter!r}; known: {sorted(self.drafters)}"
                )
            if pool.remote_drafter and pool.max_k > self.drafters[pool.remote_drafter].max_k:
                raise ValueError(f"pools.{name}.max_k: {pool.max_k} is more than drafters.{pool.remote_drafter}.max_k "
                                 f"({self.drafters[pool.remote_drafter].max_k}), which its drafter drafts at most")
        for name, d in self.drafters.items():
            if d.model not in self.models:
                raise ValueError(f"drafters.{name}.model: unknown model {d.model!r}; known: {sorted(self.models)}")
        for name, model in self.models.items():
            if model.source.startswith("truncate:"):
                parts = model.source.split(":")
                if len(parts) != 3 or parts[1] not in self.models or not parts[2].isdigit():
                    raise ValueError(
                        f"models.{name}.source: expected 'truncate:<model>:<layers>' naming a model of this file"
                    )
            if model.source.startswith("shipped:"):
                parts = model.source.split(":", 2)
                if len(parts) != 3 or parts[1] not in self.models or not parts[2]:
                    raise ValueError(
                        f"models.{name}.source: expected 'shipped:<model>:<dir>' naming a model of this file"
                    )
        for model in self.served_models():
            if not any(p.auto for p in self.pools.values() if p.model == model):
                raise ValueError(f"pools: no pool of model {model!r} has auto: true; the auto policy needs one")
        if self.router.default_mode not in ("auto", "none"):
            mode = SpecMode.parse(self.router.default_mode)
            if not any(mode in p.modes for p in self.pools.values()):
                raise ValueError(f"router.default_mode: no pool serves mode {mode.value!r}")
        return self

    def router_max_ongoing(self) -> int:
        """Requests one router replica admits (`router.max_ongoing_requests`; unset, every pool's
        capacity at its most replicas plus ROUTER_OWN_CALLS). Each router replica calls the pools
        through its own handle, whose queue bound (a pool's max_queued_requests) raises the 429: a
        router admitting less than that never reaches it, and a burst of long requests then waits at
        the proxies until it times out instead of being turned away."""
        if self.router.max_ongoing_requests is not None:
            return self.router.max_ongoing_requests
        return ROUTER_OWN_CALLS + sum(
            p.max_ongoing_requests * p.most_replicas
            + max(p.max_queued_requests, 0) for p in self.pools.values())

    def served_models(self) -> list[str]:
        """Target models that at least one pool serves (drafters are not served)."""
        return sorted({p.model for p in self.pools.values()})

def load_config(path: str | Path) -> ClusterConfig:
    """Read and validate a cluster config; raise ConfigError naming the bad field."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    return parse_config(raw, origin=str(path))

def parse_config(raw: Any, origin: str = "<config>") -> ClusterConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"{origin}: top level must be a mapping")
    try:
        return ClusterConfig.model_validate(raw)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = ".".join(str(x) for x in err["loc"]) or "(top level)"
            lines.append(f"  {loc}: {err['msg']}")
        raise ConfigError(f"{origin}: invalid cluster config:\n" + "\n".join(lines)) from None
