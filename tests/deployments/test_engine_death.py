"""The death of a replica's vLLM engine core (`deployments.engine_death`), without Ray: the replica
fails every call at once with EngineDead, its health check fails at once and it retires (once); the
router retries a call that sent no output, answers UNAVAILABLE / 503 with Retry-After otherwise, and
never INTERNAL / 500, also mid-stream. Engines are test doubles with AsyncLLM's call shape raising
vLLM's own EngineDeadError; the router sees the replica's error as Ray delivers it (a RayTaskError
that is also an instance of the cause). tests/e2e/test_chaos.py kills a real engine core."""

from __future__ import annotations

import asyncio
import doctest
import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from ray.exceptions import RayTaskError
from starlette.requests import Request
from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

import deployments.engine_call as engine_call
from cluster.api.types import ApiError
from cluster.config import load_config
import deployments.app as app
from deployments.engine import EngineChunk, EngineInputError, EngineRequest, EngineServer
from deployments.engine_death import RETIRE_EXIT_CODE, EngineDead, engine_died, retire_process
from deployments.engine_start import EngineStartTimeout
from specserve.v1 import specserve_pb2 as pb
from tests.deployments.test_router import BODY, FINAL, FakeCall, make_router, post
from tests.deployments.test_router_auth import Ctx
from tests.paths import LOCAL_CPU

POOL = load_config(LOCAL_CPU).pools["ngram"]


# -- the replica ----------------------------------------------------------------------------------

class DyingEngine:
    """AsyncLLM's call shape: `outputs_first` outputs, then the engine core dies (`error` raised in
    every generate from then on, `errored` set, as vLLM's monitor thread does)."""

    def __init__(self, outputs_first: int = 0, error: Exception | None = None, errored_after: bool = True):
        self.outputs_first, self.error = outputs_first, error or EngineDeadError()
        self.errored_after, self.errored = errored_after, False
        self.health_error: Exception | None = None  # what check_health raises while `errored` is unset
        self.generations = self.health_checks = 0

    def get_num_unfinished_requests(self):
        return 1

    async def check_health(self):
        self.health_checks += 1
        if self.errored:
            raise EngineDeadError()
        if self.health_error is not None:
            raise self.health_error

    async def generate(self, prompt, params, request_id):
        self.generations += 1
        for i in range(self.outputs_first):
            out = SimpleNamespace(token_ids=[10 + i], text=f"<{i}>", logprobs=None, finish_reason=None,
                                  spec_decode_metrics=None)
            yield SimpleNamespace(outputs=[out], finished=False, prompt_token_ids=[1])
        self.errored = self.errored_after
        raise self.error


def replica(engine):
    retired = []
    s = EngineServer("ngram", POOL.model_copy(update={"health_probe_interval_s": 3600}), "m",
                     engine=engine, retire=lambda: retired.append(time.monotonic()))
    return s, retired


def drain(s, rid="r"):
    got = []

    async def run():
        async for c in s.generate(EngineRequest(request_id=rid, mode="none", k=0, prompt="p")):
            got.append(c)
    try:
        asyncio.run(run())
    except Exception as e:  # noqa: BLE001 - returned for the test to inspect
        return got, e
    return got, None


def test_death_before_output_fails_the_call_and_every_later_one_at_once_and_retires_once():
    engine = DyingEngine()
    s, retired = replica(engine)
    got, err = drain(s)
    assert got == [] and isinstance(err, EngineDead) and "engine core of replica" in str(err)
    assert len(retired) == 1
    got, err = drain(s, "r2")
    assert isinstance(err, EngineDead) and engine.generations == 1  # refused before reaching vLLM
    with pytest.raises(EngineDead):
        asyncio.run(s.check_health())
    assert engine.health_checks == 0 and len(retired) == 1  # at once, without asking the engine; retired once


def test_death_mid_stream_ends_the_stream_with_engine_dead_after_what_was_sent():
    s, retired = replica(DyingEngine(outputs_first=2))
    got, err = drain(s)
    assert got and got[0].token_ids == [10]  # the first token went out at once
    assert isinstance(err, EngineDead) and len(retired) == 1


def test_an_idle_replica_notices_the_death_in_its_load_report_and_health_check():
    engine = DyingEngine()
    s, retired = replica(engine)
    engine.errored = True  # vLLM's monitor thread saw the engine core exit; no request in flight
    report = asyncio.run(s.load())
    assert report["engine_dead"] is True and report["unfinished"] == 1 and len(retired) == 1
    with pytest.raises(EngineDead):
        asyncio.run(s.check_health())


def test_the_health_check_turns_vllms_engine_dead_error_into_engine_dead_and_retires():
    engine = DyingEngine()
    s, retired = replica(engine)
    s._last_probe_ok = time.monotonic()  # no probe generation in these checks
    asyncio.run(s.check_health())
    engine.health_error = EngineDeadError()  # vLLM's check, before our look at `errored`
    with pytest.raises(EngineDead):
        asyncio.run(s.check_health())
    assert engine.health_checks == 2 and len(retired) == 1


def test_other_engine_errors_are_not_death():
    s, retired = replica(DyingEngine(error=EngineGenerateError(), errored_after=False))
    _, err = drain(s)
    assert isinstance(err, EngineGenerateError) and not isinstance(err, EngineDead) and retired == []
    s, retired = replica(DyingEngine(error=EngineGenerateError(), errored_after=True))  # raced the death
    _, err = drain(s)
    assert isinstance(err, EngineDead) and len(retired) == 1
    s, retired = replica(DyingEngine(error=ValueError("prompt too long"), errored_after=False))
    _, err = drain(s)
    assert isinstance(err, EngineInputError) and retired == []


def test_a_replica_shutting_down_does_not_retire():
    engine = DyingEngine()
    shutdowns = []
    engine.shutdown = lambda: (shutdowns.append(1), setattr(engine, "errored", True))  # AsyncLLM marks it dead
    s, retired = replica(engine)
    s.shutdown()
    with pytest.raises(EngineDead, match="shutting down"):
        asyncio.run(s.check_health())
    _, err = drain(s)
    assert isinstance(err, EngineDead) and "shutting down" in str(err)
    s.shutdown()
    s.__del__()  # Ray Serve's hook: the same shutdown, once
    assert retired == [] and shutdowns == [1]


def test_engine_died():
    assert engine_died(EngineDeadError(), errored=False)
    assert engine_died(RuntimeError("anything"), errored=True)
    assert not engine_died(EngineGenerateError(), errored=False)


def test_retire_process_exits_after_the_grace():
    codes = []
    t0 = time.monotonic()
    timer = retire_process(0.05, exit_fn=codes.append)
    timer.join(timeout=5)
    assert codes == [RETIRE_EXIT_CODE] and time.monotonic() - t0 >= 0.05


def _start_replica(monkeypatch, start_vllm, startup_timeout_s: float = 600.0):
    """An EngineReplica as Ray Serve builds it (it awaits the async constructor), its model
    preparation and vLLM start replaced."""
    config = load_config(LOCAL_CPU)
    config.pools["ngram"] = config.pools["ngram"].model_copy(update={"startup_timeout_s": startup_timeout_s})
    monkeypatch.setattr(app.models, "resolve_model", lambda name, cfg: f"/models/{name}")
    monkeypatch.setattr(app.logsafe, "setup_replica_logging", lambda: None)
    monkeypatch.setattr(app, "start_vllm", start_vllm)

    async def no_openai_layer(engine, args):  # vLLM's serving layer needs a real engine (tests/e2e)
        return None
    monkeypatch.setattr(app, "build_openai_app", no_openai_layer)
    r = app.EngineReplica.__new__(app.EngineReplica)
    loop = asyncio.new_event_loop()  # not asyncio.run: it would wait for a start still running in its thread
    try:
        loop.run_until_complete(r.__init__("ngram", config.pools["ngram"], config))
    finally:
        loop.close()
    return r


def test_a_serve_replica_retires_its_process_an_injected_engine_does_not(monkeypatch):
    started = []
    r = _start_replica(monkeypatch, lambda pool, kwargs: started.append(kwargs) or DyingEngine())
    assert r._retire is retire_process
    assert started[0]["model"] == "/models/smollm2-135m" and r.served_name == "smollm2-135m"
    injected, _ = replica(DyingEngine())
    assert injected._retire is not retire_process


def test_a_replica_whose_engine_does_not_start_in_time_fails_naming_the_field(monkeypatch):
    hung = threading.Event()
    t0 = time.monotonic()
    with pytest.raises(EngineStartTimeout, match=r"pools\.ngram\.startup_timeout_s: the engine did not start within 0\.2 s"):
        _start_replica(monkeypatch, lambda pool, kwargs: hung.wait(30), startup_timeout_s=0.2)
    assert time.monotonic() - t0 < 5  # gave up at the bound, not when the start ended
    hung.set()


# -- the router -----------------------------------------------------------------------------------

def as_ray_delivers(e: Exception) -> Exception:
    """The replica's exception as a DeploymentHandle raises it in the router."""
    return RayTaskError("generate", f"Traceback (most recent call last):\n{type(e).__name__}: {e}",
                        e).as_instanceof_cause()


def dead() -> Exception:
    return as_ray_delivers(EngineDead("pool 'ngram': the engine core of replica ngram-1 died (EngineDeadError)"))


class DyingCall(FakeCall):
    """Sends its chunks, then fails with `error` (the engine core died mid-stream)."""

    async def __anext__(self):
        if self.chunks:
            return self.chunks.pop(0)
        raise self.error

    def cancel(self):
        self.cancelled = True


@pytest.fixture
def short_pause(monkeypatch):
    monkeypatch.setattr(engine_call, "DEAD_ENGINE_RETRY_PAUSE_S", 0.05)


def test_death_before_output_is_retried_after_the_replicas_grace(short_pause):
    calls = iter([FakeCall(error=dead()), FakeCall([FINAL])])
    router, handles = make_router(lambda: next(calls))
    t0 = time.monotonic()
    r = post(router, BODY)
    assert r.status_code == 200 and json.loads(r.body)["specserve"]["replica"] == "r2"
    assert len(handles["ngram"].calls) == 2 and time.monotonic() - t0 >= 0.05
    assert router.inflight == {"ngram": 0, "draft": 0}


def test_death_on_the_retry_too_is_503_with_retry_after_never_500(short_pause):
    router, handles = make_router(lambda: FakeCall(error=dead()))
    r = post(router, BODY)
    err = json.loads(r.body)["error"]
    assert r.status_code == 503 and r.headers["retry-after"] == "1" and len(handles["ngram"].calls) == 2
    assert err["code"] == "unavailable" and "engine of the replica serving the request died" in err["message"]


class TrailingCtx(Ctx):
    def set_trailing_metadata(self, md):
        self.trailing = dict(md)


def test_death_is_grpc_unavailable_with_a_retry_hint(short_pause):
    router, _ = make_router(lambda: FakeCall(error=dead()))
    ctx = TrailingCtx()
    req = pb.GenerateRequest(prompt="hi", speculative=pb.SpeculativeOverride(mode="ngram", k=2))
    with pytest.raises(ApiError):
        asyncio.run(router.Generate(req, ctx))
    assert ctx.code == grpc.StatusCode.UNAVAILABLE and "died" in ctx.details and ctx.trailing["retry-after-s"]


def _mid_stream_router():
    return make_router(lambda: DyingCall([EngineChunk(text="a", token_ids=[1], replica="r1")], error=dead()))


def test_death_mid_stream_is_grpc_unavailable_and_not_retried():
    router, handles = _mid_stream_router()
    ctx = TrailingCtx()
    req = pb.GenerateRequest(prompt="hi", speculative=pb.SpeculativeOverride(mode="ngram", k=2))
    got = []

    async def stream():
        async for m in router.GenerateStream(req, ctx):
            got.append(m)
    with pytest.raises(ApiError):
        asyncio.run(asyncio.wait_for(stream(), timeout=10))  # never a hang
    assert [m.text for m in got] == ["a"] and ctx.code == grpc.StatusCode.UNAVAILABLE
    assert len(handles["ngram"].calls) == 1  # output was sent: no retry


def test_death_mid_stream_is_an_unavailable_error_event_over_http():
    router, handles = _mid_stream_router()
    raw = json.dumps({**BODY, "stream": True}).encode()
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
             "headers": [(b"content-type", b"application/json")], "query_string": b"", "scheme": "http",
             "server": ("x", 80), "root_path": ""}

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}

    async def run():
        r = await router(Request(scope, receive))
        assert r.status_code == 200  # the first token went out before the death
        return "".join([c if isinstance(c, str) else c.decode() async for c in r.body_iterator])
    text = asyncio.run(asyncio.wait_for(run(), timeout=10))
    events = [json.loads(line[6:]) for line in text.split("\n\n") if line.startswith("data: {")]
    assert events[-1]["error"]["code"] == "unavailable" and text.endswith("data: [DONE]\n\n")
    assert len(handles["ngram"].calls) == 1


def test_engine_call_doctests():
    assert doctest.testmod(engine_call).failed == 0
