"""The router replica's own listeners: the HTTP and gRPC doors of the API on `api.host`, in place of
Ray Serve's proxies (`api.door: router`, the default).

A call through Ray's proxy crossed one more process before the router saw it, and every streamed
chunk crossed it again on the way out: about 10 ms before the first token on a 2-core machine
(BENCHMARKS.md, time to first token). Here the router's methods run on the replica's own event
loop, called by uvicorn (HTTP) and `grpc.aio` (gRPC), and only the router-to-engine hop remains.
The listeners also bind exactly `api.host` (Ray's gRPC proxy binds every interface) and speak TLS
natively, gRPC with client certificates when `api.tls.client_ca_file` is set.

Every replica on a node listens on the same ports (SO_REUSEPORT: the kernel spreads connections).
What the proxy gave the router is kept here: the replica's bound on calls (`cluster.api.admission`:
`router.max_ongoing_requests` running, `router.max_queued_requests` waiting, then 503 /
UNAVAILABLE), the cancellation of a call whose client went away, undecodable gRPC messages
answered INVALID_ARGUMENT (`cluster.api.grpc_ingress.tolerant`), and gRPC reflection. The HTTP door
also bounds what one client can hold: a body must be all there within
`api.limits.body_read_timeout_s` of its headers (else 408, connection closed) before the request
takes a place, and one client address keeps at most `api.limits.max_connections_per_client`
connections open (else 429, closed).
Each refusal is counted by reason (`on_refused`: busy, body_timeout, per_client).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from typing import Any, Callable, Optional

import uvicorn
from starlette.requests import Request
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from cluster.api.admission import Admission, Full, PerClient
from cluster.api.types import ApiError, ErrorCode
from cluster.config import ClusterConfig
from cluster.ops.placement import grpc_message_options, grpc_reflection
from cluster.routing.deadline import RETRY_AFTER_S
from cluster.tls import grpc_server_credentials
from deployments.router_grpc import grpc_status, grpc_trailers
from deployments.router_http import error_response

log = logging.getLogger("specserve.door")

GRPC_SERVICES = ("specserve.v1.SpecServe", "grpc.health.v1.Health")
DOOR_DRAIN_S = 10.0  # a stopping replica's calls under way get this long to end


def busy_error() -> ApiError:
    return ApiError(ErrorCode.UNAVAILABLE, "router: every place is taken (router.max_ongoing_requests running, "
                    "router.max_queued_requests waiting); retry later", retry_after_s=RETRY_AFTER_S)


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port that the router replicas of a node share (SO_REUSEPORT)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"api: cannot listen on {host}:{port} ({e.strerror})") from None
    return sock


# -- HTTP ------------------------------------------------------------------------------------------


class HttpApp:
    """ASGI app over the router's `__call__`. A request's body is read first, within
    `body_read_timeout_s` (else 408, the connection closed), and only then does the request take a
    place (admission), so a client trickling bodies holds connections, not the router's places. A
    call not streamed is cancelled when its client disconnects before the answer (a stream is, by
    Starlette's StreamingResponse, which listens for it)."""

    def __init__(self, router: Any, admission: Admission, body_read_timeout_s: float, max_body_bytes: int,
                 on_refused: Callable[[str], None] = lambda reason: None):
        self.router, self.admission = router, admission
        self.body_read_timeout_s, self.max_body_bytes, self.on_refused = body_read_timeout_s, max_body_bytes, on_refused

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":  # lifespan is off; websockets are not served
            return
        try:
            read = await asyncio.wait_for(self._read_body(scope, receive), self.body_read_timeout_s)
        except asyncio.TimeoutError:
            self.on_refused("body_timeout")
            await body_late_response()(scope, receive, send)
            return
        if read is None:  # the client went away while sending
            return
        try:
            async with self.admission.slot():
                await self._serve(scope, _replay(read, receive), send)
        except Full:
            self.on_refused("busy")
            await error_response(busy_error())(scope, receive, send)

    async def _read_body(self, scope, receive) -> Optional[list[dict]]:
        """The body's messages, read to its end or to past max_body_bytes (the router refuses what
        is larger, from Content-Length before reading anything); None if the client went away."""
        declared = dict(scope.get("headers") or ()).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            return []
        messages, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            messages.append(message)
            size += len(message.get("body", b""))
            if not message.get("more_body", False) or size > self.max_body_bytes:
                return messages

    async def _serve(self, scope, receive, send) -> None:
        body_read = asyncio.Event()

        async def tracked_receive():
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_read.set()
            return message

        handler = asyncio.ensure_future(self.router(Request(scope, tracked_receive)))
        watcher = asyncio.ensure_future(_client_gone(body_read, receive))
        try:
            await asyncio.wait({handler, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not handler.done():  # the client went away (or this task was cancelled)
                handler.cancel()
        if handler.cancelled() or not handler.done():
            return
        response = handler.result()
        await response(scope, receive, send)


def _replay(read: list[dict], receive):
    """A receive that gives the messages already read, then the connection's own."""
    pending = list(read)

    async def replayed():
        return pending.pop(0) if pending else await receive()
    return replayed


def body_late_response():
    e = ApiError(ErrorCode.REQUEST_TIMEOUT, "body: not all received within api.limits.body_read_timeout_s",
                 field="body")
    response = error_response(e)
    response.headers["connection"] = "close"  # the rest of the body is not read: the connection ends
    return response


async def _client_gone(body_read: asyncio.Event, receive) -> None:
    """Returns once the client disconnected, which is only looked for after the body was read."""
    await body_read.wait()
    while (await receive())["type"] != "http.disconnect":
        pass


def capped_protocol(per_client: PerClient, on_refused: Callable[[str], None]):
    """uvicorn's HTTP protocol, counting each connection against its client address's cap: one past
    it is answered 429 and closed before uvicorn sees it."""
    refusal = error_response(ApiError(
        ErrorCode.RESOURCE_EXHAUSTED, "too many open connections from this address "
        "(api.limits.max_connections_per_client)", retry_after_s=RETRY_AFTER_S))
    head = f"HTTP/1.1 429 Too Many Requests\r\ncontent-length: {len(refusal.body)}\r\nconnection: close\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in refusal.headers.items() if k != "content-length")
    answer = head.encode("latin-1") + b"\r\n" + refusal.body

    class CappedProtocol(AutoHTTPProtocol):
        client_address: Optional[str] = None

        def connection_made(self, transport) -> None:
            peer = transport.get_extra_info("peername")
            address = str(peer[0]) if peer else ""
            if not per_client.enter(address):
                on_refused("per_client")
                transport.write(answer)
                transport.close()
                return
            self.client_address = address
            super().connection_made(transport)

        def connection_lost(self, exc) -> None:
            if self.client_address is None:  # refused: uvicorn never saw it
                return
            per_client.leave(self.client_address)
            self.client_address = None
            super().connection_lost(exc)

    return CappedProtocol


async def start_http(app: HttpApp, config: ClusterConfig, protocol: Any = "auto"):
    """uvicorn serving `app` on api.host:api.http_port (HTTPS when api.tls is set, client
    certificates required with api.tls.http_client_certs) with the HTTP `protocol` class; returns
    the server and its task."""
    api = config.api
    tls = {}
    if api.tls.enabled:
        tls = {"ssl_certfile": api.tls.certfile, "ssl_keyfile": api.tls.keyfile}
    if api.tls.http_client_certs:  # mTLS: no certificate from the CA, no connection
        tls.update(ssl_ca_certs=api.tls.client_ca_file, ssl_cert_reqs=ssl.CERT_REQUIRED)
    sock = listening_socket(api.host, api.http_port)
    logging.getLogger("uvicorn.error").setLevel(logging.CRITICAL)
    server = uvicorn.Server(uvicorn.Config(app, http=protocol, lifespan="off", access_log=False,
                                           log_config=None, **tls))
    server.install_signal_handlers = lambda: None  # the replica's process keeps its own
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    for _ in range(200):  # started (or failed) within 2 s
        if server.started or task.done():
            break
        await asyncio.sleep(0.01)
    if task.done():
        task.result()  # raises what stopped it
        raise RuntimeError(f"api: the HTTP door on {api.host}:{api.http_port} stopped at start")
    return server, task


# -- gRPC ------------------------------------------------------------------------------------------


class GrpcServicer:
    """The router's gRPC methods as grpc.aio handlers: admission, then the router's method; an
    ApiError ends the call with its status (the router already set it on the context)."""

    def __init__(self, router: Any, admission: Admission, on_refused: Callable[[str], None] = lambda reason: None):
        self.router, self.admission, self.on_refused = router, admission, on_refused

    async def _unary(self, name: str, request, context):
        try:
            async with self.admission.slot():
                return await getattr(self.router, name)(request, grpc_context=context)
        except Exception as err:  # noqa: BLE001 - every failure ends the call with its status
            e = self._status(name, err)
        await context.abort(grpc_status(e), e.message, grpc_trailers(e))

    async def _streaming(self, name: str, request, context):
        try:
            async with self.admission.slot():
                async for message in getattr(self.router, name)(request, grpc_context=context):
                    yield message
                return
        except Exception as err:  # noqa: BLE001 - every failure ends the call with its status
            e = self._status(name, err)
        await context.abort(grpc_status(e), e.message, grpc_trailers(e))

    def _status(self, name: str, err: Exception) -> ApiError:
        """The status a failed call ends with: UNAVAILABLE when no place was free, the router's own
        error as it is, and INTERNAL naming the type for anything else (a bug, logged; grpc alone
        would answer UNKNOWN). Called while `err` is being handled."""
        if isinstance(err, Full):
            self.on_refused("busy")
            return busy_error()
        if isinstance(err, ApiError):
            return err
        log.exception("gRPC %s failed", name)
        return ApiError(ErrorCode.INTERNAL, f"{name}: internal error ({type(err).__name__})")

    async def Generate(self, request, context):
        return await self._unary("Generate", request, context)

    async def GenerateStream(self, request, context):
        async for m in self._streaming("GenerateStream", request, context):
            yield m

    async def ListModels(self, request, context):
        return await self._unary("ListModels", request, context)

    async def GetTuning(self, request, context):
        return await self._unary("GetTuning", request, context)

    async def Check(self, request, context):
        return await self._unary("Check", request, context)

    async def List(self, request, context):
        return await self._unary("List", request, context)

    async def Watch(self, request, context):
        async for m in self._streaming("Watch", request, context):
            yield m


async def start_grpc(servicer: GrpcServicer, config: ClusterConfig):
    """A grpc.aio server on api.host:api.grpc_port (TLS when api.tls is set, client certificates
    required with client_ca_file) with specserve's service, health and (per `grpc_reflection`)
    reflection."""
    import grpc
    from grpc_reflection.v1alpha import reflection

    from cluster.api.grpc_ingress import add_HealthServicer_to_server, add_SpecServeServicer_to_server

    api = config.api
    server = grpc.aio.server(options=[*grpc_message_options(config), ("grpc.so_reuseport", 1)])
    add_SpecServeServicer_to_server(servicer, server)
    add_HealthServicer_to_server(servicer, server)
    if grpc_reflection(config):
        reflection.enable_server_reflection((*GRPC_SERVICES, reflection.SERVICE_NAME), server)
    address = f"[{api.host}]:{api.grpc_port}" if ":" in api.host else f"{api.host}:{api.grpc_port}"
    if api.tls.enabled:
        bound = server.add_secure_port(address, grpc_server_credentials(api.tls.certfile, api.tls.keyfile,
                                                                         api.tls.client_ca_file))
    else:
        bound = server.add_insecure_port(address)
    if not bound:
        raise OSError(f"api: cannot listen on {address} (gRPC)")
    await server.start()
    return server


class Doors:
    """The replica's HTTP and gRPC listeners (gRPC only when api.grpc_port is set)."""

    def __init__(self, router: Any, config: ClusterConfig, on_refused: Callable[[str], None] = lambda reason: None):
        self.config = config
        limits = config.api.limits
        self.admission = Admission(config.router_max_ongoing(), config.router.max_queued_requests)
        self.per_client = PerClient(limits.max_connections_per_client)
        self.http_app = HttpApp(router, self.admission, limits.body_read_timeout_s, limits.max_body_bytes, on_refused)
        self.http_protocol = capped_protocol(self.per_client, on_refused)
        self.grpc_servicer = GrpcServicer(router, self.admission, on_refused)
        self._http: Optional[tuple[Any, asyncio.Task]] = None
        self._grpc: Any = None

    async def open(self) -> "Doors":
        try:
            self._http = await start_http(self.http_app, self.config, self.http_protocol)
            if self.config.api.grpc_port:
                self._grpc = await start_grpc(self.grpc_servicer, self.config)
        except BaseException:
            await self.close(0)
            raise
        log.info("api: HTTP on %s:%d%s", self.config.api.host, self.config.api.http_port,
                 f", gRPC on port {self.config.api.grpc_port}" if self._grpc is not None else "")
        return self

    async def close(self, grace_s: float) -> None:
        """Stop taking connections; calls under way get `grace_s` to finish."""
        if self._grpc is not None:
            await self._grpc.stop(grace_s)
            self._grpc = None
        if self._http is not None:
            server, task = self._http
            server.should_exit = True
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout=grace_s + 1)
            except Exception:  # noqa: BLE001 - closing (a timeout included): force it
                server.force_exit = True
                task.cancel()
            self._http = None
