"""A small typed client of specserve's OpenAI-compatible HTTP API, sync and async.

Contract: `generate(...)` sends one request (chat when `messages` is given, completions when
`prompt` is) and returns a `GenerateResult`; `generate_stream(...)` yields `StreamChunk`s as the
server's Server-Sent Events arrive; `models()` lists the served models with their pools. Every
non-2xx answer (and an error event inside a stream) raises `ClientError(status, message, param)`.
The client knows nothing of benchmarks: timings it reports are wall-clock at the client
(`time.perf_counter`), except `GenerateResult.spec.ttft_s` / `latency_s`, which the server measured.

Body building, SSE framing and chunk parsing are pure functions shared by both clients; they and the
result types live in cluster/client_wire.py.
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator, Iterator, Optional

import httpx

from cluster.client_wire import (
    ClientError, GenerateResult, ModelInfo, StreamChunk, build_body, collect_stream, error_from_response, iter_sse_data,
    parse_chunk, parse_models, parse_response,
)

DEFAULT_URL = "http://127.0.0.1:8000"


# -- clients ---------------------------------------------------------------------------------------


def _transport_error(e: httpx.HTTPError) -> ClientError:
    return ClientError(0, f"{type(e).__name__}: {e}")


class SpecServeClient:
    """Blocking client. `with SpecServeClient(url) as c: c.generate(messages=[...])`."""

    def __init__(self, base_url: str = DEFAULT_URL, timeout_s: float = 600.0, api_key: Optional[str] = None,
                 transport: Optional[httpx.BaseTransport] = None):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout_s, headers=headers,
                                  transport=transport)

    def __enter__(self) -> "SpecServeClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def models(self) -> list[ModelInfo]:
        try:
            r = self._http.get("/v1/models")
        except httpx.HTTPError as e:
            raise _transport_error(e) from e
        if r.status_code >= 400:
            raise error_from_response(r.status_code, r.content, dict(r.headers))
        return parse_models(r.json())

    def generate(self, **kwargs: Any) -> GenerateResult:
        """Keyword arguments as `build_body` (without `stream`)."""
        path, body = build_body(stream=False, **kwargs)
        start = time.perf_counter()
        try:
            r = self._http.post(path, json=body)
        except httpx.HTTPError as e:
            raise _transport_error(e) from e
        if r.status_code >= 400:
            raise error_from_response(r.status_code, r.content, dict(r.headers))
        return parse_response(r.json(), time.perf_counter() - start)

    def generate_stream(self, **kwargs: Any) -> Iterator[StreamChunk]:
        path, body = build_body(stream=True, **kwargs)
        try:
            with self._http.stream("POST", path, json=body) as r:
                if r.status_code >= 400:
                    raise error_from_response(r.status_code, r.read(), dict(r.headers))
                done = False  # after [DONE], read on to the end so the connection can be reused
                for payload in iter_sse_data(r.iter_lines()):
                    chunk = None if done else parse_chunk(payload, time.perf_counter())
                    done = done or chunk is None
                    if chunk is not None:
                        yield chunk
        except httpx.HTTPError as e:
            raise _transport_error(e) from e

    def generate_streamed(self, **kwargs: Any) -> GenerateResult:
        """Stream, then fold: the result carries client-measured TTFT and chunk times."""
        start = time.perf_counter()
        return collect_stream(self.generate_stream(**kwargs), start)


class AsyncSpecServeClient:
    """asyncio client: `async with AsyncSpecServeClient(url) as c: await c.generate(...)`."""

    def __init__(self, base_url: str = DEFAULT_URL, timeout_s: float = 600.0, api_key: Optional[str] = None,
                 max_connections: int = 256, transport: Optional[httpx.AsyncBaseTransport] = None):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._http = httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=timeout_s, headers=headers,
                                       limits=limits, transport=transport)

    async def __aenter__(self) -> "AsyncSpecServeClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def models(self) -> list[ModelInfo]:
        try:
            r = await self._http.get("/v1/models")
        except httpx.HTTPError as e:
            raise _transport_error(e) from e
        if r.status_code >= 400:
            raise error_from_response(r.status_code, r.content, dict(r.headers))
        return parse_models(r.json())

    async def forget_outputs(self) -> dict:
        """The cluster's suffix trees drop earlier requests' outputs (`POST /v1/specserve/forget_outputs`)."""
        try:
            r = await self._http.post("/v1/specserve/forget_outputs")
        except httpx.HTTPError as e:
            raise _transport_error(e) from e
        if r.status_code >= 400:
            raise error_from_response(r.status_code, r.content, dict(r.headers))
        return r.json()

    async def generate(self, **kwargs: Any) -> GenerateResult:
        path, body = build_body(stream=False, **kwargs)
        start = time.perf_counter()
        try:
            r = await self._http.post(path, json=body)
        except httpx.HTTPError as e:
            raise _transport_error(e) from e
        if r.status_code >= 400:
            raise error_from_response(r.status_code, r.content, dict(r.headers))
        return parse_response(r.json(), time.perf_counter() - start)

    async def generate_stream(self, **kwargs: Any) -> AsyncIterator[StreamChunk]:
        path, body = build_body(stream=True, **kwargs)
        try:
            async with self._http.stream("POST", path, json=body) as r:
                if r.status_code >= 400:
                    raise error_from_response(r.status_code, await r.aread(), dict(r.headers))
                lines: list[str] = []
                done = False  # after [DONE], read on to the end so the connection can be reused
                async for line in r.aiter_lines():
                    if line.strip():
                        lines.append(line)
                        continue
                    for payload in iter_sse_data(lines + [""]):
                        chunk = None if done else parse_chunk(payload, time.perf_counter())
                        done = done or chunk is None
                        if chunk is not None:
                            yield chunk
                    lines = []
                for payload in ([] if done else iter_sse_data(lines)):
                    chunk = parse_chunk(payload, time.perf_counter())
                    if chunk is not None:
                        yield chunk
        except httpx.HTTPError as e:
            raise _transport_error(e) from e

    async def generate_streamed(self, **kwargs: Any) -> GenerateResult:
        start = time.perf_counter()
        chunks = [c async for c in self.generate_stream(**kwargs)]
        return collect_stream(chunks, start)
