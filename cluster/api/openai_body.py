"""What the router reads of an OpenAI request body before vLLM's serving layer gets it.

The body itself is vLLM's to validate and answer (`deployments.vllm_openai`): the router never
refuses or rewrites a field vLLM accepts. It reads, tolerantly, only what its decision needs (the
text to classify and to size, the model, streaming, temperature, the fields that imply a workload
class) and takes out specserve's own extension, `"specserve": {"workload_class", "speculative",
"request_id"}`, which it validates (a bad one is INVALID_ARGUMENT naming it).
"""

from __future__ import annotations

import json
from typing import Any, Optional

from pydantic import TypeAdapter, ValidationError

from cluster.api.types import (MAX_MESSAGES, ApiError, ChatMessage, ErrorCode, GenerateRequest, UpstreamError,
                               parse_request)
from cluster.speculation import plain_field

SPECSERVE_EXT = "specserve"
_EXT_FIELDS = ("workload_class", "speculative", "request_id")
_BOOL = TypeAdapter(bool)
# Fields whose strings vLLM passes to its engine core as they are (a prompt is tokenized before).
ENGINE_STRING_FIELDS = ("stop", "bad_words", "structured_outputs", "response_format", "vllm_xargs", "logit_bias")


def text_of(content: Any) -> str:
    """The text of a message's content: a string, or the text parts of a list of parts.

    >>> text_of("hi"), text_of([{"type": "text", "text": "a"}, {"type": "image_url"}, {"text": "b"}]), text_of(None)
    ('hi', 'a\\nb', '')
    """
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def request_class(body: dict[str, Any]) -> Optional[str]:
    """The workload class a request's own fields imply: `structured` when it asks for a format
    (`response_format` other than text, vLLM's `structured_outputs`) or may call tools.

    >>> request_class({"response_format": {"type": "json_object"}}), request_class({"tools": [{}]})
    ('structured', 'structured')
    >>> request_class({"tools": [{}], "tool_choice": "none"}), request_class({"response_format": {"type": "text"}})
    (None, None)
    """
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        return "structured"
    if body.get("structured_outputs"):
        return "structured"
    if body.get("tools") and body.get("tool_choice") != "none":
        return "structured"
    return None


def _lax_bool(value: Any) -> bool:
    """A flag as vLLM's request models read it (pydantic's lax bool: "yes", 1, "true", ...); else False.

    >>> [_lax_bool(v) for v in (True, "yes", 1, "on", "no", None, [1], 2)]
    [True, True, True, True, False, False, False, False]
    """
    try:
        return _BOOL.validate_python(value)
    except ValidationError:
        return False


def lone_surrogate_field(body: dict[str, Any]) -> Optional[str]:
    r"""The first field of ENGINE_STRING_FIELDS holding a string with a lone surrogate (valid JSON,
    not encodable as UTF-8): vLLM would take it and then fail inside its engine.

    >>> lone_surrogate_field({"stop": ["ok", "\ud800"]}), lone_surrogate_field({"stop": "ok", "prompt": "\ud800"})
    ('stop', None)
    """
    for name in ENGINE_STRING_FIELDS:
        stack, seen = [body.get(name)], 0
        while stack and seen < 10_000:
            value, seen = stack.pop(), seen + 1
            if isinstance(value, str):
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    return name
            elif isinstance(value, dict):
                stack.extend(value.keys())
                stack.extend(value.values())
            elif isinstance(value, list):
                stack.extend(value)
    return None


def _number(value: Any, default: float) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def routing_view(body: Any, chat: bool) -> tuple[GenerateRequest, dict[str, Any]]:
    """(what the router decides on, the body vLLM gets: without specserve's extension).

    >>> req, fwd = routing_view({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
    ...                          "stream": True, "specserve": {"workload_class": "code"}}, chat=True)
    >>> (req.messages[0].content, req.stream, req.workload_class, req.temperature, "specserve" in fwd)
    ('x', True, 'code', 1.0, False)
    >>> routing_view({"prompt": ["a", "b"], "temperature": 0}, chat=False)[0].prompt
    'a\\nb'
    """
    if not isinstance(body, dict):
        raise ApiError(ErrorCode.INVALID_ARGUMENT, "request body must be a JSON object", field="body")
    forward = dict(body)
    ext = forward.pop(SPECSERVE_EXT, None)
    if ext is None:
        ext = {}
    if not isinstance(ext, dict):
        raise ApiError(ErrorCode.INVALID_ARGUMENT, "specserve: must be an object", field="specserve")
    unknown = sorted(set(ext) - set(_EXT_FIELDS))
    if unknown:
        raise ApiError(ErrorCode.INVALID_ARGUMENT, f"specserve: unknown fields {unknown}", field="specserve")
    bad = lone_surrogate_field(forward)
    if bad is not None:  # vLLM's error shape: the caller gets one kind of error body for vLLM's fields
        raise UpstreamError(400, {"error": {"message": f"{bad}: strings must be valid Unicode (no lone surrogates)",
                                            "type": "BadRequestError", "param": bad, "code": 400}})
    checked = parse_request({"prompt": "-", **{k: v for k, v in ext.items() if v is not None}})  # names a bad field
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    if chat:
        raw = body.get("messages")
        if isinstance(raw, list) and len(raw) > MAX_MESSAGES:  # specserve's bound, as on gRPC (api docs)
            raise ApiError(ErrorCode.INVALID_ARGUMENT, f"messages: {len(raw)} messages, more than {MAX_MESSAGES}",
                           field="messages")
        messages = [ChatMessage.model_construct(role=str(m.get("role", "")), content=text_of(m.get("content")))
                    for m in raw if isinstance(m, dict)] if isinstance(raw, list) else []
        if not messages:
            messages, prompt = None, ""
    else:
        raw = body.get("prompt")
        prompt = raw if isinstance(raw, str) else "\n".join(p for p in raw if isinstance(p, str)) \
            if isinstance(raw, list) else ""
    req = GenerateRequest.model_construct(
        model=body.get("model") if isinstance(body.get("model"), str) else None,
        prompt=prompt, messages=messages,
        max_tokens=1,  # unread: vLLM checks the request's length against the context itself
        temperature=_number(body.get("temperature"), 1.0), top_p=1.0, seed=None, stop=[], logprobs=None,
        workload_class=checked.workload_class, speculative=checked.speculative, request_id=checked.request_id,
        stream=_lax_bool(body.get("stream")), ignore_eos=_lax_bool(body.get("ignore_eos")),
        format_class=request_class(body), plain_field=plain_field(body),
    )
    return req, forward


def forward_bytes(body: Any) -> bytes:
    """The body vLLM gets, as JSON bytes (a lone surrogate escaped, as the client sent it; nothing
    nested left for Ray to pickle); a body too deep to encode is INVALID_ARGUMENT naming it."""
    try:
        return json.dumps(body, separators=(",", ":")).encode()
    except (RecursionError, ValueError) as e:
        raise ApiError(ErrorCode.INVALID_ARGUMENT, f"body: cannot be encoded again ({type(e).__name__})",
                       field="body") from None
