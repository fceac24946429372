"""How a specserve process drives Ray: the environment of Ray's nodes and of a local Ray, the
arguments of `ray.init` for `specserve up` (start a local Ray or join one) and for the commands that
attach to a running cluster (`specserve status`), the record of a local Ray's GCS address and auth
mode through which those commands find it, and the driver's own log levels.

Pure functions over the config and the process environment (the record's file aside), so `up`,
`status`, the KubeRay render (`ray_node_env`) and tests use the same values; where each engine pool
and the router are placed is `cluster.ops.placement`.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from pathlib import Path
from typing import Any, Optional

from cluster.config import ClusterConfig
from cluster.ops.ray_tls import ray_tls_env

# Ray Serve 2.60's gRPCOptions has no message-size field; its proxy reads this variable when it
# starts (ray/serve/_private/constants.py: the server's max send and receive message length).
GRPC_MAX_MESSAGE_ENV = "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"


# Ray Serve runs a replica's methods on an event loop in a thread of their own by default, and its
# handles' routing on yet another loop: every call then crosses threads twice in the caller and twice
# in the callee. Run both on the replica's main loop (the settings of Serve's throughput-optimized
# mode, without the rest of it): a router-to-engine call took 4 ms fewer at p50 on 2 cores. The
# methods of specserve's deployments do not block their loop (blocking work goes to threads).
SERVE_LOOP_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}


def ray_node_env(config: ClusterConfig) -> dict[str, str]:
    """Environment of every Ray node (so of every worker, Serve's proxies included) that the
    config asks for: the gRPC proxy's message-size bound (api.limits.grpc_max_message_bytes) and
    Serve's replicas on one event loop (SERVE_LOOP_ENV)."""
    return {GRPC_MAX_MESSAGE_ENV: str(config.api.limits.grpc_max_message_bytes), **SERVE_LOOP_ENV}


# Ray 2.60 turns a loopback `_node_ip_address` into this machine's routable address
# (`ray._private.services.resolve_ip_for_localhost`) unless its "no clusters" switch is set; with it,
# the GCS, raylet, workers and their gRPC servers listen on 127.0.0.1 only (seen with `ss -ltnp`).
RAY_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def local_ray_env(config: ClusterConfig) -> dict[str, str]:
    """Environment for starting a local Ray (set before `ray.init`; its processes inherit it): the
    node's environment, and Ray's switch that keeps it on loopback when ray.node_ip_address is one."""
    env = ray_node_env(config)
    if _is_loopback(config.ray.node_ip_address):
        env[RAY_LOOPBACK_ENV] = "0"
    return env


def _is_loopback(host: Optional[str]) -> bool:
    return bool(host) and (host == "localhost" or host == "::1" or host.startswith("127."))


def ray_attach_env(config: ClusterConfig, environ: dict, record: Optional[dict] = None) -> dict[str, str]:
    """Environment for a client process that attaches to the running cluster's Ray (`specserve
    status`), set before `import ray`: the loopback switch when that Ray listens on loopback (the
    local default), since without it Ray dials the machine's routable address, where nothing listens;
    and, unless the caller or the config names a Ray, RAY_ADDRESS, the auth mode and Ray's TLS
    variables of `record` (what `specserve up` recorded for this config: `read_ray_address`).

    >>> from cluster.config import load_config
    >>> local = load_config(str(Path(__file__).resolve().parents[1] / "configs" / "local-cpu.yaml"))
    >>> ray_attach_env(local, {})
    {'RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER': '0'}
    >>> ray_attach_env(local, {"RAY_ADDRESS": "10.0.0.5:6379"})
    {}
    >>> ray_attach_env(local, {"RAY_ADDRESS": "127.0.0.1:6379"})
    {'RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER': '0'}
    >>> ray_attach_env(local, {}, {"gcs": "127.0.0.1:41234", "auth_mode": "token"})["RAY_ADDRESS"]
    '127.0.0.1:41234'
    """
    if environ.get("RAY_ADDRESS") or config.ray.address:
        record = None
    address = environ.get("RAY_ADDRESS") or config.ray.address or (record or {}).get("gcs")
    if address and address != "auto":
        host = address.split("://")[-1].rsplit(":", 1)[0].strip("[]")
    else:
        host = config.ray.node_ip_address if not config.ray.address else None
    env = {RAY_LOOPBACK_ENV: "0"} if _is_loopback(host) else {}
    if record:  # the Ray that `specserve up` started for this config (`ray_address_file`)
        env["RAY_ADDRESS"] = record["gcs"]
        if record.get("auth_mode") and RAY_AUTH_MODE_ENV not in environ:
            env[RAY_AUTH_MODE_ENV] = record["auth_mode"]
        if isinstance(record.get("tls"), dict):  # Ray's mutual TLS: the node certificate dials it
            env.update({k: str(v) for k, v in record["tls"].items() if k.startswith("RAY_")})
    return env


def ray_init_kwargs(config: ClusterConfig, pythonpath: str, log_to_driver: bool = False) -> dict[str, Any]:
    """Arguments of `ray.init` for `specserve up`: join ray.address, or start a local Ray whose
    processes bind to ray.node_ip_address (loopback by default: nothing of Ray on the network).

    `log_to_driver`: whether Ray copies every worker's stdout and stderr (vLLM engines, Serve's
    controller and proxies) to this terminal. Off, a start-up prints a few lines instead of
    hundreds; the workers write them to the session's log directory either way."""
    # "local": a new local Ray even when /tmp/ray/ray_current_cluster names another (a `ray start`
    # on this machine, or a cluster killed outright, leaves that file behind).
    kwargs: dict[str, Any] = dict(address=config.ray.address or "local", include_dashboard=False, logging_level=logging.WARNING,
                                  log_to_driver=log_to_driver, runtime_env={"env_vars": {"PYTHONPATH": pythonpath}})
    if not config.ray.address:
        kwargs["num_cpus"] = config.ray.num_cpus
        if config.ray.node_ip_address:
            kwargs["_node_ip_address"] = config.ray.node_ip_address
        if config.ray.metrics_export_port:
            kwargs["_metrics_export_port"] = config.ray.metrics_export_port
        if config.ray.head_resources:
            kwargs["resources"] = dict(config.ray.head_resources)
        if config.ray.nodes:
            kwargs["_node_name"] = "head"
    return kwargs


def ray_attach_kwargs() -> dict[str, Any]:
    """Arguments of `ray.init` for a client command that reads the running cluster (`specserve
    status`): attach to it ("auto": RAY_ADDRESS, which `ray_attach_env` sets from the cluster's
    record, else the newest local Ray) and print only the command's own output, none of the
    workers' and no Ray log line below ERROR."""
    return dict(address="auto", logging_level=logging.ERROR, log_to_driver=False)


def ray_address_file(config: ClusterConfig) -> Path:
    """Where `specserve up` writes the GCS address of the local Ray it started, so that
    `specserve status --config` attaches to that cluster and not to another on this machine
    (Ray's own "auto" picks the newest).

    >>> from cluster.config import load_config
    >>> ray_address_file(load_config(str(Path(__file__).resolve().parents[1] / "configs" / "local-cpu.yaml"))).name
    'specserve-8000.gcs'
    """
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specserve" / "run"
    return base / f"{config.name}-{config.api.http_port}.gcs"


RAY_AUTH_MODE_ENV = "RAY_AUTH_MODE"  # a new local Ray turns on token auth; a client must ask for it


def ray_address_record(gcs_address: str, environ: dict) -> str:
    """What `specserve up` writes to `ray_address_file`: the GCS address and Ray's auth mode.

    >>> ray_address_record("127.0.0.1:6379", {"RAY_AUTH_MODE": "token"})
    '{"gcs": "127.0.0.1:6379", "auth_mode": "token"}'
    >>> ray_address_record("127.0.0.1:6379", {"RAY_USE_TLS": "1", "RAY_TLS_CA_CERT": "/t/ca.crt"})
    '{"gcs": "127.0.0.1:6379", "auth_mode": null, "tls": {"RAY_USE_TLS": "1", "RAY_TLS_CA_CERT": "/t/ca.crt"}}'
    """
    tls = ray_tls_env(environ)
    return json.dumps({"gcs": gcs_address, "auth_mode": environ.get(RAY_AUTH_MODE_ENV), **({"tls": tls} if tls else {})})


def read_ray_address(config: ClusterConfig) -> Optional[dict]:
    """{"gcs", "auth_mode"} that `specserve up` recorded for this config's local cluster, or None."""
    try:
        record = json.loads(ray_address_file(config).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("gcs") else None


def gcs_listening(address: str, timeout_s: float = 1.0) -> bool:
    """Whether something accepts a TCP connection at a recorded GCS address: a `specserve up` that
    was killed outright leaves its record behind, and attaching there would wait out the timeout.

    >>> gcs_listening("127.0.0.1:1"), gcs_listening("not an address")
    (False, False)
    """
    host, _, port = address.split("://")[-1].rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


# Importing ray.serve gives the driver's `ray.serve` logger its own stderr handler at INFO (its
# "Started Serve in namespace ..." lines); the workers' Serve logs reach the terminal only through
# log_to_driver.
SERVE_LOGGER = "ray.serve"


def driver_log_levels(verbose: bool) -> dict[str, int]:
    """Levels for loggers of this (driver) process: Serve's own progress lines only with `verbose`.

    >>> driver_log_levels(False)
    {'ray.serve': 30}
    >>> driver_log_levels(True)
    {}
    """
    return {} if verbose else {SERVE_LOGGER: logging.WARNING}
