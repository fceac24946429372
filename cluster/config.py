"""Cluster config: one YAML file, validated by pydantic, that describes models, engine pools,
the router, Redis and the API ports. A bad file fails at load with a message naming the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from cluster.config_pool import PoolConfig
# The service sections live in cluster.config_sections; importers reach every one of them through here.
from cluster.config_sections import (  # noqa: F401
    ApiConfig, AuthConfig, DrafterWireConfig, LimitsConfig, RayConfig, RedisConfig, RouterConfig, Strict,
    TeachingConfig, TlsConfig,
)
from cluster.speculation import SpecMode

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
