"""The subset of `kustomize build` the overlays under k8s/ use: resources, namespace, labels, images and
strategic-merge patches. `build(path)` gives the objects `kubectl kustomize path` gives for them, so the
rendered manifests and the tests need no kustomize binary; a field outside the subset is refused.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

Obj = dict[str, Any]

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
