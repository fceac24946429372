"""The router's HTTP front door, which Ray Serve's HTTP proxy hands to the router replica's
`__call__` as a Starlette request: vLLM's OpenAI API (`/v1/chat/completions`, `/v1/completions`,
`/tokenize`, `/detokenize`, `/version`, `/health`, `/metrics`), answered by vLLM's own serving layer
in the engine replica the router chose (`deployments.vllm_openai`), with specserve's `specserve`
object added to each generation's answer; and specserve's own `/v1/models`, `/v1/specserve/status`
and `POST /v1/specserve/forget_outputs` (suffix trees drop earlier outputs).

A mixin of `deployments.router.Router`: the methods read the router's state (`bounds`, `config`,
`complete`, `_stream`, `_authenticate`, `models_json`, `status`) and answer every `ApiError` with
its HTTP status, Retry-After or WWW-Authenticate header, and an OpenAI error body. Paths are matched
by Starlette's routes (`ROUTES`), after the caller's key is checked and a trailing slash dropped: a
known path with another method is 405 with an Allow header, an unknown one 404, both naming `path`.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import aclosing
from typing import Any, AsyncIterator, Optional, Sequence

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Match, Route

from cluster.api.auth import bearer_from_http
from cluster.api.openai_body import forward_bytes, routing_view
from cluster.api.types import ApiError, ErrorCode, GenerateRequest, body_too_large, check_json_content_type
from cluster.api.wire import Completion
from deployments.vllm_openai import add_to_stream_tail, json_with_object
from cluster.policy.teaching import client_id
from cluster.routing.deadline import RETRY_AFTER_S, body_expired


class HttpDoor:
    """The HTTP methods of the router (see module doc)."""

    async def __call__(self, request: Request):
        deadline_s = self.bounds.deadline(time.monotonic())  # the body's read counts against it
        try:
            client = client_id(self._authenticate(bearer_from_http(request.headers)), request.client)
            route, allowed = match_route(request)
            if route is None:
                return error_response(route_error(request, allowed), allow=allowed)
            return await route.endpoint(self, request, client, deadline_s)
        except ApiError as e:
            return error_response(e)

    async def _models(self, request: Request, client: str, deadline_s: float) -> JSONResponse:
        return JSONResponse(self.models_json())

    async def _status_route(self, request: Request, client: str, deadline_s: float) -> JSONResponse:
        return JSONResponse(await self.status())

    async def _forget_outputs(self, request: Request, client: str, deadline_s: float) -> JSONResponse:
        return JSONResponse(await self.forget_outputs())

    async def _json_body(self, request: Request, deadline_s: float):
        check_json_content_type(request.headers.get("content-type"))
        try:
            return json.loads(await self._read_body(request, deadline_s))
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise ApiError(ErrorCode.INVALID_ARGUMENT, f"body: not valid JSON ({e})", field="body") from None

    async def _generate(self, request: Request, client: str, deadline_s: float):
        path = _route_path(request)
        req, forward = routing_view(await self._json_body(request, deadline_s), chat=path.endswith("chat/completions"))
        if req.model is not None and req.model not in self.served:
            req.model = None  # the default model's pool: vLLM answers that the body's model does not exist
        call = {"path": path, "body": forward_bytes(forward)}
        if req.stream:
            stream = self._sse(req, call, client, deadline_s)
            first = await stream.__anext__()  # validation, routing and overload errors -> HTTP codes
            return StreamingResponse(_prepend(first, stream), media_type="text/event-stream")
        final, comp, raw = None, None, []
        async with aclosing(self._stream(req, streamed=False, client=client, deadline_s=deadline_s,
                                         openai=call)) as stream:
            async for final, comp in stream:
                raw.append(final.raw)
        assert final is not None and comp is not None
        media = final.media_type or "application/json"
        body = "".join(raw)
        if media.startswith("text/event-stream"):  # vLLM streamed after all (it reads `stream` leniently)
            return Response(add_to_stream_tail(body, "specserve", specserve_object(comp, with_tokens=False)),
                            status_code=final.http_status or 200, media_type=media)
        return Response(json_with_object(body.encode(), "specserve", specserve_object(comp)),
                        status_code=final.http_status or 200, media_type=media)

    def _model_pool(self, model: Any) -> str:
        """The first pool serving `model` (the default model when it is not a known name)."""
        name = model if isinstance(model, str) and model in self.served else self.served[0]
        return next(n for n, p in self.config.pools.items() if p.model == name)

    async def _vllm_simple(self, pool: str, method: str, path: str, body: bytes = b"", query: str = "") -> Response:
        """A call of vLLM's app that generates nothing, on one replica of `pool`."""
        try:
            out = await asyncio.wait_for(self.engines[pool].openai_simple.remote(method, path, body, query),
                                         timeout=self.bounds.first_token_s)
        except asyncio.TimeoutError:
            raise ApiError(ErrorCode.UNAVAILABLE, f"pool {pool!r} did not answer {path} in time",
                           retry_after_s=RETRY_AFTER_S) from None
        except ApiError:
            raise
        except Exception as e:  # noqa: BLE001 - mapped to a typed API error
            raise ApiError(ErrorCode.UNAVAILABLE, f"pool {pool!r}: {type(e).__name__}",
                           retry_after_s=RETRY_AFTER_S) from None
        return Response(out["body"], status_code=out["status"], media_type=out["media_type"])

    async def _tokenize(self, request: Request, client: str, deadline_s: float) -> Response:
        body = await self._json_body(request, deadline_s)
        pool = self._model_pool(body.get("model") if isinstance(body, dict) else None)
        return await self._vllm_simple(pool, "POST", _route_path(request), forward_bytes(body))

    async def _version(self, request: Request, client: str, deadline_s: float) -> Response:
        return await self._vllm_simple(next(iter(self.config.pools)), "GET", "/version")

    async def _health(self, request: Request, client: str, deadline_s: float) -> Response:
        """200 while every pool has a replica that answers its load report, else 503."""
        for name, handle in self.engines.items():
            try:
                rep = await asyncio.wait_for(handle.load.remote(), timeout=2.0)
            except Exception:  # noqa: BLE001 - any failure is an unhealthy pool
                rep = {"engine_dead": True}
            if rep.get("engine_dead"):
                raise ApiError(ErrorCode.UNAVAILABLE, f"pool {name!r} has no live engine replica",
                               retry_after_s=RETRY_AFTER_S)
        return Response(status_code=200)

    async def _metrics(self, request: Request, client: str, deadline_s: float) -> Response:
        """vLLM's Prometheus metrics of one replica of every pool, each sample labelled with its pool."""
        texts = {}
        for name in self.engines:
            r = await self._vllm_simple(name, "GET", "/metrics")
            texts[name] = r.body.decode("utf-8", errors="replace")
        return Response(merge_metrics(texts), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def _read_body(self, request, deadline_s: float) -> bytes:
        """The request's body, read up to api.limits.max_body_bytes: 413 from its Content-Length
        before reading, or as soon as more than that arrived; 408 unless it is all there by `deadline_s`."""
        try:
            return await asyncio.wait_for(self._read_body_bounded(request), timeout=max(deadline_s - time.monotonic(), 0.0))
        except asyncio.TimeoutError:
            raise body_expired(self.bounds) from None

    async def _read_body_bounded(self, request) -> bytes:
        limit = self.config.api.limits.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise body_too_large(int(declared), limit)
        chunks, n = [], 0
        async for chunk in request.stream():
            n += len(chunk)
            if n > limit:
                raise body_too_large(n, limit)
            chunks.append(chunk)
        return b"".join(chunks)

    async def _sse(self, req: GenerateRequest, call: dict, client: str, deadline_s: float) -> AsyncIterator[str]:
        """vLLM's SSE events, with the `specserve` object added to its last one. Errors before the
        first event propagate (so they become HTTP codes); later ones are sent as an error event,
        then [DONE]."""
        started = False
        try:
            async with aclosing(self._stream(req, client=client, deadline_s=deadline_s, openai=call)) as stream:
                async for chunk, comp in stream:
                    if chunk.finish_reason is not None:
                        yield add_to_stream_tail(chunk.raw, "specserve", specserve_object(comp, with_tokens=False))
                    elif chunk.raw:
                        yield chunk.raw
                    started = True
        except ApiError as e:
            if not started:
                raise
            yield f"data: {json.dumps(e.to_openai())}\n\ndata: [DONE]\n\n"



async def _prepend(first: str, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    yield first
    async with aclosing(rest):
        async for item in rest:
            yield item


ROUTES = (
    Route("/v1/models", HttpDoor._models, methods=["GET"]),
    Route("/v1/completions", HttpDoor._generate, methods=["POST"]),
    Route("/v1/chat/completions", HttpDoor._generate, methods=["POST"]),
    Route("/tokenize", HttpDoor._tokenize, methods=["POST"]),
    Route("/detokenize", HttpDoor._tokenize, methods=["POST"]),
    Route("/version", HttpDoor._version, methods=["GET"]),
    Route("/health", HttpDoor._health, methods=["GET"]),
    Route("/metrics", HttpDoor._metrics, methods=["GET"]),
    Route("/v1/specserve/status", HttpDoor._status_route, methods=["GET"]),
    Route("/v1/specserve/forget_outputs", HttpDoor._forget_outputs, methods=["POST"]),
)


def _route_path(request: Request) -> str:
    return request.url.path.rstrip("/") or "/"


def match_route(request: Request) -> tuple[Optional[Route], list[str]]:
    """The route of `request` (its path without a trailing slash), else None and the methods its path
    takes (none: no such path)."""
    scope = {**request.scope, "path": _route_path(request), "root_path": ""}
    allowed: list[str] = []
    for route in ROUTES:
        match, _ = route.matches(scope)
        if match is Match.FULL:
            return route, []
        if match is Match.PARTIAL:
            allowed += sorted(route.methods or ())
    return None, allowed


def route_error(request: Request, allowed: list[str]) -> ApiError:
    """404 for a path with no route, 405 for a route's path with another method; both name `path`."""
    path = _route_path(request)
    if allowed:
        return ApiError(ErrorCode.METHOD_NOT_ALLOWED, f"path: {path} takes {', '.join(allowed)}, not {request.method}",
                        field="path")
    return ApiError(ErrorCode.NOT_FOUND, f"no route {request.method} {path}", field="path")


def specserve_object(c: Completion, with_tokens: bool = True) -> dict[str, Any]:
    """The `specserve` object of an answer: the request id, what was decided and what happened
    (`cluster.speculation.SpecStats`), timings, and the first choice's token ids."""
    ext = {"request_id": c.request_id, **c.stats, "ttft_s": round(c.ttft_s, 6),
           "latency_s": round(c.latency_s, 6), "tpot_s": round(c.tpot_s, 6)}
    if with_tokens:
        ext["token_ids"] = c.token_ids
    return ext


def merge_metrics(texts: dict[str, str]) -> str:
    r"""Prometheus text expositions, one per pool, as one: every sample gains a `pool` label, and
    each family's samples stay together under its one HELP and TYPE.

    >>> print(merge_metrics({"a": "# TYPE x counter\nx{m=\"1\"} 2\n", "b": "# TYPE x counter\nx 3\n"}), end="")
    # TYPE x counter
    x{pool="a",m="1"} 2
    x{pool="b"} 3
    """
    families: dict[str, tuple[list[str], list[str]]] = {}
    for pool, text in texts.items():
        current = ""
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                current = line.split()[2]
                head, _ = families.setdefault(current, ([], []))
                if line not in head:
                    head.append(line)
            elif line and not line.startswith("#"):
                name, sep, rest = line.partition("{")
                sample = (f'{name}{{pool="{pool}",{rest}' if sep else
                          f'{line.split(" ", 1)[0]}{{pool="{pool}"}} {line.split(" ", 1)[1]}')
                families.setdefault(current, ([], []))[1].append(sample)
    return "".join(line + "\n" for head, samples in families.values() for line in (*head, *samples))


def error_response(e: ApiError, allow: Sequence[str] = ()) -> JSONResponse:
    """An OpenAI error body with the error's HTTP status and its Retry-After, WWW-Authenticate or
    Allow header (vLLM's own error answer as it is)."""
    headers = {"Retry-After": str(max(1, round(e.retry_after_s)))} if e.retry_after_s else {}
    if e.code is ErrorCode.UNAUTHENTICATED:
        headers = {"WWW-Authenticate": 'Bearer realm="specserve"'}
    if allow:
        headers["Allow"] = ", ".join(allow)
    return JSONResponse(e.to_openai(), status_code=getattr(e, "status", e.code.http_status), headers=headers or None)
