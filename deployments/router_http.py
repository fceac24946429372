"""The router's HTTP front door: OpenAI-compatible `/v1/completions`, `/v1/chat/completions` (JSON
or SSE), `/v1/models`, `/v1/specserve/status` and `POST /v1/specserve/forget_outputs` (suffix
trees drop earlier outputs), which Ray Serve's HTTP proxy hands to the router
replica's `__call__` as a Starlette request.

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
from typing import AsyncIterator, Optional, Sequence

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Match, Route

from cluster.api.auth import bearer_from_http
from cluster.api.types import (ApiError, ErrorCode, GenerateRequest, body_too_large, check_json_content_type,
                               from_openai)
from cluster.api.wire import openai_chunk, openai_error_event, openai_response
from cluster.policy.teaching import client_id
from cluster.routing.deadline import body_expired


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

    async def _generate(self, request: Request, client: str, deadline_s: float):
        chat = _route_path(request).endswith("chat/completions")
        check_json_content_type(request.headers.get("content-type"))
        try:
            body = json.loads(await self._read_body(request, deadline_s))
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise ApiError(ErrorCode.INVALID_ARGUMENT, f"body: not valid JSON ({e})", field="body") from None
        req = from_openai(body, chat=chat)
        if req.stream:
            stream = self._sse(req, chat, client, deadline_s)
            first = await stream.__anext__()  # validation, routing and overload errors -> HTTP codes
            return StreamingResponse(_prepend(first, stream), media_type="text/event-stream")
        return JSONResponse(openai_response(await self.complete(req, client, deadline_s), chat))

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

    async def _sse(self, req: GenerateRequest, chat: bool, client: str, deadline_s: float) -> AsyncIterator[str]:
        """SSE events. Errors before the first event propagate (so they become HTTP codes);
        later ones are sent as an error event, then [DONE]."""
        started = False
        try:
            async with aclosing(self._stream(req, client=client, deadline_s=deadline_s)) as stream:
                async for chunk, comp in stream:
                    final = comp if chunk.finish_reason is not None else None
                    yield openai_chunk(comp.request_id, comp.model, chat, chunk.text, chunk.token_ids, final)
                    started = True
        except ApiError as e:
            if not started:
                raise
            yield openai_error_event(e)
        yield "data: [DONE]\n\n"



async def _prepend(first: str, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    yield first
    async with aclosing(rest):
        async for item in rest:
            yield item


ROUTES = (
    Route("/v1/models", HttpDoor._models, methods=["GET"]),
    Route("/v1/completions", HttpDoor._generate, methods=["POST"]),
    Route("/v1/chat/completions", HttpDoor._generate, methods=["POST"]),
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


def error_response(e: ApiError, allow: Sequence[str] = ()) -> JSONResponse:
    """An OpenAI error body with the error's HTTP status and its Retry-After, WWW-Authenticate or
    Allow header."""
    headers = {"Retry-After": str(max(1, round(e.retry_after_s)))} if e.retry_after_s else {}
    if e.code is ErrorCode.UNAUTHENTICATED:
        headers = {"WWW-Authenticate": 'Bearer realm="specserve"'}
    if allow:
        headers["Allow"] = ", ".join(allow)
    return JSONResponse(e.to_openai(), status_code=e.code.http_status, headers=headers or None)
