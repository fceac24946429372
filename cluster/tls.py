"""TLS for the two front doors and for Redis: server settings, client credentials, test certificates.

What Ray Serve 2.60 gives (read in ray/serve/config.py, _private/http_util.py, default_impl.py):
- HTTP: `HTTPOptions(ssl_certfile, ssl_keyfile, ssl_keyfile_password, ssl_ca_certs)` are passed to
  uvicorn, so the HTTP proxy itself serves HTTPS (`http_tls_options`). It never passes
  `ssl_cert_reqs`, so uvicorn keeps CERT_NONE: `ssl_ca_certs` does NOT make client certificates
  required (no mTLS on HTTP; a test here shows it).
- gRPC: the proxy binds with `add_insecure_port("[::]:<port>")` on every interface and has no TLS
  option. `GrpcTlsForwarder` is the smallest sound addition: a TLS (optionally mTLS) gRPC listener
  that passes every call through, bytes unchanged, with metadata, deadline, status and trailers, to
  Ray's plaintext port on loopback. Ray's port must then be closed to the network (firewall /
  NetworkPolicy), since Ray binds it on all interfaces.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import logging
import os
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence
from urllib.parse import urlsplit, urlunsplit

log = logging.getLogger("specserve.tls")


class TlsConfigError(ValueError):
    """Certificate files that cannot be used; the message names the file."""


# -- server side --------------------------------------------------------------------------------

def _check_pair(certfile: str, keyfile: str, password: Optional[str] = None) -> None:
    for name, p in (("certfile", certfile), ("keyfile", keyfile)):
        if not Path(p).is_file():
            raise TlsConfigError(f"tls.{name}: {p}: no such file")
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile, password)
    except (ssl.SSLError, OSError) as e:
        raise TlsConfigError(f"tls: {certfile} / {keyfile}: not a matching certificate and key ({e})") from None


def http_tls_options(certfile: str, keyfile: str, keyfile_password: Optional[str] = None) -> dict[str, str]:
    """Keyword arguments for Ray's `HTTPOptions` that make the HTTP proxy serve HTTPS. The pair is
    loaded once here so a bad file fails `specserve up` instead of the proxy actor."""
    _check_pair(certfile, keyfile, keyfile_password)
    out = {"ssl_certfile": str(certfile), "ssl_keyfile": str(keyfile)}
    if keyfile_password:
        out["ssl_keyfile_password"] = keyfile_password
    return out


def grpc_server_credentials(certfile: str, keyfile: str, client_ca_file: Optional[str] = None):
    """grpc.ServerCredentials; with `client_ca_file`, clients must present a certificate it signed (mTLS)."""
    import grpc

    _check_pair(certfile, keyfile)
    root = Path(client_ca_file).read_bytes() if client_ca_file else None
    return grpc.ssl_server_credentials([(Path(keyfile).read_bytes(), Path(certfile).read_bytes())],
                                       root_certificates=root, require_client_auth=root is not None)


# -- client side --------------------------------------------------------------------------------

def grpc_channel_credentials(ca_file: Optional[str] = None, certfile: Optional[str] = None,
                             keyfile: Optional[str] = None):
    """grpc.ChannelCredentials trusting `ca_file` (None: the system roots), with a client pair for mTLS."""
    import grpc

    read = lambda p: Path(p).read_bytes() if p else None  # noqa: E731
    return grpc.ssl_channel_credentials(root_certificates=read(ca_file), private_key=read(keyfile),
                                        certificate_chain=read(certfile))


def client_ssl_context(ca_file: Optional[str] = None, certfile: Optional[str] = None,
                       keyfile: Optional[str] = None) -> ssl.SSLContext:
    """For httpx (`httpx.Client(verify=client_ssl_context(ca))`) and other stdlib-TLS clients."""
    ctx = ssl.create_default_context(cafile=ca_file)
    if certfile:
        ctx.load_cert_chain(certfile, keyfile)
    return ctx


# -- gRPC TLS forwarder (Ray's gRPC proxy has no TLS) -------------------------------------------

_DROP_METADATA = {"user-agent", "grpc-accept-encoding", "grpc-encoding", "te", "content-type"}


class _PassThrough:
    """grpc.GenericRpcHandler: every method, as raw bytes, one request in and a stream of responses
    out. That shape carries unary and server-streaming methods alike on the wire, and they are all
    Ray Serve's gRPC proxy serves (it has no client-streaming methods). It is also the shape that
    sends the request and the half-close in one batch upstream: forwarding a request *stream*
    raced the upstream's early status (e.g. UNIMPLEMENTED) with the write of the request, and grpc
    then reported INTERNAL "Internal error from Core" instead (9 of 1,000 calls under CPU load)."""

    def __init__(self, channel):
        self._channel = channel

    def service(self, details):
        import grpc

        method = details.method
        channel = self._channel

        async def forward(request, context):
            metadata = tuple((k, v) for k, v in context.invocation_metadata() if k not in _DROP_METADATA)
            call = channel.unary_stream(method)(request, metadata=metadata, timeout=context.time_remaining())
            try:
                initial = await call.initial_metadata()
                if initial:
                    await context.send_initial_metadata(tuple(initial))
                async for response in call:
                    yield response
                trailing = await call.trailing_metadata()
                if trailing:
                    context.set_trailing_metadata(tuple(trailing))
            except grpc.aio.AioRpcError as e:
                await context.abort(e.code(), e.details() or "", trailing_metadata=tuple(e.trailing_metadata() or ()))
            finally:
                call.cancel()  # no-op when finished; aborts upstream work when our caller went away

        return grpc.unary_stream_rpc_method_handler(forward)


async def start_grpc_tls_forwarder(listen: str, upstream: str, server_credentials,
                                   options: Sequence[tuple[str, Any]] = ()):
    """Start a TLS gRPC listener on `listen` ('host:port', port 0 picks one) forwarding to the
    plaintext `upstream`; returns (server, port). Stop with `await server.stop(grace)`."""
    import grpc

    channel = grpc.aio.insecure_channel(upstream, options=list(options))
    server = grpc.aio.server(options=list(options))
    server.add_generic_rpc_handlers((_PassThrough(channel),))
    port = server.add_secure_port(listen, server_credentials)
    if port == 0:
        raise OSError(f"gRPC TLS forwarder: cannot listen on {listen}")
    await server.start()
    log.info("gRPC TLS listener on %s (port %d) -> %s", listen, port, upstream)
    return server, port


class GrpcTlsForwarder:
    """The forwarder on its own event loop in a daemon thread, for a synchronous caller such as
    `specserve up`: `fwd = GrpcTlsForwarder(listen, upstream, creds).start(); ...; fwd.stop()`."""

    def __init__(self, listen: str, upstream: str, server_credentials, startup_timeout_s: float = 10.0,
                 options: Sequence[tuple[str, Any]] = ()):
        self.listen, self.upstream, self._creds = listen, upstream, server_credentials
        self.options = list(options)  # grpc options of the listener and its upstream channel (message sizes)
        self.startup_timeout_s = startup_timeout_s
        self.port: Optional[int] = None
        self._loop = asyncio.new_event_loop()
        self._server = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="grpc-tls-forwarder", daemon=True)

    def start(self) -> "GrpcTlsForwarder":
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(
            start_grpc_tls_forwarder(self.listen, self.upstream, self._creds, self.options), self._loop)
        self._server, self.port = fut.result(timeout=self.startup_timeout_s)
        return self

    def stop(self, grace_s: float = 5.0) -> None:
        if self._server is not None:
            asyncio.run_coroutine_threadsafe(self._server.stop(grace_s), self._loop).result(timeout=grace_s + 5)
            self._server = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)


# -- Redis: ACL user / password and TLS ---------------------------------------------------------

def redis_client_kwargs(url: str, password_env: Optional[str] = "SPECSERVE_REDIS_PASSWORD",
                        ca_file: Optional[str] = None, certfile: Optional[str] = None,
                        keyfile: Optional[str] = None, environ=None) -> dict[str, Any]:
    """Extra kwargs for `redis.Redis.from_url(url, **kwargs)`. The user name may sit in the URL
    (`rediss://specserve@host:6380/0`); the password comes from the environment variable
    `password_env` (a Secret), so the config file holds none. `rediss://` turns TLS on: the server
    certificate is verified against `ca_file` (None: system roots) and its host name checked;
    `certfile`/`keyfile` add a client certificate."""
    environ = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    if password_env and environ.get(password_env):
        out["password"] = environ[password_env]
    if urlsplit(url).scheme == "rediss":
        out.update(ssl_cert_reqs="required", ssl_check_hostname=True)
        if ca_file:
            out["ssl_ca_certs"] = str(ca_file)
        if certfile:
            out.update(ssl_certfile=str(certfile), ssl_keyfile=str(keyfile) if keyfile else None)
    elif ca_file or certfile:
        raise TlsConfigError(f"redis: TLS files given but url {redact_url(url)} is not rediss://")
    return out


def redact_url(url: str) -> str:
    """URL with any password replaced by '***' (for logs and error messages)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


# -- test certificates --------------------------------------------------------------------------

@dataclass(frozen=True)
class TestPki:
    __test__ = False  # not a pytest class
    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_test_ca_and_cert(tmpdir: str | os.PathLike, hostnames: Sequence[str] = ("localhost", "127.0.0.1"),
                          days: int = 2, client_name: str = "specserve-test-client") -> TestPki:
    """A throwaway CA (P-256), a server certificate for `hostnames` (DNS names and IP addresses go
    to the right SAN kinds) and a client certificate, all PEM files in `tmpdir`. For tests only:
    the keys are written unencrypted."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    out = Path(tmpdir)
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write(path: Path, key, cert) -> None:
        path.with_suffix(".key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        path.with_suffix(".key").chmod(0o600)
        path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = name(f"specserve test CA {now:%Y%m%d%H%M%S}")
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    write(out / "ca", ca_key, ca)

    def leaf(cn: str, sans: list, usage) -> tuple:
        key = ec.generate_private_key(ec.SECP256R1())
        b = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(ca_name)
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(start).not_valid_after(end)
             .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
             .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
             .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False))
        if sans:
            b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return key, b.sign(ca_key, hashes.SHA256())

    sans = []
    for h in hostnames:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    write(out / "server", *leaf(hostnames[0] if hostnames else "server", sans, ExtendedKeyUsageOID.SERVER_AUTH))
    write(out / "client", *leaf(client_name, [], ExtendedKeyUsageOID.CLIENT_AUTH))
    return TestPki(ca_cert=out / "ca.crt", ca_key=out / "ca.key", server_cert=out / "server.crt",
                   server_key=out / "server.key", client_cert=out / "client.crt", client_key=out / "client.key")
