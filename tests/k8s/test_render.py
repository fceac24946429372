"""Pure pieces of cluster/k8s/render.py and cluster/k8s/rayservice.py: merging, Kubernetes checks, placement,
Serve config, kustomize subset."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from cluster.config import ConfigError, load_config, parse_config
from cluster.k8s.kustomize import _new_image, build, strategic_merge
from cluster.k8s.rayservice import (
    _start_params, api_key_env, api_key_volume, drafter_secret_env, ray_service, ray_tls_parts, serve_config,
)
from cluster.k8s.render import RenderSettings, deep_merge, k8s_config_errors, load_settings, main, placement_errors
from tests.k8s.k8s_checks import K8S, ROOT
from tests.paths import LOCAL_CPU


def _cfg(pools, **extra):
    raw = {"models": {"m": {"source": "org/m"}, "d": {"source": "org/d"}}, "pools": pools,
           "api": {"host": "0.0.0.0"}, "redis": {"url": "redis://r:6379/0", "start_local": False}, **extra}
    return raw, parse_config(raw)


def _settings(*groups, head=None):
    return RenderSettings.model_validate({
        "cluster_config": "x.yaml", "image": "img:1",
        "head": head or {"cpu": 2, "memory_gib": 4, "ray_cpus": 1},
        "worker_groups": list(groups),
    })


TP2 = {"name": "tp2", "cpu": 16, "memory_gib": 64, "gpus": 2, "ray_cpus": 8, "custom_resources": {"big": 2},
       "max_replicas": 2}
ONE = {"name": "one", "cpu": 8, "memory_gib": 32, "gpus": 1, "max_replicas": 3}
BUNDLES_TP2 = [{"CPU": 1, "GPU": 1, "big": 1}, {"GPU": 1, "big": 1}]


def test_deep_merge():
    assert deep_merge({"a": {"b": 1, "c": 2}, "d": [1]}, {"a": {"b": 3}, "d": [2], "e": None}) == \
        {"a": {"b": 3, "c": 2}, "d": [2], "e": None}
    base = {"a": {"b": 1}}
    deep_merge(base, {"a": {"b": 2}})
    assert base == {"a": {"b": 1}}  # no aliasing


def test_k8s_config_errors():
    local = load_config(LOCAL_CPU)
    errors = k8s_config_errors(local)
    assert len(errors) == 4 and any("api.host" in e for e in errors) and any("start_local" in e for e in errors)
    assert any("ACL user" in e for e in errors)
    assert k8s_config_errors(load_config(ROOT / "cluster/configs/gpu-example.yaml")) == []


def test_placement_fits():
    _, cfg = _cfg({"p": {"model": "m", "tensor_parallel_size": 2, "bundles": BUNDLES_TP2,
                         "autoscaling": {"min_replicas": 1, "max_replicas": 2}}})
    assert placement_errors(cfg, _settings(TP2)) == []


def test_placement_tp_must_match_gpus():
    _, cfg = _cfg({"p": {"model": "m", "tensor_parallel_size": 4, "bundles": BUNDLES_TP2}})
    assert any("tensor_parallel_size is 4" in e for e in placement_errors(cfg, _settings(TP2)))
    _, cfg = _cfg({"p": {"model": "m", "tensor_parallel_size": 2, "bundles": [{"CPU": 1}]}})
    assert any("needs GPU bundles" in e for e in placement_errors(cfg, _settings(TP2)))


def test_placement_strict_pack_needs_one_pod():
    bundles = [{"CPU": 1, "GPU": 1}, {"GPU": 1}]
    _, cfg = _cfg({"p": {"model": "m", "tensor_parallel_size": 2, "bundles": bundles}})
    errors = placement_errors(cfg, _settings(ONE))
    assert any("STRICT_PACK" in e and "fit no single pod" in e for e in errors)
    _, cfg = _cfg({"p": {"model": "m", "tensor_parallel_size": 2, "bundles": bundles, "placement_strategy": "SPREAD"}})
    assert placement_errors(cfg, _settings(ONE)) == []


def test_placement_strict_spread_needs_enough_pods():
    bundles = [{"CPU": 1}] * 6
    _, cfg = _cfg({"p": {"model": "m", "bundles": bundles, "placement_strategy": "STRICT_SPREAD"}})
    assert any("STRICT_SPREAD needs 6 pods" in e for e in placement_errors(cfg, _settings(ONE)))


def test_placement_custom_resource_must_be_advertised():
    _, cfg = _cfg({"p": {"model": "m", "tensor_parallel_size": 2, "bundles": BUNDLES_TP2}})
    errors = placement_errors(cfg, _settings({**TP2, "custom_resources": {}}))
    assert any("fit no single pod" in e for e in errors)
    assert any(e.startswith("capacity:") and "big" in e for e in errors)


def test_placement_capacity_at_max_replicas():
    _, cfg = _cfg({"p": {"model": "m", "tensor_parallel_size": 2, "bundles": BUNDLES_TP2,
                         "autoscaling": {"min_replicas": 1, "max_replicas": 3}}})
    errors = placement_errors(cfg, _settings(TP2))  # 3 replicas x 2 GPU > 2 pods x 2 GPU
    assert any("need 6 GPU" in e and "offer 4" in e for e in errors)


def test_placement_specserve_drafters_go_on_their_own_group():
    drafter_group = {"name": "dr", "cpu": 8, "memory_gib": 32, "gpus": 1, "custom_resources": {"drafter": 1},
                     "max_replicas": 2}
    pools = {"p": {"model": "m", "method": "remote_draft", "remote_drafter": "x", "max_k": 4,
                   "tensor_parallel_size": 2, "bundles": BUNDLES_TP2}}
    _, cfg = _cfg(pools, drafters={"x": {"model": "d", "replicas": 2, "resources": {"CPU": 1, "GPU": 1, "drafter": 1}}})
    assert placement_errors(cfg, _settings(TP2, drafter_group)) == []
    # Without the group's own resource the drafter could take the targets' GPUs.
    _, cfg = _cfg(pools, drafters={"x": {"model": "d", "resources": {"CPU": 1, "GPU": 1}}})
    errors = placement_errors(cfg, _settings(TP2, drafter_group))
    assert any(e.startswith("drafters.x: may land with its targets (pools.p)") and "tp2" in e for e in errors)
    _, cfg = _cfg(pools, drafters={"x": {"model": "d", "replicas": 3, "resources": {"GPU": 1, "drafter": 1}}})
    assert any("need 3 drafter" in e for e in placement_errors(cfg, _settings(TP2, drafter_group)))
    _, cfg = _cfg(pools, drafters={"x": {"model": "d", "resources": {"GPU": 1, "drafter": 1}}})
    assert any(e.startswith("drafters.x: resources") for e in placement_errors(cfg, _settings(TP2)))


def test_cpu_bundles_may_use_the_head():
    _, cfg = _cfg({"p": {"model": "m", "bundles": [{"CPU": 1}]}})
    assert placement_errors(cfg, _settings({**ONE, "ray_cpus": 0})) == []


def test_serve_config_autoscaling_or_replicas_and_grpc():
    raw, cfg = _cfg({
        "a": {"model": "m", "autoscaling": {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 4}},
        "b": {"model": "m", "method": "ngram", "max_k": 3, "replicas": 2},
    }, api={"host": "0.0.0.0", "grpc_port": 0})
    serve = serve_config(raw, cfg, _settings(ONE))
    deps = {d["name"]: d for d in serve["applications"][0]["deployments"]}
    assert deps["engine-a"]["autoscaling_config"]["max_replicas"] == 3 and "num_replicas" not in deps["engine-a"]
    assert deps["engine-b"]["num_replicas"] == 2 and "autoscaling_config" not in deps["engine-b"]
    assert "grpc_options" not in serve
    assert serve["applications"][0]["args"] == {"config": raw}


@pytest.mark.parametrize("auth,reflection", [
    ({}, True),
    ({"enabled": True}, False),  # Ray's proxy would answer reflection before any key check
    ({"enabled": True, "allow_unauthenticated_reflection": True}, True),
])
def test_serve_config_reflection_is_off_with_auth(auth, reflection):
    raw, cfg = _cfg({"a": {"model": "m"}}, auth=auth)
    assert serve_config(raw, cfg, _settings(ONE))["grpc_options"]["enable_reflection"] is reflection


def test_api_keys_reach_the_pods_by_reference_only():
    settings = _settings(ONE)
    _, off = _cfg({"a": {"model": "m"}})
    assert api_key_env(off, settings) == [] and api_key_volume(off, settings) == ([], [])
    _, env_only = _cfg({"a": {"model": "m"}}, auth={"enabled": True})
    assert api_key_env(env_only, settings) == [{"name": "SPECSERVE_API_KEYS", "valueFrom": {"secretKeyRef": {
        "name": "specserve-api-keys", "key": "keys"}}}]
    assert api_key_volume(env_only, settings) == ([], [])
    _, both = _cfg({"a": {"model": "m"}}, auth={"enabled": True, "api_keys_file": "/etc/specserve/keys/api-keys"})
    (env,) = api_key_env(both, settings)
    assert env["valueFrom"]["secretKeyRef"]["optional"] is True  # the file may hold every key
    (volume,), (mount,) = api_key_volume(both, settings)
    assert volume["secret"]["secretName"] == "specserve-api-keys"
    assert volume["secret"]["items"] == [{"key": "api-keys", "path": "api-keys"}]
    assert mount == {"name": "api-keys", "mountPath": "/etc/specserve/keys", "readOnly": True}
    _, file_only = _cfg({"a": {"model": "m"}}, auth={"enabled": True, "api_keys_env": None, "api_keys_file": "/k/f"})
    assert api_key_env(file_only, settings) == []


def test_the_drafter_wire_secret_reaches_the_pods_by_reference_only_when_drafters_run():
    settings = _settings(ONE)
    _, plain = _cfg({"a": {"model": "m"}})
    assert drafter_secret_env(plain, settings) == []
    _, remote = _cfg({"a": {"model": "m", "method": "remote_draft", "remote_drafter": "d1", "max_k": 4}},
                     drafters={"d1": {"model": "d"}})
    assert drafter_secret_env(remote, settings) == [{"name": "SPECSERVE_DRAFTER_SECRET", "valueFrom": {
        "secretKeyRef": {"name": "specserve-drafter", "key": "secret"}}}]


def test_rays_mutual_tls_each_pod_signs_its_own_certificate_and_the_ca_key_stays_in_the_init_container():
    settings = _settings(ONE)
    raw, on = _cfg({"a": {"model": "m"}})
    env, volumes, mounts, (init,) = ray_tls_parts(on, settings)
    assert {e["name"]: e["value"] for e in env} == {
        "RAY_USE_TLS": "1", "RAY_TLS_SERVER_CERT": "/etc/specserve/ray-tls/tls.crt",
        "RAY_TLS_SERVER_KEY": "/etc/specserve/ray-tls/tls.key", "RAY_TLS_CA_CERT": "/etc/specserve/ray-tls/ca.crt"}
    assert init["command"][:4] == ["python", "-m", "cluster.ops.ray_tls", "node-cert"]
    assert init["command"][-2:] == ["--host", "$(POD_IP)"]
    assert init["env"] == [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    ca = next(v for v in volumes if v["name"] == "ray-ca")
    assert ca["secret"]["secretName"] == "specserve-ray-tls"
    service = ray_service(raw, on, settings)["spec"]["rayClusterConfig"]
    pods = [service["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in service["workerGroupSpecs"]]
    for pod in pods:
        assert [c["name"] for c in pod["initContainers"]] == ["ray-tls"]
        for c in pod["containers"]:  # the Ray containers read the pod's certificate, never the CA's key
            names = {m["name"] for m in c["volumeMounts"]}
            assert "ray-tls" in names and "ray-ca" not in names
            assert {"RAY_USE_TLS", "RAY_TLS_SERVER_KEY"} <= {e["name"] for e in c["env"]}
    autoscaler = service["autoscalerOptions"]  # it dials the GCS too
    assert {"RAY_USE_TLS", "RAY_TLS_CA_CERT"} <= {e["name"] for e in autoscaler["env"]}
    assert "ray-tls" in {m["name"] for m in autoscaler["volumeMounts"]}

    raw_off, off = _cfg({"a": {"model": "m"}}, ray={"tls": {"enabled": False}})
    assert ray_tls_parts(off, settings) == ([], [], [], [])
    head = ray_service(raw_off, off, settings)["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    assert "initContainers" not in head


@pytest.mark.parametrize("extra,needle", [
    ({"api": {"host": "0.0.0.0", "tls": {"certfile": "/c.pem", "keyfile": "/k.pem"}}}, "api.tls"),
    ({"auth": {"enabled": True, "api_keys_file": "/tmp/keys"}}, "auth.api_keys_file"),
    ({"auth": {"enabled": True, "api_keys_file": "keys"}}, "auth.api_keys_file"),
])
def test_k8s_config_errors_tls_and_key_file(extra, needle):
    _, cfg = _cfg({"a": {"model": "m"}}, **extra)
    assert any(needle in e for e in k8s_config_errors(cfg))


def test_start_params_resources_in_the_ray_autoscaler_format():
    params = _start_params(_settings(TP2).worker_groups[0], head=False)
    assert params["num-cpus"] == "8"
    assert json.loads(params["resources"][1:-1].replace("\\", "")) == {"big": 2}
    assert "resources" not in _start_params(_settings(ONE).worker_groups[0], head=False)
    assert _start_params(_settings(ONE).head, head=True)["dashboard-host"] == "0.0.0.0"


def test_strategic_merge():
    base = {"spec": {"containers": [{"name": "a", "image": "x", "env": [{"name": "A", "value": "1"}]},
                                    {"name": "b", "image": "y"}], "keep": 1, "drop": 2}}
    patch = {"spec": {"containers": [{"name": "a", "env": [{"name": "B", "value": "2"}]}], "drop": None}}
    out = strategic_merge(base, patch)
    assert out["spec"]["containers"][0] == {"name": "a", "image": "x",
                                            "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]}
    assert out["spec"]["containers"][1]["name"] == "b" and out["spec"]["keep"] == 1 and "drop" not in out["spec"]
    assert strategic_merge(base, patch, builtin=False)["spec"]["containers"] == patch["spec"]["containers"]
    svc = strategic_merge({"ports": [{"port": 1, "name": "a"}]}, {"ports": [{"port": 1, "name": "b"}, {"port": 2}]})
    assert svc["ports"] == [{"port": 1, "name": "b"}, {"port": 2}]


@pytest.mark.parametrize("image,rules,want", [
    ("app:1", [{"name": "app", "newName": "reg/app", "newTag": "2"}], "reg/app:2"),
    ("app", [{"name": "app", "newTag": "3"}], "app:3"),
    ("reg:5000/app:1", [{"name": "reg:5000/app", "newTag": "9"}], "reg:5000/app:9"),
    ("other:1", [{"name": "app", "newTag": "2"}], "other:1"),
])
def test_new_image(image, rules, want):
    assert _new_image(image, rules) == want


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_build_rejects_unsupported_fields_and_unmatched_patches(tmp_path):
    _write(tmp_path / "a/kustomization.yaml", "resources: [x.yaml]\ncommonAnnotations: {a: b}\n")
    _write(tmp_path / "a/x.yaml", "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n")
    with pytest.raises(ValueError, match="commonAnnotations"):
        build(tmp_path / "a")
    _write(tmp_path / "a/kustomization.yaml", "resources: [x.yaml]\npatches: [{path: p.yaml}]\n")
    _write(tmp_path / "a/p.yaml", "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: y}\ndata: {k: v}\n")
    with pytest.raises(ValueError, match="matches 0 objects"):
        build(tmp_path / "a")


def test_build_namespace_labels_images_patches(tmp_path):
    _write(tmp_path / "base/kustomization.yaml", "resources: [s.yaml]\n")
    _write(tmp_path / "base/s.yaml", yaml.safe_dump({
        "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "s"},
        "spec": {"template": {"spec": {"containers": [{"name": "c", "image": "app:1"}]}}}}))
    _write(tmp_path / "o/kustomization.yaml", yaml.safe_dump({
        "resources": ["../base"], "namespace": "ns", "labels": [{"pairs": {"l": "v"}}],
        "images": [{"name": "app", "newTag": "2"}], "patches": [{"path": "p.yaml"}]}))
    _write(tmp_path / "o/p.yaml", yaml.safe_dump({
        "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "s"},
        "spec": {"template": {"spec": {"containers": [{"name": "c", "args": ["x"]}]}}}}))
    (obj,) = build(tmp_path / "o")
    assert obj["metadata"] == {"name": "s", "namespace": "ns", "labels": {"l": "v"}}
    assert obj["spec"]["template"]["spec"]["containers"] == [{"name": "c", "image": "app:2", "args": ["x"]}]


def test_load_settings_names_the_bad_field(tmp_path):
    text = (K8S / "overlays/gpu-prod/render.yaml").read_text().replace("memory_gib: 160", "memory_gb: 160")
    _write(tmp_path / "render.yaml", text)
    with pytest.raises(ConfigError, match="memory_gb"):
        load_settings(tmp_path)


@pytest.fixture
def k8s_copy(tmp_path):
    dest = tmp_path / "k8s"
    shutil.copytree(K8S, dest, ignore=shutil.ignore_patterns("schemas", "docker"))
    for overlay in (dest / "overlays").iterdir():
        settings = overlay / "render.yaml"
        settings.write_text(settings.read_text().replace("../../../cluster/configs/", str(ROOT / "cluster/configs") + "/"))
    assert main(["--k8s-dir", str(dest)]) == 0  # paths in headers stay relative to the overlay
    return dest


def test_check_fails_on_stale_files(k8s_copy):
    assert main(["--k8s-dir", str(k8s_copy), "--check"]) == 0
    gen = k8s_copy / "overlays/gpu-prod/generated.yaml"
    gen.write_text(gen.read_text().replace("maxReplicas: 8", "maxReplicas: 9"))
    assert main(["--k8s-dir", str(k8s_copy), "--check"]) == 1
    assert main(["--k8s-dir", str(k8s_copy), "--overlay", "gpu-prod"]) == 0
    assert main(["--k8s-dir", str(k8s_copy), "--check"]) == 0


def test_render_refuses_a_config_that_cannot_run(k8s_copy, tmp_path):
    bad = yaml.safe_load((ROOT / "cluster/configs/gpu-example.yaml").read_text())
    bad["pools"]["ngram"]["autoscaling"]["max_replicas"] = 40
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    assert main(["--k8s-dir", str(k8s_copy), "--overlay", "gpu-prod", "--config", str(tmp_path / "bad.yaml")]) == 2
    bad["pools"]["ngram"]["max_kk"] = 1
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    assert main(["--k8s-dir", str(k8s_copy), "--overlay", "gpu-prod", "--config", str(tmp_path / "bad.yaml")]) == 2
