"""No secret value in any manifest: every overlay, and every cluster config rendered through every
overlay, passes cluster.k8s.secret_scan; the scan finds each kind of literal secret it names."""

from __future__ import annotations

import base64
import shutil

import pytest
import yaml

from cluster.k8s.render import effective_config, generated_objects, load_settings, main
from cluster.k8s.secret_scan import PLACEHOLDER_PREFIX, literal_secrets
from tests.k8s.k8s_checks import K8S, OVERLAYS, ROOT

CONFIGS = sorted((ROOT / "cluster" / "configs").glob("*.yaml"))
LEAK = "s3cr3t-Value-0123456789"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_built_overlays_carry_no_literal_secret(built, overlay):
    assert literal_secrets(built[overlay]) == []


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_every_config_renders_without_a_literal_secret(overlay, config):
    settings = load_settings(K8S / "overlays" / overlay)
    raw, cfg = effective_config(yaml.safe_load(config.read_text()), settings.config_overrides, str(config))
    assert literal_secrets(generated_objects(raw, cfg, settings)) == []


def _pod(env=None, **extra):
    return {"kind": "Pod", "metadata": {"name": "p"},
            "spec": {"containers": [{"name": "c", "env": env or []}], **extra}}


@pytest.mark.parametrize("obj", [
    _pod([{"name": "SPECSERVE_API_KEYS", "value": LEAK}]),
    _pod([{"name": "HF_TOKEN", "value": LEAK}]),
    _pod([{"name": "REDISCLI_AUTH", "value": LEAK}]),
    _pod([{"name": "REDIS_URL", "value": f"redis://tuning:{LEAK}@redis:6379/0"}]),
    {"kind": "RayService", "metadata": {"name": "r"},
     "spec": {"rayClusterConfig": {"gcsFaultToleranceOptions": {"redisPassword": {"value": LEAK}}}}},
    {"kind": "Secret", "metadata": {"name": "s"}, "stringData": {"password": LEAK}},
    {"kind": "Secret", "metadata": {"name": "s"}, "data": {"password": base64.b64encode(LEAK.encode()).decode()}},
    {"kind": "ConfigMap", "metadata": {"name": "c"}, "data": {"redis.conf": f"port 6379\nrequirepass {LEAK}\n"}},
    {"kind": "ConfigMap", "metadata": {"name": "c"}, "data": {"users.acl": f"user tuning on >{LEAK} ~specserve:*\n"}},
    # the embedded Serve config: a pool's env, a URL
    {"kind": "RayService", "metadata": {"name": "r"}, "spec": {"serveConfigV2": yaml.safe_dump(
        {"applications": [{"args": {"config": {"pools": {"p": {"env": {"OPENAI_API_KEY": LEAK}}}}}}]})}},
    {"kind": "RayService", "metadata": {"name": "r"}, "spec": {"serveConfigV2": yaml.safe_dump(
        {"applications": [{"args": {"config": {"redis": {"url": f"redis://:{LEAK}@r:6379/0"}}}}]})}},
], ids=["api-keys-env", "hf-token-env", "redis-cli-auth", "url-in-env", "kuberay-redis-password", "secret-stringData",
        "secret-data", "requirepass", "acl-plaintext", "embedded-env", "embedded-url"])
def test_each_kind_of_literal_secret_is_found_without_echoing_it(obj):
    findings = literal_secrets([obj])
    assert findings, obj
    assert all(LEAK not in f for f in findings)


@pytest.mark.parametrize("obj", [
    _pod([{"name": "SPECSERVE_API_KEYS", "valueFrom": {"secretKeyRef": {"name": "k", "key": "keys"}}},
          {"name": "SSL_KEY_FILE", "value": "/etc/tls/tls.key"}, {"name": "HOME", "value": "/tmp"}],
         automountServiceAccountToken=False, volumes=[{"name": "k", "secret": {"secretName": "api-keys"}}]),
    {"kind": "RayService", "metadata": {"name": "r"}, "spec": {"rayClusterConfig": {"gcsFaultToleranceOptions": {
        "redisUsername": {"value": "gcs"},
        "redisPassword": {"valueFrom": {"secretKeyRef": {"name": "r", "key": "gcs-password"}}}}}}},
    {"kind": "Secret", "metadata": {"name": "s"}, "stringData": {"password": PLACEHOLDER_PREFIX + "change-me"}},
    {"kind": "ConfigMap", "metadata": {"name": "c"}, "data": {
        "redis.conf": "requirepass \"$REDIS_PASSWORD\"\n",
        "acl.sh": 'echo "user tuning on #$(hash "$REDIS_TUNING_PASSWORD") ~specserve:*" > /run/redis/users.acl\n'}},
    {"kind": "RayService", "metadata": {"name": "r"}, "spec": {"serveConfigV2": yaml.safe_dump({"applications": [
        {"args": {"config": {"redis": {"url": "redis://tuning@r:6379/0", "password_env": "SPECSERVE_REDIS_PASSWORD"},
                             "auth": {"api_keys_env": "SPECSERVE_API_KEYS", "api_keys_file": "/k/keys"}}}}]})}},
], ids=["references", "kuberay-refs", "placeholder", "env-expansions", "embedded-pointers"])
def test_references_and_pointers_are_not_findings(obj):
    assert literal_secrets([obj]) == []


def test_render_refuses_an_overlay_with_a_literal_secret(tmp_path, capsys):
    k8s = tmp_path / "k8s"
    shutil.copytree(K8S, k8s)
    shutil.copytree(ROOT / "cluster" / "configs", tmp_path / "cluster" / "configs")
    render_yaml = k8s / "overlays" / "cpu-dev" / "render.yaml"
    render_yaml.write_text(render_yaml.read_text() + f"env:\n  HF_TOKEN: {LEAK}\n")
    assert main(["--k8s-dir", str(k8s), "--overlay", "cpu-dev"]) == 2
    err = capsys.readouterr().err
    assert "HF_TOKEN" in err and LEAK not in err
