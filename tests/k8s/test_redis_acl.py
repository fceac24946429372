"""The in-cluster Redis (k8s/base/redis.yaml): one ACL user per client, passwords only as hashes,
bounded memory that evicts tuning state and never Ray's GCS data. The ACL script and redis.conf are
taken from the built manifests and run against a real redis-server."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from urllib.parse import urlparse

import pytest
import yaml

from cluster.state.redis_server import find_redis_server, free_port
from tests.k8s.k8s_checks import K8S, OVERLAYS

PASSWORDS = {"REDIS_ADMIN_PASSWORD": "admin-0123456789abcdef", "REDIS_GCS_PASSWORD": "gcs-0123456789abcdef",
             "REDIS_TUNING_PASSWORD": "tuning-0123456789abcdef"}
GCS_KEY = "RAYspecserve-gcs@NODE"  # Ray's GCS tables: RAY<externalStorageNamespace>@<table>


def _one(objs, kind, name):
    (obj,) = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


def _redis_parts(objs):
    cm = _one(objs, "ConfigMap", "specserve-redis")
    container = _one(objs, "StatefulSet", "specserve-redis")["spec"]["template"]["spec"]["containers"][0]
    return cm["data"], container


def _acl_file(script: str, env: dict, tmp_path) -> str:
    run = subprocess.run(["sh", "-c", script], env={"PATH": os.environ["PATH"], **env}, capture_output=True,
                         text=True, timeout=10)
    assert run.returncode == 0, run.stderr
    path = tmp_path / "users.acl"
    path.write_text(run.stdout)
    return run.stdout


@pytest.mark.skipif(shutil.which("sha256sum") is None, reason="needs sha256sum (busybox has it in the Redis image)")
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_acl_script_writes_hashes_only_and_refuses_weak_passwords(built, overlay, tmp_path):
    data, _ = _redis_parts(built[overlay])
    text = _acl_file(data["acl.sh"], PASSWORDS, tmp_path)
    users = {line.split()[1] for line in text.splitlines()}
    assert users == {"default", "gcs", "tuning"}
    assert not any(pw in text for pw in PASSWORDS.values()) and ">" not in text
    assert len(re.findall(r" #[0-9a-f]{64} ", text)) == 3
    short = subprocess.run(["sh", "-c", data["acl.sh"]], capture_output=True, text=True, timeout=10,
                           env={"PATH": os.environ["PATH"], **PASSWORDS, "REDIS_GCS_PASSWORD": ""})
    assert short.returncode != 0 and "REDIS_GCS_PASSWORD" in short.stderr and "user" not in short.stdout


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_users_and_memory_match_the_clients(built, overlay):
    from tests.k8s.test_manifests import _effective

    settings, _, cfg = _effective(overlay)
    data, container = _redis_parts(built[overlay])
    assert f'user {settings.redis_gcs_user} on' in data["acl.sh"]
    tuning = urlparse(cfg.redis.url).username
    assert re.search(rf'user {tuning} on .* ~(\S+)\*', data["acl.sh"]).group(1) in cfg.redis.key_prefix
    env = {e["name"]: e["valueFrom"] for e in container["env"]}
    for var in PASSWORDS:
        assert env[var]["secretKeyRef"]["name"] == settings.redis_secret
    assert env["REDIS_MEMORY_LIMIT_MIB"]["resourceFieldRef"] == {
        "containerName": container["name"], "resource": "limits.memory", "divisor": "1Mi"}
    assert container["resources"]["limits"]["memory"]
    assert "--maxmemory" in container["args"][0] and "REDIS_MEMORY_LIMIT_MIB * 3 / 4" in container["args"][0]
    assert re.search(r"^maxmemory-policy volatile-ttl$", data["redis.conf"], re.M)
    assert re.search(r"^aclfile /tmp/users.acl$", data["redis.conf"], re.M)
    assert "/tmp/users.acl" in container["args"][0]


@pytest.fixture
def k8s_redis(built, tmp_path):
    """redis-server with the cpu-dev overlay's redis.conf rules (ACL file, eviction policy) on loopback."""
    if shutil.which("sha256sum") is None:
        pytest.skip("needs sha256sum")
    data, _ = _redis_parts(built["cpu-dev"])
    _acl_file(data["acl.sh"], PASSWORDS, tmp_path)
    policy = re.search(r"^maxmemory-policy (\S+)$", data["redis.conf"], re.M).group(1)
    port = free_port()
    proc = subprocess.Popen([find_redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path), "--aclfile", str(tmp_path / "users.acl"),
                             "--maxmemory-policy", policy],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    yield port
    proc.terminate()
    proc.wait(10)


def _client(port, user=None, password=None):
    import redis

    return redis.Redis(host="127.0.0.1", port=port, username=user, password=password, socket_timeout=2)


@pytest.mark.redis
def test_each_user_reaches_only_its_own_keys(k8s_redis):
    import redis

    port = k8s_redis
    with pytest.raises(redis.AuthenticationError):
        _client(port).ping()
    gcs = _client(port, "gcs", PASSWORDS["REDIS_GCS_PASSWORD"])
    tuning = _client(port, "tuning", PASSWORDS["REDIS_TUNING_PASSWORD"])
    admin = _client(port, None, PASSWORDS["REDIS_ADMIN_PASSWORD"])
    # What Ray's GCS runs: connecting (INFO SENTINEL, INFO CLUSTER, DEL DUMMY), then its tables.
    assert gcs.execute_command("INFO", "SENTINEL") is not None and gcs.execute_command("INFO", "CLUSTER") is not None
    gcs.delete("DUMMY")
    gcs.hset(GCS_KEY, "n1", "x")
    assert gcs.incrby("RAYspecserve-gcs@JobCounter", 1) == 1
    # What the tuning store and the autoscaler run: MULTI pipelines, SCAN, HGETALL, SET with a TTL, MGET.
    pipe = tuning.pipeline(transaction=True)
    pipe.hset("specserve:v3:cell", mapping={"n": 1})
    pipe.expire("specserve:v3:cell", 60)
    pipe.execute()
    assert tuning.scan(0, match="specserve:v3:*")[1] == [b"specserve:v3:cell"]
    tuning.set("specserve:v3:autoscale:p", "{}", ex=60)
    assert tuning.mget(["specserve:v3:autoscale:p"]) == [b"{}"]
    for denied in (lambda: tuning.hget(GCS_KEY, "n1"), lambda: tuning.flushall(), lambda: tuning.keys("*"),
                   lambda: gcs.hgetall("specserve:v3:cell"), lambda: gcs.flushall(), lambda: gcs.config_get("*"),
                   lambda: tuning.config_set("maxmemory", "1")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            denied()
    assert admin.hget(GCS_KEY, "n1") == b"x"


@pytest.mark.redis
def test_full_memory_evicts_tuning_state_never_gcs_data(k8s_redis):
    import redis

    port = k8s_redis
    admin = _client(port, None, PASSWORDS["REDIS_ADMIN_PASSWORD"])
    gcs = _client(port, "gcs", PASSWORDS["REDIS_GCS_PASSWORD"])
    tuning = _client(port, "tuning", PASSWORDS["REDIS_TUNING_PASSWORD"])
    for i in range(200):
        gcs.hset(GCS_KEY, f"n{i}", "g" * 100)
    used = int(admin.info("memory")["used_memory"])
    admin.config_set("maxmemory", str(used + 256 * 1024))
    written = 0
    for i in range(2000):  # ~2 MB of tuning cells with a TTL into 256 KiB of room
        tuning.set(f"specserve:v3:c{i}", "t" * 1000, ex=3600 + i)
        written += 1
    assert tuning.dbsize() < written  # cells were evicted ...
    assert gcs.hlen(GCS_KEY) == 200  # ... Ray's GCS table was not
    admin.delete(*[k for k in admin.scan_iter("specserve:*")])
    admin.config_set("maxmemory", str(int(admin.info("memory")["used_memory"]) + 1024))
    with pytest.raises(redis.exceptions.OutOfMemoryError):  # nothing evictable: refused, not killed
        for i in range(1000):
            gcs.hset(GCS_KEY, f"m{i}", "g" * 1000)
    assert gcs.hlen(GCS_KEY) >= 200


def test_the_tuning_users_rules_are_what_the_docs_say():
    text = (K8S.parent / "docs" / "security.md").read_text()
    (cm,) = [d for d in yaml.safe_load_all((K8S / "base" / "redis.yaml").read_text()) if d["kind"] == "ConfigMap"]
    acl = cm["data"]["acl.sh"]
    rules = re.search(r'user tuning on #\$\(sha "\$REDIS_TUNING_PASSWORD"\) (.*)"$', acl, re.M).group(1)
    assert rules in text
