"""vLLM's OpenAI API through specserve gives vLLM's answers: a stock vLLM 0.32 OpenAI server (the
n-gram pool's engine arguments, n-gram speculation K = 3, the pool's own server options: chat
template and tool-call parser) runs beside the cluster, and every request goes to both; the answers
must agree, feature by feature (greedy text, tool calls, JSON, logprobs within float tolerance,
usage, errors), also through the official `openai` client.

What may differ, and is left out of the comparison: ids, timestamps, vLLM's per-request `metrics`
(the cluster's engines record per-request speculation metrics) and specserve's own `specserve` object.
"""

from __future__ import annotations

import json
import math

import grpc
import httpx
import pytest
from pydantic import BaseModel

from cluster.api.grpc_openai import StreamReader
from tools.bench import anchors as A
from cluster.config import load_config
from specserve.v1 import specserve_pb2 as pb
from tests.e2e.helpers import specserve_stub
from tests.paths import LOCAL_CPU

pytestmark = pytest.mark.engine

MODEL = "smollm2-135m"
MSG = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
    "additionalProperties": False}}}]
WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
LOGPROB_TOL = 0.05  # verification batches differ in shape between the two engines


@pytest.fixture(scope="module")
def stock(cluster, tmp_path_factory):
    """The stock vLLM server's URL (started once for this module, stopped after it)."""
    pytest.importorskip("vllm")
    from cluster.ops.models import resolve_model

    config = load_config(LOCAL_CPU)
    pool = config.pools["ngram"]
    (baseline,) = A.parse_baselines("ngram:3", pool, "ngram")
    (server,) = A.plan_servers([baseline], pool, resolve_model(pool.model, config), pool.model,
                               config.models[pool.model].dtype, tmp_path_factory.mktemp("stock"))
    server.env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    assert "--tool-call-parser" in server.argv and "--chat-template" in server.argv  # the pool's own options
    with A.StockFleet([server], timeout_s=pool.startup_timeout_s, log=print) as urls:
        yield urls[baseline.name]


_VOLATILE = {"id", "created", "metrics", "specserve", "system_fingerprint"}


def _clean(obj):
    """An answer without what may differ (see module doc); tool-call ids are random on both sides."""
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items() if k not in _VOLATILE}
    if isinstance(obj, list):
        return [_clean(v) for v in obj]
    return obj


def _close(a, b, path="$"):
    """Equal, floats (logprobs) within LOGPROB_TOL; AssertionError naming where they differ."""
    if isinstance(a, float) or isinstance(b, float):
        assert isinstance(a, (int, float)) and isinstance(b, (int, float)), (path, a, b)
        assert math.isclose(a, b, abs_tol=LOGPROB_TOL) or (math.isinf(a) and a == b), (path, a, b)
    elif isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), (path, sorted(a.keys() ^ b.keys()))
        for k in a:
            _close(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), (path, len(a), len(b))
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)


def _both(cluster, stock, path, body, method="POST"):
    ours = httpx.request(method, cluster.http_url + path, json=body, timeout=300)
    theirs = httpx.request(method, stock + path, json=body, timeout=300)
    assert ours.status_code == theirs.status_code, (body, ours.text, theirs.text)
    return ours, theirs


def _same(cluster, stock, path, body):
    """The same status and the same answer from both; specserve's answer (JSON) returned."""
    ours, theirs = _both(cluster, stock, path, body)
    a, b = ours.json(), theirs.json()
    if ours.status_code != 200:  # vLLM's own error, passed on as it is
        assert a == b, (body, a, b)
        return a
    _close(_clean(a), _clean(b))
    return a


def _chat(**extra):
    return {"model": MODEL, "messages": MSG, "max_tokens": 16, "temperature": 0, **extra}


CHAT_CASES = {
    "plain": _chat(),
    "content_parts": _chat(messages=[{"role": "user", "content": [{"type": "text", "text": "Name a colour."},
                                                                   {"type": "text", "text": "One word."}]}]),
    "roles": _chat(messages=[{"role": "system", "content": "You answer briefly."}, *MSG,
                             {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And Italy?"}]),
    "tool_history": _chat(tools=TOOLS, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"}]),
    "tools_none": _chat(tools=TOOLS, tool_choice="none"),
    "tools_auto": _chat(tools=TOOLS, tool_choice="auto", max_tokens=80, messages=WEATHER),
    "tools_required": _chat(tools=TOOLS, tool_choice="required", max_tokens=80, messages=WEATHER),
    "tools_named": _chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                         max_tokens=80, messages=WEATHER),
    "json_object": _chat(response_format={"type": "json_object"}, max_tokens=24),
    "json_schema": _chat(response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
                         messages=[{"role": "user", "content": "Invent a person."}], max_tokens=40),
    "structured_regex": _chat(structured_outputs={"regex": "[A-Z][a-z]{2,8}"}),
    "structured_choice": _chat(structured_outputs={"choice": ["Paris", "London", "Rome"]}),
    "structured_grammar": _chat(structured_outputs={"grammar": 'root ::= "yes" | "no"'}),
    "n_2": _chat(n=2),
    "logprobs": _chat(logprobs=True, top_logprobs=3, max_tokens=6),
    "penalties": _chat(presence_penalty=1.5, frequency_penalty=1.0, repetition_penalty=1.3, max_tokens=24),
    "stop": _chat(stop=["."], max_tokens=24),
    "stop_token_ids": _chat(stop_token_ids=[28], max_tokens=24),
    "min_tokens": _chat(min_tokens=12, max_tokens=14),
    "max_completion_tokens": {**_chat(), "max_completion_tokens": 5},
    "seed_greedy": _chat(seed=7),
    "chat_template_kwargs": _chat(chat_template_kwargs={"add_generation_prompt": False}),
    "unknown_field": _chat(not_a_vllm_field=1),
    "bad_max_tokens": _chat(max_tokens="ten"),
    "no_messages": {"model": MODEL, "max_tokens": 4},
    "unknown_model": _chat(model="nope"),
    "too_long": _chat(max_tokens=5000),
}

COMPLETION_CASES = {
    "plain": {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0},
    "logprobs_echo": {"model": MODEL, "prompt": "One, two, three,", "max_tokens": 4, "temperature": 0,
                      "logprobs": 2, "echo": True},
    "prompt_list": {"model": MODEL, "prompt": ["Red, green,", "Monday, Tuesday,"], "max_tokens": 4, "temperature": 0},
    "best_of": {"model": MODEL, "prompt": "A B C", "max_tokens": 4, "temperature": 0, "best_of": 2},
    "token_prompt": {"model": MODEL, "prompt": [504, 3458, 282], "max_tokens": 4, "temperature": 0},
}


@pytest.mark.parametrize("name", list(CHAT_CASES))
def test_chat_feature_gives_vllms_answer(cluster, stock, name):
    body = CHAT_CASES[name]
    a = _same(cluster, stock, "/v1/chat/completions", body)
    if name == "json_schema":  # the schema was applied, not only passed along
        person = json.loads(a["choices"][0]["message"]["content"])
        assert set(person) == {"name", "age"} and isinstance(person["age"], int)
    if name in ("tools_required", "tools_named"):
        assert a["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    if name == "structured_choice":
        assert a["choices"][0]["message"]["content"] in ("Paris", "London", "Rome")
    if name == "logprobs":
        assert len(a["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 3
    if a.get("choices"):  # specserve's object rides along on every generation
        assert a["specserve"]["pool"] and "acceptance_length" in a["specserve"]


def _first_tokens(url: str, body: dict) -> list[dict]:
    """The top two candidates at each position of a greedy chat answer (token ids from logprobs)."""
    r = httpx.post(url + "/v1/chat/completions", json={**body, "logprobs": True, "top_logprobs": 2,
                                                        "return_tokens_as_token_ids": True}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["content"]


def test_logit_bias_and_min_p_are_served_at_k0_where_vllm_refuses_them(cluster, stock):
    """Stock vLLM refuses both whenever speculation is configured; specserve serves them at K = 0 in
    the same engine. Their effect is checked against stock vLLM's own greedy answer: the first token
    banned by logit_bias gives way to stock's second candidate, a +100 bias forces its token, and
    min_p = 1 (only the most likely token survives) samples stock's greedy text at temperature 1."""
    body = _chat(max_tokens=1)
    refused = httpx.post(stock + "/v1/chat/completions", json={**body, "logit_bias": {"28": 5}}, timeout=300)
    assert refused.status_code == 400 and "speculative decoding" in refused.text
    first = _first_tokens(stock, body)[0]
    banned, runner_up = (int(c["token"].split(":")[1]) for c in first["top_logprobs"])
    for ext in ({}, {"specserve": {"speculative": {"mode": "none"}}}):
        ours = httpx.post(cluster.http_url + "/v1/chat/completions",
                          json={**body, **ext, "logit_bias": {str(banned): -100}}, timeout=300).json()
        assert ours["specserve"]["token_ids"] == [runner_up], (ext, ours)
        assert ours["specserve"]["k"] == 0 and ours["specserve"]["decision"]["plain_for"] == "logit_bias"
    forced = httpx.post(cluster.http_url + "/v1/chat/completions",
                        json=_chat(max_tokens=4, logit_bias={"330": 100}), timeout=300).json()
    assert forced["specserve"]["token_ids"] == [330] * 4
    greedy = httpx.post(stock + "/v1/chat/completions", json=_chat(max_tokens=16), timeout=300).json()
    for seed in (1, 2):
        ours = httpx.post(cluster.http_url + "/v1/chat/completions",
                          json=_chat(max_tokens=16, temperature=1.0, min_p=1.0, seed=seed), timeout=300).json()
        assert ours["choices"][0]["message"]["content"] == greedy["choices"][0]["message"]["content"]
        assert ours["specserve"]["decision"]["plain_for"] == "min_p"


def test_logit_bias_with_a_speculative_k_is_refused_naming_the_field(cluster):
    body = _chat(logit_bias={"28": 5}, specserve={"speculative": {"mode": "ngram", "k": 4}})
    r = httpx.post(cluster.http_url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and "logit_bias" in r.text, r.text


@pytest.mark.parametrize("name", list(COMPLETION_CASES))
def test_completion_feature_gives_vllms_answer(cluster, stock, name):
    _same(cluster, stock, "/v1/completions", COMPLETION_CASES[name])


def _events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


@pytest.mark.parametrize("options", [{"include_usage": True}, {"include_usage": True, "continuous_usage_stats": True}])
def test_streams_carry_the_same_text_and_usage(cluster, stock, options):
    body = _chat(stream=True, stream_options=options, max_tokens=12)
    ours, theirs = _both(cluster, stock, "/v1/chat/completions", body)
    a, b = _events(ours.text), _events(theirs.text)
    text = [("".join(c["delta"].get("content") or "" for e in ev for c in e.get("choices", []))) for ev in (a, b)]
    assert text[0] == text[1] and text[0]
    assert a[-1]["usage"] == b[-1]["usage"] and a[-1]["usage"]["completion_tokens"] > 0
    if options.get("continuous_usage_stats"):
        assert all("usage" in e for e in a) and all("usage" in e for e in b)
    assert "specserve" in a[-1] and ours.text.rstrip().endswith("data: [DONE]")


@pytest.mark.parametrize("path, body", [("/tokenize", {"model": MODEL, "prompt": "Hello there"}),
                                        ("/tokenize", {"model": MODEL, "messages": MSG}),
                                        ("/detokenize", {"model": MODEL, "tokens": [19556, 665]}),
                                        ("/tokenize", {"model": MODEL, "prompt": 5})])
def test_tokenize_and_detokenize_give_vllms_answer(cluster, stock, path, body):
    _same(cluster, stock, path, body)


def test_version_health_and_metrics(cluster, stock):
    for path in ("/version", "/health"):
        ours, theirs = _both(cluster, stock, path, None, method="GET")
        assert ours.content == theirs.content
    metrics = httpx.get(cluster.http_url + "/metrics", timeout=60)
    assert metrics.status_code == 200
    lines = metrics.text.splitlines()
    for pool in ("ngram", "draft"):  # vLLM's names, one series per pool
        assert any(line.startswith("vllm:spec_decode_num_draft_tokens_total{") and f'pool="{pool}"' in line
                   for line in lines), pool
    assert sum(line.startswith("# TYPE vllm:spec_decode_num_draft_tokens_total ") for line in lines) == 1


class Person(BaseModel):
    name: str
    age: int


def test_the_openai_client_gets_the_same_parsed_tools_and_streamed_usage(cluster, stock):
    import openai

    def client(url):
        return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)

    ours, theirs = client(cluster.http_url), client(stock)
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Invent a person."}], max_tokens=40, temperature=0)
    parsed = [c.chat.completions.parse(response_format=Person, **kw).choices[0].message.parsed for c in (ours, theirs)]
    assert parsed[0] == parsed[1] and isinstance(parsed[0], Person)
    kw = dict(model=MODEL, messages=WEATHER, max_tokens=80, temperature=0,
              tools=TOOLS, tool_choice="required")
    calls = [c.chat.completions.create(**kw).choices[0].message.tool_calls for c in (ours, theirs)]
    assert [(t.function.name, t.function.arguments) for t in calls[0]] == \
           [(t.function.name, t.function.arguments) for t in calls[1]]
    kw = dict(model=MODEL, messages=MSG, max_tokens=10, temperature=0, stream=True,
              stream_options={"include_usage": True})
    usage = [[ch.usage for ch in c.chat.completions.create(**kw) if ch.usage][-1] for c in (ours, theirs)]
    assert usage[0] == usage[1]


def test_a_seed_gives_the_same_sample_every_time_through_specserve(cluster):
    body = _chat(temperature=0.8, seed=1234, max_tokens=16, specserve={"speculative": {"mode": "none", "k": 0}})
    texts = {httpx.post(cluster.http_url + "/v1/chat/completions", json=body, timeout=120).json()
             ["choices"][0]["message"]["content"] for _ in range(2)}
    assert len(texts) == 1, texts


@pytest.mark.parametrize("fmt", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}},
    {"tools": TOOLS, "tool_choice": "required"},
    {"structured_outputs": {"regex": "(Paris|Rome)( is a city\\.)+"}},
])
def test_constrained_output_is_the_same_with_every_mode_and_k(cluster, fmt):
    """Structured outputs and tool calls go through per-request speculation: greedy output the same as
    plain decoding in every mode at every K (vLLM's scheduler cuts a draft at the first token the
    grammar forbids, so none is verified), and the router files the request as `structured`."""
    answers = {}
    for spec in ({"mode": "none", "k": 0}, {"mode": "ngram", "k": 6}, {"mode": "suffix", "k": 16}, None):
        body = _chat(messages=WEATHER, max_tokens=48, **fmt, **({"specserve": {"speculative": spec}} if spec else {}))
        r = httpx.post(cluster.http_url + "/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        a = r.json()
        msg = a["choices"][0]["message"]
        answers[spec["mode"] if spec else "router"] = (msg["content"], [(t["function"]["name"], t["function"]["arguments"])
                                                  for t in msg.get("tool_calls") or []], a["specserve"]["token_ids"])
        assert a["specserve"]["workload_class"] == "structured"
    assert len(set(map(repr, answers.values()))) == 1, answers


# -- gRPC: the same path, the same answers ------------------------------------------------------

@pytest.fixture(scope="module")
def grpc_stub(cluster):
    with specserve_stub(cluster.grpc_target) as s:
        yield s


def _grpc_chat(messages, **fields):
    sampling = fields.pop("sampling", {})
    return pb.GenerateRequest(model=MODEL, messages=[pb.ChatMessage(**m) for m in messages],
                              sampling=pb.SamplingParams(temperature=0, **sampling), **fields)


def _stock(stock, body):
    r = httpx.post(stock + ("/v1/chat/completions" if "messages" in body else "/v1/completions"),
                   json={"model": MODEL, "temperature": 0, **body}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_grpc_json_schema_tools_and_penalties_give_vllms_answer(grpc_stub, stock):
    schema = _grpc_chat([{"role": "user", "content": "Invent a person."}], sampling={"max_tokens": 40},
                        response_format=pb.ResponseFormat(type="json_schema", json_schema=json.dumps(PERSON),
                                                          name="person"))
    ours = grpc_stub.Generate(schema, timeout=300)
    theirs = _stock(stock, {"messages": [{"role": "user", "content": "Invent a person."}], "max_tokens": 40,
                            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}})
    assert ours.text == theirs["choices"][0]["message"]["content"] and set(json.loads(ours.text)) == {"name", "age"}
    assert ours.spec.workload_class == "structured"
    tool = pb.Tool(name="get_weather", description="The weather in a city",
                   parameters_json=json.dumps(TOOLS[0]["function"]["parameters"]))
    for choice in ("required", "get_weather"):
        req = _grpc_chat(WEATHER, sampling={"max_tokens": 80}, tools=[tool], tool_choice=choice)
        ours = grpc_stub.Generate(req, timeout=300)
        theirs = _stock(stock, {"messages": WEATHER, "max_tokens": 80, "tools": TOOLS, "tool_choice": choice if
                                choice == "required" else {"type": "function", "function": {"name": choice}}})
        want = [(c["function"]["name"], c["function"]["arguments"]) for c in theirs["choices"][0]["message"]["tool_calls"]]
        assert [(c.name, c.arguments_json) for c in ours.tool_calls] == want and want
        streamed = list(grpc_stub.GenerateStream(req, timeout=300))
        stock_stream = httpx.post(stock + "/v1/chat/completions", timeout=300, json={
            "model": MODEL, "temperature": 0, "messages": WEATHER, "max_tokens": 80, "tools": TOOLS, "stream": True,
            "tool_choice": choice if choice == "required" else {"type": "function", "function": {"name": choice}}})
        reader = StreamReader()  # vLLM streams the arguments as generated, unstreamed it re-serializes them
        reader.read(stock_stream.text)
        assert [(c.name, c.arguments_json) for c in streamed[-1].tool_calls] == \
               [(c["name"], c["arguments_json"]) for c in reader.tool_calls]
        assert [json.loads(c.arguments_json) for c in streamed[-1].tool_calls] == [json.loads(a) for _, a in want]
    sampling = {"max_tokens": 24, "presence_penalty": 1.5, "frequency_penalty": 1.0, "repetition_penalty": 1.3,
                "stop_token_ids": [28], "min_tokens": 3}
    ours = grpc_stub.Generate(_grpc_chat(MSG, sampling=sampling), timeout=300)
    theirs = _stock(stock, {"messages": MSG, **sampling})
    assert ours.text == theirs["choices"][0]["message"]["content"]
    assert ours.finish_reason == theirs["choices"][0]["finish_reason"]
    assert ours.completion_tokens == theirs["usage"]["completion_tokens"]


def test_grpc_logprobs_and_n_give_vllms_answer(cluster, grpc_stub, stock):
    ours = grpc_stub.Generate(pb.GenerateRequest(model=MODEL, prompt="One, two, three,", sampling=pb.SamplingParams(
        temperature=0, max_tokens=4, logprobs=2)), timeout=300)
    theirs = _stock(stock, {"prompt": "One, two, three,", "max_tokens": 4, "logprobs": 2,
                            "return_tokens_as_token_ids": True, "return_token_ids": True})
    want = theirs["choices"][0]
    assert ours.text == want["text"] and list(ours.token_ids) == want["token_ids"]
    assert [t.token_id for t in ours.logprobs] == [int(t.split(":")[1]) for t in want["logprobs"]["tokens"]]
    for t, p, top in zip(ours.logprobs, want["logprobs"]["token_logprobs"], want["logprobs"]["top_logprobs"]):
        assert math.isclose(t.logprob, p, abs_tol=LOGPROB_TOL)
        assert {c.token_id for c in t.top} == {int(k.split(":")[1]) for k in top}
    # n = 2 samples (vLLM refuses n > 1 greedy): a seed fixes them, so gRPC and HTTP give the same two
    two = grpc_stub.Generate(pb.GenerateRequest(model=MODEL, prompt="One, two, three,", sampling=pb.SamplingParams(
        temperature=0.8, seed=5, max_tokens=6, n=2)), timeout=300)
    http = httpx.post(cluster.http_url + "/v1/completions", timeout=300, json={
        "model": MODEL, "prompt": "One, two, three,", "temperature": 0.8, "seed": 5, "max_tokens": 6, "n": 2}).json()
    assert len(http["choices"]) == 2 and [c.text for c in two.choices] == [c["text"] for c in http["choices"]]
    assert two.text == two.choices[0].text and two.completion_tokens == http["usage"]["completion_tokens"]
    chat = grpc_stub.Generate(_grpc_chat(MSG, sampling={"max_tokens": 6, "logprobs": 3}), timeout=300)
    theirs = _stock(stock, {"messages": MSG, "max_tokens": 6, "logprobs": True, "top_logprobs": 3,
                            "return_tokens_as_token_ids": True})
    want = theirs["choices"][0]["logprobs"]["content"]
    assert [t.token_id for t in chat.logprobs] == [int(t["token"].split(":")[1]) for t in want]
    assert all(len(t.top) == 3 for t in chat.logprobs)
    streamed = list(grpc_stub.GenerateStream(_grpc_chat(MSG, sampling={"max_tokens": 6, "logprobs": 3}), timeout=300))
    assert [t.token_id for m in streamed for t in m.logprobs] == [t.token_id for t in chat.logprobs]
    assert "".join(m.text for m in streamed) == chat.text


def test_grpc_passes_vllms_own_errors(grpc_stub, stock):
    tool = pb.Tool(name="get_weather", parameters_json="{}")
    with pytest.raises(grpc.RpcError) as e:
        grpc_stub.Generate(_grpc_chat(WEATHER, tools=[tool], tool_choice="no_such_tool"), timeout=300)
    theirs = httpx.post(stock + "/v1/chat/completions", json={
        "model": MODEL, "messages": WEATHER, "tools": [{"type": "function", "function": {"name": "get_weather",
                                                                                          "parameters": {}}}],
        "tool_choice": {"type": "function", "function": {"name": "no_such_tool"}}}, timeout=300)
    assert theirs.status_code == 400
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details() == theirs.json()["error"]["message"]
    with pytest.raises(grpc.RpcError) as e:
        list(grpc_stub.GenerateStream(_grpc_chat(MSG, sampling={"n": 2}), timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampling.n" in e.value.details()
