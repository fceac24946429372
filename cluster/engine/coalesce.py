"""How many tokens an engine replica gathers into one streamed chunk.

Every chunk a replica sends costs the same fixed work however many tokens it carries: a Ray
streaming hop from the engine replica to the router, another from the router to the proxy, and
an event to the client. One chunk per token per request means that work grows with the batch
(measured on 2 CPU cores at 16 streams: about 1.5 ms of CPU per chunk across those processes,
enough to slow the engine sharing the cores). So a replica sends at most about
`chunks_per_step` chunks per engine step across its running requests: with `batch` requests
running, a request's tokens go out ceil(batch / chunks_per_step) at a time. The first token and
the last chunk always go out at once, so TTFT and end-to-end latency are not delayed; a request
the caller does not stream gets its first token (the router's liveness and TTFT signal) and then
one final chunk. Nothing is held longer than MAX_HOLD_S, so the router's idle timeout
(`router.stream_idle_timeout_s`) keeps meaning "the engine stopped", however long the request.
"""

from __future__ import annotations

from typing import Optional

# The most tokens one chunk of a streamed request waits for (a reader sees text at least this often).
MAX_CHUNK_TOKENS = 16
NOT_STREAMED = 1 << 30
# The longest output is held back before it is sent anyway (s).
MAX_HOLD_S = 1.0


def chunk_tokens(batch: int, chunks_per_step: Optional[int], streamed: bool = True,
                 cap: int = MAX_CHUNK_TOKENS) -> int:
    """Tokens per chunk for a request while `batch` requests run in its engine.

    >>> [chunk_tokens(b, 4) for b in (0, 1, 4, 5, 16, 32, 64, 200)]
    [1, 1, 1, 2, 4, 8, 16, 16]
    >>> chunk_tokens(32, None), chunk_tokens(3, 4, streamed=False) == NOT_STREAMED
    (1, True)
    """
    if not streamed:
        return NOT_STREAMED
    if not chunks_per_step:
        return 1
    return max(1, min(cap, -(-batch // chunks_per_step)))


def flush(buffered_tokens: int, sent_any: bool, finished: bool, batch: int, chunks_per_step: Optional[int],
          streamed: bool = True, held_s: float = 0.0) -> bool:
    """Send what is buffered now? The first token, the last output, a full chunk, or output held
    `held_s` >= MAX_HOLD_S since the last send.

    >>> flush(1, False, False, 32, 4), flush(0, False, False, 32, 4), flush(7, True, False, 32, 4)
    (True, False, False)
    >>> flush(8, True, False, 32, 4), flush(0, False, True, 32, 4)
    (True, True)
    >>> flush(1, True, True, 32, 4), flush(500, True, False, 1, 4, streamed=False)
    (True, False)
    >>> flush(500, True, False, 1, 4, streamed=False, held_s=1.0), flush(0, True, False, 1, 4, held_s=5.0)
    (True, False)
    """
    if buffered_tokens <= 0:
        return finished
    return (not sent_any or finished or held_s >= MAX_HOLD_S
            or buffered_tokens >= chunk_tokens(batch, chunks_per_step, streamed))
