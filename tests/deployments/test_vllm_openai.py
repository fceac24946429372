"""The engine replica's hold on vLLM's serving layer, without an engine: what `CapturingEngine` does
to a request's SamplingParams and records of its outputs, and `call_app` over a small ASGI app.
vLLM's real serving layer over a real engine is tested end to end (tests/e2e/test_vllm_conformance.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind

from deployments.vllm_openai import Capture, CapturingEngine, _CAPTURE, add_to_stream_tail, call_app


@dataclass
class Out:  # the fields of vLLM's CompletionOutput / RequestOutput that the capture reads
    index: int
    token_ids: list
    finish_reason: str | None = None
    spec_decode_metrics: object = None


@dataclass
class ReqOut:
    outputs: list
    finished: bool = False
    prompt_token_ids: list = field(default_factory=lambda: [1, 2, 3])


class Engine:
    """Yields cumulative or delta outputs as vLLM does for the request's output kind."""

    def __init__(self):
        self.params = []

    async def generate(self, prompt, params, request_id):
        self.params.append(params)
        steps = [[7], [7, 8], [7, 8, 9]]
        for i, ids in enumerate(steps):
            last = i == len(steps) - 1
            if params.output_kind == RequestOutputKind.FINAL_ONLY and not last:
                continue
            delta = ids if params.output_kind != RequestOutputKind.DELTA else ids[-1:]
            yield ReqOut([Out(0, delta, "length" if last else None)], finished=last)


def run(engine, params, capture):
    async def go():
        token = _CAPTURE.set(capture)
        try:
            return [o async for o in CapturingEngine(engine).generate("p", params, "r")]
        finally:
            _CAPTURE.reset(token)
    return asyncio.run(go())


def test_a_final_only_call_is_watched_step_by_step_and_gets_only_the_final_output():
    engine, notes = Engine(), []
    capture = Capture(extra_args={"specserve_k": 3}, notify=lambda: notes.append(1))
    params = SamplingParams(max_tokens=3, output_kind=RequestOutputKind.FINAL_ONLY, extra_args={"user": 1})
    outs = run(engine, params, capture)
    assert len(outs) == 1 and outs[0].outputs[0].token_ids == [7, 8, 9]  # what FINAL_ONLY would have given
    assert capture.token_ids == {0: [7, 8, 9]} and len(notes) == 3  # but every step was seen
    assert capture.finish_reason == {0: "length"} and capture.finished == 1 and capture.prompt_tokens == 3
    # the decision joins the caller's own extra args (the router's win on a clash)
    assert engine.params[0].extra_args == {"user": 1, "specserve_k": 3}
    assert capture.take_first_choice() == [7, 8, 9] and capture.take_first_choice() == []


def test_a_final_only_call_of_several_choices_stays_final_only():
    """vLLM gathers the n choices into its final output only under FINAL_ONLY (with CUMULATIVE each
    output is one child's, and the serving layer keeps the last: one choice of n)."""
    engine, capture = Engine(), Capture()
    params = SamplingParams(max_tokens=3, n=2, temperature=0.5, output_kind=RequestOutputKind.FINAL_ONLY)
    outs = run(engine, params, capture)
    assert engine.params[0].output_kind == RequestOutputKind.FINAL_ONLY and len(outs) == 1


def test_a_streamed_call_passes_every_delta_on():
    engine, capture = Engine(), Capture()
    outs = run(engine, SamplingParams(max_tokens=3, output_kind=RequestOutputKind.DELTA), capture)
    assert [o.outputs[0].token_ids for o in outs] == [[7], [8], [9]]
    assert capture.token_ids == {0: [7, 8, 9]} and capture.take_new() == 3 and capture.take_new() == 0


def test_outside_a_call_the_engine_is_untouched():
    engine = Engine()
    params = SamplingParams(max_tokens=3, output_kind=RequestOutputKind.FINAL_ONLY)
    outs = run(engine, params, None)
    assert len(outs) == 1 and params.output_kind == RequestOutputKind.FINAL_ONLY


def _first_body_then_close(app):
    async def go():
        events = []
        gen = call_app(app, "POST", "/x", b"hello", Capture())
        async for ev in gen:
            events.append(ev)
            if ev.body:
                break
        await gen.aclose()
        return events
    return asyncio.run(go())


def test_closing_a_call_early_is_a_disconnect_the_app_sees():
    seen = []

    async def app(scope, receive, send):  # as vLLM's handlers do: listen for the client going away
        body = (await receive())["body"]
        await send({"type": "http.response.start", "status": 201, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": body, "more_body": True})
        seen.append((await receive())["type"])

    events = _first_body_then_close(app)  # what the app sent together comes as one event
    assert events[0].status == 201 and ("content-type", "text/plain") in events[0].headers
    assert events[0].body == b"hello" and seen == ["http.disconnect"]


def test_an_app_that_ignores_the_disconnect_is_cancelled_after_the_grace(monkeypatch):
    import deployments.vllm_openai as V

    monkeypatch.setattr(V, "DISCONNECT_GRACE_S", 0.05)
    cancelled = []

    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"x", "more_body": True})
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(scope["path"])
            raise

    _first_body_then_close(app)
    assert cancelled == ["/x"]


def test_the_specserve_object_goes_on_the_last_json_event_before_done():
    tail = 'data: {"choices":[{"finish_reason":"stop"}]}\n\ndata: {"choices":[],"usage":{}}\n\ndata: [DONE]\n\n'
    out = add_to_stream_tail(tail, "specserve", {"k": 2})
    assert out == ('data: {"choices":[{"finish_reason":"stop"}]}\n\n'
                   'data: {"choices":[],"usage":{},"specserve":{"k":2}}\n\ndata: [DONE]\n\n')
    assert add_to_stream_tail("data: [DONE]\n\n", "specserve", {}) == "data: [DONE]\n\n"
