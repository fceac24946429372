"""API keys and TLS on a real cluster: no key, a wrong key and a revoked key are refused on HTTP
(401) and gRPC (UNAUTHENTICATED); a valid key works; HTTPS and gRPC over TLS work with a
certificate made by the test (and fail against another CA); health stays open. The router's own
gRPC door speaks TLS on api.grpc_port, as mTLS for in-cluster callers (`api.tls.client_ca_file`):
a client certificate from that CA is required, and nothing answers plaintext there."""

from __future__ import annotations

import time

import grpc
import httpx
import pytest

from cluster.tls import make_test_ca_and_cert
from specserve.v1 import specserve_pb2 as pb
from specserve.v1 import specserve_pb2_grpc as pb_grpc
from tests.e2e.conftest import launch_cluster

pytestmark = pytest.mark.engine

KEEP = "sk-keep-0123456789abcdef0123"
REVOKE = "sk-revoke-0123456789abcdef01"


@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("secure")
    pki = make_test_ca_and_cert(tmp / "pki")
    keys = tmp / "api-keys"
    keys.write_text(f"keep:{KEEP}\nrevoke:{REVOKE}\n")

    def mutate(raw):
        raw["auth"] = {"enabled": True, "api_keys_file": str(keys), "reload_interval_s": 0.5}
        raw["api"]["tls"] = {"certfile": str(pki.server_cert), "keyfile": str(pki.server_key),
                             "client_ca_file": str(pki.ca_cert)}
        raw["pools"] = {"ngram": raw["pools"]["ngram"]}  # one engine is enough here
        raw["pools"]["ngram"]["max_k"] = 2

    for c in launch_cluster(tmp, "specserve-secure", mutate):
        yield c, pki, keys


def _https(c) -> str:
    return c.http_url.replace("http://", "https://")


def _chat(c, pki, key):
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.post(f"{_https(c)}/v1/chat/completions", headers=headers, verify=str(pki.ca_cert), timeout=120,
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})


def _grpc_stub(c, pki, client_cert=True):
    port = c.raw["api"]["grpc_port"]
    creds = grpc.ssl_channel_credentials(
        root_certificates=pki.ca_cert.read_bytes(),
        private_key=pki.client_key.read_bytes() if client_cert else None,
        certificate_chain=pki.client_cert.read_bytes() if client_cert else None)
    channel = grpc.secure_channel(f"localhost:{port}", creds)
    return channel, pb_grpc.SpecServeStub(channel)


def _grpc_list(stub, key):
    md = [("authorization", f"Bearer {key}")] if key is not None else []
    return stub.ListModels(pb.ListModelsRequest(), metadata=md, timeout=60)


def test_keys_on_http_and_grpc_with_tls(secure):
    c, pki, keys = secure
    # HTTPS with the test CA
    assert _chat(c, pki, KEEP).status_code == 200
    for bad in (None, "sk-wrong-0123456789abcdef012"):
        r = _chat(c, pki, bad)
        assert r.status_code == 401 and r.json()["error"]["message"] == "missing or invalid API key"
    # gRPC over the TLS port
    channel, stub = _grpc_stub(c, pki)
    assert _grpc_list(stub, KEEP).models[0].name == "smollm2-135m"
    for bad in (None, "sk-wrong-0123456789abcdef012"):
        with pytest.raises(grpc.RpcError) as e:
            _grpc_list(stub, bad)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # health stays reachable without a key (allow_unauthenticated_health defaults to true)
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    health = health_pb2_grpc.HealthStub(channel)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=30).status == health_pb2.HealthCheckResponse.SERVING
    # revocation: rewrite the key file, no restart
    assert _chat(c, pki, REVOKE).status_code == 200
    keys.write_text(f"keep:{KEEP}\n")
    deadline = time.monotonic() + 15
    while _chat(c, pki, REVOKE).status_code != 401:
        assert time.monotonic() < deadline, "revoked key still accepted"
        time.sleep(0.5)
    with pytest.raises(grpc.RpcError) as e:
        _grpc_list(stub, REVOKE)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert _chat(c, pki, KEEP).status_code == 200
    channel.close()


def test_tls_refuses_another_ca(secure, tmp_path):
    c, _, _ = secure
    other = make_test_ca_and_cert(tmp_path / "other")
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{_https(c)}/v1/models", verify=str(other.ca_cert), timeout=30)
    channel, stub = _grpc_stub(c, other)
    with pytest.raises(grpc.RpcError) as e:
        _grpc_list(stub, KEEP)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    channel.close()


def test_grpc_mtls_requires_a_client_certificate_from_the_ca(secure, tmp_path):
    c, pki, _ = secure
    channel, stub = _grpc_stub(c, pki, client_cert=False)
    with pytest.raises(grpc.RpcError) as e:
        _grpc_list(stub, KEEP)  # a valid API key is not enough without the client certificate
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    channel.close()
    other = make_test_ca_and_cert(tmp_path / "other")
    port = c.raw["api"]["grpc_port"]
    foreign = grpc.secure_channel(f"localhost:{port}", grpc.ssl_channel_credentials(
        root_certificates=pki.ca_cert.read_bytes(), private_key=other.client_key.read_bytes(),
        certificate_chain=other.client_cert.read_bytes()))
    with pytest.raises(grpc.RpcError) as e:
        _grpc_list(pb_grpc.SpecServeStub(foreign), KEEP)  # a client certificate from another CA
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    foreign.close()
    channel, stub = _grpc_stub(c, pki)
    assert _grpc_list(stub, KEEP).models[0].name == "smollm2-135m"
    channel.close()


def test_grpc_port_answers_no_plaintext(secure):
    c, _, _ = secure
    channel = grpc.insecure_channel(f"localhost:{c.raw['api']['grpc_port']}")
    with pytest.raises(grpc.RpcError) as e:
        _grpc_list(pb_grpc.SpecServeStub(channel), KEEP)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    channel.close()


# -- every socket of the cluster: loopback, or a client certificate required ---------------------------

H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def _answers(host: str, port: int, tls: bool) -> bool:
    """Whether the server at host:port answers an HTTP/2 preface (plaintext, or over TLS without a
    client certificate) with any byte: a server that wants a certificate ends the connection
    instead (TLS 1.3 sends that refusal after the handshake, so it shows on the first read)."""
    import socket
    import ssl

    try:
        with socket.create_connection((host, port), timeout=5) as raw:
            if not tls:
                raw.sendall(H2_PREFACE)
                return bool(raw.recv(16))
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE  # the question is the client side
            ctx.set_alpn_protocols(["h2"])
            with ctx.wrap_socket(raw, server_hostname=host) as s:
                s.sendall(H2_PREFACE)
                return bool(s.recv(16))
    except (OSError, ssl.SSLError):
        return False


def _listening(root_pid: int) -> list[tuple[str, str, int]]:
    """(process, address, port) of every TCP socket listening in the cluster's process tree."""
    import psutil

    from cluster.ops.cpu_pinning import program

    out = []
    for p in [psutil.Process(root_pid), *psutil.Process(root_pid).children(recursive=True)]:
        try:
            name = program((p.cmdline() or [p.name()])[0])
            out += [(name, s.laddr.ip, s.laddr.port) for s in p.net_connections(kind="tcp")
                    if s.status == psutil.CONN_LISTEN]
        except psutil.Error:
            continue
    return out


def _loopback(ip: str) -> bool:
    import ipaddress

    a = ipaddress.ip_address(ip)
    return a.is_loopback or (a.version == 6 and a.ipv4_mapped is not None and a.ipv4_mapped.is_loopback)


def test_every_socket_is_loopback_or_requires_a_client_certificate(cluster):
    """The embedded config's cluster (Ray's mutual TLS on, `ray.tls`): every socket its processes
    listen on is a loopback one, or refuses a caller without a certificate from the cluster's CA,
    plaintext or TLS. Ray Serve binds each replica's inter-deployment gRPC server to `[::]`: those
    must be among the refusing ones (found and checked, whatever address they have)."""
    socks = _listening(cluster.proc.pid)
    api = {cluster.raw["api"]["http_port"], cluster.raw["api"]["grpc_port"]}
    open_ = [(n, ip, port, how) for n, ip, port in socks if not _loopback(ip)
             for how, tls in (("plaintext", False), ("TLS without a client certificate", True))
             if _answers("127.0.0.1", port, tls)]
    assert not open_, f"answered without a client certificate: {open_}"
    replicas = {n for n, _, _ in socks if n.startswith("ray::ServeReplica")}
    assert len(replicas) >= 3, socks  # the router and both engine replicas
    inter = [(n, port) for n, ip, port in socks if n in replicas and port not in api and not _loopback(ip)]
    assert {n for n, _ in inter} == replicas, f"a replica without its [::] inter-deployment server: {socks}"
    for n, port in inter:  # a real gRPC call, too: Ray's token alone would answer UNAUTHENTICATED
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        with pytest.raises(grpc.RpcError) as e:
            channel.unary_unary("/ray.serve.ASGIService/HandleRequest")(b"", timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, (n, port, e.value.code(), e.value.details())
        channel.close()
