"""An overlay's Kubernetes-only settings (`k8s/overlays/<name>/render.yaml`: image, node groups, pod
sizes) and whether a cluster config can run on them: what it must say on Kubernetes, and whether its
pools' placement-group bundles fit the node groups. Pure functions over plain data; cluster/k8s/render.py
(with cluster/k8s/rayservice.py) turns a config that passes into manifests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional
from urllib.parse import urlparse

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cluster.config import ClusterConfig, ConfigError
from cluster.ops.placement import used_drafters

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
    redis_secret: str = Field(
        "specserve-redis",
        description=("Secret with the Redis ACL users' passwords: `tuning-password` (the user named in redis.url; "
                     "SPECSERVE_REDIS_PASSWORD of the Ray pods), `gcs-password` (Ray's GCS), and `admin-password` "
                     "(the `default` user, read by the Redis StatefulSet only)."))
    redis_gcs_user: str = Field("gcs", description="Redis ACL user of Ray's GCS fault tolerance (k8s/base/redis.yaml).")
    hf_secret: str = Field("specserve-hf", description="Optional Secret with `token` (HF_TOKEN, gated models).")
    api_keys_secret: str = Field(
        "specserve-api-keys",
        description=("Secret with the API keys when the cluster config has auth.enabled: key `keys` (comma-separated "
                     "`label:key`) becomes auth.api_keys_env; with auth.api_keys_file, the key named like the "
                     "file's basename is mounted as that file."))
    drafter_secret: str = Field(
        "specserve-drafter",
        description=("Secret with the drafter wire's shared secret when the cluster config has drafters: key "
                     "`secret` (at least 16 characters) becomes SPECSERVE_DRAFTER_SECRET of the Ray pods."))
    ray_tls_secret: str = Field(
        "specserve-ray-tls",
        description=("Secret with the CA of Ray's mutual TLS when the cluster config has ray.tls.enabled: keys `ca.crt` "
                     "and `ca.key` (PEM); each Ray pod signs its own certificate with it at start (k8s/README.md)."))
    gcs_fault_tolerance: bool = Field(True, description="Ray GCS fault tolerance on the config's Redis.")
    autoscaler_idle_timeout_s: int = Field(300, ge=0, description="KubeRay autoscaler: idle pod lifetime.")
    upscaling_mode: Literal["Default", "Aggressive", "Conservative"] = Field("Default")
    graceful_shutdown_timeout_s: float = Field(
        120.0, gt=0, description="Serve lets a stopping engine replica finish requests this long."
    )
    termination_grace_s: int = Field(180, ge=0, description="Pod terminationGracePeriodSeconds.")
    cluster_deletion_delay_s: int = Field(60, ge=0, description="Old RayCluster lives this long after a switch.")
    operator_namespace: str = Field("kuberay-system", description="Namespace of the KubeRay operator (NetworkPolicy).")
    api_client_namespaces: list[str] = Field(
        default_factory=list,
        description=("Namespaces whose pods may open the HTTP and gRPC API ports: the ingress controller's or "
                     "gateway's, which terminates TLS for clients outside the cluster (NetworkPolicy). Empty: "
                     "none besides the Ray pods (`kubectl port-forward` is not subject to NetworkPolicies)."))


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


POD_WRITABLE_DIRS = ("/tmp", "/dev/shm", "/var/cache/specserve")  # the Ray pods' emptyDir mounts


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
    if not urlparse(cfg.redis.url).username:
        errors.append(f"redis.url must name the tuning state's ACL user (redis://tuning@host:port/db), "
                      f"got {cfg.redis.url!r}")
    if cfg.api.tls.enabled:
        errors.append("api.tls is for `specserve up`; on Kubernetes TLS ends at the ingress or gateway in front of "
                      "the Service (k8s/README.md), so api.tls must be unset")
    keys_file = cfg.auth.api_keys_file if cfg.auth.enabled else None
    if keys_file and (not keys_file.startswith("/") or keys_file.rsplit("/", 1)[0] in POD_WRITABLE_DIRS + ("",)):
        errors.append(f"auth.api_keys_file must be an absolute path in a directory of its own (the API-key Secret is "
                      f"mounted there), not in {', '.join(POD_WRITABLE_DIRS)}: got {keys_file!r}")
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
        most = pool.most_replicas
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
