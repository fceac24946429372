"""The API's data at the edge: one validated request type for gRPC and HTTP, and typed errors.

Both front doors (gRPC messages, OpenAI-style JSON) are converted into `GenerateRequest`, which
validates every field; a bad field raises `ApiError(INVALID_ARGUMENT)` whose message names it.
`ApiError` carries both the gRPC status and the HTTP code, so each door maps errors one way.
"""

from __future__ import annotations

import enum
import re
import secrets
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from cluster.speculation import WORKLOAD_CLASSES, SpecMode

MAX_PROMPT_CHARS = 256 * 1024  # larger prompts are refused before tokenization
MAX_MESSAGES = 256
MAX_STOP = 4  # vLLM's own limit (VLLM_MAX_STOP_STRINGS), which serves every request
MAX_STOP_CHARS = 128
MAX_TOKENS_LIMIT = 32768
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


class ErrorCode(enum.Enum):
    """(gRPC status name, HTTP status, OpenAI error type). The OpenAI body's `code` is the member's
    name in lower case (for most members, the gRPC status name)."""

    INVALID_ARGUMENT = ("INVALID_ARGUMENT", 400, "invalid_request_error")
    REQUEST_TOO_LARGE = ("INVALID_ARGUMENT", 413, "invalid_request_error")  # a size limit of api.limits
    UNSUPPORTED_MEDIA_TYPE = ("INVALID_ARGUMENT", 415, "invalid_request_error")  # HTTP only: not JSON
    UNAUTHENTICATED = ("UNAUTHENTICATED", 401, "authentication_error")
    NOT_FOUND = ("NOT_FOUND", 404, "not_found_error")
    METHOD_NOT_ALLOWED = ("UNIMPLEMENTED", 405, "invalid_request_error")  # HTTP only: a route, another method
    RESOURCE_EXHAUSTED = ("RESOURCE_EXHAUSTED", 429, "rate_limit_error")
    CANCELLED = ("CANCELLED", 499, "cancelled")
    INTERNAL = ("INTERNAL", 500, "internal_error")
    UNAVAILABLE = ("UNAVAILABLE", 503, "service_unavailable")
    DEADLINE_EXCEEDED = ("DEADLINE_EXCEEDED", 504, "timeout")
    REQUEST_TIMEOUT = ("DEADLINE_EXCEEDED", 408, "timeout")  # HTTP only: the body did not arrive in time

    @property
    def grpc_name(self) -> str:
        return self.value[0]

    @property
    def http_status(self) -> int:
        return self.value[1]

    @property
    def openai_type(self) -> str:
        return self.value[2]


class ApiError(Exception):
    def __init__(self, code: ErrorCode, message: str, field: Optional[str] = None, retry_after_s: Optional[float] = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field
        self.retry_after_s = retry_after_s

    def __reduce__(self):  # picklable across Ray (the gRPC proxy unpickles the replica's error)
        return (ApiError, (self.code, self.message, self.field, self.retry_after_s))

    def to_openai(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.code.openai_type,
                "param": self.field,
                "code": self.code.name.lower(),
            }
        }


class UpstreamError(ApiError):
    """vLLM's own error answer (its HTTP status and JSON body), passed on to the client as it is."""

    def __init__(self, status: int, body: Any):
        err = body.get("error") if isinstance(body, dict) else None
        err = err if isinstance(err, dict) else {}
        code = next((c for c in (ErrorCode.INVALID_ARGUMENT, ErrorCode.NOT_FOUND, ErrorCode.REQUEST_TOO_LARGE,
                                 ErrorCode.RESOURCE_EXHAUSTED, ErrorCode.UNAVAILABLE, ErrorCode.DEADLINE_EXCEEDED)
                     if c.http_status == status), ErrorCode.INVALID_ARGUMENT if 400 <= status < 500 else ErrorCode.INTERNAL)
        super().__init__(code, str(err.get("message") or body)[:2000], field=err.get("param"))
        self.status = status
        self.body = body

    def __reduce__(self):
        return (UpstreamError, (self.status, self.body))

    def to_openai(self) -> dict[str, Any]:
        return self.body if isinstance(self.body, dict) else super().to_openai()


def _valid_unicode(s: str) -> str:
    """Reject strings that cannot be encoded as UTF-8 (lone surrogates from JSON escapes)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode (no lone surrogates)") from None
    return s


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str = Field(max_length=MAX_PROMPT_CHARS)


class SpeculativeOverride(_Strict):
    mode: str = Field(description="none | ngram | draft_model | eagle | eagle3 | mtp | suffix")
    k: Optional[int] = Field(None, ge=0, le=16,
                             description="K for this request (0..pool max_k), fixed at every step; unset: the "
                                         "configured default K, or, under `auto`, the engine's K per step")

    @field_validator("mode")
    @classmethod
    def _mode(cls, v: str) -> str:
        return SpecMode.parse(v).value


class GenerateRequest(_Strict):
    model: Optional[str] = Field(None, max_length=256)
    prompt: Optional[str] = Field(None, max_length=MAX_PROMPT_CHARS)
    messages: Optional[list[ChatMessage]] = Field(None, min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int = Field(128, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float = Field(0.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: Optional[int] = Field(None, ge=-(2**63), lt=2**63)
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOP)
    logprobs: Optional[int] = Field(None, ge=0, le=5)
    workload_class: Optional[str] = None
    speculative: Optional[SpeculativeOverride] = None
    request_id: Optional[str] = None
    stream: bool = False
    ignore_eos: bool = False
    # The workload class the request's own fields imply (a response format, tools), set by the
    # HTTP door (`cluster.api.openai_body.request_class`); it takes the place of the prompt's classifier.
    format_class: Optional[str] = Field(None, exclude=True)
    # A sampling field served only at K = 0 (`cluster.speculation.plain_field`), set by the HTTP door.
    plain_field: Optional[str] = Field(None, exclude=True)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: list[str]) -> list[str]:
        for s in v:
            if not s or len(s) > MAX_STOP_CHARS:
                raise ValueError(f"each stop string must have 1..{MAX_STOP_CHARS} characters")
            _valid_unicode(s)
        return v

    @field_validator("workload_class")
    @classmethod
    def _workload(cls, v: Optional[str]) -> Optional[str]:
        if v in (None, ""):
            return None
        if v not in WORKLOAD_CLASSES:
            raise ValueError(f"unknown workload class {v!r}; allowed: {', '.join(WORKLOAD_CLASSES)}")
        return v

    @field_validator("request_id")
    @classmethod
    def _rid(cls, v: Optional[str]) -> Optional[str]:
        if v in (None, ""):
            return None
        if not _REQUEST_ID.match(v):
            raise ValueError("request_id must be 1..128 characters of [A-Za-z0-9._:-]")
        return v

    @model_validator(mode="after")
    def _one_input(self) -> "GenerateRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of `prompt` and `messages` must be given")
        if self.prompt is not None and not self.prompt:
            raise ValueError("`prompt` must not be empty")
        return self

    def ensure_request_id(self) -> str:
        if not self.request_id:
            self.request_id = "req-" + secrets.token_hex(12)  # unguessable
        return self.request_id


def validation_error(e: ValidationError) -> ApiError:
    """First pydantic error -> INVALID_ARGUMENT naming the field (all errors listed in the message)."""
    errs = e.errors()
    parts = []
    for err in errs[:5]:
        loc = ".".join(str(x) for x in err["loc"]) or "request"
        parts.append(f"{loc}: {err['msg']}")
    first = ".".join(str(x) for x in errs[0]["loc"]) if errs and errs[0]["loc"] else None
    if first is None and errs:  # a whole-request check: name the field its message is about
        first = "prompt" if "`prompt`" in errs[0]["msg"] else "body"
    return ApiError(ErrorCode.INVALID_ARGUMENT, "; ".join(parts) or "invalid request", field=first)


def parse_request(data: Any) -> GenerateRequest:
    if not isinstance(data, dict):
        raise ApiError(ErrorCode.INVALID_ARGUMENT, "request body must be a JSON object", field="body")
    try:
        return GenerateRequest.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


def check_prompt_size(req: GenerateRequest, max_chars: int) -> None:
    """REQUEST_TOO_LARGE unless the prompt, or all messages' contents together, has at most
    `max_chars` characters (api.limits.max_prompt_chars)."""
    field = "messages" if req.messages else "prompt"
    n = len(req.prompt or "") + sum(len(m.content) for m in req.messages or ())
    if n > max_chars:
        raise ApiError(ErrorCode.REQUEST_TOO_LARGE,
                       f"{field}: {n} characters in all, more than the limit of {max_chars} "
                       "(api.limits.max_prompt_chars)", field=field)


def check_json_content_type(header: Optional[str]) -> None:
    """UNSUPPORTED_MEDIA_TYPE unless a request's Content-Type is application/json (charset utf-8 or
    none): a cross-site form or `text/plain` POST, which a browser sends without asking, is refused."""
    media, _, params = (header or "").partition(";")
    charset = next((v.strip().strip('"').lower() for k, _, v in (p.partition("=") for p in params.split(";"))
                    if k.strip().lower() == "charset"), "utf-8")
    if media.strip().lower() != "application/json" or charset not in ("utf-8", "utf8"):
        raise ApiError(ErrorCode.UNSUPPORTED_MEDIA_TYPE,
                       f"content-type: {(header or '(none)')[:80]!r} is not supported; send application/json",
                       field="content-type")


def body_too_large(n: int, limit: int) -> ApiError:
    """The 413 of an HTTP body of (at least) `n` bytes, past `limit` (api.limits.max_body_bytes)."""
    return ApiError(ErrorCode.REQUEST_TOO_LARGE, f"body: {n} bytes or more, more than the limit of {limit} bytes "
                                                 "(api.limits.max_body_bytes)", field="body")
