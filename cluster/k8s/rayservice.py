"""The KubeRay RayService of an overlay, from the cluster config and the overlay's render settings:
its Serve config (serveConfigV2: one application whose per-deployment entries are the builder's own
options from cluster.ops.placement), the RayCluster with its in-tree autoscaler, and the pod template
of each Ray node group: resources, a hardened security context, ports and probes, and the environment
and volumes that reach Kubernetes Secrets only by reference (Redis passwords, API keys, the drafter
wire's secret), with the init container that signs Ray's mutual-TLS node certificate.

Pure functions over plain data; cluster/k8s/render.py puts the RayService beside the overlay's other
objects and writes the files.
"""

from __future__ import annotations

import copy
import json
from pathlib import PurePosixPath
from typing import Any
from urllib.parse import urlparse

import yaml

from cluster.config import ClusterConfig
from cluster.engine.draft_wire import SECRET_ENV
from cluster.routing.deadline import proxy_timeout_s
from cluster.ops.placement import (
    APP_IMPORT_PATH,
    GRPC_SERVICER_FUNCTIONS, drafter_deployment_options, engine_deployment_options, grpc_reflection,
    router_deployment_options, used_drafters,
)
from cluster.ops.ray_driver import ray_node_env
from cluster.k8s.render_settings import NodeGroup, RenderSettings

RUN_AS_UID = 1000  # the `specserve` user of k8s/docker/Dockerfile.{cpu,gpu}
Obj = dict[str, Any]


# -- Serve config -------------------------------------------------------------------------------------


def _serve_options(opts: dict[str, Any]) -> Obj:
    """Deployment options of cluster.ops.placement as Serve config entries.

    `ray_actor_options` stays with the builder: its runtime_env is computed inside the cluster
    (e.g. LD_PRELOAD of the image's venv), and a Serve config entry would replace it.
    """
    return {k: copy.deepcopy(v) for k, v in opts.items() if k != "ray_actor_options"}


def serve_config(raw: dict[str, Any], cfg: ClusterConfig, settings: RenderSettings) -> Obj:
    """Ray Serve config (serveConfigV2): one application built by deployments.app from `raw`.

    Its per-deployment entries are the builder's own options (cluster.ops.placement), so KubeRay's
    view and `build_app`'s agree; only the shutdown grace is the overlay's.
    """
    deployments = [_serve_options(router_deployment_options(cfg))]
    deployments += [_serve_options(drafter_deployment_options(n, cfg.drafters[n], {})) for n in used_drafters(cfg)]
    for name, pool in cfg.pools.items():
        d = _serve_options(engine_deployment_options(name, pool, {}, redis=cfg.redis))
        d["graceful_shutdown_timeout_s"] = settings.graceful_shutdown_timeout_s
        deployments.append(d)
    out: Obj = {
        "proxy_location": "EveryNode",
        "http_options": {"host": cfg.api.host, "port": cfg.api.http_port,
                         "request_timeout_s": proxy_timeout_s(cfg.router.request_timeout_s)},
        "logging_config": {"encoding": "JSON", "log_level": "INFO"},
        "applications": [
            {
                "name": cfg.name,
                "route_prefix": "/",
                "import_path": APP_IMPORT_PATH,
                "args": {"config": raw},
                "deployments": deployments,
            }
        ],
    }
    if cfg.api.grpc_port:
        out["grpc_options"] = {"port": cfg.api.grpc_port, "grpc_servicer_functions": list(GRPC_SERVICER_FUNCTIONS),
                               "enable_reflection": grpc_reflection(cfg),
                               "request_timeout_s": proxy_timeout_s(cfg.router.request_timeout_s)}
    return out


# -- the Ray pods: resources, security, Secrets by reference, Ray's TLS -------------------------------


def _qty_gib(gib: float) -> str:
    return f"{int(gib)}Gi" if float(gib).is_integer() else f"{int(round(gib * 1024))}Mi"


def _hardened() -> Obj:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _labels(settings: RenderSettings, component: str, group: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": settings.name,
        "app.kubernetes.io/component": component,
        "specserve.io/group": group,
        "specserve.io/redis-client": "true",
    }


REDIS_TUNING_PASSWORD_KEY = "tuning-password"  # keys of settings.redis_secret (k8s/base/redis.yaml reads them too)
REDIS_GCS_PASSWORD_KEY = "gcs-password"
API_KEYS_SECRET_KEY = "keys"  # the key of settings.api_keys_secret that holds the API keys


def api_key_env(cfg: ClusterConfig, settings: RenderSettings) -> list[Obj]:
    """With auth on: the router's key variable (auth.api_keys_env) from the API-key Secret, by reference.

    Optional when a key file is configured too (then either source may hold the keys)."""
    if not (cfg.auth.enabled and cfg.auth.api_keys_env):
        return []
    ref: Obj = {"name": settings.api_keys_secret, "key": API_KEYS_SECRET_KEY}
    if cfg.auth.api_keys_file:
        ref["optional"] = True
    return [{"name": cfg.auth.api_keys_env, "valueFrom": {"secretKeyRef": ref}}]


DRAFTER_SECRET_KEY = "secret"  # the key of settings.drafter_secret


def drafter_secret_env(cfg: ClusterConfig, settings: RenderSettings) -> list[Obj]:
    """With drafters: the drafter wire's shared secret (`cluster.engine.draft_wire`) from its Secret, by
    reference, in every Ray pod (drafter replicas and the engines that call them may land anywhere)."""
    if not used_drafters(cfg):
        return []

    ref = {"name": settings.drafter_secret, "key": DRAFTER_SECRET_KEY}
    return [{"name": SECRET_ENV, "valueFrom": {"secretKeyRef": ref}}]


def api_key_volume(cfg: ClusterConfig, settings: RenderSettings) -> tuple[list[Obj], list[Obj]]:
    """(volumes, volumeMounts): with auth on and auth.api_keys_file set, the API-key Secret mounted
    so that its key named like the file's basename is that file. Kubernetes updates a mounted
    Secret in place, and the router re-reads the file: keys rotate without a restart."""
    if not (cfg.auth.enabled and cfg.auth.api_keys_file):
        return [], []
    path = PurePosixPath(cfg.auth.api_keys_file)
    volume = {"name": "api-keys", "secret": {"secretName": settings.api_keys_secret, "defaultMode": 0o440,
                                             "items": [{"key": path.name, "path": path.name}]}}
    return [volume], [{"name": "api-keys", "mountPath": str(path.parent), "readOnly": True}]


RAY_TLS_DIR, RAY_CA_DIR = "/etc/specserve/ray-tls", "/etc/specserve/ray-ca"


def ray_tls_parts(cfg: ClusterConfig, settings: RenderSettings) -> tuple[list[Obj], list[Obj], list[Obj], list[Obj]]:
    """(env, volumes, volumeMounts, initContainers) of a Ray pod with Ray's mutual TLS (ray.tls.enabled;
    cluster/ops/ray_tls.py): an init container signs a certificate for the pod's address with the CA of
    the Secret `ray_tls_secret` (`ca.crt`, `ca.key`) into a memory volume, which Ray's containers read
    (RAY_USE_TLS and the three files); the CA's key stays in the init container."""
    if not cfg.ray.tls.enabled:
        return [], [], [], []
    env = [{"name": k, "value": v} for k, v in (("RAY_USE_TLS", "1"), ("RAY_TLS_SERVER_CERT", f"{RAY_TLS_DIR}/tls.crt"),
                                               ("RAY_TLS_SERVER_KEY", f"{RAY_TLS_DIR}/tls.key"),
                                               ("RAY_TLS_CA_CERT", f"{RAY_TLS_DIR}/ca.crt"))]
    volumes = [{"name": "ray-tls", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}},
               {"name": "ray-ca", "secret": {"secretName": settings.ray_tls_secret, "defaultMode": 0o440,
                                             "items": [{"key": "ca.crt", "path": "ca.crt"},
                                                       {"key": "ca.key", "path": "ca.key"}]}}]
    mounts = [{"name": "ray-tls", "mountPath": RAY_TLS_DIR, "readOnly": True}]
    init = {
        "name": "ray-tls",
        "image": settings.image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["python", "-m", "cluster.ops.ray_tls", "node-cert", "--ca-dir", RAY_CA_DIR, "--out", RAY_TLS_DIR,
                    "--host", "$(POD_IP)"],
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"cpu": "500m", "memory": "256Mi"}},
        "securityContext": _hardened(),
        "volumeMounts": [{"name": "ray-tls", "mountPath": RAY_TLS_DIR},
                         {"name": "ray-ca", "mountPath": RAY_CA_DIR, "readOnly": True}],
    }
    return env, volumes, mounts, [init]


def _pod(settings: RenderSettings, cfg: ClusterConfig, group: NodeGroup, role: str, group_name: str) -> Obj:
    """Pod template of one Ray node group (role: head or worker)."""
    res: Obj = {"cpu": f"{group.cpu:g}", "memory": _qty_gib(group.memory_gib)}
    if group.gpus:
        res["nvidia.com/gpu"] = str(group.gpus)
    tls_env, tls_volumes, tls_mounts, tls_init = ray_tls_parts(cfg, settings)
    env = [{"name": k, "value": v} for k, v in sorted(settings.env.items())]
    env += [
        {"name": "HOME", "value": "/tmp"},
        # Ray starts workers (Serve replicas, so the engines) at nice 15 by default: see cluster/ops/up.py.
        {"name": "RAY_worker_niceness", "value": "0"},
        *({"name": k, "value": v} for k, v in sorted(ray_node_env(cfg).items())),  # e.g. the gRPC message-size bound
        {"name": "SPECSERVE_REDIS_PASSWORD",
         "valueFrom": {"secretKeyRef": {"name": settings.redis_secret, "key": REDIS_TUNING_PASSWORD_KEY}}},
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": settings.hf_secret, "key": "token", "optional": True}}},
        *api_key_env(cfg, settings),
        *drafter_secret_env(cfg, settings),
        *tls_env,
    ]
    ports = [{"name": "serve", "containerPort": cfg.api.http_port}]
    if cfg.api.grpc_port:
        ports.append({"name": "grpc", "containerPort": cfg.api.grpc_port})
    if role == "head":
        ports = [{"name": "gcs", "containerPort": 6379}, {"name": "dashboard", "containerPort": 8265},
                 {"name": "client", "containerPort": 10001}] + ports
    container: Obj = {
        "name": f"ray-{role}",
        "image": settings.image,
        "imagePullPolicy": "IfNotPresent",
        "ports": ports,
        "env": env,
        "resources": {"requests": dict(res), "limits": dict(res)},
        "securityContext": _hardened(),
        "volumeMounts": [
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "cache", "mountPath": "/var/cache/specserve"},
            *api_key_volume(cfg, settings)[1],
            *tls_mounts,
        ],
        "lifecycle": {"preStop": {"exec": {"command": ["/bin/sh", "-c", "ray stop"]}}},
    }
    if role == "worker":
        # Ready = this pod's Serve proxy answers the standard grpc.health.v1 service (the router's).
        container["readinessProbe"] = (
            {"grpc": {"port": cfg.api.grpc_port}, "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 3}
            if cfg.api.grpc_port
            else {"httpGet": {"path": "/-/healthz", "port": cfg.api.http_port}, "periodSeconds": 10}
        )
    spec: Obj = {
        "securityContext": {
            "runAsNonRoot": True, "runAsUser": RUN_AS_UID, "runAsGroup": RUN_AS_UID, "fsGroup": RUN_AS_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        # The head keeps its token: the in-tree autoscaler sidecar talks to the Kubernetes API.
        "automountServiceAccountToken": role == "head",
        "terminationGracePeriodSeconds": settings.termination_grace_s,
        "containers": [container],
        "volumes": [
            {"name": "tmp", "emptyDir": {"sizeLimit": "10Gi"}},
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": _qty_gib(group.shm_gib)}},
            {"name": "cache", "emptyDir": {"sizeLimit": _qty_gib(group.cache_gib)}},
            *api_key_volume(cfg, settings)[0],
            *tls_volumes,
        ],
    }
    if tls_init:
        spec["initContainers"] = tls_init
    if group.node_selector:
        spec["nodeSelector"] = dict(group.node_selector)
    if group.tolerations:
        spec["tolerations"] = copy.deepcopy(group.tolerations)
    return {"metadata": {"labels": _labels(settings, f"ray-{role}", group_name)}, "spec": spec}


def _start_params(group: NodeGroup, head: bool) -> dict[str, str]:
    params = {"num-cpus": str(int(group.ray_resources()["CPU"]))}
    if head:
        params["dashboard-host"] = "0.0.0.0"
    if group.custom_resources:
        # KubeRay's (and the Ray autoscaler's) format: a JSON object inside escaped quotes.
        params["resources"] = '"' + json.dumps(group.custom_resources, sort_keys=True).replace('"', '\\"') + '"'
    return params


# -- the RayService -----------------------------------------------------------------------------------


def ray_service(raw: dict[str, Any], cfg: ClusterConfig, settings: RenderSettings) -> Obj:
    serve_yaml = yaml.safe_dump(serve_config(raw, cfg, settings), sort_keys=False, default_flow_style=False)
    redis = urlparse(cfg.redis.url)
    ports = [{"name": "http", "port": cfg.api.http_port, "targetPort": cfg.api.http_port, "appProtocol": "http"}]
    if cfg.api.grpc_port:
        ports.append({"name": "grpc", "port": cfg.api.grpc_port, "targetPort": cfg.api.grpc_port,
                      "appProtocol": "kubernetes.io/h2c"})
    tls_env, _, tls_mounts, _ = ray_tls_parts(cfg, settings)
    cluster: Obj = {
        "rayVersion": settings.ray_version,
        "enableInTreeAutoscaling": True,
        "autoscalerOptions": {
            "version": "v2",
            "upscalingMode": settings.upscaling_mode,
            "idleTimeoutSeconds": settings.autoscaler_idle_timeout_s,
            "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"cpu": "500m", "memory": "512Mi"}},
            "securityContext": _hardened(),
            # The autoscaler dials the GCS too: with Ray's TLS on, with the pod's certificate.
            "env": tls_env,
            "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, *tls_mounts],
        },
        "headGroupSpec": {
            "rayStartParams": _start_params(settings.head, head=True),
            "template": _pod(settings, cfg, settings.head, "head", "head"),
        },
        "workerGroupSpecs": [
            {
                "groupName": g.name,
                "replicas": g.replicas if g.replicas is not None else g.min_replicas,
                "minReplicas": g.min_replicas,
                "maxReplicas": g.max_replicas,
                **({"idleTimeoutSeconds": g.idle_timeout_s} if g.idle_timeout_s is not None else {}),
                "rayStartParams": _start_params(g, head=False),
                "template": _pod(settings, cfg, g, "worker", g.name),
            }
            for g in settings.worker_groups
        ],
    }
    if settings.gcs_fault_tolerance:
        cluster["gcsFaultToleranceOptions"] = {
            "redisAddress": f"{redis.hostname}:{redis.port or 6379}",
            "redisUsername": {"value": settings.redis_gcs_user},  # a name, not a secret
            "redisPassword": {"valueFrom": {"secretKeyRef": {"name": settings.redis_secret, "key": REDIS_GCS_PASSWORD_KEY}}},
            "externalStorageNamespace": f"{settings.name}-gcs",
        }
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": settings.name},
        "spec": {
            # A changed rayClusterConfig starts a new RayCluster; traffic moves when it is ready.
            "upgradeStrategy": {"type": "NewCluster"},
            "rayClusterDeletionDelaySeconds": settings.cluster_deletion_delay_s,
            "serveService": {"metadata": {"name": f"{settings.name}-serve"}, "spec": {"type": "ClusterIP", "ports": ports}},
            "serveConfigV2": serve_yaml,
            "rayClusterConfig": cluster,
        },
    }
