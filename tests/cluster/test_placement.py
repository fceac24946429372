"""How `specserve up` starts or joins Ray (cluster.ops.ray_driver.ray_init_kwargs): a local Ray binds to
loopback unless the config says otherwise; joining a cluster passes no local-only argument."""

from __future__ import annotations

import inspect
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.config import load_config, parse_config
from cluster.ops.ray_driver import (
    RAY_LOOPBACK_ENV, driver_log_levels, local_ray_env, ray_attach_env, ray_attach_kwargs, ray_init_kwargs,
)
from tests.paths import LOCAL_CPU

CONFIGS = Path(__file__).resolve().parents[2] / "cluster" / "configs"


def _cfg(ray: dict):
    raw = {"models": {"m": {"source": "org/m"}}, "pools": {"p": {"model": "m"}}, "ray": ray}
    return parse_config(raw)


def test_the_local_default_binds_ray_to_loopback():
    kw = ray_init_kwargs(load_config(LOCAL_CPU), pythonpath="/src")
    assert kw["address"] == "local"  # a new local Ray is started (whatever a stale ray_current_cluster says) ...
    assert kw["_node_ip_address"] == "127.0.0.1"  # ... and its GCS, raylet and workers listen on loopback
    assert kw["num_cpus"] == 4 and kw["_metrics_export_port"] == 8090
    assert kw["include_dashboard"] is False and kw["logging_level"] == logging.WARNING
    assert kw["runtime_env"] == {"env_vars": {"PYTHONPATH": "/src"}}


def test_node_address_is_configurable_and_joining_passes_no_local_arguments():
    assert ray_init_kwargs(_cfg({"node_ip_address": "10.0.0.5"}), "/src")["_node_ip_address"] == "10.0.0.5"
    assert "_node_ip_address" not in ray_init_kwargs(_cfg({"node_ip_address": None}), "/src")
    joined = ray_init_kwargs(_cfg({"address": "auto", "num_cpus": 2, "metrics_export_port": 8090}), "/src")
    assert joined["address"] == "auto"
    assert not {"_node_ip_address", "num_cpus", "_metrics_export_port"} & set(joined)


def test_loopback_needs_rays_switch_and_only_a_loopback_address_sets_it():
    assert local_ray_env(load_config(LOCAL_CPU))[RAY_LOOPBACK_ENV] == "0"
    assert RAY_LOOPBACK_ENV not in local_ray_env(_cfg({"node_ip_address": "10.0.0.5"}))
    assert RAY_LOOPBACK_ENV not in local_ray_env(_cfg({"node_ip_address": None}))


_LISTENERS = """
import json, psutil, ray
from cluster.config import load_config
from cluster.ops.ray_driver import ray_init_kwargs
ctx = ray.init(**ray_init_kwargs(load_config(%r), pythonpath="."))
pids = {p.pid for p in psutil.Process().children(recursive=True)} | {psutil.Process().pid}
ips = sorted({c.laddr.ip for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.pid in pids})
print(json.dumps({"node": ctx.address_info["node_ip_address"], "listen": ips}))
ray.shutdown()
"""


def test_a_local_ray_started_as_up_starts_it_listens_on_loopback_only():
    """A real Ray, started with `specserve up`'s environment and arguments for the local default:
    its node address and every listening socket of its processes are loopback ones."""
    env = {**os.environ, **local_ray_env(load_config(LOCAL_CPU))}
    out = subprocess.run([sys.executable, "-c", _LISTENERS % str(LOCAL_CPU)], env=env,
                         capture_output=True, text=True, timeout=180, cwd=CONFIGS.parents[1])
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["node"] == "127.0.0.1", seen
    assert seen["listen"] and all(ip in ("127.0.0.1", "::ffff:127.0.0.1") for ip in seen["listen"]), seen


def test_workers_output_reaches_the_terminal_only_when_asked():
    """Ray forwards every worker's stdout and stderr (vLLM engines, Serve's controller and proxies:
    hundreds of lines per start-up) unless told not to: `specserve up` forwards them only with
    --verbose, and `specserve status` never (its JSON is its whole output)."""
    cfg = load_config(LOCAL_CPU)
    assert ray_init_kwargs(cfg, "/src")["log_to_driver"] is False
    assert ray_init_kwargs(cfg, "/src", log_to_driver=True)["log_to_driver"] is True
    joined = _cfg({"address": "auto"})
    assert ray_init_kwargs(joined, "/src")["log_to_driver"] is False
    assert ray_attach_kwargs() == {"address": "auto", "logging_level": logging.ERROR, "log_to_driver": False}
    assert driver_log_levels(verbose=False) == {"ray.serve": logging.WARNING}
    assert driver_log_levels(verbose=True) == {}


@pytest.mark.parametrize("config", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_argument_is_one_ray_init_takes(config):
    import ray

    named = set(inspect.signature(ray.init).parameters)
    private = {"_node_ip_address", "_metrics_export_port", "_node_name"}  # popped from **kwargs by ray.init (ray/_private/worker.py)
    source = inspect.getsource(ray.init)
    for name in [*ray_init_kwargs(load_config(config), "/src"), *ray_attach_kwargs()]:
        assert name in named or (name in private and f'"{name}"' in source), name


def test_a_client_attaches_with_the_loopback_switch_only_to_a_loopback_ray():
    """`specserve status` attaches to the running Ray: to the local default's (loopback) with Ray's
    loopback switch, else Ray dials the machine's routable address and retries for minutes; to a
    joined or routable cluster without it (the switch would give the client a loopback node address)."""
    local = load_config(LOCAL_CPU)
    assert ray_attach_env(local, {}) == {RAY_LOOPBACK_ENV: "0"}
    assert ray_attach_env(local, {"RAY_ADDRESS": "ray://localhost:10001"}) == {RAY_LOOPBACK_ENV: "0"}
    assert ray_attach_env(local, {"RAY_ADDRESS": "10.1.2.3:6379"}) == {}
    assert ray_attach_env(_cfg({"address": "auto"}), {}) == {}
    assert ray_attach_env(_cfg({"address": "10.1.2.3:6379"}), {}) == {}
    assert ray_attach_env(_cfg({"node_ip_address": "10.0.0.5"}), {}) == {}


def test_status_attaches_to_the_cluster_up_recorded_for_its_config(tmp_path, monkeypatch):
    """`specserve up` records its local Ray's GCS address and auth mode per config (name and HTTP
    port); `specserve status --config` attaches there, not to whichever Ray on the machine is newest."""
    from cluster.ops.ray_driver import RAY_AUTH_MODE_ENV, ray_address_file, ray_address_record, read_ray_address

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    local = load_config(LOCAL_CPU)
    assert read_ray_address(local) is None
    path = ray_address_file(local)
    path.parent.mkdir(parents=True)
    path.write_text(ray_address_record("127.0.0.1:41234", {RAY_AUTH_MODE_ENV: "token"}))
    record = read_ray_address(local)
    assert record == {"gcs": "127.0.0.1:41234", "auth_mode": "token"}
    recorded = {RAY_LOOPBACK_ENV: "0", "RAY_ADDRESS": "127.0.0.1:41234"}
    assert ray_attach_env(local, {}, record) == {**recorded, RAY_AUTH_MODE_ENV: "token"}
    assert ray_attach_env(local, {RAY_AUTH_MODE_ENV: "disabled"}, record) == recorded  # the caller's wins
    assert ray_attach_env(local, {"RAY_ADDRESS": "10.1.2.3:6379"}, record) == {}  # an explicit address ignores the record
    assert ray_attach_env(_cfg({"address": "10.1.2.3:6379"}), {}, record) == {}  # so does the config's
    other = _cfg({})
    other.api.http_port = 8001
    assert read_ray_address(other) is None  # another config's cluster
    path.write_text("not json")
    assert read_ray_address(local) is None
    from cluster.ops.up import forget_ray_address

    forget_ray_address(local)  # `up` stopping: the record goes, and again is no error
    forget_ray_address(local)
    assert not path.exists()


def test_a_record_whose_gcs_does_not_listen_is_stale():
    """`specserve status` drops a record left by a cluster that was killed outright (nothing
    listens at its GCS address) and attaches through Ray's "auto" instead of waiting it out."""
    import socket

    from cluster.ops.ray_driver import gcs_listening

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        address = "127.0.0.1:%d" % server.getsockname()[1]
        assert gcs_listening(address)
    assert not gcs_listening(address, timeout_s=0.5)  # closed
    assert not gcs_listening("[::1]:notaport")


def test_the_app_import_path_names_the_builder_of_the_application():
    """`up` and the KubeRay Serve config deploy the application by this path."""
    from cluster.ops.placement import app_builder
    from deployments.app import build_app

    assert app_builder() is build_app
