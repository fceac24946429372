"""The engine replicas' local lane (`deployments.engine_lane`, `deployments.router_lane`): real Unix
sockets and both real ends, with an engine double behind the replica's end. Streams arrive whole and
in order; a router that hangs up stops the engine's stream; the replica's bound on calls holds
(running, waiting, then busy: the router's 429); a replica's errors come back as the errors a
handle call raised; a lane whose replica is gone is skipped for the handle without costing the
call its retry; and the router uses the lanes only while every fresh replica of the pool has one."""

from __future__ import annotations

import asyncio
import json
import os
import stat

import pytest
from starlette.requests import Request

from deployments.engine_death import EngineDead
from deployments.engine_lane import LaneServer, lane_path
from deployments.engine_types import EngineChunk, EngineRequest
from deployments.router_lane import LaneBusy, LaneGone, Lanes, pick
from tests.deployments.test_router import BODY, FINAL, FakeCall, make_router, vllm_shaped

REQ = EngineRequest("r1", "ngram", 3, openai={"path": "/v1/chat/completions", "body": b'{"x": "\xc3\xa9"}'})


class Engine:
    """generate() double: `n` chunks `every_s` apart, or `error` before any; records what it got and
    whether its stream was closed before the end."""

    def __init__(self, n=3, every_s=0.0, error=None, chunks=None):
        self.n, self.every_s, self.error, self.chunks = n, every_s, error, chunks
        self.requests, self.closed_early, self.running = [], 0, 0

    async def generate(self, req):
        self.requests.append(req)
        if self.error is not None:
            raise self.error
        self.running += 1
        done = False
        try:
            chunks = self.chunks or [EngineChunk(text=str(i), token_ids=[i], logprobs=[{i: -0.5}], replica="ngram-abc")
                                     for i in range(self.n)]
            for c in chunks:
                await asyncio.sleep(self.every_s)
                yield c
            done = True
        finally:
            self.running -= 1
            self.closed_early += not done


async def serve(tmp_path, engine, ongoing=4, queued=4, replica="ngram-abc"):
    return await LaneServer(lane_path(str(tmp_path / "lanes"), "ngram", replica), engine.generate, ongoing, queued).start()


def handle_call():
    return FakeCall([FINAL])


async def drain(call):
    return [c async for c in call]


def test_a_stream_arrives_whole_and_in_order_and_the_socket_is_private(tmp_path):
    async def run():
        engine = Engine(n=5)
        server = await serve(tmp_path, engine)
        lanes = Lanes(str(tmp_path / "lanes"))
        call = lanes.call("ngram", REQ, handle_call)
        got = await drain(call)
        assert call.via == "lane" and lanes.inflight == {} and lanes.calls == {"ngram": 1}
        assert [c.token_ids for c in got] == [[i] for i in range(5)] and got[2].logprobs == [{2: -0.5}]
        assert engine.requests == [REQ]  # the body's bytes, the tuples, all as sent
        assert stat.S_IMODE(os.stat(server.path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(tmp_path / "lanes").st_mode) == 0o700
        server.close()
        assert not os.path.exists(server.path)
    asyncio.run(run())


def test_a_router_that_hangs_up_stops_the_engines_stream(tmp_path):
    async def run():
        engine = Engine(n=1000, every_s=0.01)
        server = await serve(tmp_path, engine)
        call = Lanes(str(tmp_path / "lanes")).call("ngram", REQ, handle_call)
        await call.__anext__()
        call.cancel()
        for _ in range(100):
            if engine.closed_early:
                break
            await asyncio.sleep(0.01)
        assert engine.closed_early == 1 and engine.running == 0 and server.ongoing == 0
    asyncio.run(run())


def test_the_replicas_bound_runs_some_queues_some_and_refuses_the_rest(tmp_path):
    async def run():
        engine = Engine(n=2, every_s=0.3)
        server = await serve(tmp_path, engine, ongoing=1, queued=1)
        lanes = Lanes(str(tmp_path / "lanes"))
        first, second, third = (lanes.call("ngram", REQ, handle_call) for _ in range(3))
        t1 = asyncio.ensure_future(drain(first))
        await asyncio.sleep(0.1)
        t2 = asyncio.ensure_future(drain(second))
        await asyncio.sleep(0.1)
        assert server.ongoing == 2 and engine.running == 1
        with pytest.raises(LaneBusy):
            await drain(third)
        assert len(await t1) == 2 and len(await t2) == 2
        assert server.ongoing == 0 and lanes.inflight == {}
    asyncio.run(run())


@pytest.mark.parametrize("error, expected", [(EngineDead("core died"), EngineDead), (ValueError("too long"), ValueError),
                                             (KeyError("boom"), RuntimeError)])
def test_a_replicas_error_comes_back_as_the_error_a_handle_call_raised(tmp_path, error, expected):
    async def run():
        await serve(tmp_path, Engine(error=error))
        lanes = Lanes(str(tmp_path / "lanes"))
        with pytest.raises(expected) as got:
            await drain(lanes.call("ngram", REQ, handle_call))
        assert str(error.args[0]) in str(got.value) and lanes.inflight == {}
    asyncio.run(run())


def test_a_stopping_replica_takes_no_new_call_and_lets_the_one_under_way_end(tmp_path):
    async def run():
        engine = Engine(n=3, every_s=0.1)
        server = await serve(tmp_path, engine)
        lanes = Lanes(str(tmp_path / "lanes"))
        under_way = asyncio.ensure_future(drain(lanes.call("ngram", REQ, handle_call)))
        await asyncio.sleep(0.05)
        await server.drain(5.0)
        assert server.ongoing == 0 and not os.path.exists(server.path)
        assert len(await under_way) == 3 and engine.closed_early == 0
        lanes._listed = (float("-inf"), {})
        late = lanes.call("ngram", REQ, handle_call)
        assert [c.replica for c in await drain(late)] == ["r2"] and late.via == "handle"
    asyncio.run(run())


def test_a_replica_that_closes_mid_stream_is_lane_gone(tmp_path):
    """The replica's process ends mid-stream: one chunk, then its end of the connection closes."""
    import dataclasses

    from deployments.engine_lane import frame, read_frame

    async def run():
        async def dying(reader, writer):
            await read_frame(reader)
            writer.write(frame({"chunk": dataclasses.asdict(EngineChunk(text="a", token_ids=[1]))}))
            await writer.drain()
            writer.close()
        path = lane_path(str(tmp_path), "ngram", "ngram-abc")
        await asyncio.start_unix_server(dying, path=path)
        lanes = Lanes(str(tmp_path))
        call = lanes.call("ngram", REQ, handle_call)
        assert (await call.__anext__()).token_ids == [1]
        with pytest.raises(LaneGone):
            await asyncio.wait_for(call.__anext__(), 5)
        assert lanes.inflight == {}
    asyncio.run(run())


def test_a_lane_whose_replica_is_gone_is_skipped_for_the_next_then_the_handle(tmp_path):
    async def run():
        folder = tmp_path / "lanes"
        folder.mkdir()
        dead = lane_path(str(folder), "ngram", "ngram-0dead")
        open(dead, "w").close()  # a socket file whose listener is gone: connecting is refused
        lanes = Lanes(str(folder))
        call = lanes.call("ngram", REQ, handle_call)
        assert [c.replica for c in await drain(call)] == ["r2"] and call.via == "handle"
        assert lanes.local("ngram") == {}
        lanes._listed = (float("-inf"), {})
        assert lanes.local("ngram") == {}  # listed again: the refused lane stays out for a while
        engine = Engine(n=1)
        await serve(tmp_path, engine, replica="ngram-live")
        lanes._listed = (float("-inf"), {})
        call = lanes.call("ngram", REQ, handle_call)
        assert len(await drain(call)) == 1 and call.via == "lane"
    asyncio.run(run())


def test_lanes_are_used_only_while_every_fresh_replica_of_the_pool_has_one(tmp_path):
    async def run():
        await serve(tmp_path, Engine(), replica="ngram-a1")
        await serve(tmp_path, Engine(), replica="ngram-b2")
        lanes = Lanes(str(tmp_path / "lanes"))
        assert lanes.usable("ngram", ["ngram-a1", "ngram-b2"]) and lanes.usable("ngram", ["ngram-a1"])
        assert not lanes.usable("ngram", ["ngram-a1", "ngram-c3"])  # one replica is on another node
        assert lanes.usable("ngram", [])  # nothing reported yet: the lanes here are all there is
        assert not lanes.usable("draft", ["draft-a1"]) and not lanes.usable("draft", [])  # no lane of its own
    asyncio.run(run())


def test_calls_go_to_the_lane_with_the_fewest_calls_rotating_on_ties():
    assert pick(["a", "b", "c"], {"a": 1, "b": 1}, 0) == ["c", "a", "b"]
    assert [pick(["a", "b"], {}, t)[0] for t in range(4)] == ["a", "b", "a", "b"]


def test_a_socket_path_past_the_kernels_bound_is_refused_not_truncated(tmp_path):
    async def run():
        with pytest.raises(OSError, match="longer than"):
            await LaneServer(str(tmp_path / ("x" * 120) / "a.sock"), Engine().generate, 1, 1).start()
    asyncio.run(run())


def _request(body):
    raw = json.dumps(body).encode()
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
             "headers": [(b"content-type", b"application/json")], "query_string": b"", "scheme": "http",
             "server": ("x", 80), "root_path": ""}

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}
    return Request(scope, receive)


def test_the_router_streams_by_the_lane_once_the_pool_reported_and_maps_busy_to_429(tmp_path):
    """Through the router's HTTP door: while a replica without a lane here has reported lately, calls
    go by the handle; once only the lane's replica has, they take its lane (the handle sees none);
    a full replica is 429."""
    import time

    async def run():
        router, handles = make_router(lambda: FakeCall([FINAL]))
        router.lanes = Lanes(str(tmp_path / "lanes"))

        async def generate(req):  # the engine's OpenAI door: vLLM's answer in `raw`
            for c in vllm_shaped([EngineChunk(text="hi", token_ids=[7], replica="ngram-abc"),
                                  EngineChunk(text="!", token_ids=[8], finish_reason="stop", prompt_tokens=3,
                                              completion_tokens=2, stats={"mode": "ngram", "k": 2},
                                              replica="ngram-abc")], req):
                yield c
        server = await LaneServer(lane_path(router.lanes.folder, "ngram", "ngram-abc"), generate, 1, 0).start()
        router.engine_load["ngram"]["ngram-e15e"] = (time.monotonic(), 0.0)  # on another node
        r = await router(_request(BODY))
        assert r.status_code == 200 and len(handles["ngram"].calls) == 1
        router.engine_load["ngram"]["ngram-e15e"] = (time.monotonic() - 31, 0.0)  # gone for a while
        router.engine_load["ngram"]["ngram-abc"] = (time.monotonic(), 0.0)
        r = await router(_request(BODY))
        assert r.status_code == 200 and len(handles["ngram"].calls) == 1
        assert json.loads(r.body)["specserve"]["replica"] == "ngram-abc"
        assert router.lanes.calls == {"ngram": 1} and router.inflight["ngram"] == 0

        gate = asyncio.Event()

        async def holding(req):
            await gate.wait()
            yield EngineChunk(text="", token_ids=[], finish_reason="stop")
        server._generate = holding
        held = asyncio.ensure_future(router(_request({**BODY, "stream": True})))
        await asyncio.sleep(0.2)
        r = await router(_request(BODY))
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        gate.set()
        held.cancel()
        await asyncio.gather(held, return_exceptions=True)
        server.close()
    asyncio.run(run())
