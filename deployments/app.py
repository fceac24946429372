"""The application graph: one engine deployment per pool, one drafter deployment per entry of
`drafters` (bound to the pools that draft remotely), and the router ingress bound to the engines.

`build_app(args)` is the Ray Serve import path (`deployments.app:build_app`), used alike by
`specserve up` and by the Serve config rendered for KubeRay. `args` holds the cluster config,
inline (`{"config": {...}}`) or as a path (`{"config_path": "..."}`).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from ray import serve

from cluster.api.auth import ApiKeyStore
from cluster.autoscale.ray_policy import AutoscaleRecords
from cluster.config import ClusterConfig, DrafterDeploymentConfig, load_config, parse_config
from cluster.config_pool import PoolConfig
from cluster.ops import logsafe, models  # by module: tests replace their functions
from cluster.ops.metrics import RouterMetrics
from cluster.ops.placement import (
    cpu_engine_env, drafter_deployment_options, engine_deployment_options, router_deployment_options, used_drafters,
)
from cluster.routing.classifier import classify
from deployments.drafter import DrafterServer
from deployments.engine import EngineServer, engine_kwargs
from deployments.engine_death import retire_process
from deployments.engine_lane import LaneServer, lane_path, node_lane_folder
from deployments.engine_start import start_vllm, within_startup_timeout
from deployments.router import Router
from deployments.router_door import DOOR_DRAIN_S, Doors
from deployments.router_lane import Lanes
from deployments.vllm_openai import build_openai_app, server_args

log = logging.getLogger("specserve.app")


class EngineReplica(EngineServer):
    """EngineServer that prepares its own model files on the node it lands on (cached per node) and
    starts its engine within the pool's startup_timeout_s (Ray Serve awaits an async constructor)."""

    async def __init__(self, pool_name: str, pool: PoolConfig, config: ClusterConfig, drafter: Any = None):
        logsafe.setup_replica_logging()
        model = config.models[pool.model]

        paths: dict[str, str] = {}

        def start() -> Any:
            paths["model"] = model_path = models.resolve_model(pool.model, config)
            drafter_path = models.resolve_model(pool.drafter, config) if pool.drafter else None
            return start_vllm(pool_name, engine_kwargs(pool, model_path, drafter_path, pool.model, model.dtype,
                                                       trust_remote_code=model.trust_remote_code))

        engine = await within_startup_timeout(pool_name, pool.startup_timeout_s, start)
        # vLLM's own OpenAI serving layer over the engine: what the router's HTTP door forwards to.
        self.openai_app = await build_openai_app(engine, server_args(paths["model"], pool.model,
                                                                     pool.openai_server_args, pool_name))

        async def drafter_endpoint() -> str:  # `drafter`: the Serve handle of the pool's remote drafter
            return await drafter.endpoint.remote()

        super().__init__(pool_name, pool, pool.model, engine, retire=retire_process,
                         drafter_endpoint=drafter_endpoint if drafter is not None else None)
        folder = node_lane_folder() if config.router.engine_lane else None
        if folder is not None:
            try:
                self.lane = await LaneServer(lane_path(folder, pool_name, self.replica), self.generate,
                                             pool.max_ongoing_requests, pool.max_queued_requests).start()
            except OSError as e:
                log.warning("pool %s: no local lane (%s); the router calls this replica by its handle", pool_name, e)

    async def __del__(self):
        """Serve's graceful stop, after its own calls drained: the lane stops taking calls, its calls
        under way get DOOR_DRAIN_S to end, then the engine stops."""
        if getattr(self, "lane", None) is not None:
            await self.lane.drain(DOOR_DRAIN_S)
        self.shutdown()


class DrafterReplica(DrafterServer):
    """DrafterServer that prepares its draft model on the node it lands on (cached per node)."""

    def __init__(self, name: str, d: DrafterDeploymentConfig, config: ClusterConfig):
        logsafe.setup_replica_logging()
        super().__init__(name, models.resolve_model(d.model, config), dtype=config.models[d.model].dtype,
                         max_sequences=d.max_sequences, idle_ttl_s=d.idle_ttl_s, max_context=d.max_context,
                         port=d.port, num_threads=max(int(d.resources.get("CPU", 1)), 1), max_k=d.max_k,
                         wire=d.wire.model_dump())


class RouterReplica(Router):
    """Router with its I/O dependencies (tuning store in Redis, classifier) built in the replica, and
    with `api.door: router`, the API's listeners (deployments/router_door.py)."""

    async def __init__(self, config: ClusterConfig, engines: dict[str, Any]):
        logsafe.setup_replica_logging()
        auth = ApiKeyStore.from_config(config.auth) if config.auth.enabled else None
        metrics = RouterMetrics()
        super().__init__(config, engines, tuning=_make_tuning(config, on_malformed=metrics.tuning_key_ignored,
                                                              on_redis_error=metrics.tuning_redis_error),
                         classifier=_make_classifier(), auth=auth, metrics=metrics,
                         autoscale=_make_autoscale(config, on_malformed=lambda pool: metrics.failure(
                             "autoscale_record", "malformed")),
                         lanes=Lanes(node_lane_folder()) if config.router.engine_lane else None)
        self.doors = None
        if config.api.door == "router":
            self.doors = await Doors(self, config, on_refused=lambda reason: metrics.door_refused.inc(
                1, {"reason": reason})).open()

    async def __del__(self):
        """Serve's graceful stop: the listeners close, calls under way get DOOR_DRAIN_S to end."""
        if getattr(self, "doors", None) is not None:
            await self.doors.close(DOOR_DRAIN_S)


def _make_autoscale(config: ClusterConfig, **kwargs):
    """Reader of the goodput autoscaler's records, for the pools it decides (None if none does)."""
    pools = [n for n, p in config.pools.items() if p.autoscaling is not None and p.autoscaling.policy == "goodput"]
    return AutoscaleRecords(config.redis.model_dump(mode="json"), pools, **kwargs) if pools else None


def _make_tuning(config: ClusterConfig, **kwargs):
    from cluster.state.tuning import TuningStore

    return TuningStore.from_config(config, **kwargs)


def _make_classifier():
    return lambda prompt, messages: classify(text=prompt, messages=messages)


def config_from_args(args: dict[str, Any]) -> ClusterConfig:
    if "config" in args:
        return parse_config(args["config"], origin="args.config")
    if "config_path" in args:
        return load_config(args["config_path"])
    raise ValueError("build_app args need `config` (a dict) or `config_path`")


def build_app(args: dict[str, Any]) -> serve.Application:
    """The Ray Serve application builder (Ray requires exactly one parameter)."""
    return build_app_for(config_from_args(args))


def build_app_for(config: ClusterConfig, platform_env: Optional[dict[str, str]] = None) -> serve.Application:
    env = cpu_engine_env() if platform_env is None else platform_env
    drafters = {
        name: serve.deployment(DrafterReplica).options(
            **drafter_deployment_options(name, config.drafters[name], env)
        ).bind(name, config.drafters[name], config)
        for name in used_drafters(config)
    }
    engines = {}
    for name, pool in config.pools.items():
        extra = (drafters[pool.remote_drafter],) if pool.remote_drafter else ()
        engines[name] = serve.deployment(EngineReplica).options(
            **engine_deployment_options(name, pool, env, redis=config.redis)
        ).bind(name, pool, config, *extra)
    return serve.deployment(RouterReplica).options(**router_deployment_options(config)).bind(config, engines)
