"""The router's end-to-end deadline (router.request_timeout_s, `cluster.routing.deadline`) at both doors:
a slow engine, a retry that would overrun, a slow HTTP body; each ends with DEADLINE_EXCEEDED /
HTTP 504 (the body: 408) naming the limit, and the engine call is cancelled (vLLM aborts it)."""

from __future__ import annotations

import asyncio
import json
import time

from ray.exceptions import ActorDiedError
from starlette.requests import Request

from deployments.engine import EngineChunk
from tests.deployments.test_router import BODY, FINAL, FakeCall, make_router, post


class DrippingCall(FakeCall):
    """A chunk every `every_s`, never the last: each within the idle bound, the whole past the deadline."""

    def __init__(self, every_s: float):
        super().__init__()
        self.every_s = every_s

    async def __anext__(self):
        await asyncio.sleep(self.every_s)
        return EngineChunk(text="a", token_ids=[1], replica="r1")


class StallingCall(FakeCall):
    async def __anext__(self):
        await asyncio.sleep(3600)


def _short(router, request_s=0.5, first_s=0.5, idle_s=0.5):
    r = router.config.router
    r.request_timeout_s, r.first_token_timeout_s, r.stream_idle_timeout_s = request_s, first_s, idle_s
    return router


def test_a_slow_engine_past_the_deadline_is_504_naming_the_limit_and_is_cancelled():
    router, handles = make_router(lambda: DrippingCall(every_s=0.05))
    _short(router, request_s=0.4, idle_s=0.3)
    t0 = time.monotonic()
    r = post(router, BODY)
    assert time.monotonic() - t0 < 2.0
    assert r.status_code == 504
    err = json.loads(r.body)["error"]
    assert err["code"] == "deadline_exceeded" and "router.request_timeout_s (0.4 s)" in err["message"]
    assert handles["ngram"].calls[0].cancelled
    assert router.inflight == {"ngram": 0, "draft": 0}


def test_a_stalled_first_output_within_a_longer_deadline_is_still_503():
    router, handles = make_router(lambda: StallingCall())
    _short(router, request_s=5.0, first_s=0.2)
    r = post(router, BODY)
    assert r.status_code == 503 and b"router.first_token_timeout_s" in r.body
    assert handles["ngram"].calls[0].cancelled


def test_the_retry_after_a_dead_replica_gets_only_what_is_left_of_the_deadline():
    calls = iter([FakeCall(error=ActorDiedError()), StallingCall()])
    router, handles = make_router(lambda: next(calls))
    _short(router, request_s=0.4, first_s=0.4)
    t0 = time.monotonic()
    r = post(router, BODY)
    assert time.monotonic() - t0 < 2.0
    assert r.status_code == 504, r.body
    assert len(handles["ngram"].calls) == 2 and handles["ngram"].calls[1].cancelled


def test_grpc_generate_past_the_deadline_is_deadline_exceeded():
    import grpc
    import pytest

    from cluster.api.types import ApiError
    from specserve.v1 import specserve_pb2 as pb

    class Ctx:
        code = details = None

        def set_code(self, c):
            self.code = c

        def set_details(self, d):
            self.details = d

        def invocation_metadata(self):
            return []

    router, handles = make_router(lambda: DrippingCall(every_s=0.05))
    _short(router, request_s=0.3)
    ctx = Ctx()
    req = pb.GenerateRequest(prompt="hi", speculative=pb.SpeculativeOverride(mode="ngram", k=2))
    with pytest.raises(ApiError):
        asyncio.run(router.Generate(req, ctx))
    assert ctx.code == grpc.StatusCode.DEADLINE_EXCEEDED and "router.request_timeout_s" in ctx.details
    assert handles["ngram"].calls[0].cancelled

    async def stream():
        return [m async for m in router.GenerateStream(req, Ctx())]
    with pytest.raises(ApiError) as e:
        asyncio.run(stream())
    assert e.value.code.grpc_name == "DEADLINE_EXCEEDED"


def test_a_stream_past_the_deadline_ends_with_an_error_event():
    router, _ = make_router(lambda: DrippingCall(every_s=0.05))
    _short(router, request_s=0.3)
    raw = json.dumps({**BODY, "stream": True}).encode()
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
             "headers": [(b"content-type", b"application/json")], "query_string": b"", "scheme": "http",
             "server": ("x", 80), "root_path": ""}

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}

    async def run():
        r = await router(Request(scope, receive))
        assert r.status_code == 200  # the first chunk went out in time
        return "".join([c if isinstance(c, str) else c.decode() async for c in r.body_iterator])
    text = asyncio.run(run())
    assert '"deadline_exceeded"' in text and text.endswith("data: [DONE]\n\n")


def test_a_slow_body_is_408_within_the_deadline():
    router, handles = make_router(lambda: FakeCall([FINAL]))
    _short(router, request_s=0.3)
    raw = json.dumps(BODY).encode()
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
             "headers": [(b"content-type", b"application/json")], "query_string": b"", "scheme": "http",
             "server": ("x", 80), "root_path": ""}
    parts = iter([raw[:10], raw[10:20]])

    async def receive():  # a byte now and then, never the end
        await asyncio.sleep(0.1)
        return {"type": "http.request", "body": next(parts, b" "), "more_body": True}

    t0 = time.monotonic()
    r = asyncio.run(router(Request(scope, receive)))
    assert time.monotonic() - t0 < 2.0
    assert r.status_code == 408
    err = json.loads(r.body)["error"]
    assert (err["param"], err["code"]) == ("body", "request_timeout") and "router.request_timeout_s" in err["message"]
    assert handles["ngram"].calls == []  # nothing reached an engine


def test_a_request_within_the_deadline_is_untouched():
    router, handles = make_router(lambda: FakeCall([EngineChunk(text="a", token_ids=[1], replica="r1"), FINAL]))
    _short(router, request_s=5.0)
    assert post(router, BODY).status_code == 200
    assert not handles["ngram"].calls[0].cancelled
