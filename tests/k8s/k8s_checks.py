"""Helpers of the Kubernetes manifest tests: the vendored schemas and strict validators.

A uniquely named module (not conftest) so `import` cannot pick up another directory's conftest."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from jsonschema import Draft202012Validator
from referencing import Registry, Resource

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "render.yaml").exists())
K8S_SCHEMA = "k8s-v1.31-strict.json"
KUBERAY_SCHEMA = "kuberay-v1.4-rayservice.json"


def _load(name: str) -> dict:
    return json.loads((K8S / "schemas" / name).read_text())


_K8S = _load(K8S_SCHEMA)
_KUBERAY = _load(KUBERAY_SCHEMA)
_REGISTRY = Registry().with_resources(
    [(K8S_SCHEMA, Resource.from_contents(_K8S)), (KUBERAY_SCHEMA, Resource.from_contents(_KUBERAY))]
)


def schema_errors(obj: dict) -> list[str]:
    """Errors of one object against the strict Kubernetes / KubeRay schema of its apiVersion and kind."""
    kind = f"{obj.get('apiVersion')}/{obj.get('kind')}"
    if kind == "ray.io/v1/RayService":
        schema = {"$ref": KUBERAY_SCHEMA}
    elif kind in _K8S["x-kinds"]:
        schema = {"$ref": K8S_SCHEMA + _K8S["x-kinds"][kind]}
    else:
        return [f"no vendored schema for {kind}"]
    validator = Draft202012Validator(schema, registry=_REGISTRY)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]


def serve_strict_errors(serve: dict) -> list[str]:
    """Ray's own Serve schema (ServeDeploySchema) ignores unknown keys; this rejects them too."""
    from ray.serve.config import AutoscalingConfig
    from ray.serve.schema import (DeploymentSchema, HTTPOptionsSchema, ServeApplicationSchema,
                                  ServeDeploySchema, gRPCOptionsSchema)

    errors = []
    try:
        ServeDeploySchema.model_validate(serve)
    except Exception as e:  # pydantic's error names the field
        errors.append(f"ServeDeploySchema: {e}")

    def extra(where: str, d: dict, model) -> None:
        unknown = set(d) - set(model.model_fields)
        if unknown:
            errors.append(f"{where}: unknown fields {sorted(unknown)}")

    extra("(top)", serve, ServeDeploySchema)
    extra("http_options", serve.get("http_options", {}), HTTPOptionsSchema)
    extra("grpc_options", serve.get("grpc_options", {}), gRPCOptionsSchema)
    for app in serve.get("applications", []):
        extra(f"applications.{app.get('name')}", app, ServeApplicationSchema)
        for d in app.get("deployments", []):
            extra(f"deployments.{d.get('name')}", d, DeploymentSchema)
            extra(f"deployments.{d.get('name')}.autoscaling_config", d.get("autoscaling_config", {}), AutoscalingConfig)
    return errors


def read_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def build_all() -> dict[str, list[dict]]:
    """{overlay name: objects of `kustomize build` (cluster.k8s.render.build)}."""
    from cluster.k8s.kustomize import build

    return {name: build(K8S / "overlays" / name) for name in OVERLAYS}
