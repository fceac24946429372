"""cluster/ops/ray_tls.py: node certificates that Ray's own TLS accepts, and what a caller without one
gets from a gRPC server bound the way Ray binds its servers (`add_port_to_grpc_server`)."""

from __future__ import annotations

import ipaddress
import stat
from concurrent import futures

import grpc
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from cluster.config import ConfigError, parse_config
from cluster.ops import ray_tls


def _load(path):
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_a_node_certificate_names_the_node_and_loopback_and_serves_and_dials(tmp_path):
    ca_cert, ca_key = ray_tls.make_ca(tmp_path / "ca")
    pki = ray_tls.node_cert(tmp_path / "node", ca_cert, ca_key, ["10.1.2.3", "ray-head"])
    cert = _load(pki.cert)
    cert.verify_directly_issued_by(_load(ca_cert))
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(sans.get_values_for_type(x509.IPAddress)) == {ipaddress.ip_address(a) for a in ("10.1.2.3", "127.0.0.1", "::1")}
    assert set(sans.get_values_for_type(x509.DNSName)) == {"ray-head", "localhost"}
    usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH} <= set(usage)
    assert stat.S_IMODE(pki.key.stat().st_mode) == 0o600 and stat.S_IMODE(ca_key.stat().st_mode) == 0o600
    assert pki.ca_cert.read_bytes() == ca_cert.read_bytes()
    assert pki.env() == {"RAY_USE_TLS": "1", "RAY_TLS_SERVER_CERT": str(pki.cert),
                         "RAY_TLS_SERVER_KEY": str(pki.key), "RAY_TLS_CA_CERT": str(pki.ca_cert)}


def test_a_local_start_discards_the_ca_key_it_made_and_uses_a_configured_one(tmp_path):
    made = ray_tls.local_pki(["127.0.0.1"], base=tmp_path)
    assert not list(made.cert.parent.rglob("ca.key"))  # nothing else can be signed by it
    _load(made.cert).verify_directly_issued_by(_load(made.ca_cert))
    ca_cert, ca_key = ray_tls.make_ca(tmp_path / "own")
    given = ray_tls.local_pki(["127.0.0.1"], str(ca_cert), str(ca_key), base=tmp_path)
    _load(given.cert).verify_directly_issued_by(_load(ca_cert))
    assert ca_key.exists()  # a configured CA's key is the operator's
    ray_tls.forget_local_pki(made.env())
    assert not made.cert.parent.exists()
    ray_tls.forget_local_pki({"RAY_TLS_SERVER_CERT": str(ca_cert)})  # not a folder local_pki made: kept
    assert ca_cert.exists()


def _serve_like_ray(monkeypatch, pki):
    from ray._common.tls_utils import add_port_to_grpc_server

    for k, v in pki.env().items():
        monkeypatch.setenv(k, v)
    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "t.S", {"Echo": grpc.unary_unary_rpc_method_handler(lambda req, ctx: req)})])
    port = add_port_to_grpc_server(server, "127.0.0.1:0")
    server.start()
    return server, port


def test_rays_servers_refuse_a_caller_without_a_certificate_from_the_ca(tmp_path, monkeypatch):
    ca_cert, ca_key = ray_tls.make_ca(tmp_path / "ca")
    pki = ray_tls.node_cert(tmp_path / "node", ca_cert, ca_key, ["127.0.0.1"])
    other_cert, other_key = ray_tls.make_ca(tmp_path / "other")
    stranger = ray_tls.node_cert(tmp_path / "stranger", other_cert, other_key, ["127.0.0.1"])
    server, port = _serve_like_ray(monkeypatch, pki)
    target = f"127.0.0.1:{port}"

    def call(creds):
        channel = grpc.secure_channel(target, creds) if creds else grpc.insecure_channel(target)
        try:
            return channel.unary_unary("/t.S/Echo")(b"x", timeout=5)
        finally:
            channel.close()

    try:
        ca = pki.ca_cert.read_bytes()
        assert call(grpc.ssl_channel_credentials(ca, pki.key.read_bytes(), pki.cert.read_bytes())) == b"x"
        for creds in (None, grpc.ssl_channel_credentials(ca),
                      grpc.ssl_channel_credentials(ca, stranger.key.read_bytes(), stranger.cert.read_bytes())):
            with pytest.raises(grpc.RpcError) as e:
                call(creds)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(0)


def test_the_init_container_command(tmp_path, capsys):
    assert ray_tls.main(["node-cert", "--ca-dir", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "missing ca.crt, ca.key" in capsys.readouterr().err
    ray_tls.make_ca(tmp_path / "ca")
    assert ray_tls.main(["node-cert", "--ca-dir", str(tmp_path / "ca"), "--out", str(tmp_path / "o"),
                         "--host", "10.0.0.7"]) == 0
    assert f"RAY_TLS_SERVER_CERT={tmp_path / 'o' / 'tls.crt'}" in capsys.readouterr().out


def test_the_config_names_a_half_given_ca(tmp_path):
    raw = {"models": {"m": {"source": "org/m"}}, "pools": {"a": {"model": "m"}}}
    assert parse_config(raw).ray.tls.enabled
    with pytest.raises(ConfigError, match="ca_cert and ca_key go together"):
        parse_config({**raw, "ray": {"tls": {"ca_cert": str(tmp_path / "ca.crt")}}})
    with pytest.raises(ConfigError, match="ca_key: .*no such file"):
        parse_config({**raw, "ray": {"tls": {"ca_cert": __file__, "ca_key": str(tmp_path / "nope")}}})
