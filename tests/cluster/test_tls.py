"""TLS (cluster.tls): test certificates, HTTPS through Ray Serve's own uvicorn start-up code (no Ray
cluster), the gRPC TLS forwarder (TLS and mTLS, metadata / status / trailers / streaming passed
through), and Redis with an ACL user and TLS. Servers are tiny, on loopback ports."""

from __future__ import annotations

import asyncio
import socket
import ssl
import subprocess
import time
from contextlib import asynccontextmanager

import grpc
import httpx
import pytest

from cluster.state.redis_server import find_redis_server, free_port, server_args
from cluster.tls import (TlsConfigError, client_ssl_context, grpc_channel_credentials, grpc_server_credentials,
                         http_tls_options, make_test_ca_and_cert, redact_url, redis_client_kwargs,
                         start_grpc_tls_forwarder)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_test_ca_and_cert(tmp_path_factory.mktemp("pki"), ["localhost", "127.0.0.1"])


@pytest.fixture(scope="module")
def other_pki(tmp_path_factory):
    """A second, unrelated CA: a client trusting it must refuse our server."""
    return make_test_ca_and_cert(tmp_path_factory.mktemp("pki-other"), ["localhost", "127.0.0.1"])


# -- certificates and option builders -------------------------------------------------------------

def test_test_certificates_chain_and_names(pki):
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(pki.server_cert.read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert oct(pki.server_key.stat().st_mode & 0o777) == "0o600"
    # the server certificate is signed by the CA, and a stdlib client context loads the CA
    from cryptography.hazmat.primitives.asymmetric.ec import ECDSA

    ca = x509.load_pem_x509_certificate(pki.ca_cert.read_bytes())
    ca.public_key().verify(cert.signature, cert.tbs_certificate_bytes, ECDSA(cert.signature_hash_algorithm))
    assert client_ssl_context(str(pki.ca_cert)).cert_store_stats()["x509_ca"] == 1


def test_http_tls_options_fail_fast_on_bad_files(pki, other_pki, tmp_path):
    from ray.serve.config import HTTPOptions

    opts = http_tls_options(str(pki.server_cert), str(pki.server_key))
    assert HTTPOptions(host="127.0.0.1", port=8443, **opts).ssl_certfile == str(pki.server_cert)
    with pytest.raises(TlsConfigError, match="no such file"):
        http_tls_options(str(tmp_path / "missing.crt"), str(pki.server_key))
    with pytest.raises(TlsConfigError, match="not a matching"):
        http_tls_options(str(pki.server_cert), str(other_pki.server_key))


# -- HTTPS: Ray Serve's own HTTP server start-up (ray.serve._private.http_util) --------------------

async def _echo_app(scope, receive, send):
    assert scope["type"] == "http"
    auth = dict(scope["headers"]).get(b"authorization", b"").decode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": f"ok {scope['scheme']} {auth}".encode()})


@asynccontextmanager
async def ray_http_server(**ssl_opts):
    from ray.serve._private.http_util import start_asgi_http_server
    from ray.serve.config import HTTPOptions

    port = free_port()
    task, server = await start_asgi_http_server(
        _echo_app, HTTPOptions(host="127.0.0.1", port=port, **ssl_opts), event_loop=asyncio.get_running_loop())
    try:
        for _ in range(200):
            if server.started:
                break
            await asyncio.sleep(0.01)
        yield port
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


def test_https_through_ray_http_proxy_code(pki, other_pki):
    async def go():
        async with ray_http_server(**http_tls_options(str(pki.server_cert), str(pki.server_key))) as port:
            async with httpx.AsyncClient(verify=client_ssl_context(str(pki.ca_cert))) as c:
                r = await c.get(f"https://localhost:{port}/", headers={"Authorization": "Bearer k"})
                assert r.status_code == 200 and r.text == "ok https Bearer k"
                r = await c.get(f"https://127.0.0.1:{port}/")  # IP SAN
                assert r.status_code == 200
            async with httpx.AsyncClient(verify=client_ssl_context(str(other_pki.ca_cert))) as c:
                with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                    await c.get(f"https://localhost:{port}/")
            async with httpx.AsyncClient() as c:  # plaintext to a TLS port: no answer
                with pytest.raises(httpx.HTTPError):
                    await c.get(f"http://localhost:{port}/")

    asyncio.run(go())


def test_ray_http_ssl_ca_certs_does_not_require_client_certificates(pki):
    """Ray 2.60 passes ssl_ca_certs to uvicorn but not ssl_cert_reqs (uvicorn keeps CERT_NONE):
    a client with no certificate is still served. So HTTP has no mTLS; this test pins that."""
    async def go():
        opts = {**http_tls_options(str(pki.server_cert), str(pki.server_key)), "ssl_ca_certs": str(pki.ca_cert)}
        async with ray_http_server(**opts) as port:
            async with httpx.AsyncClient(verify=client_ssl_context(str(pki.ca_cert))) as c:
                assert (await c.get(f"https://localhost:{port}/")).status_code == 200

    asyncio.run(go())


# -- gRPC TLS forwarder ------------------------------------------------------------------------------

class _Upstream(grpc.GenericRpcHandler):
    """Stands in for Ray's plaintext gRPC proxy: echoes metadata, streams, fails with trailers."""

    def service(self, details):
        if details.method == "/t.T/Echo":
            async def echo(request, context):
                md = dict(context.invocation_metadata())
                await context.send_initial_metadata((("request_id", "rid-1"),))
                context.set_trailing_metadata((("x-trailer", "t"),))
                return request + b"|" + md.get("authorization", "").encode()
            return grpc.unary_unary_rpc_method_handler(echo)
        if details.method == "/t.T/Stream":
            async def stream(request, context):
                for i in range(3):
                    yield request + str(i).encode()
            return grpc.unary_stream_rpc_method_handler(stream)
        if details.method == "/t.T/Fail":
            async def fail(request, context):
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key",
                                    trailing_metadata=(("retry-after-s", "1"),))
            return grpc.unary_unary_rpc_method_handler(fail)
        if details.method == "/t.T/Slow":
            async def slow(request, context):
                await asyncio.sleep(5)
                return b"late"
            return grpc.unary_unary_rpc_method_handler(slow)
        return None


@asynccontextmanager
async def forwarder(pki, client_ca=None):
    upstream = grpc.aio.server()
    upstream.add_generic_rpc_handlers((_Upstream(),))
    up_port = upstream.add_insecure_port("127.0.0.1:0")
    await upstream.start()
    creds = grpc_server_credentials(str(pki.server_cert), str(pki.server_key),
                                    client_ca_file=str(client_ca) if client_ca else None)
    fwd, port = await start_grpc_tls_forwarder("127.0.0.1:0", f"127.0.0.1:{up_port}", creds)
    try:
        yield port
    finally:
        await fwd.stop(0)
        await upstream.stop(0)


def _channel(port, creds):
    return grpc.aio.secure_channel(f"localhost:{port}", creds)


def test_grpc_forwarder_tls_passes_calls_through(pki, other_pki):
    async def go():
        async with forwarder(pki) as port:
            async with _channel(port, grpc_channel_credentials(str(pki.ca_cert))) as ch:
                call = ch.unary_unary("/t.T/Echo")(b"hi", metadata=(("authorization", "Bearer k"),), timeout=5)
                assert await call == b"hi|Bearer k"
                assert ("request_id", "rid-1") in tuple(await call.initial_metadata())
                assert ("x-trailer", "t") in tuple(await call.trailing_metadata())
                got = [m async for m in ch.unary_stream("/t.T/Stream")(b"s")]  # no deadline
                assert got == [b"s0", b"s1", b"s2"]
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await ch.unary_unary("/t.T/Fail")(b"", timeout=5)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert e.value.details() == "missing or invalid API key"
                assert ("retry-after-s", "1") in tuple(e.value.trailing_metadata())
                with pytest.raises(grpc.aio.AioRpcError) as e:  # the caller's deadline reaches upstream
                    t0 = time.monotonic()
                    await ch.unary_unary("/t.T/Slow")(b"", timeout=0.5)
                assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - t0 < 3
                # An upstream that answers before reading the request: the status must come through
                # as sent. (Forwarding the request as a stream lost it to INTERNAL ~1% of the time
                # under CPU load; the loop makes a regression likely to show.)
                for _ in range(100):
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await ch.unary_unary("/t.T/Nope")(b"x" * 100, timeout=5)
                    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED, e.value.details()
            async with _channel(port, grpc_channel_credentials(str(other_pki.ca_cert))) as ch:  # wrong CA
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await ch.unary_unary("/t.T/Echo")(b"hi", timeout=5)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            async with grpc.aio.insecure_channel(f"localhost:{port}") as ch:  # plaintext to the TLS port
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await ch.unary_unary("/t.T/Echo")(b"hi", timeout=5)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE

    asyncio.run(go())


def test_grpc_forwarder_mtls_requires_a_client_certificate_from_the_ca(pki, other_pki):
    async def go():
        async with forwarder(pki, client_ca=pki.ca_cert) as port:
            good = grpc_channel_credentials(str(pki.ca_cert), str(pki.client_cert), str(pki.client_key))
            async with _channel(port, good) as ch:
                assert await ch.unary_unary("/t.T/Echo")(b"m", timeout=5) == b"m|"
            for creds in (grpc_channel_credentials(str(pki.ca_cert)),  # no client certificate
                          grpc_channel_credentials(str(pki.ca_cert), str(other_pki.client_cert),
                                                   str(other_pki.client_key))):  # signed by another CA
                async with _channel(port, creds) as ch:
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await ch.unary_unary("/t.T/Echo")(b"m", timeout=5)
                    assert e.value.code() == grpc.StatusCode.UNAVAILABLE

    asyncio.run(go())


def test_grpc_forwarder_thread_wrapper(pki):
    from cluster.tls import GrpcTlsForwarder

    upstream = grpc.server(__import__("concurrent.futures").futures.ThreadPoolExecutor(2))
    upstream.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "t.T", {"Echo": grpc.unary_unary_rpc_method_handler(lambda req, ctx: req)}),))
    up_port = upstream.add_insecure_port("127.0.0.1:0")
    upstream.start()
    fwd = GrpcTlsForwarder("127.0.0.1:0", f"127.0.0.1:{up_port}",
                           grpc_server_credentials(str(pki.server_cert), str(pki.server_key))).start()
    try:
        with grpc.secure_channel(f"localhost:{fwd.port}", grpc_channel_credentials(str(pki.ca_cert))) as ch:
            assert ch.unary_unary("/t.T/Echo")(b"sync", timeout=5) == b"sync"
    finally:
        fwd.stop(0)
        upstream.stop(0)


# -- Redis: ACL user, password from the environment, TLS -----------------------------------------------

def test_redact_url_and_kwargs():
    assert redact_url("rediss://specserve:s3cret@redis.svc:6380/0") == "rediss://specserve:***@redis.svc:6380/0"
    assert redact_url("redis://127.0.0.1:6390/0") == "redis://127.0.0.1:6390/0"
    kw = redis_client_kwargs("rediss://u@h:6380/0", ca_file="/ca.crt", environ={"SPECSERVE_REDIS_PASSWORD": "pw"})
    assert kw == {"password": "pw", "ssl_cert_reqs": "required", "ssl_check_hostname": True, "ssl_ca_certs": "/ca.crt"}
    assert redis_client_kwargs("redis://h:1/0", environ={}) == {}
    with pytest.raises(TlsConfigError, match="not rediss"):
        redis_client_kwargs("redis://u:pw@h:1/0", ca_file="/ca.crt", environ={})


def _answers(port: int) -> bool:
    """Any RESP reply counts (PING without AUTH gets -NOAUTH here, by design)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.settimeout(0.2)
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            return bool(s.recv(64))
    except OSError:
        return False


@pytest.fixture
def acl_redis(tmp_path):
    """redis-server with the default user disabled and one ACL user limited to specserve:* keys."""
    port = free_port()
    args = server_args(find_redis_server(), port, tmp_path) + [
        "--appendonly", "no", "--save", "",
        "--user", "default", "off",
        "--user", "specserve", "on", ">pw-0123456789", "~specserve:*", "+@all", "-@dangerous"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path)
    deadline = time.monotonic() + 10
    while not _answers(port) and time.monotonic() < deadline:
        time.sleep(0.05)
    yield port
    proc.terminate()
    proc.wait(10)


class _TlsRelay:
    """A TLS-terminating TCP relay in front of a plaintext server (the bundled redis-server has no
    TLS build): lets a test check redis-py's rediss:// against our test CA."""

    def __init__(self, pki, upstream_port):
        self.ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.ctx.load_cert_chain(pki.server_cert, pki.server_key)
        self.upstream_port = upstream_port

    async def _pipe(self, r, w):
        try:
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
        finally:
            w.close()

    async def _handle(self, cr, cw):
        ur, uw = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        await asyncio.gather(self._pipe(cr, uw), self._pipe(ur, cw), return_exceptions=True)


@pytest.mark.redis
def test_redis_acl_user_and_tls(pki, other_pki, acl_redis):
    import redis

    def client(url, **kw):
        return redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2, **kw)

    plain = f"redis://specserve@127.0.0.1:{acl_redis}/0"
    with pytest.raises(redis.AuthenticationError):  # no password
        client(plain).set("specserve:x", "1")
    with pytest.raises(redis.AuthenticationError):  # wrong password
        client(plain, **redis_client_kwargs(plain, environ={"SPECSERVE_REDIS_PASSWORD": "wrong"})).ping()
    ok = client(plain, **redis_client_kwargs(plain, environ={"SPECSERVE_REDIS_PASSWORD": "pw-0123456789"}))
    assert ok.set("specserve:x", "1") and ok.get("specserve:x") == b"1"
    with pytest.raises(redis.exceptions.NoPermissionError):  # the ACL confines the user to its prefix
        ok.set("other:x", "1")

    async def over_tls():
        relay = _TlsRelay(pki, acl_redis)
        srv = await asyncio.start_server(relay._handle, "127.0.0.1", 0, ssl=relay.ctx)
        port = srv.sockets[0].getsockname()[1]
        url = f"rediss://specserve@localhost:{port}/0"
        env = {"SPECSERVE_REDIS_PASSWORD": "pw-0123456789"}
        loop = asyncio.get_running_loop()
        try:
            good = client(url, **redis_client_kwargs(url, ca_file=str(pki.ca_cert), environ=env))
            assert await loop.run_in_executor(None, good.get, "specserve:x") == b"1"
            bad = client(url, **redis_client_kwargs(url, ca_file=str(other_pki.ca_cert), environ=env))
            with pytest.raises(redis.ConnectionError, match="CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
                await loop.run_in_executor(None, bad.get, "specserve:x")
        finally:
            srv.close()

    asyncio.run(over_tls())
