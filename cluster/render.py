"""Kubernetes (KubeRay) manifests rendered from a cluster config: one source of truth.

Contract: an overlay directory `k8s/overlays/<name>/` holds `render.yaml` (Kubernetes-only facts:
image, node groups, pod sizes; `RenderSettings` below) naming a cluster config file (the same
YAML `specserve up` reads). `render()` turns the two into the overlay's `generated.yaml`: a KubeRay
RayService whose `serveConfigV2` embeds that cluster config for `deployments.app:build_app`, one
PodDisruptionBudget per worker group, the headless gRPC Service and the Ray pods' NetworkPolicy.
`build()` is the subset of `kustomize build` the overlays use (resources, namespace, labels,
images, strategic-merge patches); `kubectl kustomize` gives the same objects.

Decisions (what fits where, what a cluster config must say on Kubernetes) are pure functions over
plain data with dense tests; only `main` reads and writes files.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any, Literal, Optional
from urllib.parse import urlparse

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cluster.config import ClusterConfig, ConfigError, parse_config
from cluster.placement import (
    GRPC_SERVICER_FUNCTIONS, drafter_deployment_options, engine_deployment_options, router_deployment_options,
    ray_node_env, used_drafters,
)

IMPORT_PATH = "deployments.app:build_app"
RUN_AS_UID = 1000  # the `specserve` user of k8s/docker/Dockerfile.{cpu,gpu}
GENERATED = "generated.yaml"
Obj = dict[str, Any]


# -- settings of one overlay (render.yaml) ------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NodeGroup(_Strict):
    """One kind of Ray pod: its size and where Kubernetes may place it."""

    cpu: float = Field(gt=0, description="CPU cores requested (= limit) per pod.")
    memory_gib: float = Field(gt=0, description="Memory requested (= limit) per pod, GiB.")
    gpus: int = Field(0, ge=0, description="nvidia.com/gpu per pod; Ray advertises the same number of GPU.")
    ray_cpus: Optional[int] = Field(None, ge=0, description="CPU Ray advertises (None: the pod's whole cores).")
    custom_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Ray custom resources the pod advertises; pool bundles naming them land only here.",
    )
    node_selector: dict[str, str] = Field(default_factory=dict, description="Kubernetes nodeSelector.")
    tolerations: list[dict[str, Any]] = Field(default_factory=list, description="Kubernetes tolerations.")
    shm_gib: float = Field(1.0, gt=0, description="Size of /dev/shm (object store, NCCL), GiB.")
    cache_gib: float = Field(20.0, gt=0, description="emptyDir for model weights and compile caches, GiB.")

    def ray_resources(self) -> dict[str, float]:
        res: dict[str, float] = {"CPU": float(self.ray_cpus if self.ray_cpus is not None else int(self.cpu))}
        if self.gpus:
            res["GPU"] = float(self.gpus)
        res.update(self.custom_resources)
        return res


class WorkerGroup(NodeGroup):
    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", description="KubeRay groupName.")
    min_replicas: int = Field(0, ge=0, description="Pods the KubeRay autoscaler keeps at least.")
    max_replicas: int = Field(1, ge=1, description="Pods the KubeRay autoscaler may start at most.")
    replicas: Optional[int] = Field(None, ge=0, description="Pods at creation (default min_replicas).")
    idle_timeout_s: Optional[int] = Field(None, ge=0, description="Idle pods are removed after this.")


class RenderSettings(_Strict):
    cluster_config: str = Field(description="Cluster config file, relative to the overlay directory.")
    config_overrides: dict[str, Any] = Field(
        default_factory=dict, description="Deep-merged into the cluster config before it is embedded."
    )
    name: str = Field("specserve", description="Name of the RayService and prefix of generated objects.")
    image: str = Field(description="Ray image (k8s/docker/Dockerfile.*); kustomize `images` may rewrite it.")
    ray_version: str = Field("2.60.0", description="Ray version inside the image (KubeRay needs it).")
    env: dict[str, str] = Field(default_factory=dict, description="Environment of every Ray container.")
    head: NodeGroup = Field(description="The head pod (GCS, dashboard, router replicas, autoscaler).")
    worker_groups: list[WorkerGroup] = Field(min_length=1, description="Worker pod groups (engines).")
    redis_secret: str = Field("specserve-redis", description="Secret with `password` (and optional `url`).")
    hf_secret: str = Field("specserve-hf", description="Optional Secret with `token` (HF_TOKEN, gated models).")
    gcs_fault_tolerance: bool = Field(True, description="Ray GCS fault tolerance on the config's Redis.")
    autoscaler_idle_timeout_s: int = Field(300, ge=0, description="KubeRay autoscaler: idle pod lifetime.")
    upscaling_mode: Literal["Default", "Aggressive", "Conservative"] = Field("Default")
    graceful_shutdown_timeout_s: float = Field(
        120.0, gt=0, description="Serve lets a stopping engine replica finish requests this long."
    )
    termination_grace_s: int = Field(180, ge=0, description="Pod terminationGracePeriodSeconds.")
    cluster_deletion_delay_s: int = Field(60, ge=0, description="Old RayCluster lives this long after a switch.")
    operator_namespace: str = Field("kuberay-system", description="Namespace of the KubeRay operator (NetworkPolicy).")


def load_settings(overlay_dir: Path) -> RenderSettings:
    path = overlay_dir / "render.yaml"
    try:
        return RenderSettings.model_validate(yaml.safe_load(path.read_text()))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except ValidationError as e:
        lines = [f"  {'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()]
        raise ConfigError(f"{path}: invalid render settings:\n" + "\n".join(lines)) from None


# -- the cluster config as Kubernetes sees it ---------------------------------------------------------


def deep_merge(base: Any, override: Any) -> Any:
    """Mappings merge key by key (recursively); anything else in `override` replaces `base`."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for k, v in override.items():
            out[k] = deep_merge(base[k], v) if k in base else copy.deepcopy(v)
        return out
    return copy.deepcopy(override)


def effective_config(raw: dict[str, Any], overrides: dict[str, Any], origin: str) -> tuple[dict, ClusterConfig]:
    """The raw cluster config with the overlay's overrides, and its validated model."""
    merged = deep_merge(raw, overrides)
    return merged, parse_config(merged, origin=origin)


def k8s_config_errors(cfg: ClusterConfig) -> list[str]:
    """What a cluster config must say to run on Kubernetes (empty list: fine)."""
    errors = []
    if cfg.api.host != "0.0.0.0":
        errors.append(f"api.host must be 0.0.0.0 on Kubernetes (pods are reached by IP), got {cfg.api.host!r}")
    if cfg.redis.start_local:
        errors.append("redis.start_local must be false on Kubernetes (Redis is a StatefulSet or external)")
    host = urlparse(cfg.redis.url).hostname or ""
    if host in ("127.0.0.1", "localhost", "::1", ""):
        errors.append(f"redis.url must name a Service or external host, got {cfg.redis.url!r}")
    return errors


def _fits(need: dict[str, float], have: dict[str, float]) -> bool:
    return all(have.get(r, 0.0) >= amount for r, amount in need.items() if amount > 0)


def _sum(bundles: list[dict[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for b in bundles:
        for r, amount in b.items():
            total[r] = total.get(r, 0.0) + amount
    return total


def placement_errors(cfg: ClusterConfig, settings: RenderSettings) -> list[str]:
    """Do the pools' placement-group bundles fit the node groups, and does their TP match the GPUs?

    STRICT_PACK puts a replica's bundles on one pod, so their sum must fit one pod; the other
    strategies may spread them, so each bundle must fit some pod (STRICT_SPREAD: distinct pods).
    Capacity: for each resource, the pools' max replicas times their bundles must fit in the
    groups' max pods (plus the head).
    """
    errors: list[str] = []
    nodes = [("head", settings.head.ray_resources(), 1)]
    nodes += [(g.name, g.ray_resources(), g.max_replicas) for g in settings.worker_groups]
    demand: dict[str, float] = {}
    for name, pool in cfg.pools.items():
        where = f"pools.{name}"
        gpus = _sum(pool.bundles).get("GPU", 0.0)
        if gpus and gpus != pool.tensor_parallel_size:
            errors.append(f"{where}: bundles hold {gpus:g} GPU but tensor_parallel_size is {pool.tensor_parallel_size}")
        if pool.tensor_parallel_size > 1 and not gpus:
            errors.append(f"{where}: tensor_parallel_size {pool.tensor_parallel_size} needs GPU bundles")
        if pool.placement_strategy == "STRICT_PACK":
            if not any(_fits(_sum(pool.bundles), res) for _, res, _ in nodes):
                errors.append(f"{where}: STRICT_PACK bundles {pool.bundles} fit no single pod of {_shapes(nodes)}")
        else:
            for b in pool.bundles:
                if not any(_fits(b, res) for _, res, _ in nodes):
                    errors.append(f"{where}: bundle {b} fits no pod of {_shapes(nodes)}")
            if pool.placement_strategy == "STRICT_SPREAD" and len(pool.bundles) > sum(n for *_, n in nodes):
                errors.append(f"{where}: STRICT_SPREAD needs {len(pool.bundles)} pods")
        most = pool.autoscaling.max_replicas if pool.autoscaling else pool.replicas
        for r, amount in _sum(pool.bundles).items():
            demand[r] = demand.get(r, 0.0) + most * amount
    errors += _drafter_placement_errors(cfg, nodes, demand)
    for r, amount in sorted(demand.items()):
        supply = sum(res.get(r, 0.0) * n for _, res, n in nodes)
        if amount > supply:
            errors.append(f"capacity: pools may need {amount:g} {r} at max replicas, node groups offer {supply:g}")
    return errors


def _drafter_placement_errors(cfg: ClusterConfig, nodes, demand: dict[str, float]) -> list[str]:
    """Each drafter replica must fit some pod; a GPU drafter must not fit a pod its targets fit
    (drafters go on their own worker group: give them a custom resource only that group advertises)."""
    errors = []
    for name in used_drafters(cfg):
        d = cfg.drafters[name]
        fits = [g for g, res, _ in nodes if _fits(d.resources, res)]
        if not fits:
            errors.append(f"drafters.{name}: resources {d.resources} fit no pod of {_shapes(nodes)}")
        for pname, pool in cfg.pools.items():
            if pool.remote_drafter != name or not d.resources.get("GPU"):
                continue
            shared = [g for g, res, _ in nodes if g in fits and _fits(_sum(pool.bundles), res)]
            if shared:
                errors.append(f"drafters.{name}: may land with its targets (pools.{pname}) on {shared}; "
                              "give it a custom resource only the drafters' worker group advertises")
        for r, amount in d.resources.items():
            demand[r] = demand.get(r, 0.0) + d.replicas * amount
    return errors


def _shapes(nodes) -> str:
    return ", ".join(f"{n}={res}" for n, res, _ in nodes)


# -- Serve config and the RayService -----------------------------------------------------------------


def _serve_options(opts: dict[str, Any]) -> Obj:
    """Deployment options of cluster.placement as Serve config entries.

    `ray_actor_options` stays with the builder: its runtime_env is computed inside the cluster
    (e.g. LD_PRELOAD of the image's venv), and a Serve config entry would replace it.
    """
    return {k: copy.deepcopy(v) for k, v in opts.items() if k != "ray_actor_options"}


def serve_config(raw: dict[str, Any], cfg: ClusterConfig, settings: RenderSettings) -> Obj:
    """Ray Serve config (serveConfigV2): one application built by deployments.app from `raw`.

    Its per-deployment entries are the builder's own options (cluster.placement), so KubeRay's
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
        "http_options": {"host": cfg.api.host, "port": cfg.api.http_port},
        "logging_config": {"encoding": "JSON", "log_level": "INFO"},
        "applications": [
            {
                "name": cfg.name,
                "route_prefix": "/",
                "import_path": IMPORT_PATH,
                "args": {"config": raw},
                "deployments": deployments,
            }
        ],
    }
    if cfg.api.grpc_port:
        out["grpc_options"] = {"port": cfg.api.grpc_port, "grpc_servicer_functions": list(GRPC_SERVICER_FUNCTIONS)}
    return out


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


def _pod(settings: RenderSettings, cfg: ClusterConfig, group: NodeGroup, role: str, group_name: str) -> Obj:
    """Pod template of one Ray node group (role: head or worker)."""
    res: Obj = {"cpu": f"{group.cpu:g}", "memory": _qty_gib(group.memory_gib)}
    if group.gpus:
        res["nvidia.com/gpu"] = str(group.gpus)
    env = [{"name": k, "value": v} for k, v in sorted(settings.env.items())]
    env += [
        {"name": "HOME", "value": "/tmp"},
        # Ray starts workers (Serve replicas, so the engines) at nice 15 by default: see cluster/cli.py.
        {"name": "RAY_worker_niceness", "value": "0"},
        *({"name": k, "value": v} for k, v in sorted(ray_node_env(cfg).items())),  # e.g. the gRPC message-size bound
        {"name": "SPECSERVE_REDIS_PASSWORD", "valueFrom": {"secretKeyRef": {"name": settings.redis_secret, "key": "password"}}},
        {"name": "SPECSERVE_REDIS_URL", "valueFrom": {"secretKeyRef": {"name": settings.redis_secret, "key": "url", "optional": True}}},
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": settings.hf_secret, "key": "token", "optional": True}}},
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
        ],
    }
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


def ray_service(raw: dict[str, Any], cfg: ClusterConfig, settings: RenderSettings) -> Obj:
    serve_yaml = yaml.safe_dump(serve_config(raw, cfg, settings), sort_keys=False, default_flow_style=False)
    redis = urlparse(cfg.redis.url)
    ports = [{"name": "http", "port": cfg.api.http_port, "targetPort": cfg.api.http_port, "appProtocol": "http"}]
    if cfg.api.grpc_port:
        ports.append({"name": "grpc", "port": cfg.api.grpc_port, "targetPort": cfg.api.grpc_port,
                      "appProtocol": "kubernetes.io/h2c"})
    cluster: Obj = {
        "rayVersion": settings.ray_version,
        "enableInTreeAutoscaling": True,
        "autoscalerOptions": {
            "version": "v2",
            "upscalingMode": settings.upscaling_mode,
            "idleTimeoutSeconds": settings.autoscaler_idle_timeout_s,
            "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"cpu": "500m", "memory": "512Mi"}},
            "securityContext": _hardened(),
            "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
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
            "redisPassword": {"valueFrom": {"secretKeyRef": {"name": settings.redis_secret, "key": "password"}}},
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


def generated_objects(raw: dict[str, Any], cfg: ClusterConfig, settings: RenderSettings) -> list[Obj]:
    """Everything of the overlay that follows from the cluster config and render settings."""
    name = settings.name
    ray_pods = {"app.kubernetes.io/name": name, "specserve.io/redis-client": "true"}
    objs = [ray_service(raw, cfg, settings)]
    for g in settings.worker_groups:
        objs.append({
            "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": {"name": f"{name}-{g.name}"},
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {
                "app.kubernetes.io/name": name, "specserve.io/group": g.name}}},
        })
    if cfg.api.grpc_port:
        # Headless: gRPC clients balance per request over every serving pod (HTTP/2 is sticky).
        objs.append({
            "apiVersion": "v1", "kind": "Service", "metadata": {"name": f"{name}-grpc-headless"},
            "spec": {"clusterIP": "None", "selector": {"app.kubernetes.io/name": name, "ray.io/serve": "true"},
                     "ports": [{"name": "grpc", "port": cfg.api.grpc_port, "targetPort": cfg.api.grpc_port,
                                "appProtocol": "kubernetes.io/h2c"}]},
        })
    serving = [{"port": cfg.api.http_port, "protocol": "TCP"}]
    if cfg.api.grpc_port:
        serving.append({"port": cfg.api.grpc_port, "protocol": "TCP"})
    objs.append({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": f"{name}-ray"},
        "spec": {
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": name}},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": ray_pods}}]},  # Ray pods among themselves: any port
                {"ports": serving},  # clients of the HTTP and gRPC APIs
                {"from": [{"namespaceSelector": {"matchLabels": {
                    "kubernetes.io/metadata.name": settings.operator_namespace}}}],
                 "ports": [{"port": 8265, "protocol": "TCP"}]},  # KubeRay submits the Serve config here
            ],
        },
    })
    return objs


# -- kustomize subset --------------------------------------------------------------------------------

KUSTOMIZE_FIELDS = {"apiVersion", "kind", "resources", "namespace", "labels", "images", "patches"}
LEGACY_ORDER = ["Namespace", "ResourceQuota", "StorageClass", "CustomResourceDefinition", "ServiceAccount",
                "PodSecurityPolicy", "Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding", "ConfigMap",
                "Secret", "Endpoints", "Service", "LimitRange", "PriorityClass", "PersistentVolume",
                "PersistentVolumeClaim", "Deployment", "StatefulSet", "CronJob", "PodDisruptionBudget"]
# Strategic-merge keys of the lists our patches touch (built-in kinds only; CRD lists are replaced).
MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name", "volumes": "name",
              "volumeMounts": "mountPath", "imagePullSecrets": "name"}


def _docs(path: Path) -> list[Obj]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _builtin(obj: Obj) -> bool:
    group = obj.get("apiVersion", "").rpartition("/")[0]
    return "." not in group or group.endswith(".k8s.io")


def strategic_merge(base: Any, patch: Any, builtin: bool = True, field: str = "") -> Any:
    """Kubernetes strategic merge: maps merge, null deletes, keyed lists merge by key, others replace."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            else:
                out[k] = strategic_merge(base[k], v, builtin, k) if k in base else copy.deepcopy(v)
        return out
    key = MERGE_KEYS.get(field) if builtin else None
    if key is None and builtin and field == "ports" and isinstance(base, list):
        key = "containerPort" if all("containerPort" in p for p in base + patch) else "port"
    if key and isinstance(base, list) and isinstance(patch, list):
        out = [copy.deepcopy(b) for b in base]
        for item in patch:
            match = next((i for i, b in enumerate(out) if b.get(key) == item.get(key)), None)
            if match is None:
                out.append(copy.deepcopy(item))
            else:
                out[match] = strategic_merge(out[match], item, builtin)
        return out
    return copy.deepcopy(patch)


def _set_images(node: Any, images: list[Obj]) -> None:
    """kustomize `images`: rewrite `image` of every container anywhere in the object."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k in ("containers", "initContainers") and isinstance(v, list):
                for c in v:
                    c["image"] = _new_image(c.get("image", ""), images)
            else:
                _set_images(v, images)
    elif isinstance(node, list):
        for v in node:
            _set_images(v, images)


def _new_image(image: str, images: list[Obj]) -> str:
    name, tag = image, ""
    if ":" in image.rsplit("/", 1)[-1]:
        name, tag = image.rsplit(":", 1)
    for rule in images:
        if rule["name"] == name:
            name = rule.get("newName", name)
            tag = rule.get("newTag", tag)
    return f"{name}:{tag}" if tag else name


def build(path: Path) -> list[Obj]:
    """`kustomize build path` for the subset of kustomization fields named in KUSTOMIZE_FIELDS."""
    kfile = path / "kustomization.yaml"
    k = yaml.safe_load(kfile.read_text()) or {}
    unknown = set(k) - KUSTOMIZE_FIELDS
    if unknown:
        raise ValueError(f"{kfile}: fields {sorted(unknown)} are outside the supported kustomize subset")
    objs: list[Obj] = []
    for res in k.get("resources", []):
        p = path / res
        objs += build(p) if p.is_dir() else _docs(p)
    for entry in k.get("patches", []):
        for patch in _docs(path / entry["path"]):
            target = entry.get("target", {})
            kind, name = target.get("kind", patch.get("kind")), target.get("name", patch["metadata"]["name"])
            hits = [i for i, o in enumerate(objs) if o["kind"] == kind and o["metadata"]["name"] == name]
            if len(hits) != 1:
                raise ValueError(f"{kfile}: patch {entry['path']} matches {len(hits)} objects ({kind}/{name})")
            obj = objs[hits[0]]
            body = {f: v for f, v in patch.items() if f not in ("apiVersion", "kind")}
            objs[hits[0]] = strategic_merge(obj, body, _builtin(obj))
    if "namespace" in k:
        for o in objs:
            o["metadata"]["namespace"] = k["namespace"]
    for entry in k.get("labels", []):
        if entry.get("includeSelectors") or entry.get("includeTemplates"):
            raise ValueError(f"{kfile}: labels with includeSelectors/includeTemplates are not supported")
        for o in objs:
            o["metadata"].setdefault("labels", {}).update(entry["pairs"])
    if k.get("images"):
        for o in objs:
            _set_images(o, k["images"])
    return sorted(objs, key=_order)


def _order(o: Obj) -> tuple:
    kind = o["kind"]
    rank = LEGACY_ORDER.index(kind) if kind in LEGACY_ORDER else len(LEGACY_ORDER)
    return rank, kind, o["metadata"].get("namespace", ""), o["metadata"]["name"]


# -- files --------------------------------------------------------------------------------------------


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, s: str):
    return dumper.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None)


_Dumper.add_representer(str, _str)


def dump(objs: list[Obj], header: str = "") -> str:
    body = yaml.dump_all(objs, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120)
    return header + body


def render(overlay_dir: Path, config_path: Optional[Path] = None) -> tuple[str, list[str]]:
    """(text of generated.yaml, errors) for one overlay; no file is written."""
    settings = load_settings(overlay_dir)
    path = config_path or (overlay_dir / settings.cluster_config)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    raw, cfg = effective_config(raw, settings.config_overrides, origin=str(path))
    errors = k8s_config_errors(cfg) + placement_errors(cfg, settings)
    header = (f"# GENERATED by `specserve k8s render` (cluster/render.py) from {overlay_dir.name}/render.yaml\n"
              f"# and the cluster config {settings.cluster_config}. Do not edit: edit those and re-render.\n")
    return dump(generated_objects(raw, cfg, settings), header), errors


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specserve k8s render", description=__doc__.split("\n\n")[0])
    ap.add_argument("--k8s-dir", type=Path, default=Path("k8s"), help="Directory holding base/ and overlays/.")
    ap.add_argument("--overlay", action="append", help="Overlay name under overlays/ (repeatable; default: all).")
    ap.add_argument("--config", type=Path, help="Cluster config to embed instead of render.yaml's cluster_config.")
    ap.add_argument("--out", type=Path, help="Where built manifests go (default: <k8s-dir>/rendered).")
    ap.add_argument("--check", action="store_true", help="Write nothing; exit 1 if any file is out of date.")
    args = ap.parse_args(argv)
    overlays_dir = args.k8s_dir / "overlays"
    names = args.overlay or sorted(p.name for p in overlays_dir.iterdir() if (p / "render.yaml").exists())
    out_dir = args.out or args.k8s_dir / "rendered"
    stale = []
    for name in names:
        overlay = overlays_dir / name
        try:
            text, errors = render(overlay, args.config)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if errors:
            print(f"error: overlay {name}:\n  " + "\n  ".join(errors), file=sys.stderr)
            return 2
        gen = overlay / GENERATED
        if args.check:
            stale += [gen] if not gen.exists() or gen.read_text() != text else []
        else:
            gen.write_text(text)
        built = dump(build(overlay), f"# kustomize build k8s/overlays/{name} (GENERATED; do not edit)\n")
        dest = out_dir / f"{name}.yaml"
        if args.check:
            stale += [dest] if not dest.exists() or dest.read_text() != built else []
        else:
            out_dir.mkdir(parents=True, exist_ok=True)
            dest.write_text(built)
            print(f"{name}: wrote {gen} and {dest}")
    if stale:
        print("out of date (run `specserve k8s render`): " + ", ".join(map(str, stale)), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
