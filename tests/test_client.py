"""cluster.client and cluster.client_wire against hand-built SSE text and a fake server speaking real HTTP +
chunked SSE."""

import asyncio
import json

import pytest

try:
    from tests.bench.fake_openai import FakeServer
except ImportError:  # tests/ is not a package: pytest put tests/ itself on sys.path
    from bench.fake_openai import FakeServer
from cluster.client import AsyncSpecServeClient, SpecServeClient
from cluster.client_wire import (ClientError, build_body, collect_stream, final_new_tokens, error_from_response, iter_sse_data,
                                 parse_chunk)


# -- pure pieces ------------------------------------------------------------------------------------


def test_build_body_chat_and_completions_logprobs_and_extension():
    path, body = build_body(messages=[{"role": "user", "content": "hi"}], logprobs=2, max_tokens=7,
                            speculative={"mode": "ngram", "k": 3}, request_id="r1")
    assert path == "/v1/chat/completions"
    assert body["logprobs"] is True and body["top_logprobs"] == 2 and body["max_tokens"] == 7
    assert body["specserve"] == {"speculative": {"mode": "ngram", "k": 3}, "request_id": "r1"}
    assert "temperature" not in body and "prompt" not in body
    path, body = build_body(prompt="x", logprobs=2, temperature=0.0)
    assert path == "/v1/completions" and body["logprobs"] == 2 and body["temperature"] == 0.0
    assert "specserve" not in body and "top_logprobs" not in body
    with pytest.raises(ValueError):
        build_body(prompt="x", messages=[])
    with pytest.raises(ValueError):
        build_body()


def test_iter_sse_data_framing():
    lines = [": keep-alive", "data: {\"a\": 1}", "", "event: x", "data: line1", "data:line2", "", "", "data: [DONE]"]
    assert list(iter_sse_data(lines)) == ['{"a": 1}', "line1\nline2", "[DONE]"]


def test_parse_chunk_new_tokens_final_stats_done_and_error():
    c = parse_chunk(json.dumps({"choices": [{"delta": {"content": "ab"}, "finish_reason": None}],
                                "specserve": {"token_ids": [5, 6]}}), 1.0)
    assert (c.text, c.token_ids, c.finish_reason, c.spec) == ("ab", [5, 6], None, None)
    final = parse_chunk(json.dumps({"choices": [{"text": "c", "finish_reason": "length"}], "usage": {"x": 1},
                                    "specserve": {"mode": "ngram", "k": 2, "steps": 2, "accepted": 1,
                                                  "token_ids": [5, 6, 7], "logprobs": [{"5": -0.1}]}}), 2.0)
    assert final.token_ids == [5, 6, 7] and final.spec.logprobs == [{5: -0.1}]
    assert final.spec.stats().acceptance_length == 1.5
    assert parse_chunk("[DONE]", 3.0) is None
    with pytest.raises(ClientError) as e:
        parse_chunk(json.dumps({"error": {"message": "boom", "param": "k"}}), 0.0)
    assert e.value.message == "boom" and e.value.param == "k"


def test_collect_stream_timings_and_tokens_from_final_stats():
    chunks = [parse_chunk(json.dumps({"choices": [{"delta": {"content": "a"}}], "specserve": {"token_ids": [1]}}), 10.2),
              parse_chunk(json.dumps({"choices": [{"delta": {"content": "bc"}}], "specserve": {"token_ids": [2, 3]}}), 10.5),
              parse_chunk(json.dumps({"choices": [{"delta": {"content": "d"}, "finish_reason": "stop"}],
                                      "specserve": {"mode": "none", "steps": 4, "token_ids": [1, 2, 3, 4]}}), 10.6)]
    r = collect_stream(chunks, 10.0)
    assert r.text == "abcd" and r.token_ids == [1, 2, 3, 4] and r.finish_reason == "stop"
    assert r.ttft_s == pytest.approx(0.2) and r.latency_s == pytest.approx(0.6)
    assert r.chunk_times_s == pytest.approx([0.2, 0.5, 0.6]) and r.chunk_tokens == [1, 2, 1]


def test_final_chunk_tokens_new_or_whole_output():
    # The router's format: the last chunk's token_ids are its new tokens.
    assert final_new_tokens([1, 2], [3], 3) == [3]
    assert final_new_tokens([1, 2], [1], 3) == [1]  # a repeated token, told apart by the usage count
    # The whole output repeated in the last chunk.
    assert final_new_tokens([1, 2], [1, 2, 3], 3) == [3]
    assert final_new_tokens([1, 2], [1, 2, 3], None) == [3]
    assert final_new_tokens([], [4, 5], None) == [4, 5]
    assert final_new_tokens([1, 2], [], 2) == []
    chunks = [parse_chunk(json.dumps({"choices": [{"delta": {"content": "a"}}], "specserve": {"token_ids": [7]}}), 1.1),
              parse_chunk(json.dumps({"choices": [{"delta": {}, "finish_reason": "length"}],
                                      "usage": {"completion_tokens": 2},
                                      "specserve": {"mode": "ngram", "k": 1, "steps": 1, "token_ids": [7]}}), 1.3)]
    r = collect_stream(chunks, 1.0)
    assert r.token_ids == [7, 7] and r.spec.token_ids == [7, 7] and r.chunk_tokens == [1, 1]


def test_error_from_response_documented_and_garbage_bodies():
    e = error_from_response(429, b'{"error": {"message": "busy", "type": "rate_limit_error", "param": null}}',
                            {"retry-after": "3"})
    assert (e.status, e.message, e.type, e.retry_after_s) == (429, "busy", "rate_limit_error", 3.0)
    e = error_from_response(502, b"<html>bad gateway</html>")
    assert e.status == 502 and "bad gateway" in e.message and e.param is None


# -- against a real HTTP server -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    with FakeServer(prefill_s=0.05, step_s=0.03, tie_positions=frozenset({2})) as s:
        yield s


def test_sync_models_generate_and_stream(server):
    with SpecServeClient(server.url) as c:
        models = c.models()
        assert models[0].id == "fake-model" and models[0].pools[1]["max_k"] == 4
        r = c.generate(messages=[{"role": "user", "content": "hello"}], max_tokens=6,
                       speculative={"mode": "ngram", "k": 2}, logprobs=2)
        assert r.token_ids == server.reference_tokens("hello", 6)
        assert r.spec.mode == "ngram" and r.spec.k == 2 and r.spec.steps == 3 and r.spec.accepted == 3
        assert r.spec.logprobs[2][r.token_ids[2]] == -0.1 and len(r.spec.logprobs) == 6
        assert r.ttft_s == pytest.approx(0.05) and r.latency_s >= 0.05 + 3 * 0.03
        rs = c.generate_streamed(prompt="hello", max_tokens=6, speculative={"mode": "ngram", "k": 2})
        assert rs.token_ids == r.token_ids and rs.chunk_tokens == [2, 2, 2] and rs.finish_reason == "length"
        assert rs.text == "".join(f" t{t}" for t in r.token_ids)
    # Chunks arrived one by one (not buffered): gaps of about step_s, TTFT about prefill_s.
    assert rs.ttft_s >= 0.045 and rs.ttft_s < rs.chunk_times_s[-1] - 0.05
    gaps = [b - a for a, b in zip(rs.chunk_times_s, rs.chunk_times_s[1:])]
    assert all(g >= 0.02 for g in gaps)


def test_sync_errors_are_typed(server):
    with SpecServeClient(server.url) as c:
        with pytest.raises(ClientError) as e:
            c.generate(prompt="x", model="nope")
        assert e.value.status == 404 and e.value.param == "model"
        with pytest.raises(ClientError) as e:
            list(c.generate_stream(prompt="FAIL429 please"))
        assert e.value.status == 429 and e.value.retry_after_s == 2.0
    with SpecServeClient("http://127.0.0.1:9") as c:  # nothing listens on the discard port
        with pytest.raises(ClientError) as e:
            c.models()
        assert e.value.status == 0


def test_async_stream_concurrent(server):
    async def go():
        async with AsyncSpecServeClient(server.url) as c:
            assert (await c.models())[0].id == "fake-model"
            results = await asyncio.gather(*(c.generate_streamed(messages=[{"role": "user", "content": f"p{i}"}],
                                                                 max_tokens=5, speculative={"mode": "none"})
                                             for i in range(4)))
            one = await c.generate(prompt="p0", max_tokens=5)
            with pytest.raises(ClientError) as e:
                await c.generate_streamed(prompt="FAIL429")
            return results, one, e.value

    results, one, err = asyncio.run(go())
    for i, r in enumerate(results):
        assert r.token_ids == server.reference_tokens(f"p{i}", 5) and r.chunk_tokens == [1] * 5
        assert r.spec.mode == "none" and r.spec.steps == 5
    assert one.spec.decided_by == "policy" and one.spec.k == 3
    assert err.status == 429
