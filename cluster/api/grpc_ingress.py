"""gRPC servicer registration for Ray Serve's gRPC proxy, tolerant of undecodable requests.

Ray's proxy decodes each request with the servicer's `request_deserializer` before any of our
code runs; a body that is not valid protobuf (or has invalid UTF-8 in a string field) makes grpcio
answer UNKNOWN. Registering through `tolerant(...)` swaps every deserializer for one that returns
an `Undecodable` marker instead of raising; the router answers it with INVALID_ARGUMENT.
`cluster.ops.placement.GRPC_SERVICER_FUNCTIONS` names the functions below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2_grpc

from specserve.v1 import specserve_pb2_grpc


@dataclass(frozen=True)
class Undecodable:
    """A request body that did not decode as the method's message type (picklable)."""

    method: str
    reason: str


def _tolerant_deserializer(deserialize: Callable[[bytes], Any], method: str) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except (DecodeError, UnicodeDecodeError, ValueError) as e:
            return Undecodable(method=method, reason=str(e)[:200] or type(e).__name__)
    return parse


def _tolerant_handlers(handlers: dict[str, Any]) -> dict[str, Any]:
    return {m: h._replace(request_deserializer=_tolerant_deserializer(h.request_deserializer, m))
            if h.request_deserializer is not None else h for m, h in handlers.items()}


class _TolerantServer:
    """Wraps the proxy's server during registration; everything else passes through."""

    def __init__(self, server: Any):
        self._server = server

    def add_generic_rpc_handlers(self, generic_handlers):
        for handler in generic_handlers:
            if hasattr(handler, "_method_handlers"):  # grpc's method_handlers_generic_handler
                handler._method_handlers = _tolerant_handlers(handler._method_handlers)
        self._server.add_generic_rpc_handlers(generic_handlers)

    def add_registered_method_handlers(self, service_name: str, method_handlers: dict[str, Any]):
        self._server.add_registered_method_handlers(service_name, _tolerant_handlers(method_handlers))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)


def tolerant(add_to_server: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
    def add(servicer: Any, server: Any) -> None:
        add_to_server(servicer, _TolerantServer(server))
    return add


add_SpecServeServicer_to_server = tolerant(specserve_pb2_grpc.add_SpecServeServicer_to_server)
add_HealthServicer_to_server = tolerant(health_pb2_grpc.add_HealthServicer_to_server)
