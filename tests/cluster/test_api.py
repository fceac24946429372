import pytest

from cluster.api.openai_body import routing_view
from cluster.api.types import ApiError, ErrorCode, parse_request


def bad(body, chat=True):
    with pytest.raises(ApiError) as e:
        routing_view(body, chat=chat)
    assert e.value.code == ErrorCode.INVALID_ARGUMENT
    return e.value


MSG = [{"role": "user", "content": "hi"}]


def test_chat_request_with_extension():
    r, fwd = routing_view({"model": "m", "messages": MSG, "max_tokens": 5, "stop": "x", "stream": True, "n": 2,
                           "logprobs": True, "top_logprobs": 2, "temperature": 0,
                           "specserve": {"workload_class": "code", "speculative": {"mode": "ngram", "k": 3},
                                         "request_id": "abc-1"}}, chat=True)
    assert r.model == "m" and r.stream and r.temperature == 0.0 and r.messages[0].content == "hi"
    assert r.workload_class == "code" and r.speculative.mode == "ngram" and r.speculative.k == 3
    assert r.request_id == "abc-1"
    # vLLM gets the body as it came, without specserve's extension: every OpenAI field is vLLM's to judge
    assert fwd == {"model": "m", "messages": MSG, "max_tokens": 5, "stop": "x", "stream": True, "n": 2,
                   "logprobs": True, "top_logprobs": 2, "temperature": 0}


def test_completion_request_and_content_parts():
    r, _ = routing_view({"prompt": ["hello"], "max_tokens": 3, "logprobs": 1}, chat=False)
    assert r.prompt == "hello" and r.temperature == 1.0  # OpenAI's default temperature, as vLLM applies it
    r, _ = routing_view({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                   {"type": "text", "text": "b"}]}]}, chat=True)
    assert r.messages[0].content == "a\nb"


def test_a_format_or_tools_make_the_request_structured():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    for extra in ({"response_format": {"type": "json_object"}}, {"tools": tools},
                  {"structured_outputs": {"choice": ["a", "b"]}}):
        assert routing_view({"messages": MSG, **extra}, chat=True)[0].format_class == "structured"
    assert routing_view({"messages": MSG, "tools": tools, "tool_choice": "none"}, chat=True)[0].format_class is None


@pytest.mark.parametrize("body", [{"messages": "x"}, {"messages": [1, None]}, {"prompt": 7}, {"prompt": [1, 2]},
                                  {"messages": MSG, "temperature": "hot", "stream": "maybe", "model": 3}])
def test_shapes_vllm_refuses_pass_through_for_vllm_to_name(body):
    req, fwd = routing_view(body, chat="messages" in body)
    assert fwd == body and not req.stream


@pytest.mark.parametrize(
    "body, field",
    [({"messages": MSG, "specserve": {"speculative": {"mode": "warp"}}}, "speculative.mode"),
     ({"messages": MSG, "specserve": {"speculative": {"mode": "ngram", "k": 99}}}, "speculative.k"),
     ({"messages": MSG, "specserve": {"speculative": {"mode": "ngram", "k": 2, "k_grow": -1}}}, "speculative.k_grow"),
     ({"messages": MSG, "specserve": {"speculative": {"mode": "ngram", "k": 2, "k_grow": 17}}}, "speculative.k_grow"),
     ({"messages": MSG, "specserve": {"workload_class": "poetry"}}, "workload_class"),
     ({"messages": MSG, "specserve": {"request_id": "has space"}}, "request_id"),
     ({"messages": MSG, "specserve": {"bogus": 1}}, "specserve"),
     ({"messages": MSG, "specserve": 3}, "specserve")],
)
def test_bad_extension_fields_are_named(body, field):
    assert field in (bad(body).field or "")


def test_prompt_and_body_shape():
    assert bad("not a dict").field == "body"
    with pytest.raises(ApiError):
        parse_request({"prompt": "", "max_tokens": 1})
    with pytest.raises(ApiError):
        parse_request({"prompt": "a", "messages": MSG})
    with pytest.raises(ApiError) as e:
        parse_request({"prompt": "x" * (256 * 1024 + 1)})
    assert e.value.field == "prompt"


def test_request_ids_are_generated_and_unguessable():
    a, b = parse_request({"prompt": "x"}), parse_request({"prompt": "x"})
    ra, rb = a.ensure_request_id(), b.ensure_request_id()
    assert ra != rb and len(ra) >= 20


def test_k_grow_is_refused_naming_the_field_on_http_and_grpc():
    """A K is the caller's, fixed, or the engine's per step: a request that asks for K growth is
    refused by name, never served as if it had not asked."""
    from cluster.api.wire import from_proto
    from specserve.v1 import specserve_pb2 as pb

    with pytest.raises(ApiError) as e:
        from_proto(pb.GenerateRequest(prompt="x", speculative=pb.SpeculativeOverride(mode="ngram", k=2, k_grow=2)))
    assert e.value.field == "speculative.k_grow"
    with pytest.raises(ApiError) as e:
        routing_view({"model": "m", "messages": MSG, "specserve": {"speculative": {"mode": "ngram", "k": 2, "k_grow": 0}}},
                     chat=True)
    assert "k_grow" in (e.value.field or "") + str(e.value)
    assert from_proto(pb.GenerateRequest(prompt="x", speculative=pb.SpeculativeOverride(mode="ngram", k=2))).speculative.k == 2


# -- size limits and content types (api.limits) --------------------------------------------------------

def test_total_prompt_size_counts_every_message():
    from cluster.api.types import check_prompt_size

    req = routing_view({"messages": [{"role": "user", "content": "x" * 1000}] * 10}, chat=True)[0]
    check_prompt_size(req, 10_000)
    with pytest.raises(ApiError) as e:
        check_prompt_size(req, 9_999)
    assert e.value.code is ErrorCode.REQUEST_TOO_LARGE and e.value.field == "messages"
    assert e.value.code.http_status == 413 and e.value.code.grpc_name == "INVALID_ARGUMENT"
    assert "10000 characters" in e.value.message and "api.limits.max_prompt_chars" in e.value.message
    assert e.value.to_openai()["error"]["code"] == "request_too_large"
    with pytest.raises(ApiError) as e:
        check_prompt_size(routing_view({"prompt": "abc"}, chat=False)[0], 2)
    assert e.value.field == "prompt"


@pytest.mark.parametrize("header", ["application/json", "Application/JSON", "application/json; charset=utf-8",
                                    'application/json;charset="UTF-8"', "application/json ; charset=utf8"])
def test_json_content_types_pass(header):
    from cluster.api.types import check_json_content_type

    check_json_content_type(header)


@pytest.mark.parametrize("header", [None, "", "text/plain", "text/plain; charset=utf-8", "application/x-www-form-urlencoded",
                                    "multipart/form-data; boundary=x", "application/json; charset=latin-1",
                                    "application/xml", "application/jsonx", "text/json"])
def test_other_content_types_are_415(header):
    from cluster.api.types import check_json_content_type

    with pytest.raises(ApiError) as e:
        check_json_content_type(header)
    assert e.value.code is ErrorCode.UNSUPPORTED_MEDIA_TYPE and e.value.code.http_status == 415
    assert e.value.field == "content-type" and "application/json" in e.value.message


def test_error_codes_keep_their_openai_names():
    assert {c.name.lower() for c in ErrorCode} >= {"invalid_argument", "resource_exhausted", "unavailable"}
    assert ApiError(ErrorCode.INVALID_ARGUMENT, "x").to_openai()["error"]["code"] == "invalid_argument"


def test_more_messages_than_the_bound_are_refused_naming_them():
    from cluster.api.types import MAX_MESSAGES

    assert bad({"messages": MSG * (MAX_MESSAGES + 1)}).field == "messages"
    assert len(routing_view({"messages": MSG * MAX_MESSAGES}, chat=True)[0].messages) == MAX_MESSAGES


def test_a_lone_surrogate_in_a_string_vllm_hands_its_engine_is_refused_in_vllms_shape():
    from cluster.api.types import UpstreamError

    with pytest.raises(UpstreamError) as e:
        routing_view({"messages": MSG, "stop": ["ok", "\ud800"]}, chat=True)
    assert e.value.status == 400 and e.value.to_openai()["error"]["param"] == "stop"
    assert e.value.to_openai()["error"]["code"] == 400  # vLLM's error body: the code is the HTTP status
    routing_view({"messages": [{"role": "user", "content": "\ud800"}]}, chat=True)  # a prompt is vLLM's to take
