"""The gRPC message-size bound (api.limits.grpc_max_message_bytes): how it reaches Ray Serve's gRPC
proxy (an environment variable Ray reads, set for `specserve up` and in the rendered pods), and the
TLS listener in front of the proxy enforcing it with RESOURCE_EXHAUSTED."""

from __future__ import annotations

import os
import subprocess
import sys

import grpc
import pytest

from cluster.config import parse_config
from cluster.ops.placement import grpc_message_options
from cluster.ops.ray_driver import GRPC_MAX_MESSAGE_ENV, ray_node_env
from cluster.tls import GrpcTlsForwarder, grpc_channel_credentials, grpc_server_credentials, make_test_ca_and_cert
from tests.k8s.k8s_checks import ROOT
from tests.paths import LOCAL_CPU

MIB = 1 << 20


def config(**limits):
    import yaml

    raw = yaml.safe_load(LOCAL_CPU.read_text())
    raw["api"]["limits"] = limits
    return parse_config(raw)


def test_the_default_bound_is_8_mib_both_ways():
    cfg = config()
    assert ray_node_env(cfg)[GRPC_MAX_MESSAGE_ENV] == str(8 * MIB)
    assert grpc_message_options(cfg) == [("grpc.max_receive_message_length", 8 * MIB),
                                         ("grpc.max_send_message_length", 8 * MIB)]
    assert ray_node_env(config(grpc_max_message_bytes=MIB))[GRPC_MAX_MESSAGE_ENV] == str(MIB)


def test_a_bound_grpc_cannot_hold_is_refused_naming_the_field():
    from cluster.config import ConfigError

    with pytest.raises(ConfigError, match="api.limits.grpc_max_message_bytes"):
        config(grpc_max_message_bytes=1 << 31)
    with pytest.raises(ConfigError, match="api.limits.max_body_bytes"):
        config(max_body_bytes=10)


def test_ray_serve_reads_the_variable_into_its_proxy_server_options():
    """A contract with the pinned Ray: the proxy builds its gRPC server with the message sizes of
    this variable (ray/serve/_private/constants.py DEFAULT_GRPC_SERVER_OPTIONS)."""
    code = ("from ray.serve._private.constants import DEFAULT_GRPC_SERVER_OPTIONS as o; "
            "print(sorted(o))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, GRPC_MAX_MESSAGE_ENV: str(8 * MIB)},
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.strip() == str(sorted([("grpc.max_receive_message_length", 8 * MIB),
                                      ("grpc.max_send_message_length", 8 * MIB)]))


def test_the_rendered_pods_carry_the_variable():
    import yaml

    for name in ("cpu-dev", "gpu-prod"):
        docs = list(yaml.safe_load_all((ROOT / f"k8s/rendered/{name}.yaml").read_text()))
        envs = [c["env"] for d in docs if d and d.get("kind") == "RayService"
                for g in [d["spec"]["rayClusterConfig"]["headGroupSpec"], *d["spec"]["rayClusterConfig"].get(
                    "workerGroupSpecs", [])]
                for c in g["template"]["spec"]["containers"]]
        assert envs and all({"name": GRPC_MAX_MESSAGE_ENV, "value": str(8 * MIB)} in env for env in envs), name


def test_the_tls_listener_refuses_a_larger_message_with_resource_exhausted(tmp_path):
    pki = make_test_ca_and_cert(tmp_path, ["localhost", "127.0.0.1"])
    options = grpc_message_options(config(grpc_max_message_bytes=MIB))
    upstream = grpc.server(__import__("concurrent.futures").futures.ThreadPoolExecutor(2), options=options)
    upstream.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "t.T", {"Echo": grpc.unary_unary_rpc_method_handler(lambda req, ctx: req[:10])}),))
    up_port = upstream.add_insecure_port("127.0.0.1:0")
    upstream.start()
    fwd = GrpcTlsForwarder("127.0.0.1:0", f"127.0.0.1:{up_port}",
                           grpc_server_credentials(str(pki.server_cert), str(pki.server_key)), options=options).start()
    try:
        with grpc.secure_channel(f"localhost:{fwd.port}", grpc_channel_credentials(str(pki.ca_cert)),
                                 options=[("grpc.max_send_message_length", 16 * MIB)]) as ch:
            echo = ch.unary_unary("/t.T/Echo")
            assert echo(b"x" * (MIB - 64), timeout=10) == b"x" * 10
            with pytest.raises(grpc.RpcError) as e:
                echo(b"x" * (MIB + 1), timeout=10)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        fwd.stop(0)
        upstream.stop(0)
