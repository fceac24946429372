"""Router logic without Ray: engine handles are test doubles with the DeploymentHandle call shape
(`handle.options(stream=True).generate.remote(req)` -> async iterator with cancel())."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

from ray.serve.exceptions import BackPressureError
from starlette.requests import Request

from cluster.config import load_config
from cluster.speculation import WORKLOAD_CLASSES
from deployments.engine import EngineChunk, EngineInputError
from deployments.router import Router
from tests.paths import LOCAL_CPU

CONFIG = LOCAL_CPU


class FakeCall:
    def __init__(self, chunks=(), error=None):
        self.chunks, self.error, self.cancelled = list(chunks), error, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.error is not None:
            raise self.error
        if not self.chunks:
            raise StopAsyncIteration
        return self.chunks.pop(0)

    def cancel(self):
        self.cancelled = True
        if self.error is not None:
            raise self.error  # what Ray's handle does when the assignment already failed


class FakeHandle:
    def __init__(self, make_call):
        self.make_call, self.calls, self.requests = make_call, [], []

    def options(self, **_):
        return self

    @property
    def generate(self):
        return self

    def remote(self, req):
        self.requests.append(req)
        call = self.make_call()
        if call is not None and req.openai is not None:
            call.chunks = vllm_shaped(call.chunks, req)
        self.calls.append(call)
        return call


def vllm_shaped(chunks, req):
    """The chunks of a fake engine as the engine's OpenAI door sends them (`deployments.engine_openai`):
    vLLM's answer in `raw` (SSE events when streamed, else one JSON body on the last chunk)."""
    chat = req.openai["path"].endswith("chat/completions")
    text, out = "", []
    for c in chunks:
        text += c.text
        if req.streamed:
            delta = {"delta": {"content": c.text}} if chat else {"text": c.text}
            raw = "data: " + json.dumps({"object": "chunk", "choices": [{"index": 0, **delta,
                                                                         "finish_reason": c.finish_reason}]}) + "\n\n"
            raw += "data: [DONE]\n\n" if c.finish_reason is not None else ""
        elif c.finish_reason is not None:
            choice = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
            raw = json.dumps({"id": "chatcmpl-" + req.request_id, "object": "chat.completion",
                              "choices": [{"index": 0, **choice, "finish_reason": c.finish_reason}],
                              "usage": {"prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens}})
        else:
            raw = ""
        out.append(dataclasses.replace(c, raw=raw, http_status=200,
                                       media_type="text/event-stream" if req.streamed else "application/json"))
    return out


def post(router, body, path="/v1/chat/completions"):
    raw = json.dumps(body).encode()
    scope = {"type": "http", "method": "POST", "path": path, "headers": [(b"content-type", b"application/json")],
             "query_string": b"", "scheme": "http", "server": ("x", 80), "root_path": ""}

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}
    return asyncio.run(router(Request(scope, receive)))


def make_router(make_call, step_k: bool = True, **ngram_update):
    cfg = load_config(CONFIG)
    if not step_k:
        cfg.pools = {name: pool.model_copy(update={"step_k": False}) for name, pool in cfg.pools.items()}
    if ngram_update:
        cfg.pools["ngram"] = cfg.pools["ngram"].model_copy(update=ngram_update)
    handles = {name: FakeHandle(make_call) for name in cfg.pools}
    return Router(cfg, handles), handles


BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "specserve": {"speculative": {"mode": "ngram", "k": 2}}}


def test_backpressure_is_429_with_retry_after():
    router, handles = make_router(lambda: FakeCall(error=BackPressureError(num_queued_requests=3, max_queued_requests=3)))
    r = post(router, BODY)
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert json.loads(r.body)["error"]["code"] == "resource_exhausted"
    assert router.inflight == {"ngram": 0, "draft": 0}
    assert handles["ngram"].calls[0].cancelled


def test_engine_input_error_is_400_naming_the_prompt():
    router, _ = make_router(lambda: FakeCall(error=EngineInputError("prompt is longer than the context")))
    r = post(router, BODY)
    assert r.status_code == 400 and json.loads(r.body)["error"]["param"] == "prompt"


def test_success_reports_decision_and_stats():
    final = EngineChunk(text="lo", token_ids=[2], finish_reason="stop", prompt_tokens=5, completion_tokens=2,
                        stats={"mode": "ngram", "k": 2, "steps": 1, "drafted": 2, "accepted": 0}, replica="r1")
    router, handles = make_router(lambda: FakeCall([EngineChunk(text="hel", token_ids=[1], replica="r1"), final]))
    r = post(router, BODY)
    assert r.status_code == 200
    body = json.loads(r.body)
    assert body["choices"][0]["message"]["content"] == "hello"
    s = body["specserve"]
    assert (s["pool"], s["k"], s["decided_by"], s["token_ids"], s["replica"]) == ("ngram", 2, "request", [1, 2], "r1")
    req = handles["ngram"].requests[0]
    assert req.k == 2 and req.k_step_alpha is None  # an explicit K is fixed at every step
    assert not handles["ngram"].calls[0].cancelled


def test_the_response_says_whether_the_exploration_draw_chose_mode_and_k():
    router, _ = make_router(lambda: FakeCall([FINAL]))
    body = {"messages": [{"role": "user", "content": "Summarize: the cat sat on the mat."}], "max_tokens": 4}
    assert json.loads(post(router, body).body)["specserve"]["explored"] is False  # no RNG: exploits
    assert json.loads(post(router, BODY).body)["specserve"]["explored"] is False  # the caller's K
    decide = router.decide

    def exploring(req):
        model, d = decide(req)
        return model, dataclasses.replace(d, detail={**d.detail, "explore": True})

    router.decide = exploring
    assert json.loads(post(router, body).body)["specserve"]["explored"] is True


def test_the_response_reports_the_load_bucket_and_scores_behind_its_decision():
    router, _ = make_router(lambda: FakeCall([FINAL]))
    body = {"messages": [{"role": "user", "content": "Summarize: the cat sat on the mat."}], "max_tokens": 4}
    d = json.loads(post(router, body).body)["specserve"]["decision"]
    assert d["load_bucket"] == "1" and d["join_batch"] == 1.0  # an idle router
    assert d["k_by"] == "engine" and 0.0 < d["k_step_alpha"] < 1.0 and d["scores"] and "cost_per_k" not in d
    assert "k_scores" not in d  # the engine chooses K: the policy's scores per K are not the request's K
    explicit = json.loads(post(router, BODY).body)["specserve"]["decision"]
    assert explicit == {"k_by": "request", "load_bucket": "1"}  # the caller's K: no scores, only the load it met


def test_a_policy_decision_lets_the_engine_pick_k_per_step_from_the_class_alpha():
    router, handles = make_router(lambda: FakeCall([FINAL]))
    body = {"messages": [{"role": "user", "content": "Summarize: the cat sat on the mat. The cat sat."}], "max_tokens": 4}
    _, d, req = router.plan(_req(body))
    pool = router.config.pools[d.pool]
    assert d.decided_by == "policy" and d.mode in pool.modes and (req.mode, req.k) == (d.mode.value, pool.mode_max_k(d.mode))
    assert 0.0 < req.k_step_alpha < 1.0 and d.detail["k_step_alpha"] == req.k_step_alpha
    # An explicit K is the caller's: fixed, no per-step choice.
    _, d, req = router.plan(_req(BODY))
    assert (d.k, req.k, req.k_step_alpha) == (2, 2, None)


def _req(body):
    import copy

    from cluster.api.openai_body import routing_view

    return routing_view(copy.deepcopy(body), chat=True)[0]  # routing_view takes the specserve block out of the body


def test_stream_that_ends_early_is_unavailable():
    router, handles = make_router(lambda: FakeCall([EngineChunk(text="a", token_ids=[1])]))
    r = post(router, BODY)
    assert r.status_code == 503 and r.headers["retry-after"]


FINAL = EngineChunk(text="ok", token_ids=[5], finish_reason="stop", prompt_tokens=1, completion_tokens=1,
                    stats={"mode": "ngram", "k": 2}, replica="r2")


def test_replica_death_before_output_is_retried_once():
    from ray.exceptions import ActorDiedError

    calls = iter([FakeCall(error=ActorDiedError()), FakeCall([FINAL])])
    router, handles = make_router(lambda: next(calls))
    r = post(router, BODY)
    assert r.status_code == 200 and json.loads(r.body)["specserve"]["replica"] == "r2"
    assert len(handles["ngram"].calls) == 2


def test_replica_death_twice_is_unavailable():
    from ray.exceptions import ActorDiedError

    router, handles = make_router(lambda: FakeCall(error=ActorDiedError()))
    r = post(router, BODY)
    assert r.status_code == 503 and len(handles["ngram"].calls) == 2


class StallingCall(FakeCall):
    async def __anext__(self):
        await asyncio.sleep(3600)


def test_no_first_output_is_bounded():
    router, handles = make_router(lambda: StallingCall())
    router.config.router.first_token_timeout_s = 0.2
    r = post(router, BODY)
    assert r.status_code == 503 and b"no output" in r.body
    assert handles["ngram"].calls[0].cancelled


def test_a_failing_stats_recorder_never_fails_the_request():
    class Broken:
        def observe(self, *a, **k):
            raise ValueError("value must be >0, got 0")

    router, _ = make_router(lambda: FakeCall([FINAL]))
    router.metrics = Broken()
    assert post(router, BODY).status_code == 200


def test_router_metrics_accept_zero_counts():
    import ray

    from cluster.ops.metrics import RouterMetrics
    from cluster.routing.route import Decision
    from cluster.speculation import SpecMode

    # Ray validates tags only with a running node. Its start-up can time out on a loaded 2-core
    # machine ("The current node timed out during startup"): one more try before failing.
    for attempt in (1, 2):
        try:
            ray.init(num_cpus=1, include_dashboard=False, ignore_reinit_error=True)
            break
        except Exception as e:
            ray.shutdown()
            if attempt == 2 or "timed out during startup" not in str(e):
                raise
    try:
        m = RouterMetrics()
        m.observe(Decision("ngram", SpecMode.NONE, 0, "policy", "chat"), {"drafted": 0, "accepted": 0, "steps": 3})
        m.observe(Decision("ngram", SpecMode.NGRAM, 3, "policy", "code"),
                  {"drafted": 6, "accepted": 4, "steps": 2, "acceptance_length": 3.0})
    finally:
        ray.shutdown()


class RecordingTuning:
    """Tuning store double: remembers what the router records (pure logic; the real store has its own tests)."""

    healthy = True

    def __init__(self):
        self.records = []

    def snapshot(self, model):
        from cluster.policy import TuningView

        return TuningView(model)

    def record_completion(self, model, decision, completion, batch_per_replica=0.0):
        self.records.append((decision.detail["load_bucket"], decision.decided_by))
        return True


def test_stats_are_recorded_in_the_bucket_of_the_load_they_met():
    # The local pools share one hardware group: a request that ran while 3 others ran on either
    # pool met a batch of 4 (bucket 4-7), whichever pool; one alone met batch 1. A K the caller
    # chose teaches the tuner nothing (`cluster.policy.teaching`).
    import time

    router, _ = make_router(lambda: FakeCall([FINAL]))
    router.tuning = RecordingTuning()
    assert post(router, BODY).status_code == 200
    auto = {**BODY, "specserve": {}}
    assert post(router, auto).status_code == 200
    router.inflight.update({"ngram": 1, "draft": 2})
    router.meter.change("group:local", +3, time.monotonic())  # the three others, as _stream counts them
    assert post(router, BODY).status_code == 200
    assert post(router, auto).status_code == 200
    assert router.tuning.records == [("1", "policy"), ("4-7", "policy")]
    assert router.teacher.excluded == {"caller_mode": 2}


class SlowCall(FakeCall):
    """A call whose first chunk comes after `on_start` ran and `delay_s` passed (others join meanwhile)."""

    def __init__(self, chunks, on_start, delay_s):
        super().__init__(chunks)
        self.on_start, self.delay_s = on_start, delay_s

    async def __anext__(self):
        if self.on_start is not None:
            self.on_start()
            self.on_start = None
            await asyncio.sleep(self.delay_s)
        return await super().__anext__()


def test_a_request_admitted_idle_that_meets_a_burst_is_recorded_at_the_burst_load():
    """The first request of a burst is admitted to an idle machine (its decision's bucket is 1) but
    runs in a batch of 5: its step times belong to bucket 4-7, not to the batch-1 cells."""
    import time

    router_box = {}

    def burst():  # four more requests arrive just after this one was admitted
        router_box["r"].meter.change("group:local", +4, time.monotonic())

    router, _ = make_router(lambda: SlowCall([FINAL], burst, 0.2))
    router_box["r"] = router
    router.tuning = RecordingTuning()
    r = post(router, {**BODY, "specserve": {}})
    assert r.status_code == 200
    assert json.loads(r.body)["specserve"]["decision"]["load_bucket"] == "1"  # decided at admission, idle
    assert router.tuning.records == [("4-7", "policy")]  # recorded at the load it ran under


def test_engine_load_reports_raise_the_load_the_policy_sees():
    """Other routers' traffic is visible through the engines' own load reports (sampled in the
    background); stale reports stop counting."""
    from deployments import router as router_mod

    class LoadCall:
        def __init__(self, n):
            self.n = n

        async def remote(self):
            return {"replica": "r1", "unfinished": self.n}

    router, handles = make_router(lambda: FakeCall([FINAL]))
    handles["ngram"].load = LoadCall(12)
    handles["draft"].load = LoadCall(0)

    async def go():
        router._ensure_load_poll()
        await asyncio.sleep(0.05)
        live = {v.name: v for v in router._live_pools("smollm2-135m")}
        router._load_poll.cancel()
        return live

    live = asyncio.run(go())
    assert live["ngram"].running == 12.0 and live["draft"].running == 0.0
    assert live["draft"].load_batch == 12.0  # same hardware group
    old = router_mod.time.monotonic() - 2 * router_mod.LOAD_REPORT_MAX_AGE_S
    router.engine_load["ngram"]["r1"] = (old, 12.0)
    assert {v.name: v.running for v in router._live_pools("smollm2-135m")} == {"ngram": 0.0, "draft": 0.0}


def test_a_report_taken_before_a_request_finished_does_not_count_it():
    """One stream, requests back to back: the engine's last report (sampled up to a poll interval
    before) still lists the previous request; the router takes off what it saw finish since, so
    the next request meets batch 1, not 2 (the 17:08 bench put its one-stream traffic at 2-3)."""
    from deployments import router as router_mod

    router, _ = make_router(lambda: FakeCall([FINAL]))  # served by replica r2
    router.engine_load["ngram"]["r2"] = (router_mod.time.monotonic(), 1.0)  # the request below, in flight
    assert post(router, BODY).status_code == 200
    live = {v.name: v for v in router._live_pools("smollm2-135m")}
    assert live["ngram"].running == 0.0 and live["ngram"].load_batch == 0.0
    # a report taken after the request finished is believed as it is
    router.engine_load["ngram"]["r2"] = (router_mod.time.monotonic(), 3.0)
    assert {v.name: v.running for v in router._live_pools("smollm2-135m")}["ngram"] == 3.0


def test_the_policy_scores_a_pool_with_its_configured_priors():
    """The policy scores a pool with its configured `prior_alpha` and `prior_draft_cost` (local
    config: with its measured fixed cost the EAGLE head pays only for math, α 0.39, at K = 2 when
    idle)."""
    from cluster.policy import choose_auto

    class ColdTuning:  # no state yet: the priors alone
        def snapshot(self, model):
            return None

    router, _ = make_router(lambda: FakeCall([]))
    router.tuning = ColdTuning()
    draft = router.views["draft"]
    chosen = {c: choose_auto([draft], router.config.router, c).k for c in WORKLOAD_CLASSES}
    assert chosen["math"] == 2 and max(k for c, k in chosen.items() if c != "math") == 0
    # without the measured draft cost the same pool would draft for other classes too
    bare = dataclasses.replace(draft, prior_draft_cost=None)
    assert max(choose_auto([bare], router.config.router, c).k for c in WORKLOAD_CLASSES if c != "math") > 0


def test_grpc_stats_carry_the_exploration_flag():
    from cluster.api.wire import Completion, spec_stats_proto
    from specserve.v1 import specserve_pb2 as pb

    c = Completion(request_id="r", model="m", text="", token_ids=[], finish_reason="stop",
                   stats={"mode": "ngram", "k": 4, "decided_by": "policy", "explored": True})
    assert spec_stats_proto(pb, c).explored is True
    c.stats["explored"] = False
    assert spec_stats_proto(pb, c).explored is False
    assert spec_stats_proto(pb, c).load_bucket == ""
    c.stats["decision"] = {"load_bucket": "16+", "k_by": "engine"}
    assert spec_stats_proto(pb, c).load_bucket == "16+"


def test_a_stream_closed_between_chunks_cancels_the_engine_call_at_once():
    """A client that goes away while the router holds a chunk (deadline, hang-up) closes the
    outermost generator at its yield; the engine call must be cancelled then, not when the garbage
    collector gets to the inner generators (vLLM only aborts a request on cancel)."""
    import gc

    from specserve.v1 import specserve_pb2 as pb

    chunk = EngineChunk(text="a", token_ids=[1])
    router, handles = make_router(lambda: FakeCall([chunk, chunk, chunk, FINAL]))
    req = pb.GenerateRequest(prompt="hi", speculative=pb.SpeculativeOverride(mode="ngram", k=2))

    async def hang_up():
        stream = router.GenerateStream(req)
        await stream.__anext__()
        gc.disable()  # so only an explicit close can cancel the call
        try:
            await stream.aclose()
            return handles["ngram"].calls[0].cancelled
        finally:
            gc.enable()

    assert asyncio.run(hang_up()) is True
    assert router.inflight == {"ngram": 0, "draft": 0}
