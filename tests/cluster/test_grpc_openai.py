"""`cluster.api.grpc_openai`: gRPC messages to the OpenAI bodies vLLM's serving layer gets, and
vLLM's answers and stream events back. Against a real cluster and a stock vLLM server:
tests/e2e/test_vllm_conformance.py."""

from __future__ import annotations

import json

import pytest

from cluster.api.grpc_openai import StreamReader, logprobs_of, openai_call, response_proto
from cluster.api.types import ApiError, UpstreamError
from cluster.api.wire import from_proto
from specserve.v1 import specserve_pb2 as pb


def _call(stream=False, **fields):
    msg = pb.GenerateRequest(**fields)
    return openai_call(msg, from_proto(msg), stream=stream)


def test_a_chat_request_maps_every_field_to_its_openai_name():
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    path, body = _call(
        model="m", messages=[pb.ChatMessage(role="user", content="hi")],
        sampling=pb.SamplingParams(max_tokens=9, temperature=0.5, top_p=0.9, seed=3, stop=["."], logprobs=2,
                                   stop_token_ids=[5, 6], min_tokens=2, n=2, presence_penalty=0.5,
                                   frequency_penalty=0.25, repetition_penalty=1.5),
        response_format=pb.ResponseFormat(type="json_schema", json_schema=json.dumps(schema), name="place"),
        tools=[pb.Tool(name="f", description="d", parameters_json=json.dumps(schema))], tool_choice="f")
    assert path == "/v1/chat/completions"
    assert body == {
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9, "temperature": 0.5,
        "top_p": pytest.approx(0.9), "seed": 3, "stop": ["."], "logprobs": True, "top_logprobs": 2,
        "return_tokens_as_token_ids": True, "return_token_ids": True, "stop_token_ids": [5, 6], "min_tokens": 2,
        "n": 2, "presence_penalty": 0.5, "frequency_penalty": 0.25, "repetition_penalty": 1.5,
        "response_format": {"type": "json_schema", "json_schema": {"name": "place", "schema": schema}},
        "tools": [{"type": "function", "function": {"name": "f", "description": "d", "parameters": schema}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}}}


def test_a_prompt_goes_to_completions_and_unset_fields_stay_vllms_defaults():
    path, body = _call(prompt="Once", sampling=pb.SamplingParams(logprobs=1))
    assert path == "/v1/completions"
    assert body == {"prompt": "Once", "max_tokens": 128, "temperature": 0.0, "top_p": 1.0, "logprobs": 1,
                    "return_tokens_as_token_ids": True, "return_token_ids": True}
    _, body = _call(stream=True, prompt="x", tools=[], tool_choice="")
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    for choice in ("none", "auto", "required"):
        assert _call(messages=[pb.ChatMessage(role="user", content="x")], tools=[pb.Tool(name="f")],
                     tool_choice=choice)[1]["tool_choice"] == choice


@pytest.mark.parametrize("fields, field", [
    (dict(prompt="x", tools=[pb.Tool(name="f")]), "tools"),
    (dict(messages=[pb.ChatMessage(role="user", content="x")], tool_choice="auto"), "tool_choice"),
    (dict(prompt="x", response_format=pb.ResponseFormat(type="json_schema")), "response_format.json_schema"),
    (dict(prompt="x", response_format=pb.ResponseFormat(type="json_schema", json_schema="{")),
     "response_format.json_schema"),
    (dict(prompt="x", response_format=pb.ResponseFormat(type="yaml")), "response_format.type"),
    (dict(messages=[pb.ChatMessage(role="user", content="x")], tools=[pb.Tool(name="f", parameters_json="[")]),
     "tools[0].parameters_json"),
])
def test_malformed_fields_are_refused_naming_them(fields, field):
    with pytest.raises(ApiError) as e:
        _call(**fields)
    assert e.value.field == field and e.value.code.grpc_name == "INVALID_ARGUMENT"


def test_a_stream_asks_for_one_choice():
    with pytest.raises(ApiError) as e:
        _call(stream=True, prompt="x", sampling=pb.SamplingParams(n=2))
    assert e.value.field == "sampling.n"


def test_vllms_answer_fills_the_response_with_every_choice():
    answer = {"choices": [
        {"index": 1, "message": {"content": "b"}, "token_ids": [2], "finish_reason": "length", "logprobs": None},
        {"index": 0, "message": {"content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
         "token_ids": [7, 8], "finish_reason": "tool_calls",
         "logprobs": {"content": [{"token": "token_id:7", "logprob": -0.5, "top_logprobs": []}]}}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 3}}
    out = response_proto(pb, answer, pb.GenerateResponse(request_id="r", token_ids=[9], prompt_tokens=1))
    assert (out.request_id, out.text, list(out.token_ids), out.finish_reason) == ("r", "", [7, 8], "tool_calls")
    assert [(c.id, c.name, c.arguments_json) for c in out.tool_calls] == [("c1", "f", "{\"x\": 1}")]
    assert [(t.token_id, t.logprob) for t in out.logprobs] == [(7, -0.5)]
    assert (out.prompt_tokens, out.completion_tokens) == (4, 3)
    assert [(c.index, c.text, list(c.token_ids)) for c in out.choices] == [(0, "", [7, 8]), (1, "b", [2])]
    one = response_proto(pb, {"choices": [{"index": 0, "text": "t", "finish_reason": "stop"}]},
                         pb.GenerateResponse(token_ids=[3]))
    assert (one.text, list(one.token_ids), len(one.choices)) == ("t", [3], 0)


def _sse(*events):
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events)


def test_the_stream_reader_folds_tool_call_deltas_and_keeps_usage():
    r = StreamReader()
    assert r.read(_sse({"choices": [{"delta": {"content": "He"}, "token_ids": [1]}]},
                       {"choices": [{"delta": {"content": "llo"}, "token_ids": [2, 3]}]})) == ("Hello", [1, 2, 3], [])
    r.read(_sse({"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "c", "function": {"name": "f", "arguments": "{\"a\""}}]}}]},
                {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}}]},
                {"choices": [{"delta": {"tool_calls": [{"index": 1, "id": "d", "function": {"name": "g", "arguments": "{}"}}]},
                              "finish_reason": "tool_calls"}]},
                {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9}}) + "data: [DONE]\n\n")
    assert r.tool_calls == [{"id": "c", "name": "f", "arguments_json": "{\"a\": 1}"},
                            {"id": "d", "name": "g", "arguments_json": "{}"}]
    assert r.finish_reason == "tool_calls" and r.usage["completion_tokens"] == 9


def test_an_error_event_in_the_stream_is_raised_with_vllms_status():
    with pytest.raises(UpstreamError) as e:
        StreamReader().read(_sse({"error": {"message": "bad grammar", "type": "BadRequestError", "code": 400}}))
    assert e.value.status == 400 and "bad grammar" in e.value.message


def test_completion_logprobs_keep_their_order():
    lp = logprobs_of({"logprobs": {"tokens": ["token_id:1", "token_id:2"], "token_logprobs": [-1.0, -2.0],
                                   "top_logprobs": None}})
    assert [(t["token_id"], t["logprob"], t["top"]) for t in lp] == [(1, -1.0, []), (2, -2.0, [])]
