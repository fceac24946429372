"""What the client sends and reads over the wire, without the transport: the result types
(`GenerateResult`, `StreamChunk`, `SpecInfo`, `ModelInfo`), the typed error (`ClientError`), and the
pure functions both clients of cluster/client.py share: the request body, the error of a non-2xx
answer, Server-Sent Events framing, and the parsing of stream chunks, whole responses and the model
list. No I/O and no HTTP library here, so they are tested on hand-built text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Optional

from cluster.speculation import SpecStats


class ClientError(Exception):
    """An error answer of the API: HTTP status (0 when the connection failed), message, field."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 type_: Optional[str] = None, retry_after_s: Optional[float] = None):
        super().__init__(f"HTTP {status}: {message}" + (f" (param: {param})" if param else ""))
        self.status = status
        self.message = message
        self.param = param
        self.type = type_
        self.retry_after_s = retry_after_s


@dataclass
class SpecInfo:
    """The response's top-level `specserve` object: the routing decision and what happened."""

    request_id: Optional[str] = None
    pool: Optional[str] = None
    replica: Optional[str] = None
    mode: str = "none"
    k: int = 0
    decided_by: Optional[str] = None
    explored: bool = False  # the policy's exploration draw chose pool and mode (not its best estimate)
    # How mode and K were chosen: `k_by` (engine: K per step up to `k`; request / default: `k`, fixed),
    # admission load bucket, joined batch, and for the policy each candidate's score and `k_step_alpha`.
    decision: dict = field(default_factory=dict)
    workload_class: Optional[str] = None
    steps: int = 0
    spec_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    acceptance_length: float = 1.0
    acceptance_rate: float = 0.0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    run_lengths: list[int] = field(default_factory=list)  # [L] = accepted runs of L tokens
    token_ids: list[int] = field(default_factory=list)
    ttft_s: Optional[float] = None  # measured by the server
    latency_s: Optional[float] = None  # measured by the server
    # One dict per output token: {token id: logprob} of the top-N alternatives (only when asked).
    logprobs: Optional[list[dict[int, float]]] = None

    @classmethod
    def from_dict(cls, d: dict) -> "SpecInfo":
        lps = d.get("logprobs")
        return cls(
            request_id=d.get("request_id"), pool=d.get("pool"),
            replica=None if d.get("replica") is None else str(d.get("replica")),
            mode=str(d.get("mode") or "none"), k=int(d.get("k") or 0),
            decided_by=d.get("decided_by"), explored=bool(d.get("explored")), workload_class=d.get("workload_class"),
            decision=dict(d.get("decision") or {}),
            steps=int(d.get("steps") or 0), spec_steps=int(d.get("spec_steps") or 0),
            drafted=int(d.get("drafted") or 0),
            accepted=int(d.get("accepted") or 0),
            acceptance_length=float(d.get("acceptance_length") or 1.0),
            acceptance_rate=float(d.get("acceptance_rate") or 0.0),
            accepted_per_position=[int(x) for x in d.get("accepted_per_position") or []],
            drafted_per_position=[int(x) for x in d.get("drafted_per_position") or []],
            run_lengths=[int(x) for x in d.get("run_lengths") or []],
            token_ids=[int(t) for t in d.get("token_ids") or []],
            ttft_s=_opt_float(d.get("ttft_s")), latency_s=_opt_float(d.get("latency_s")),
            logprobs=None if lps is None else [{int(t): float(v) for t, v in pos.items()} for pos in lps],
        )

    def stats(self) -> SpecStats:
        return SpecStats(mode=self.mode, k=self.k, steps=self.steps, spec_steps=self.spec_steps,
                         drafted=self.drafted, accepted=self.accepted,
                         accepted_per_position=list(self.accepted_per_position),
                         drafted_per_position=list(self.drafted_per_position),
                         run_lengths=list(self.run_lengths))


@dataclass
class StreamChunk:
    """One SSE event of a streamed response. `spec` is set on the last chunk only (full stats)."""

    text: str
    token_ids: list[int]  # tokens new in this chunk (the last chunk's may be the whole output)
    finish_reason: Optional[str]
    usage: Optional[dict]
    spec: Optional[SpecInfo]
    arrival_s: float  # time.perf_counter() when the event was parsed
    raw: dict
    logprobs: list[dict[int, float]] = field(default_factory=list)  # per token of the chunk: {token id: logprob}


@dataclass
class GenerateResult:
    text: str
    token_ids: list[int]
    finish_reason: Optional[str]
    usage: dict
    spec: SpecInfo
    ttft_s: Optional[float]  # client-measured when streamed; the server's figure otherwise
    latency_s: float  # client-measured, request sent -> last byte
    # Streamed only: arrival of each token-bearing chunk (s after the request was sent), its tokens.
    chunk_times_s: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    raw: dict = field(default_factory=dict)


@dataclass
class ModelInfo:
    id: str
    pools: list[dict]  # [{"name", "method", "max_k", "modes"}]; empty if the server does not say
    raw: dict


# -- pure pieces -----------------------------------------------------------------------------------


def _opt_float(v: Any) -> Optional[float]:
    return None if v is None else float(v)


def build_body(*, prompt: Optional[str] = None, messages: Optional[list[dict]] = None,
               model: Optional[str] = None, max_tokens: int = 128, temperature: Optional[float] = None,
               top_p: Optional[float] = None, seed: Optional[int] = None, stop: Optional[list[str]] = None,
               logprobs: Optional[int] = None, stream: bool = False, workload_class: Optional[str] = None,
               speculative: Optional[dict] = None, request_id: Optional[str] = None,
               extra: Optional[dict] = None) -> tuple[str, dict]:
    """(path, JSON body) of one request: chat when `messages` is given, completions when `prompt` is."""
    if (prompt is None) == (messages is None):
        raise ValueError("give exactly one of prompt and messages")
    chat = messages is not None
    body: dict[str, Any] = {"max_tokens": max_tokens, "stream": stream}
    if stream:  # vLLM's fields: each event's token ids, usage in the last event
        body.update(return_token_ids=True, stream_options={"include_usage": True})
    if chat:
        body["messages"] = messages
    else:
        body["prompt"] = prompt
    for key, value in (("model", model), ("temperature", temperature), ("top_p", top_p),
                       ("seed", seed), ("stop", stop)):
        if value is not None:
            body[key] = value
    if logprobs is not None:  # keyed by token id (vLLM's `return_tokens_as_token_ids`)
        body["return_tokens_as_token_ids"] = True
        if chat:
            body["logprobs"], body["top_logprobs"] = True, logprobs
        else:
            body["logprobs"] = logprobs
    ext = {k: v for k, v in (("workload_class", workload_class), ("speculative", speculative),
                             ("request_id", request_id)) if v is not None}
    if ext:
        body["specserve"] = ext
    body.update(extra or {})
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


def error_from_response(status: int, body: bytes, headers: Optional[dict] = None) -> ClientError:
    """The typed error of an error answer; tolerates a body that is not the documented JSON."""
    message, param, type_ = body.decode("utf-8", "replace")[:500] or f"HTTP {status}", None, None
    try:
        err = json.loads(body)["error"]
        message, param, type_ = str(err.get("message", message)), err.get("param"), err.get("type")
    except (ValueError, KeyError, TypeError, AttributeError):
        pass
    retry = (headers or {}).get("retry-after")
    try:
        retry_after_s = float(retry) if retry is not None else None
    except ValueError:
        retry_after_s = None
    return ClientError(status, message, param, type_, retry_after_s)


def iter_sse_data(lines: Iterable[str]) -> Iterator[str]:
    """SSE framing: the `data` payload of each event (multi-line data joined by newlines)."""
    data: list[str] = []
    for line in lines:
        line = line.rstrip("\r\n")
        if not line:
            if data:
                yield "\n".join(data)
                data = []
            continue
        if line.startswith(":"):
            continue  # comment / keep-alive
        name, _, value = line.partition(":")
        if name == "data":
            data.append(value[1:] if value.startswith(" ") else value)
    if data:
        yield "\n".join(data)


def parse_chunk(payload: str, arrival_s: float) -> Optional[StreamChunk]:
    """One SSE payload -> StreamChunk; None for the `[DONE]` sentinel; ClientError for an error event."""
    if payload.strip() == "[DONE]":
        return None
    obj = json.loads(payload)
    if "error" in obj:
        err = obj["error"] if isinstance(obj["error"], dict) else {"message": str(obj["error"])}
        raise ClientError(int(err.get("status") or 500), str(err.get("message")), err.get("param"), err.get("type"))
    choice = (obj.get("choices") or [{}])[0]
    delta = choice.get("delta")
    text = (delta or {}).get("content") or "" if delta is not None else choice.get("text") or ""
    finish = choice.get("finish_reason")
    ext = obj.get("specserve") or {}
    # The last event carries the stats object (vLLM's last: its finish reason, or its usage when asked
    # for); token_ids there may be the chunk's new tokens or the whole output (collect_stream tells which).
    is_final_stats = any(key in ext for key in ("steps", "mode", "drafted"))
    spec = SpecInfo.from_dict(ext) if is_final_stats else None
    # vLLM, asked `return_token_ids`, sends the chunk's tokens in the choice.
    new_ids = [int(t) for t in (ext["token_ids"] if "token_ids" in ext else choice.get("token_ids")) or []]
    return StreamChunk(text=text, token_ids=new_ids, finish_reason=finish, usage=obj.get("usage"),
                       spec=spec, arrival_s=arrival_s, raw=obj, logprobs=choice_logprobs(choice))


def choice_logprobs(choice: dict) -> list[dict[int, float]]:
    """The top logprobs of each token of a choice, keyed by token id: vLLM's chat (`content`) or
    completion (`top_logprobs`) form, its tokens spelled `token_id:N` (`return_tokens_as_token_ids`).

    >>> choice_logprobs({"logprobs": {"content": [{"top_logprobs": [{"token": "token_id:5", "logprob": -0.1}]}]}})
    [{5: -0.1}]
    >>> choice_logprobs({"logprobs": {"top_logprobs": [{"token_id:7": -0.5, "x": -1.0}]}}), choice_logprobs({})
    ([{7: -0.5}], [])
    """
    lps = choice.get("logprobs") or {}
    if not isinstance(lps, dict):
        return []
    if lps.get("content") is not None:
        positions = [{t.get("token"): t.get("logprob") for t in pos.get("top_logprobs") or []}
                     for pos in lps["content"]]
    else:
        positions = list(lps.get("top_logprobs") or [])
    return [{int(t[9:]): float(v) for t, v in pos.items() if isinstance(t, str) and t.startswith("token_id:")}
            for pos in positions if isinstance(pos, dict)]


def final_new_tokens(seen: list[int], final_ids: list[int], completion_tokens: Optional[int]) -> list[int]:
    """Tokens first sent in the last chunk, whose `token_ids` are either its new tokens or the whole
    output: `usage.completion_tokens` decides when given, else whether `seen` is a prefix."""
    if completion_tokens is not None:
        if len(seen) + len(final_ids) == completion_tokens:
            return list(final_ids)
        if len(final_ids) == completion_tokens and final_ids[: len(seen)] == seen:
            return list(final_ids[len(seen):])
    if seen and final_ids[: len(seen)] == seen:
        return list(final_ids[len(seen):])
    return list(final_ids)


def collect_stream(chunks: Iterable[StreamChunk], start_s: float) -> GenerateResult:
    """Fold streamed chunks (sent at perf_counter `start_s`) into one result with client timings."""
    text, ids, times, counts, lps = [], [], [], [], []
    finish, usage, spec, last = None, {}, None, start_s
    for ch in chunks:
        last = ch.arrival_s
        lps.extend(ch.logprobs)
        text.append(ch.text)
        new_ids = ch.token_ids
        if ch.spec is not None:
            spec = ch.spec
            done = (ch.usage or {}).get("completion_tokens")
            new_ids = final_new_tokens(ids, ch.token_ids, None if done is None else int(done))
        if new_ids or ch.text:
            times.append(ch.arrival_s - start_s)
            counts.append(len(new_ids))
        ids.extend(new_ids)
        finish = ch.finish_reason or finish
        usage = ch.usage or usage
    spec = spec or SpecInfo()
    spec.token_ids = list(ids)
    spec.logprobs = lps or spec.logprobs
    return GenerateResult(text="".join(text), token_ids=list(ids), finish_reason=finish, usage=usage,
                          spec=spec, ttft_s=times[0] if times else None, latency_s=last - start_s,
                          chunk_times_s=times, chunk_tokens=counts)


def parse_response(obj: dict, latency_s: float) -> GenerateResult:
    """A non-streamed response object -> GenerateResult (TTFT is the server's figure)."""
    choice = (obj.get("choices") or [{}])[0]
    text = (choice.get("message") or {}).get("content") if "message" in choice else choice.get("text")
    spec = SpecInfo.from_dict(obj.get("specserve") or {})
    spec.logprobs = choice_logprobs(choice) or spec.logprobs
    return GenerateResult(text=text or "", token_ids=spec.token_ids, finish_reason=choice.get("finish_reason"),
                          usage=obj.get("usage") or {}, spec=spec, ttft_s=spec.ttft_s, latency_s=latency_s, raw=obj)


def parse_models(obj: dict) -> list[ModelInfo]:
    return [ModelInfo(id=str(m.get("id")), pools=list((m.get("specserve") or {}).get("pools") or []), raw=m)
            for m in obj.get("data") or []]
