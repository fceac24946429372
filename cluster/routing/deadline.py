"""A request's time bounds at the router: one end-to-end deadline, and the engine's waits within it.

Words: the *deadline* is the request's arrival at the router plus `router.request_timeout_s`; it
covers reading an HTTP body, every engine call of the request (the one retry included) and the
whole stream. Inside it, one engine call's first output must come within
`router.first_token_timeout_s` and each later one within `router.stream_idle_timeout_s`: those say
the pool stopped (UNAVAILABLE, worth a retry elsewhere); the deadline says the request took too
long (DEADLINE_EXCEEDED, HTTP 504; a body not received by then is HTTP 408). Either way the engine
call is cancelled, which aborts the request in vLLM. Pure: explicit monotonic times.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.api.types import ApiError, ErrorCode

RETRY_AFTER_S = 1.0
PROXY_MARGIN_S = 10.0  # Ray's proxy gives up this long after the router's deadline (`proxy_timeout_s`)


@dataclass(frozen=True)
class Bounds:
    """The router config's time bounds, in seconds."""

    request_s: float  # router.request_timeout_s
    first_token_s: float  # router.first_token_timeout_s
    idle_s: float  # router.stream_idle_timeout_s

    @classmethod
    def from_config(cls, router) -> "Bounds":
        return cls(router.request_timeout_s, router.first_token_timeout_s, router.stream_idle_timeout_s)

    def deadline(self, arrived_s: float) -> float:
        """The monotonic time by which a request that arrived at `arrived_s` must be done."""
        return arrived_s + self.request_s


def engine_wait(bounds: Bounds, deadline_s: float, now_s: float, started: bool) -> tuple[float, str]:
    """(how long the next wait on the engine may last, what ends it if nothing comes): the wait's
    own bound ("first_token" before the first output, "idle" after it), or what is left until the
    deadline ("deadline") when that is sooner.

    >>> b = Bounds(request_s=120, first_token_s=60, idle_s=30)
    >>> engine_wait(b, deadline_s=120, now_s=0, started=False), engine_wait(b, 120, 10, True)
    ((60, 'first_token'), (30, 'idle'))
    >>> engine_wait(b, deadline_s=120, now_s=100, started=True), engine_wait(b, 120, 130, True)
    ((20, 'deadline'), (0.0, 'deadline'))
    """
    own, what = (bounds.idle_s, "idle") if started else (bounds.first_token_s, "first_token")
    left = max(deadline_s - now_s, 0.0)
    return (left, "deadline") if left <= own else (own, what)


def expired(what: str, bounds: Bounds, pool: str) -> ApiError:
    """The error of a wait that ended with nothing, `what` as `engine_wait` named it.

    >>> b = Bounds(120, 60, 30)
    >>> e = expired("deadline", b, "ngram"); (e.code.name, e.code.http_status, e.message)
    ('DEADLINE_EXCEEDED', 504, 'request not done within router.request_timeout_s (120 s); aborted')
    >>> e = expired("first_token", b, "ngram"); (e.code.name, e.retry_after_s, e.message)
    ('UNAVAILABLE', 1.0, "pool 'ngram' gave no output within router.first_token_timeout_s (60 s)")
    >>> expired("idle", b, "ngram").message
    "pool 'ngram' gave no output for router.stream_idle_timeout_s (30 s)"
    """
    if what == "deadline":
        return ApiError(ErrorCode.DEADLINE_EXCEEDED,
                        f"request not done within router.request_timeout_s ({bounds.request_s:g} s); aborted")
    if what == "first_token":
        return ApiError(ErrorCode.UNAVAILABLE, f"pool {pool!r} gave no output within router.first_token_timeout_s "
                                               f"({bounds.first_token_s:g} s)", retry_after_s=RETRY_AFTER_S)
    if what == "idle":
        return ApiError(ErrorCode.UNAVAILABLE, f"pool {pool!r} gave no output for router.stream_idle_timeout_s "
                                               f"({bounds.idle_s:g} s)", retry_after_s=RETRY_AFTER_S)
    raise ValueError(f"unknown wait {what!r}")


def body_expired(bounds: Bounds) -> ApiError:
    """HTTP 408: the caller did not send its body before the deadline (a slow client holds no slot longer).

    >>> e = body_expired(Bounds(120, 60, 30)); (e.code.http_status, e.field, e.message)
    (408, 'body', 'body: not received within router.request_timeout_s (120 s)')
    """
    return ApiError(ErrorCode.REQUEST_TIMEOUT, f"body: not received within router.request_timeout_s "
                                               f"({bounds.request_s:g} s)", field="body")


def proxy_timeout_s(request_timeout_s: float) -> float:
    """Ray Serve's `request_timeout_s` for its HTTP and gRPC proxies: the router's deadline plus a
    margin, so the router's own error (naming the limit, after aborting in vLLM) comes first and the
    proxy's bounds only what the router cannot see (a request queued at the proxy, a hung router).

    >>> proxy_timeout_s(120.0)
    130.0
    """
    return float(request_timeout_s) + PROXY_MARGIN_S
