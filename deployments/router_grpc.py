"""The router's gRPC front door: `specserve.v1.SpecServe` and `grpc.health.v1.Health` methods, which
Ray Serve's gRPC proxy calls on the router replica by method name (with a `RayServegRPCContext`).
Generations go through vLLM's serving layer in the engine replica, as HTTP ones do
(`cluster.api.grpc_openai` maps the messages).

A mixin of `deployments.router.Router`: the methods read the router's state (`_stream`,
`tuning`, `served`, `engines`, `auth`) and map every `ApiError` to a gRPC status with its details.
"""

from __future__ import annotations

import json
from contextlib import aclosing
from typing import Any

from cluster.api.auth import bearer_from_grpc
from cluster.api.grpc_openai import StreamReader, openai_call, response_proto, token_logprob
from cluster.api.openai_body import forward_bytes, request_class
from cluster.api.types import ApiError, ErrorCode
from cluster.api.wire import from_proto, generate_response_proto, spec_stats_proto, timing_proto
from cluster.policy.teaching import client_id
from specserve.v1 import specserve_pb2 as pb


def grpc_status(e: ApiError) -> Any:
    """The grpc.StatusCode of an error."""
    import grpc

    return getattr(grpc.StatusCode, e.code.grpc_name)


def grpc_trailers(e: ApiError) -> tuple:
    """Trailing metadata of an error: its retry hint in seconds, if it has one."""
    return (("retry-after-s", str(e.retry_after_s)),) if e.retry_after_s else ()


class GrpcDoor:
    """The gRPC methods of the router (see module doc)."""

    def _authenticate_grpc(self, ctx: Any) -> str:
        """The caller's `client_id` (its key's label, else its peer), or UNAUTHENTICATED."""
        try:
            label = self._authenticate(bearer_from_grpc(ctx))
        except ApiError as e:
            raise self._grpc_fail(ctx, e) from None
        return client_id(label, ctx.peer() if hasattr(ctx, "peer") else None)

    @staticmethod
    def _grpc_fail(ctx: Any, e: ApiError) -> ApiError:
        if ctx is not None:
            ctx.set_code(grpc_status(e))
            ctx.set_details(e.message)
            if e.retry_after_s:
                ctx.set_trailing_metadata(list(grpc_trailers(e)))
        return e

    def _decoded(self, request: Any, ctx: Any) -> Any:
        from cluster.api.grpc_ingress import Undecodable

        if isinstance(request, Undecodable):
            raise self._grpc_fail(ctx, ApiError(ErrorCode.INVALID_ARGUMENT,
                                                f"request: not a valid message for {request.method} ({request.reason})",
                                                field="request"))
        return request

    def _grpc_call(self, request: Any, stream: bool) -> tuple[Any, dict[str, Any]]:
        """(validated request, call for vLLM's serving layer) of a gRPC generation."""
        req = from_proto(request)
        path, body = openai_call(request, req, stream=stream)
        req.format_class = request_class(body)
        return req, {"path": path, "body": forward_bytes(body)}

    async def Generate(self, request, grpc_context=None):
        client = self._authenticate_grpc(grpc_context)
        request = self._decoded(request, grpc_context)

        try:
            req, call = self._grpc_call(request, stream=False)
            comp, raw = None, []
            async with aclosing(self._stream(req, streamed=False, client=client, openai=call)) as stream:
                async for chunk, comp in stream:
                    raw.append(chunk.raw)
            assert comp is not None
            return response_proto(pb, json.loads("".join(raw)), generate_response_proto(pb, comp))
        except ApiError as e:
            raise self._grpc_fail(grpc_context, e) from None

    async def GenerateStream(self, request, grpc_context=None):
        client = self._authenticate_grpc(grpc_context)
        request = self._decoded(request, grpc_context)

        try:
            req, call = self._grpc_call(request, stream=True)
            reader = StreamReader()
            async with aclosing(self._stream(req, client=client, openai=call)) as stream:
                async for chunk, comp in stream:
                    text, token_ids, logprobs = reader.read(chunk.raw)
                    msg = pb.GenerateStreamResponse(request_id=comp.request_id, text=text, token_ids=token_ids,
                                                    logprobs=[token_logprob(pb, t) for t in logprobs])
                    if chunk.finish_reason is not None:
                        msg.finish_reason = reader.finish_reason or comp.finish_reason or ""
                        msg.prompt_tokens = int(reader.usage.get("prompt_tokens") or comp.prompt_tokens)
                        msg.completion_tokens = int(reader.usage.get("completion_tokens") or comp.completion_tokens)
                        msg.tool_calls.extend(pb.ToolCall(**c) for c in reader.tool_calls)
                        msg.timing.CopyFrom(timing_proto(pb, comp))
                        msg.spec.CopyFrom(spec_stats_proto(pb, comp))
                    elif not (text or token_ids or logprobs):
                        continue
                    yield msg
        except ApiError as e:
            raise self._grpc_fail(grpc_context, e) from None

    async def ListModels(self, request, grpc_context=None):
        self._authenticate_grpc(grpc_context)
        self._decoded(request, grpc_context)

        out = pb.ListModelsResponse()
        for m in self.models_json()["data"]:
            info = out.models.add(name=m["id"])
            for p in m["specserve"]["pools"]:
                info.pools.add(name=p["name"], method=p["method"], max_k=p["max_k"], modes=p["modes"])
        return out

    async def GetTuning(self, request, grpc_context=None):
        """The tuning table of one served model (or of all): from the view the tuning store's
        thread keeps, so no Redis I/O runs on the event loop. An unknown model is NOT_FOUND."""
        self._authenticate_grpc(grpc_context)
        request = self._decoded(request, grpc_context)

        try:
            if request.model and request.model not in self.served:
                raise ApiError(ErrorCode.NOT_FOUND, f"model: {request.model[:64]!r} is not served; served models: "
                                                    f"{self.served}", field="model")
            out = pb.GetTuningResponse(redis_ok=bool(self.tuning is not None and getattr(self.tuning, "healthy", False)))
            if self.tuning is not None and hasattr(self.tuning, "table"):
                fields = pb.TuningEntry.DESCRIPTOR.fields_by_name
                for m in [request.model] if request.model else self.served:
                    for row in self.tuning.table(m, fresh=False):
                        out.entries.add(**{k: v for k, v in row.items() if k in fields})
            return out
        except ApiError as e:
            raise self._grpc_fail(grpc_context, e) from None
        except Exception as e:  # noqa: BLE001 - logged with context and counted; the caller gets INTERNAL
            self._failed("get_tuning", e, f"model {request.model[:64]!r}")
            raise self._grpc_fail(grpc_context, ApiError(
                ErrorCode.INTERNAL, f"tuning table unavailable ({type(e).__name__})")) from None

    def _health_status(self, service: str) -> int:
        from grpc_health.v1 import health_pb2

        if service not in ("", "specserve.v1.SpecServe"):
            return -1
        return health_pb2.HealthCheckResponse.SERVING if self.engines else health_pb2.HealthCheckResponse.NOT_SERVING

    async def Check(self, request, grpc_context=None):
        if not self.health_open:
            self._authenticate_grpc(grpc_context)
        request = self._decoded(request, grpc_context)
        from grpc_health.v1 import health_pb2

        status = self._health_status(request.service)
        if status < 0:
            raise self._grpc_fail(grpc_context, ApiError(ErrorCode.NOT_FOUND, f"unknown service {request.service!r}",
                                                         field="service"))
        return health_pb2.HealthCheckResponse(status=status)

    async def List(self, request, grpc_context=None):
        if not self.health_open:
            self._authenticate_grpc(grpc_context)
        self._decoded(request, grpc_context)
        from grpc_health.v1 import health_pb2

        out = health_pb2.HealthListResponse()
        for service in ("", "specserve.v1.SpecServe"):
            out.statuses[service].status = self._health_status(service)
        return out

    async def Watch(self, request, grpc_context=None):
        if not self.health_open:
            self._authenticate_grpc(grpc_context)
        request = self._decoded(request, grpc_context)
        from grpc_health.v1 import health_pb2

        status = self._health_status(request.service)
        yield health_pb2.HealthCheckResponse(
            status=health_pb2.HealthCheckResponse.SERVICE_UNKNOWN if status < 0 else status)
