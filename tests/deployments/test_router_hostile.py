"""Router against hostile callers, without Ray: size limits and content types at the HTTP door, the
total prompt size at both doors, GetTuning (unknown models, bounded caches, no Redis I/O on the
event loop), and failures off the request path logged at WARNING and counted."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import grpc
import pytest
from starlette.requests import Request

from cluster.config import RedisConfig, load_config
from cluster.state.tuning import TuningStore
from deployments.engine import EngineChunk
from deployments.router import Router
from specserve.v1 import specserve_pb2 as pb
from tests.deployments.test_router import FINAL, FakeCall, FakeHandle
from tests.deployments.test_router_auth import Ctx  # a gRPC context double; no metadata by default
from tests.paths import LOCAL_CPU

CONFIG = LOCAL_CPU
MODEL = "smollm2-135m"



def make_router(tuning=None, **limits):
    cfg = load_config(CONFIG)
    cfg.api.limits = cfg.api.limits.model_copy(update=limits)
    handles = {name: FakeHandle(lambda: FakeCall([FINAL])) for name in cfg.pools}
    return Router(cfg, handles, tuning=tuning), handles


def send(router, raw: bytes, headers=(("content-type", "application/json"),), chunk: int = 0,
         path="/v1/chat/completions"):
    """POST `raw` (in pieces of `chunk` bytes when set, as a body without Content-Length arrives);
    returns (response, bytes the router pulled from the client)."""
    pieces = [raw[i:i + chunk] for i in range(0, len(raw), chunk)] if chunk else [raw]
    pulled = []
    scope = {"type": "http", "method": "POST", "path": path, "query_string": b"", "scheme": "http",
             "server": ("x", 80), "root_path": "",
             "headers": [(k.encode(), v.encode()) for k, v in headers]}

    async def receive():
        if not pieces:
            return {"type": "http.disconnect"}
        piece = pieces.pop(0)
        pulled.append(len(piece))
        return {"type": "http.request", "body": piece, "more_body": bool(pieces)}
    return asyncio.run(router(Request(scope, receive))), sum(pulled)


def body_of(text: str, n_messages: int = 1) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": text}] * n_messages, "max_tokens": 1}).encode()


def error(r) -> dict:
    return json.loads(r.body)["error"]


# -- content type ------------------------------------------------------------------------------------

@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                                   None])
def test_a_non_json_post_is_415_and_never_reaches_an_engine(ctype):
    router, handles = make_router()
    r, _ = send(router, body_of("hi"), headers=[("content-type", ctype)] if ctype else [])
    assert r.status_code == 415 and error(r)["param"] == "content-type" and error(r)["code"] == "unsupported_media_type"
    assert not any(h.requests for h in handles.values())


def test_a_json_post_with_a_charset_is_served():
    router, _ = make_router()
    r, _ = send(router, body_of("hi"), headers=[("content-type", "application/json; charset=utf-8")])
    assert r.status_code == 200, r.body


# -- body size ---------------------------------------------------------------------------------------

def test_a_declared_content_length_past_the_limit_is_413_before_reading():
    router, handles = make_router(max_body_bytes=4096)
    raw = body_of("x" * 5000)
    r, pulled = send(router, raw, headers=[("content-type", "application/json"), ("content-length", str(len(raw)))])
    assert r.status_code == 413 and pulled == 0
    e = error(r)
    assert e["param"] == "body" and "4096" in e["message"] and "api.limits.max_body_bytes" in e["message"]
    assert not any(h.requests for h in handles.values())


def test_a_body_without_content_length_stops_being_read_at_the_limit():
    router, _ = make_router(max_body_bytes=4096)
    r, pulled = send(router, body_of("x" * 100_000), chunk=1024)
    assert r.status_code == 413 and error(r)["param"] == "body"
    assert pulled <= 4096 + 1024  # the chunk that crossed the limit, and no more


def test_a_body_at_the_limit_is_served():
    raw = body_of("hi")
    router, _ = make_router(max_body_bytes=1024)
    assert len(raw) < 1024
    r, _ = send(router, raw, headers=[("content-type", "application/json"), ("content-length", str(len(raw)))],
                chunk=7)
    assert r.status_code == 200


# -- total prompt size ---------------------------------------------------------------------------------

def test_many_messages_within_their_own_limit_are_413_together():
    """256 messages of 10 Ki characters each pass the per-message limit; together they do not."""
    router, handles = make_router(max_prompt_chars=256 << 10, max_body_bytes=8 << 20)
    r, _ = send(router, body_of("x" * 10240, n_messages=256))
    assert r.status_code == 413, r.body
    e = error(r)
    assert e["param"] == "messages" and "api.limits.max_prompt_chars" in e["message"] and "262144" in e["message"]
    assert not any(h.requests for h in handles.values())
    r, _ = send(router, body_of("x" * 10240, n_messages=25))
    assert r.status_code == 200


def test_grpc_total_prompt_size_is_invalid_argument_naming_the_limit():
    router, _ = make_router(max_prompt_chars=1000)
    req = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="x" * 600)] * 2)
    req.sampling.max_tokens = 1
    ctx = Ctx()
    with pytest.raises(Exception):
        asyncio.run(router.Generate(req, ctx))
    assert ctx.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "messages" in ctx.details and "api.limits.max_prompt_chars" in ctx.details


# -- GetTuning -----------------------------------------------------------------------------------------

def test_get_tuning_of_an_unknown_model_is_not_found():
    store = TuningStore(RedisConfig(url="redis://127.0.0.1:1/0"), models=(MODEL,), start=False)
    router, _ = make_router(tuning=store)
    ctx = Ctx()
    with pytest.raises(Exception):
        asyncio.run(router.GetTuning(pb.GetTuningRequest(model="x" * 1_000_000), ctx))
    assert ctx.code == grpc.StatusCode.NOT_FOUND and "model" in ctx.details and len(ctx.details) < 300
    assert asyncio.run(router.GetTuning(pb.GetTuningRequest(model=MODEL), Ctx())).redis_ok is False


def test_get_tuning_grows_no_cache_and_does_no_redis_io(monkeypatch):
    """Many distinct names register nothing; a served model is answered from the cached view, so
    the call never reaches Redis on the event loop (here Redis would raise at once)."""
    store = TuningStore(RedisConfig(url="redis://127.0.0.1:1/0"), models=(MODEL,), start=False)

    def no_io(*_a, **_k):
        raise AssertionError("Redis I/O on the event loop")

    monkeypatch.setattr(store, "fetch_view", no_io)
    router, _ = make_router(tuning=store)

    async def many():
        for i in range(2000):
            try:
                await router.GetTuning(pb.GetTuningRequest(model=f"m{i}" * 50), Ctx())
            except Exception:  # noqa: BLE001 - NOT_FOUND, checked above
                pass
        return await router.GetTuning(pb.GetTuningRequest(), Ctx())
    asyncio.run(many())
    assert store._models == {MODEL} and set(store._key_cache) <= {MODEL}
    assert set(store._views) <= {MODEL}


class BrokenTuning:
    healthy = True

    def table(self, model, fresh=True):
        raise RuntimeError("view corrupted")

    def snapshot(self, model):
        raise RuntimeError("view corrupted")


def test_a_get_tuning_failure_is_internal_logged_at_warning_and_counted(caplog):
    router, _ = make_router(tuning=BrokenTuning())
    ctx = Ctx()
    with caplog.at_level(logging.WARNING, logger="specserve.router"):
        with pytest.raises(Exception):
            asyncio.run(router.GetTuning(pb.GetTuningRequest(model=MODEL), ctx))
    assert ctx.code == grpc.StatusCode.INTERNAL and "RuntimeError" in ctx.details
    assert router.failures["get_tuning"] == 1
    assert any("get_tuning failed" in r.getMessage() and MODEL in r.getMessage() and "view corrupted" in r.getMessage()
               for r in caplog.records if r.levelno == logging.WARNING)


# -- load polls ----------------------------------------------------------------------------------------

class FailingLoad:
    def __init__(self):
        self.calls = 0

    @property
    def load(self):
        return self

    async def remote(self):
        self.calls += 1
        raise ConnectionError("replica gone")


class Metrics:
    def __init__(self):
        self.failures = []

    def failure(self, what, kind):
        self.failures.append((what, kind))


def test_load_poll_failures_are_logged_at_warning_once_per_pool_and_counted(caplog, monkeypatch):
    monkeypatch.setattr("deployments.router.LOAD_POLL_INTERVAL_S", 0.001)
    cfg = load_config(CONFIG)
    handles = {name: FailingLoad() for name in cfg.pools}
    metrics = Metrics()
    router = Router(cfg, handles, metrics=metrics)

    async def poll_a_while():
        task = asyncio.get_running_loop().create_task(router._poll_load())
        while min(h.calls for h in handles.values()) < 5:
            await asyncio.sleep(0.005)
        task.cancel()
    with caplog.at_level(logging.WARNING, logger="specserve.router"):
        asyncio.run(poll_a_while())
    n = sum(h.calls for h in handles.values())
    assert router.failures["load_poll"] >= 10 and len(metrics.failures) == router.failures["load_poll"]
    assert set(metrics.failures) == {("load_poll", "ConnectionError")}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == len(cfg.pools) < n  # rate-limited: once per pool
    assert all(any(f"pool {p}" in w and "replica gone" in w for w in warnings) for p in cfg.pools)


def test_a_stream_still_works_with_limits_set():
    router, _ = make_router(max_body_bytes=2048, max_prompt_chars=100)
    r, _ = send(router, body_of("hi"))
    assert r.status_code == 200 and json.loads(r.body)["choices"][0]["message"]["content"] == "ok"
    assert isinstance(FINAL, EngineChunk)
