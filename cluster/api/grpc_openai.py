"""gRPC requests through vLLM's own OpenAI serving layer, the path HTTP requests take.

`openai_call` turns a specserve.v1 `GenerateRequest` (validated first by `cluster.api.wire.from_proto`)
into the OpenAI body vLLM gets; `response_proto` reads vLLM's JSON answer into a `GenerateResponse`;
`StreamReader` reads vLLM's SSE events into `GenerateStreamResponse` messages (text, token ids,
logprobs per message; tool calls, folded from their deltas, and usage on the last). vLLM's own
errors come back as they are (`UpstreamError`), so a gRPC caller gets vLLM's message.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from cluster.api.types import ApiError, ErrorCode, GenerateRequest, UpstreamError

TOOL_CHOICES = ("none", "auto", "required")


def _json_field(text: str, field: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ApiError(ErrorCode.INVALID_ARGUMENT, f"{field}: not valid JSON ({e})", field=field) from None


def openai_call(msg: Any, req: GenerateRequest, stream: bool) -> tuple[str, dict[str, Any]]:
    """(path, OpenAI body) for a gRPC request. `req` is `from_proto(msg)`: its prompt or messages,
    limits and sampling are already validated; the fields only vLLM knows go as they are."""
    chat = req.messages is not None
    s = msg.sampling if msg.HasField("sampling") else None
    body: dict[str, Any] = {"max_tokens": req.max_tokens, "temperature": req.temperature, "top_p": req.top_p,
                            "return_token_ids": True}
    if req.model:
        body["model"] = req.model
    if chat:
        body["messages"] = [{"role": m.role, "content": m.content} for m in req.messages]
    else:
        body["prompt"] = req.prompt
    if req.seed is not None:
        body["seed"] = req.seed
    if req.stop:
        body["stop"] = list(req.stop)
    if req.logprobs is not None:
        body.update({"logprobs": True, "top_logprobs": req.logprobs} if chat else {"logprobs": req.logprobs})
        body["return_tokens_as_token_ids"] = True
    if s is not None:
        if s.stop_token_ids:
            body["stop_token_ids"] = list(s.stop_token_ids)
        for name in ("min_tokens", "n", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if s.HasField(name):
                body[name] = getattr(s, name)
        if stream and body.get("n", 1) != 1:
            raise ApiError(ErrorCode.INVALID_ARGUMENT, "sampling.n: GenerateStream returns one choice; use Generate "
                                                       "for n > 1", field="sampling.n")
    if msg.HasField("response_format"):
        body["response_format"] = response_format(msg.response_format)
    if msg.tools:
        if not chat:
            raise ApiError(ErrorCode.INVALID_ARGUMENT, "tools: need chat messages (not a prompt)", field="tools")
        body["tools"] = [{"type": "function", "function": {
            "name": t.name, **({"description": t.description} if t.description else {}),
            "parameters": _json_field(t.parameters_json or "{}", f"tools[{i}].parameters_json")}}
            for i, t in enumerate(msg.tools)]
    if msg.tool_choice:
        if not msg.tools:
            raise ApiError(ErrorCode.INVALID_ARGUMENT, "tool_choice: needs tools", field="tool_choice")
        body["tool_choice"] = msg.tool_choice if msg.tool_choice in TOOL_CHOICES else \
            {"type": "function", "function": {"name": msg.tool_choice}}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


def response_format(fmt: Any) -> dict[str, Any]:
    """A `ResponseFormat` as OpenAI's `response_format`."""
    if fmt.type == "json_schema":
        if not fmt.json_schema:
            raise ApiError(ErrorCode.INVALID_ARGUMENT, "response_format.json_schema: required for type json_schema",
                           field="response_format.json_schema")
        return {"type": "json_schema", "json_schema": {
            "name": fmt.name or "response", "schema": _json_field(fmt.json_schema, "response_format.json_schema")}}
    if fmt.type in ("text", "json_object"):
        return {"type": fmt.type}
    raise ApiError(ErrorCode.INVALID_ARGUMENT, f"response_format.type: {fmt.type[:32]!r} is not text, json_object "
                                               "or json_schema", field="response_format.type")


def _token_id(token: Any) -> int:
    """A token as vLLM writes it with `return_tokens_as_token_ids` ("token_id:123")."""
    return int(str(token).rpartition(":")[2])


def logprobs_of(choice: dict[str, Any]) -> list[dict[str, Any]]:
    """A choice's logprobs (chat or completion shape) as [{token_id, logprob, top: [...]}].

    >>> logprobs_of({"logprobs": {"content": [{"token": "token_id:5", "logprob": -0.1,
    ...     "top_logprobs": [{"token": "token_id:5", "logprob": -0.1}, {"token": "token_id:9", "logprob": -2.5}]}]}})
    [{'token_id': 5, 'logprob': -0.1, 'top': [{'token_id': 5, 'logprob': -0.1}, {'token_id': 9, 'logprob': -2.5}]}]
    >>> logprobs_of({"logprobs": {"tokens": ["token_id:7"], "token_logprobs": [-0.5],
    ...                            "top_logprobs": [{"token_id:7": -0.5}]}})
    [{'token_id': 7, 'logprob': -0.5, 'top': [{'token_id': 7, 'logprob': -0.5}]}]
    >>> logprobs_of({"logprobs": None})
    []
    """
    lp = choice.get("logprobs")
    if not isinstance(lp, dict):
        return []
    if "content" in lp:
        return [{"token_id": _token_id(t["token"]), "logprob": t["logprob"],
                 "top": [{"token_id": _token_id(c["token"]), "logprob": c["logprob"]} for c in t.get("top_logprobs") or []]}
                for t in lp["content"] or []]
    tops = lp.get("top_logprobs") or [None] * len(lp.get("tokens") or [])
    return [{"token_id": _token_id(t), "logprob": p,
             "top": [{"token_id": _token_id(k), "logprob": v} for k, v in (top or {}).items()]}
            for t, p, top in zip(lp.get("tokens") or [], lp.get("token_logprobs") or [], tops)]


def tool_calls_of(message: dict[str, Any]) -> list[dict[str, str]]:
    """A chat message's tool calls as [{id, name, arguments_json}]."""
    return [{"id": c.get("id") or "", "name": (c.get("function") or {}).get("name") or "",
             "arguments_json": (c.get("function") or {}).get("arguments") or ""}
            for c in message.get("tool_calls") or []]


def choice_fields(choice: dict[str, Any]) -> dict[str, Any]:
    """One vLLM choice (chat or completion) as the fields of a `Choice`."""
    message = choice.get("message") or {}
    return {"index": choice.get("index", 0), "text": message.get("content") or choice.get("text") or "",
            "token_ids": choice.get("token_ids") or [], "finish_reason": choice.get("finish_reason") or "",
            "tool_calls": tool_calls_of(message), "logprobs": logprobs_of(choice)}


def response_proto(pb: Any, answer: dict[str, Any], base: Any) -> Any:
    """vLLM's JSON answer over `base` (a `GenerateResponse` with the request id, timing and spec
    stats): choice 0 in the top-level fields, every choice in `choices` when there are several."""
    choices = [choice_fields(c) for c in sorted(answer.get("choices") or [], key=lambda c: c.get("index", 0))]
    usage = answer.get("usage") or {}
    base.prompt_tokens = int(usage.get("prompt_tokens") or base.prompt_tokens)
    base.completion_tokens = int(usage.get("completion_tokens") or base.completion_tokens)
    if choices:
        first = choices[0]
        base.text, base.finish_reason = first["text"], first["finish_reason"]
        ids = first["token_ids"] or list(base.token_ids)
        del base.token_ids[:]
        base.token_ids.extend(ids)
        base.tool_calls.extend(pb.ToolCall(**c) for c in first["tool_calls"])
        base.logprobs.extend(token_logprob(pb, t) for t in first["logprobs"])
    if len(choices) > 1:
        for c in choices:
            base.choices.add(index=c["index"], text=c["text"], token_ids=c["token_ids"], finish_reason=c["finish_reason"],
                             tool_calls=[pb.ToolCall(**t) for t in c["tool_calls"]],
                             logprobs=[token_logprob(pb, t) for t in c["logprobs"]])
    return base


def token_logprob(pb: Any, t: dict[str, Any]) -> Any:
    return pb.TokenLogprob(token_id=t["token_id"], logprob=t["logprob"], top=[pb.TopLogprob(**c) for c in t["top"]])


def sse_events(raw: str) -> list[dict[str, Any]]:
    """The JSON events of a piece of vLLM's SSE stream ([DONE] and blank lines skipped).

    >>> sse_events('data: {"a": 1}\\n\\ndata: [DONE]\\n\\n')
    [{'a': 1}]
    """
    return [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]


class StreamReader:
    """Reads vLLM's stream events for one choice: `read(raw)` gives the text, token ids and logprobs
    they add; tool-call deltas are folded by index (`tool_calls`), usage and finish reason kept.
    An error event raises it (vLLM's status and message)."""

    def __init__(self) -> None:
        self.calls: dict[int, dict[str, str]] = {}
        self.finish_reason: Optional[str] = None
        self.usage: dict[str, Any] = {}

    def read(self, raw: str) -> tuple[str, list[int], list[dict[str, Any]]]:
        text, token_ids, logprobs = [], [], []
        for event in sse_events(raw):
            error = event.get("error")
            if isinstance(error, dict):
                code = error.get("code")
                raise UpstreamError(code if isinstance(code, int) and 400 <= code < 600 else 500, event)
            if event.get("usage"):
                self.usage = event["usage"]
            for choice in event.get("choices") or []:
                delta = choice.get("delta") or {}
                text.append(delta.get("content") or choice.get("text") or "")
                token_ids.extend(choice.get("token_ids") or [])
                logprobs.extend(logprobs_of(choice))
                for call in delta.get("tool_calls") or []:
                    folded = self.calls.setdefault(int(call.get("index", 0)), {"id": "", "name": "", "arguments_json": ""})
                    fn = call.get("function") or {}
                    folded["id"] = folded["id"] or call.get("id") or ""
                    folded["name"] = folded["name"] or fn.get("name") or ""
                    folded["arguments_json"] += fn.get("arguments") or ""
                if choice.get("finish_reason"):
                    self.finish_reason = choice["finish_reason"]
        return "".join(text), token_ids, logprobs

    @property
    def tool_calls(self) -> list[dict[str, str]]:
        return [self.calls[i] for i in sorted(self.calls)]
