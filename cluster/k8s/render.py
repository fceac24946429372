"""Kubernetes (KubeRay) manifests rendered from a cluster config: one source of truth.

Contract: an overlay directory `k8s/overlays/<name>/` holds `render.yaml` (Kubernetes-only facts:
image, node groups, pod sizes; `RenderSettings` in cluster/k8s/render_settings.py) naming a cluster
config file (the same YAML `specserve up` reads). `render()` turns the two into the overlay's
`generated.yaml`: a KubeRay RayService whose `serveConfigV2` embeds that cluster config for
`deployments.app:build_app` (the RayService, its Serve config and its pods: cluster/k8s/rayservice.py),
one PodDisruptionBudget per worker group, the headless gRPC Service and the Ray pods' NetworkPolicy.
`main` also writes each overlay's `kustomize build` (cluster/k8s/kustomize.py) to k8s/rendered/, and
refuses an overlay whose objects carry a literal secret (cluster/k8s/secret_scan.py): secrets reach pods
only by reference to a Kubernetes Secret.

Decisions (what fits where, what a cluster config must say on Kubernetes: cluster/k8s/render_settings.py)
are pure functions over plain data with dense tests; only `main` reads and writes files.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any, Optional

import yaml

from cluster.config import ClusterConfig, ConfigError, parse_config
from cluster.k8s.kustomize import build
from cluster.k8s.rayservice import Obj, ray_service
from cluster.k8s.render_settings import (  # noqa: F401  (the overlay settings and checks are part of this interface)
    NodeGroup, RenderSettings, k8s_config_errors, load_settings, placement_errors,
)
from cluster.k8s.secret_scan import literal_secrets

GENERATED = "generated.yaml"


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
    # The manifests run Ray Serve's proxy on every node, behind the Services: the router replicas
    # must not listen on the same ports themselves (api.door router is `specserve up`'s).
    merged = deep_merge(merged, {"api": {"door": "ray_proxy"}})
    return merged, parse_config(merged, origin=origin)


# -- the overlay's objects: the RayService (cluster/k8s/rayservice.py) and what stands beside it ------


def api_client_rules(settings: RenderSettings, ports: list[Obj]) -> list[Obj]:
    """NetworkPolicy ingress rules for the HTTP and gRPC API ports: from the ingress or gateway
    namespaces only (never from every pod or address: the Ray pods also run Ray's own services)."""
    if not settings.api_client_namespaces:
        return []
    peers = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}}}
             for ns in settings.api_client_namespaces]
    return [{"from": peers, "ports": ports}]


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
                *api_client_rules(settings, serving),
                {"from": [{"namespaceSelector": {"matchLabels": {
                    "kubernetes.io/metadata.name": settings.operator_namespace}}}],
                 "ports": [{"port": 8265, "protocol": "TCP"}]},  # KubeRay submits the Serve config here
            ],
        },
    })
    return objs


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
    objs = generated_objects(raw, cfg, settings)
    errors = k8s_config_errors(cfg) + placement_errors(cfg, settings) + literal_secrets(objs)
    header = (f"# GENERATED by `specserve k8s render` (cluster/k8s/render.py) from {overlay_dir.name}/render.yaml\n"
              f"# and the cluster config {settings.cluster_config}. Do not edit: edit those and re-render.\n")
    return dump(objs, header), errors


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
        objs = build(overlay)
        leaks = literal_secrets(objs)  # the hand-written objects (base/, patches) too
        if leaks:
            print(f"error: overlay {name}:\n  " + "\n  ".join(leaks), file=sys.stderr)
            return 2
        built = dump(objs, f"# kustomize build k8s/overlays/{name} (GENERATED; do not edit)\n")
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
