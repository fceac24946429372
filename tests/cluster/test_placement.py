"""How `specserve up` starts or joins Ray (cluster.placement.ray_init_kwargs): a local Ray binds to
loopback unless the config says otherwise; joining a cluster passes no local-only argument."""

from __future__ import annotations

import inspect
import logging
from pathlib import Path

import pytest

from cluster.config import load_config, parse_config
from cluster.placement import driver_log_levels, ray_attach_kwargs, ray_init_kwargs

CONFIGS = Path(__file__).resolve().parents[2] / "cluster" / "configs"


def _cfg(ray: dict):
    raw = {"models": {"m": {"source": "org/m"}}, "pools": {"p": {"model": "m"}}, "ray": ray}
    return parse_config(raw)


def test_the_local_default_binds_ray_to_loopback():
    kw = ray_init_kwargs(load_config(CONFIGS / "local-cpu.yaml"), pythonpath="/src")
    assert kw["address"] is None  # a local Ray is started ...
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


def test_workers_output_reaches_the_terminal_only_when_asked():
    """Ray forwards every worker's stdout and stderr (vLLM engines, Serve's controller and proxies:
    hundreds of lines per start-up) unless told not to: `specserve up` forwards them only with
    --verbose, and `specserve status` never (its JSON is its whole output)."""
    cfg = load_config(CONFIGS / "local-cpu.yaml")
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
    private = {"_node_ip_address", "_metrics_export_port"}  # popped from **kwargs by ray.init (ray/_private/worker.py)
    source = inspect.getsource(ray.init)
    for name in [*ray_init_kwargs(load_config(config), "/src"), *ray_attach_kwargs()]:
        assert name in named or (name in private and f'"{name}"' in source), name
