"""Property-based fuzzing of both front doors on the real cluster.

Hypothesis draws malformed or extreme requests (bad types, out-of-range numbers, NaN/inf, empty and
1 MB prompts, unknown fields, invalid UTF-8, deep JSON nesting, K beyond the pool's max, bad modes and
workload classes, huge stop lists, wrong paths, methods and content types, undecodable protobuf), and
a thread pool sends them over real HTTP and gRPC. The expected answer of each request comes from an
oracle built from the documented validation itself (`cluster.api.types` for the edge, `Router.plan` for the
cluster checks, and for the OpenAI bodies vLLM's own request models, since vLLM's serving layer answers
them) run in this process, so the test checks that the *server* behaves as documented:

- no crash: no 5xx (except 503/429 under load), no gRPC INTERNAL/UNKNOWN, no hang, no dropped connection;
- an invalid request gets the documented error: HTTP status + OpenAI error body whose `param` names the
  field (vLLM's error body for what vLLM refuses), gRPC INVALID_ARGUMENT/NOT_FOUND whose details name
  the field; a body vLLM's request models accept may still be refused by vLLM's later checks (400/404,
  e.g. a prompt past the context), never with a server error;
- a valid-but-extreme request gets a 200 with a bounded completion (every valid request asks for at
  most MAX_GEN_TOKENS tokens, so the 2-core machine is not swamped);
- the cluster still serves a normal request afterwards.

Run against the dev cluster: SPECSERVE_TEST_ATTACH=/tmp/dev/cluster.yaml pytest -s tests/e2e/test_fuzz.py
"""

from __future__ import annotations

import collections
import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import grpc
import httpx
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from cluster.api.openai_body import routing_view
from cluster.api.types import (MAX_PROMPT_CHARS, ApiError, ErrorCode, UpstreamError, body_too_large,
                               check_json_content_type)
from cluster.config import load_config
from cluster.speculation import WORKLOAD_CLASSES, SpecMode
from cluster.api.wire import from_proto
from deployments.router import Router
from specserve.v1 import specserve_pb2 as pb
from specserve.v1 import specserve_pb2_grpc as pb_grpc

pytestmark = pytest.mark.engine

N_HTTP = 1100  # requests per door
N_GRPC = 1100
WORKERS = 8
MAX_GEN_TOKENS = 4  # every request that passes validation asks for at most this many tokens
REQUEST_TIMEOUT_S = 90.0  # longer than this is a hang
LONG_PROMPT_CHARS = 8000  # "word " prompts at least this long exceed the 2048-token context (400 prompt)
MAX_OVERLOAD_SHARE = 0.25  # 503/429 (documented under load) allowed for at most this share of requests
SURROGATE = "\ud800"  # a lone surrogate: valid JSON ("\ud800"), not encodable as UTF-8


# -- the oracle: what the documented validation says about a request -------------------------------

@dataclass(frozen=True)
class Expect:
    ok: bool  # passes validation: 200 (or a documented 429/503 under load)
    status: int = 200  # HTTP status of the documented error
    grpc_code: str = "OK"
    field: Optional[str] = None  # what `param` / the gRPC details must name
    max_tokens: int = 0
    long_prompt: bool = False  # passes the edge; the engine refuses it (400 prompt)
    stream: bool = False
    vllm: bool = False  # an OpenAI body vLLM's request model accepts: vLLM's later checks may refuse it (400/404)
    vllm_error: bool = False  # an error answer is vLLM's own (its error body, `code` the HTTP status)
    choices: int = 1  # n


def _vllm_model(chat: bool):
    if chat:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        return ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    return CompletionRequest


def _openai_expect(router: Router, data: Any, chat: bool) -> Expect:
    """An OpenAI body: specserve's extension and limits (the router's), then vLLM's request model."""
    from pydantic import ValidationError
    from vllm.exceptions import VLLMClientError

    try:
        req, forward = routing_view(data, chat=chat)
        if req.model is not None and req.model not in router.served:
            req.model = None  # as the door does: vLLM answers that the body's model does not exist
        router.plan(req)
    except UpstreamError as e:  # refused in vLLM's error shape (a string vLLM's engine cannot take)
        return Expect(ok=False, status=e.status, vllm_error=True)
    except ApiError as e:
        return Expect(ok=False, status=e.code.http_status, grpc_code=e.code.grpc_name, field=e.field)
    try:
        vreq = _vllm_model(chat).model_validate(forward)
    except (ValidationError, VLLMClientError, ValueError, TypeError, RecursionError):
        return Expect(ok=False, status=400, vllm_error=True)
    max_tokens = (vreq.max_completion_tokens if "max_completion_tokens" in type(vreq).model_fields else None) \
        or vreq.max_tokens
    chars = len(req.prompt or "") + sum(len(m.content) for m in req.messages or [])
    return Expect(ok=True, max_tokens=max_tokens if max_tokens is not None else 10**9, long_prompt=chars >= LONG_PROMPT_CHARS,
                  stream=bool(vreq.stream), vllm=True, choices=max(int(vreq.n or 1), 1))


def _expect(router: Router, parse: Callable[[], Any]) -> Expect:
    try:
        req = parse()
        router.plan(req)
    except ApiError as e:
        return Expect(ok=False, status=e.code.http_status, grpc_code=e.code.grpc_name, field=e.field)
    chars = len(req.prompt or "") + sum(len(m.content) for m in req.messages or [])
    return Expect(ok=True, max_tokens=req.max_tokens, long_prompt=chars >= LONG_PROMPT_CHARS, stream=req.stream)


def _http_expect(router: Router, method: str, path: str, body: bytes,
                 content_type: Optional[str] = "application/json") -> Expect:
    """Mirror of Router.__call__'s dispatch, with the content type, size limit and JSON parsing the
    router documents."""
    path = path.split("?")[0].rstrip("/")
    wrong_method = Expect(ok=False, status=405, grpc_code="UNIMPLEMENTED", field="path")
    if path in ("/v1/models", "/v1/specserve/status"):
        return Expect(ok=True) if method in ("GET", "HEAD") else wrong_method
    if path in ("/v1/completions", "/v1/chat/completions") and method != "POST":
        return wrong_method
    if path in ("/v1/completions", "/v1/chat/completions"):
        def parse():
            check_json_content_type(content_type)
            if len(body) > router.config.api.limits.max_body_bytes:
                raise body_too_large(len(body), router.config.api.limits.max_body_bytes)
            try:
                return json.loads(body)
            except (ValueError, UnicodeDecodeError, RecursionError) as e:  # all are "not valid JSON"
                raise ApiError(ErrorCode.INVALID_ARGUMENT, f"body: not valid JSON ({type(e).__name__})",
                               field="body") from None
        try:
            data = parse()
        except ApiError as e:
            return Expect(ok=False, status=e.code.http_status, grpc_code=e.code.grpc_name, field=e.field)
        return _openai_expect(router, data, chat=path.endswith("chat/completions"))
    return Expect(ok=False, status=404, grpc_code="NOT_FOUND", field="path")


def _grpc_expect(router: Router, method: str, raw: bytes) -> Expect:
    if method not in ("Generate", "GenerateStream"):
        return Expect(ok=False, grpc_code="UNIMPLEMENTED")
    if len(raw) > router.config.api.limits.grpc_max_message_bytes:  # refused by grpc in the proxy
        return Expect(ok=False, grpc_code="RESOURCE_EXHAUSTED")
    try:
        msg = pb.GenerateRequest.FromString(raw)
    except DecodeError:  # invalid UTF-8 in a string field, corrupt wire format
        return Expect(ok=False, status=400, grpc_code="INVALID_ARGUMENT")
    return _expect(router, lambda: from_proto(msg))


# -- strategies --------------------------------------------------------------------------------------

def _words(n: int) -> str:
    return ("word " * n)[:max(n * 5, 1)]


# Prompt texts: empty, small, a 300-token prompt, a too-long one, the edge limit and a 1 MB one.
_PROMPT_SIZES = st.sampled_from([1, 300, 3000, MAX_PROMPT_CHARS // 5, MAX_PROMPT_CHARS // 5 + 1, (1 << 20) // 5])
_SHORT_TEXT = st.text(max_size=40)
_PROMPT_TEXT = st.one_of(_SHORT_TEXT, _PROMPT_SIZES.map(_words), st.just(SURROGATE), st.just("\x00"),
                         st.just("x" * (MAX_PROMPT_CHARS + 1)))
_JSON_SCALAR = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                         st.floats(allow_nan=True, allow_infinity=True), _SHORT_TEXT)
_JSON = st.recursive(_JSON_SCALAR, lambda c: st.lists(c, max_size=3) | st.dictionaries(_SHORT_TEXT, c, max_size=3),
                     max_leaves=8)
_NAN, _INF = float("nan"), float("inf")

_INTS = [-(2**64), -(2**63), -1, 0, 1, 2, 4, 2047, 2048, 2049, 32768, 32769, 2**31, 2**32 - 1, 2**63, 2**64, 10**30]
_WRONG = [None, True, False, "", "x", "4", "0.5", [], [1], {}, {"a": 1}, 1.5, 4.0, _NAN, _INF, -_INF]
_MODES = [m.value for m in SpecMode] + ["", "NGRAM", "warp", "auto", SURROGATE]
_CLASSES = list(WORKLOAD_CLASSES) + ["", "CHAT", "chatt", "x" * 1000, SURROGATE, "\x00"]
_REQUEST_IDS = ["", "ok-1", "fuzz-dup", "a" * 128, "a" * 129, "bad id", "ü", "../etc", SURROGATE]
_STOPS = [[], [""], ["a" * 128], ["a" * 129], ["s"] * 8, ["s"] * 9, ["s"] * 10_000, [SURROGATE], ["é𝄞"], ["\n"]]

_KNOWN_HTTP = {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
               "stop", "logprobs", "top_logprobs", "stream", "ignore_eos", "n", "specserve"}
_OPENAI_IGNORED = ["user", "frequency_penalty", "presence_penalty", "logit_bias", "tools", "response_format",
                   "stream_options", "metadata", "echo", "best_of", "suffix"]


def _value(ints: bool = True, extra: tuple = ()):
    return st.sampled_from((_INTS if ints else []) + _WRONG + list(extra))


def _speculative():
    spec = st.fixed_dictionaries({"mode": st.sampled_from(_MODES)},
                                 optional={"k": _value(extra=(-1, 3, 5, 6, 7, 16, 17)), "extra": _JSON})
    return st.one_of(spec, _value(ints=False, extra=("ngram",)))


def _messages():
    role = st.sampled_from(["user", "system", "assistant", "robot", "", "USER", 5, None])
    content = st.one_of(_PROMPT_TEXT, _value(ints=False))
    msg = st.fixed_dictionaries({"role": role, "content": content}, optional={"name": _SHORT_TEXT})
    good = st.builds(lambda t: [{"role": "user", "content": t}], _SHORT_TEXT.filter(bool))
    return st.one_of(
        good, st.lists(msg, max_size=4), st.just([{"role": "user", "content": "hi"}] * 257),
        st.just([{"role": "user", "content": "hi"}] * 20), st.just([{"role": "user"}]),
        st.just([["user", "hi"]]), _value(ints=False),
    )


def _http_mutations(chat: bool):
    """(name, strategy of (key, value)) pairs; a value of `_DROP` deletes the key."""
    m = [
        ("max_tokens", _value(extra=(-1, 3)).map(lambda v: ("max_tokens", v))),
        ("max_completion_tokens", _value().map(lambda v: ("max_completion_tokens", v))),
        ("temperature", _value(extra=(-0.0, 2.0, 2.0000001, 1e308, 1e-320, -1.0)).map(lambda v: ("temperature", v))),
        ("top_p", _value(extra=(1e-300, 1.0000001, -0.0)).map(lambda v: ("top_p", v))),
        ("seed", _value(extra=(-(2**63) - 1, 2**63 - 1)).map(lambda v: ("seed", v))),
        ("stop", st.one_of(st.sampled_from(_STOPS), _value(ints=False)).map(lambda v: ("stop", v))),
        ("logprobs", _value(extra=(5, 6, -1)).map(lambda v: ("logprobs", v))),
        ("top_logprobs", _value(extra=(5, 6, -1)).map(lambda v: ("top_logprobs", v))),
        ("n", _value(extra=(1, 2, "1")).map(lambda v: ("n", v))),
        ("model", st.sampled_from(["", "smollm2-135m", "nope", "x" * 300, SURROGATE, 5, None, []])
         .map(lambda v: ("model", v))),
        ("stream", _value(ints=False, extra=(True, "yes", 1)).map(lambda v: ("stream", v))),
        ("ignore_eos", _value(ints=False).map(lambda v: ("ignore_eos", v))),
        ("unknown", st.tuples(st.one_of(_SHORT_TEXT.filter(lambda k: k not in _KNOWN_HTTP), st.just(SURROGATE)),
                              _JSON)),
        ("openai_ignored", st.tuples(st.sampled_from(_OPENAI_IGNORED), _JSON)),
        ("specserve", st.one_of(
            _value(ints=False),
            st.fixed_dictionaries({}, optional={
                "workload_class": st.sampled_from(_CLASSES), "speculative": _speculative(),
                "request_id": st.sampled_from(_REQUEST_IDS), "foo": _JSON})).map(lambda v: ("specserve", v))),
        ("drop_input", st.just(("messages" if chat else "prompt", _DROP))),
        ("wrong_input", st.just(("prompt", "hi") if chat else ("messages", [{"role": "user", "content": "hi"}]))),
    ]
    if chat:
        m.append(("messages", _messages().map(lambda v: ("messages", v))))
    else:
        prompt = st.one_of(_PROMPT_TEXT, _value(ints=False), st.sampled_from([["hi"], ["a", "b"], [1], [], [[1, 2]]]))
        m.append(("prompt", prompt.map(lambda v: ("prompt", v))))
    return m


_DROP = object()
_HTTP_MUTATIONS = {chat: _http_mutations(chat) for chat in (False, True)}
_NEST = {"array": (b"[", b"]"), "object": (b'{"a":', b"}")}
_CONTENT_TYPES = ["application/json", "text/plain", "application/x-www-form-urlencoded",
                  "multipart/form-data; boundary=x", "application/json; charset=latin-1", "", "application/xml"]
_BAD_UTF8 = [b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\xc0\xaf", b"\x80", b"\xf4\x90\x80\x80"]


@dataclass
class HttpCase:
    label: str
    method: str
    path: str
    body: bytes
    content_type: Optional[str] = "application/json"
    expect: Optional[Expect] = None

    def __repr__(self) -> str:
        b = self.body if len(self.body) <= 300 else self.body[:300] + b"...(%d bytes)" % len(self.body)
        return f"HttpCase({self.label}: {self.method} {self.path} ct={self.content_type!r} body={b!r})"


def _dumps(body: Any) -> bytes:
    return json.dumps(body, allow_nan=True).encode()


# Valid requests are the costly ones (~0.1 s of the shared CPU per token): mostly one token.
_BASE_MAX_TOKENS = st.sampled_from([1] * 6 + [2, MAX_GEN_TOKENS])


def _base_body(draw, chat: bool) -> dict:
    body: dict[str, Any] = {"max_tokens": draw(_BASE_MAX_TOKENS), "temperature": 0}
    if chat:
        body["messages"] = [{"role": "user", "content": draw(st.sampled_from(["hi", "Say hi.", "2+2="]))}]
    else:
        body["prompt"] = draw(st.sampled_from(["hi", "The capital of France is", "def f():"]))
    return body


@st.composite
def http_cases(draw) -> HttpCase:
    chat = draw(st.booleans())
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = _base_body(draw, chat)
    kind = draw(st.sampled_from(["fields"] * 6 + ["raw", "nesting", "bad_utf8", "content_type", "route"]))
    if kind == "fields":
        muts = draw(st.lists(st.sampled_from(_HTTP_MUTATIONS[chat]), min_size=1, max_size=3))
        for _, strat in muts:
            key, value = draw(strat)
            if value is _DROP:
                body.pop(key, None)
            else:
                body[key] = value
        return HttpCase("+".join(n for n, _ in muts), "POST", path, _dumps(body))
    if kind == "raw":  # bodies that are not a JSON object, or not JSON at all
        raw = draw(st.sampled_from([b"", b"[]", b"1", b'"s"', b"null", b"true", b"[{}]", b"{", b"{'a':1}",
                                    b'{"prompt": }', b"{}x", b'{"prompt":"hi","max_tokens":' + b"9" * 5000 + b"}",
                                    b"prompt=hi&max_tokens=2", b"\xef\xbb\xbf" + _dumps(body),
                                    _dumps(body).decode().encode("utf-16"), b"\x00" * 16]))
        return HttpCase("raw", "POST", path, raw)
    if kind == "nesting":  # deeply nested JSON at the top or inside an (unknown) field
        depth = draw(st.sampled_from([10, 100, 500, 1000, 3000, 100_000]))
        left, right = _NEST[draw(st.sampled_from(sorted(_NEST)))]
        nest = left * depth + b"1" + right * depth
        if draw(st.booleans()):
            return HttpCase(f"nesting_top_{depth}", "POST", path, nest)
        key = draw(st.sampled_from(["x", "stop", "specserve", "messages" if chat else "prompt"]))
        return HttpCase(f"nesting_{key}_{depth}", "POST", path, _dumps(body)[:-1] + b', "' + key.encode() + b'": '
                        + nest + b"}")
    if kind == "bad_utf8":  # invalid UTF-8 bytes inside a string value or a key
        raw = _dumps(body)
        bad = draw(st.sampled_from(_BAD_UTF8))
        where = draw(st.sampled_from([b'"hi', b'"Say', b'"2+2', b'"The', b'"def', b'"max_tokens', b'"temperature']))
        at = raw.find(where)
        at = raw.find(b'"') if at < 0 else at
        return HttpCase("bad_utf8", "POST", path, raw[:at + 1] + bad + raw[at + 1:])
    if kind == "content_type":
        return HttpCase("content_type", "POST", path, _dumps(body), content_type=draw(st.sampled_from(_CONTENT_TYPES)))
    method = draw(st.sampled_from(["GET", "PUT", "DELETE", "PATCH", "POST", "HEAD"]))
    route = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/COMPLETIONS",
                                  "/v1/completions/", "/v1/completions?x=1", "/v2/completions", "/",
                                  "/v1/specserve/status", "/v1/nope", "/v1/chat/completions/extra"]))
    return HttpCase("route", method, route, _dumps(body) if method in ("POST", "PUT", "PATCH") else b"")


@dataclass
class GrpcCase:
    label: str
    method: str  # Generate | GenerateStream | an unknown one
    raw: bytes
    expect: Optional[Expect] = None

    def __repr__(self) -> str:
        r = self.raw if len(self.raw) <= 300 else self.raw[:300] + b"...(%d bytes)" % len(self.raw)
        return f"GrpcCase({self.label}: {self.method} raw={r!r})"


_U32 = [0, 1, 3, 4, 5, 6, 7, 16, 17, 2047, 2048, 2049, 32768, 32769, 2**31, 2**32 - 1]
_F32 = [_NAN, _INF, -_INF, -0.0, -1.0, 0.0, 1e-45, 0.5, 1.0, 1.01, 2.0, 2.01, 3.4e38]
_PROTO_TEXT = st.one_of(*[_PROMPT_TEXT.filter(lambda s: SURROGATE not in s)] * 6, st.just(""), st.just("x" * (3 << 20)))


def _grpc_mutations():
    def sampling(name, values):
        return st.sampled_from(values).map(lambda v: lambda m: setattr(m.sampling, name, v))

    def set_(name, values):
        return st.sampled_from(values).map(lambda v: lambda m: setattr(m, name, v))

    def spec(mode, k):
        def apply(m):
            m.speculative.mode = mode
            if k is not None:
                m.speculative.k = k
        return apply

    def messages(msgs):
        def apply(m):
            del m.messages[:]
            m.messages.extend(pb.ChatMessage(role=r, content=c) for r, c in msgs)
        return apply

    role = st.sampled_from(["user", "system", "assistant", "robot", ""])
    return [
        ("max_tokens", sampling("max_tokens", _U32)),
        ("temperature", sampling("temperature", _F32)),
        ("top_p", sampling("top_p", _F32)),
        ("seed", sampling("seed", [-(2**63), -1, 0, 2**63 - 1])),
        ("logprobs", sampling("logprobs", [0, 5, 6, 2**32 - 1])),
        ("stop", st.sampled_from([s for s in _STOPS if SURROGATE not in s[:1]])
         .map(lambda v: lambda m: m.sampling.stop.extend(v))),
        ("workload_class", set_("workload_class", [c for c in _CLASSES if c != SURROGATE])),
        ("request_id", set_("request_id", [r for r in _REQUEST_IDS if r != SURROGATE])),
        ("model", set_("model", ["", "smollm2-135m", "nope", "x" * 300])),
        ("speculative", st.builds(spec, st.sampled_from([m for m in _MODES if m != SURROGATE]),
                                  st.one_of(st.none(), st.sampled_from(_U32)))),
        ("prompt", _PROTO_TEXT.map(lambda v: lambda m: (m.ClearField("messages"), setattr(m, "prompt", v)))),
        ("prompt_and_messages", st.just(lambda m: (setattr(m, "prompt", "hi"),
                                                   m.messages.add(role="user", content="hi")))),
        ("messages", st.one_of(
            st.lists(st.tuples(role, _PROTO_TEXT), max_size=3),
            st.just([("user", "hi")] * 257), st.just([("user", "hi")] * 20),
        ).map(lambda msgs: lambda m: (setattr(m, "prompt", ""), messages(msgs)(m)))),
    ]


_GRPC_MUTATIONS = _grpc_mutations()


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


@st.composite
def grpc_cases(draw) -> GrpcCase:
    msg = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=draw(_BASE_MAX_TOKENS),
                                                        temperature=0.0))
    if draw(st.booleans()):
        msg.prompt = draw(st.sampled_from(["hi", "The capital of France is", "def f():"]))
    else:
        msg.messages.add(role="user", content=draw(st.sampled_from(["hi", "Say hi.", "2+2="])))
    method = draw(st.sampled_from(["Generate"] * 3 + ["GenerateStream"]))
    kind = draw(st.sampled_from(["fields"] * 6 + ["bad_utf8", "unknown_field", "corrupt", "method"]))
    if kind == "fields":
        muts = draw(st.lists(st.sampled_from(_GRPC_MUTATIONS), min_size=1, max_size=3))
        for _, strat in muts:
            draw(strat)(msg)
        return GrpcCase("+".join(n for n, _ in muts), method, msg.SerializeToString())
    if kind == "bad_utf8":  # hand-made bytes: invalid UTF-8 inside a string field
        target = draw(st.sampled_from(["prompt", "content", "role", "workload_class", "request_id", "model", "stop",
                                       "mode"]))
        marker = "MARKERZZ"
        if target == "prompt":
            msg.ClearField("messages")
            msg.prompt = marker
        elif target in ("content", "role"):
            msg.prompt = ""
            del msg.messages[:]
            msg.messages.add(role=marker if target == "role" else "user",
                             content=marker if target == "content" else "hi")
        elif target == "stop":
            msg.sampling.stop.append(marker)
        elif target == "mode":
            msg.speculative.mode = marker
        else:
            setattr(msg, target, marker)
        bad = draw(st.sampled_from(_BAD_UTF8))
        raw = msg.SerializeToString().replace(marker.encode(), (b"ab" + bad).ljust(len(marker), b"c"))
        return GrpcCase(f"bad_utf8_{target}", method, raw)
    raw = msg.SerializeToString()
    if kind == "unknown_field":  # proto3 keeps unknown fields: the request stays valid
        number = draw(st.sampled_from([8, 99, 1000, 2**29 - 1]))
        value = draw(st.sampled_from([(0, _varint(7)), (2, _varint(3) + b"abc"), (5, b"\x00\x00\x80\x7f")]))
        return GrpcCase("unknown_field", method, raw + _varint(number << 3 | value[0]) + value[1])
    if kind == "corrupt":
        raw = draw(st.sampled_from([raw[:-1], raw[:3], b"\xff" * 8, raw + b"\x0a\xff\xff\xff\xff\x0f", b"\x12\x05ab",
                                    b"", b"\x00", raw + b"\x07"]))
        return GrpcCase("corrupt", method, raw)
    return GrpcCase("method", draw(st.sampled_from(["Nope", "generate", "ListModels2"])), raw)


# Reproducers of what the fuzzing found, always sent (hypothesis may or may not draw them).
_PINNED_HTTP = [
    HttpCase("pinned_stop_surrogate", "POST", "/v1/completions", b'{"prompt":"hi","max_tokens":1,"stop":["\\ud800"]}'),
    HttpCase("pinned_nesting_top", "POST", "/v1/completions", b"[" * 100_000 + b"]" * 100_000),
    HttpCase("pinned_nesting_field", "POST", "/v1/completions",
             b'{"prompt":"hi","max_tokens":1,"x":' + b"[" * 3000 + b"]" * 3000 + b"}"),
    HttpCase("pinned_surrogate_key", "POST", "/v1/completions", b'{"prompt":"hi","max_tokens":1,"\\ud800":1}'),
    HttpCase("pinned_no_input", "POST", "/v1/completions", b'{"max_tokens":1}'),
]
_PINNED_GRPC = [
    GrpcCase("pinned_bad_utf8_prompt", "Generate", b"\x12\x03h\xffi\x22\x02\x08\x01"),
    GrpcCase("pinned_corrupt", "Generate", b"\xff" * 8),
]


def _collect(strategy, n: int) -> list:
    """n examples of `strategy`, deterministically (no database, a fixed derandomized seed)."""
    out: list = []

    @settings(max_examples=n, deadline=None, derandomize=True, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(case):
        out.append(case)

    collect()
    return out


# -- sending and judging -----------------------------------------------------------------------------

@dataclass(repr=False)
class Tally:
    door: str
    statuses: collections.Counter = field(default_factory=collections.Counter)
    labels: collections.Counter = field(default_factory=collections.Counter)
    failures: list = field(default_factory=list)
    overloaded: int = 0
    retries: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def note(self, case, status: str, problem: Optional[str]) -> None:
        with self.lock:
            self.statuses[status] += 1
            if problem:
                self.labels[re.sub(r"req-[0-9a-f]+", "req-…", problem)[:100]] += 1
                self.failures.append(f"{problem}\n    case: {case!r}\n    expected: {case.expect}")

    def report(self, seconds: float) -> str:
        lines = [f"[fuzz {self.door}] {sum(self.statuses.values())} requests in {seconds:.1f} s, "
                 f"{len(self.failures)} failed, {self.overloaded} overloaded (429/503), {self.retries} retried"]
        lines.append("  statuses: " + ", ".join(f"{k}={v}" for k, v in sorted(self.statuses.items())))
        for kind, n in self.labels.most_common():
            lines.append(f"  {n:4d} x {kind}")
            examples = [f for f in self.failures if re.sub(r"req-[0-9a-f]+", "req-…", f).startswith(kind)][:2]
            lines.extend("       FAIL " + f for f in examples)
        return "\n".join(lines)


def _wait_up(url: str, timeout_s: float = 180.0) -> None:
    """The lead may restart the dev cluster: wait for it instead of failing on a refused connection."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/v1/models", timeout=10).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"cluster at {url} not serving for {timeout_s} s")
        time.sleep(2)


def _check_http_ok(r: httpx.Response, e: Expect) -> Optional[str]:
    if r.request.method != "POST":
        return None if r.status_code == 200 else f"HTTP {r.status_code}"
    bound = e.max_tokens * e.choices
    if not e.stream:
        b = r.json()
        done = b["usage"]["completion_tokens"]
        first = len(b["specserve"]["token_ids"])
        if not (all(c["finish_reason"] in ("stop", "length", "tool_calls") for c in b["choices"])
                and done <= bound and 0 < first <= e.max_tokens):
            return f"unbounded or malformed completion: {r.text[:300]}"
        return None
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return f"stream without [DONE]: {r.text[-300:]!r}"
    chunks = [json.loads(x) for x in events[:-1]]
    if any("error" in c for c in chunks):
        return f"error event in a 200 stream: {r.text[-300:]!r}"
    finished = [c for ch in chunks for c in ch.get("choices") or [] if c.get("finish_reason")]
    if len(finished) != e.choices or "specserve" not in chunks[-1] \
            or chunks[-1]["specserve"]["steps"] > bound:
        return f"unfinished stream or no specserve object: {r.text[-300:]!r}"
    return None


def _judge_http(r: httpx.Response, e: Expect) -> tuple[str, Optional[str]]:
    status = str(r.status_code)
    if r.status_code in (429, 503):
        return status, None
    if r.status_code >= 500:
        return status, f"HTTP {r.status_code} (server error): {r.text[:300]}"
    if e.ok and e.vllm and r.status_code in (400, 404):  # vLLM's later checks (context length, model, ...)
        e = Expect(ok=False, status=r.status_code, vllm_error=True)
    if e.ok and e.long_prompt:
        e = Expect(ok=False, status=400, field="prompt")
    if e.ok:
        return status, None if r.status_code == 200 else f"HTTP {r.status_code} for a valid request: {r.text[:300]}"
    if r.status_code != e.status:
        return status, f"HTTP {r.status_code}, expected {e.status}: {r.text[:300]}"
    if r.request.method == "HEAD":
        return status, None
    try:
        err = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return status, f"HTTP {r.status_code} without an OpenAI error body: {r.text[:300]}"
    if e.vllm_error:  # vLLM's error body: `code` is the HTTP status, the message says what was wrong
        ok = err.get("code") == r.status_code and isinstance(err.get("message"), str) and err["message"]
        return status, None if ok else f"not vLLM's error body for HTTP {r.status_code}: {err}"
    name = str(err.get("code", "")).upper()
    code = ErrorCode[name] if name in ErrorCode.__members__ else None
    if code is None or code.http_status != r.status_code or err.get("type") != code.openai_type:
        return status, f"error body inconsistent with HTTP {r.status_code}: {err}"
    if err.get("param") is None:
        return status, f"error `param` does not name the field: {err}"
    if e.field is not None and err["param"] != e.field:
        return status, f"error `param` is {err['param']!r}, expected {e.field!r}: {err}"
    return status, None


def _send_http(client_of: Callable[[], httpx.Client], url: str, case: HttpCase, tally: Tally) -> None:
    headers = {"content-type": case.content_type} if case.content_type else {}
    for attempt in range(3):
        t0 = time.monotonic()
        try:
            r = client_of().request(case.method, url + case.path, content=case.body, headers=headers,
                                    timeout=REQUEST_TIMEOUT_S)
        except httpx.ConnectError:  # the cluster is down (restarted by the lead): wait, retry
            with tally.lock:
                tally.retries += 1
            _wait_up(url)
            continue
        except httpx.TimeoutException:
            tally.note(case, "timeout", f"no answer within {time.monotonic() - t0:.0f} s (hang)")
            return
        except httpx.TransportError as exc:
            tally.note(case, "dropped", f"connection dropped: {type(exc).__name__}: {exc}")
            return
        status, problem = _judge_http(r, case.expect)
        if problem is None and r.status_code == 200:
            try:
                problem = _check_http_ok(r, case.expect)
            except (ValueError, KeyError, IndexError, TypeError) as exc:
                problem = f"malformed 200 answer ({type(exc).__name__}: {exc}): {r.text[:300]}"
        if r.status_code in (429, 503):
            with tally.lock:
                tally.overloaded += 1
        tally.note(case, status, problem)
        return
    tally.note(case, "unreachable", "cluster unreachable after 3 attempts")


def _judge_grpc(code: grpc.StatusCode, details: str, e: Expect, replies: list) -> Optional[str]:
    if code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE) and e.ok:
        return None
    if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
        return f"gRPC {code.name} (server error): {details[:300]}"
    if e.ok and e.long_prompt:
        e = Expect(ok=False, grpc_code="INVALID_ARGUMENT", field="prompt")
    if e.ok:
        if code != grpc.StatusCode.OK:
            return f"gRPC {code.name} for a valid request: {details[:300]}"
        msgs = replies
        tokens = sum(len(m.token_ids) for m in msgs)
        last = msgs[-1] if msgs else None
        if last is None or last.finish_reason not in ("stop", "length") or tokens > e.max_tokens \
                or last.completion_tokens != tokens:
            return f"unbounded or malformed completion ({tokens} tokens): {msgs[-1:]}"
        return None
    if code.name != e.grpc_code:
        return f"gRPC {code.name}, expected {e.grpc_code}: {details[:300]}"
    if e.field is not None and e.field not in details:
        return f"gRPC details do not name {e.field!r}: {details[:300]}"
    return None


def _send_grpc(channel: grpc.Channel, url: str, case: GrpcCase, tally: Tally) -> None:
    path = f"/specserve.v1.SpecServe/{case.method}"
    streaming = case.method == "GenerateStream"
    for attempt in range(3):
        replies: list = []
        t0 = time.monotonic()
        try:
            if streaming:
                call = channel.unary_stream(path, request_serializer=None, response_deserializer=None)
                replies = [pb.GenerateStreamResponse.FromString(x) for x in call(case.raw, timeout=REQUEST_TIMEOUT_S)]
            else:
                call = channel.unary_unary(path, request_serializer=None, response_deserializer=None)
                replies = [pb.GenerateResponse.FromString(call(case.raw, timeout=REQUEST_TIMEOUT_S))]
            code, details = grpc.StatusCode.OK, ""
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details() or ""
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            tally.note(case, code.name, f"no answer within {time.monotonic() - t0:.0f} s (hang)")
            return
        if code == grpc.StatusCode.UNAVAILABLE and ("connect" in details.lower() or "socket" in details.lower()):
            with tally.lock:
                tally.retries += 1
            _wait_up(url)
            continue
        problem = _judge_grpc(code, details, case.expect, replies)
        if code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE):
            with tally.lock:
                tally.overloaded += 1
        tally.note(case, code.name, problem)
        return
    tally.note(case, "unreachable", "cluster unreachable after 3 attempts")


def _finish(tally: Tally, seconds: float, n: int) -> None:
    print("\n" + tally.report(seconds))
    answered = sum(tally.statuses.values())
    assert answered >= n, f"only {answered} of {n} requests were sent"
    assert tally.overloaded <= MAX_OVERLOAD_SHARE * n, f"{tally.overloaded} of {n} refused as overloaded: cannot judge"
    if tally.failures:
        pytest.fail(f"{len(tally.failures)} of {n} fuzzed {tally.door} requests were not answered as documented "
                    f"(summary above with -s); first:\n{tally.failures[0]}", pytrace=False)


# -- the tests ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def oracle(cluster) -> Router:
    """A Router without engines: runs the documented validation and routing checks in this process."""
    return Router(load_config(cluster.config_path), engines={})


@pytest.fixture(scope="module")
def channel(cluster):
    ch = grpc.insecure_channel(cluster.grpc_target, options=[("grpc.max_send_message_length", 16 << 20)])
    grpc.channel_ready_future(ch).result(timeout=60)
    yield ch
    ch.close()


def _clamp_http(case: HttpCase, oracle: Router) -> HttpCase:
    """A request that passes validation must ask for at most MAX_GEN_TOKENS tokens (the 2-core budget)."""
    case.expect = _http_expect(oracle, case.method, case.path, case.body, case.content_type)
    if case.expect.ok and case.expect.vllm and (case.expect.max_tokens > MAX_GEN_TOKENS or case.expect.choices > 2):
        body = json.loads(case.body)
        body.pop("max_completion_tokens", None)
        body.pop("n", None)
        body["max_tokens"] = 1
        case.body, case.label = _dumps(body), case.label + "+clamped"
        case.expect = _http_expect(oracle, case.method, case.path, case.body, case.content_type)
    return case


def _clamp_grpc(case: GrpcCase, oracle: Router) -> GrpcCase:
    case.expect = _grpc_expect(oracle, case.method, case.raw)
    if case.expect.ok and case.expect.max_tokens > MAX_GEN_TOKENS:
        msg = pb.GenerateRequest.FromString(case.raw)
        msg.sampling.max_tokens = 1
        case.raw, case.label = msg.SerializeToString(), case.label + "+clamped"
        case.expect = _grpc_expect(oracle, case.method, case.raw)
    return case


def test_fuzz_http(cluster, oracle):
    _wait_up(cluster.http_url)
    cases = [_clamp_http(c, oracle) for c in _PINNED_HTTP + _collect(http_cases(), N_HTTP)]
    assert len(cases) >= 1000
    valid = sum(c.expect.ok for c in cases)
    print(f"\n[fuzz http] {len(cases)} cases, {valid} valid by the documented rules")
    local = threading.local()

    def client() -> httpx.Client:
        if not hasattr(local, "client"):
            local.client = httpx.Client()
        return local.client

    tally = Tally("http")
    t0 = time.monotonic()
    with ThreadPoolExecutor(WORKERS) as pool:
        list(pool.map(lambda c: _send_http(client, cluster.http_url, c, tally), cases))
    _finish(tally, time.monotonic() - t0, len(cases))


def test_fuzz_grpc(cluster, oracle, channel):
    _wait_up(cluster.http_url)
    cases = [_clamp_grpc(c, oracle) for c in _PINNED_GRPC + _collect(grpc_cases(), N_GRPC)]
    assert len(cases) >= 1000
    valid = sum(c.expect.ok for c in cases)
    print(f"\n[fuzz grpc] {len(cases)} cases, {valid} valid by the documented rules")
    tally = Tally("grpc")
    t0 = time.monotonic()
    with ThreadPoolExecutor(WORKERS) as pool:
        list(pool.map(lambda c: _send_grpc(channel, cluster.http_url, c, tally), cases))
    _finish(tally, time.monotonic() - t0, len(cases))


def test_cluster_serves_after_fuzz(cluster, channel):
    """Runs last: whatever the fuzzing did, a normal request still gets a normal answer on both doors."""
    _wait_up(cluster.http_url, timeout_s=60)
    r = httpx.post(f"{cluster.http_url}/v1/chat/completions", timeout=120,
                   json={"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": MAX_GEN_TOKENS,
                         "temperature": 0})
    assert r.status_code == 200, r.text
    assert 0 < r.json()["usage"]["completion_tokens"] <= MAX_GEN_TOKENS
    reply = pb_grpc.SpecServeStub(channel).Generate(
        pb.GenerateRequest(prompt="The capital of France is", sampling=pb.SamplingParams(max_tokens=MAX_GEN_TOKENS)),
        timeout=120)
    assert reply.finish_reason in ("stop", "length") and 0 < reply.completion_tokens <= MAX_GEN_TOKENS
    status = httpx.get(f"{cluster.http_url}/v1/specserve/status", timeout=30).json()
    assert all("engine" in p for p in status["pools"].values()), status
