"""One request's call to an engine pool, from the router: every wait bounded (`cluster.deadline`),
one retry when a replica dies before any output, an unfinished call cancelled (which aborts it in
vLLM), and Ray's and vLLM's failures mapped to typed API errors.

The engine handle is injected (a Ray Serve DeploymentHandle, or a test double with its call shape:
`handle.options(stream=True).generate.remote(req)` -> async iterator with cancel()).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator

from cluster.api import ApiError, ErrorCode
from cluster.deadline import RETRY_AFTER_S, Bounds, engine_wait, expired
from cluster.decision import Decision
from deployments.engine import EngineChunk, EngineRequest

log = logging.getLogger("specserve.router")


async def engine_chunks(handle: Any, bounds: Bounds, deadline_s: float, d: Decision, ereq: EngineRequest,
                        ) -> AsyncIterator[EngineChunk]:
    """The engine's chunks for one request, with every wait bounded (`cluster.deadline`): the first
    chunk within router.first_token_timeout_s, each later one within router.stream_idle_timeout_s
    (else UNAVAILABLE), and all of it before `deadline_s` (monotonic; else DEADLINE_EXCEEDED). A
    replica that dies before the first chunk is retried once on the pool (nothing was delivered
    yet), within the same deadline; after that the stream ends with UNAVAILABLE. An unfinished
    call is cancelled, which aborts the request in vLLM and frees its KV cache."""
    for attempt in (1, 2):
        gen = handle.options(stream=True).generate.remote(ereq)
        started = done = False
        try:
            while not done:
                wait_s, what = engine_wait(bounds, deadline_s, time.monotonic(), started)
                try:
                    chunk = await asyncio.wait_for(gen.__anext__(), timeout=wait_s)
                except StopAsyncIteration:
                    done = True
                    return
                except asyncio.TimeoutError:
                    if what == "deadline":
                        log.warning("request %s (pool %s) passed router.request_timeout_s (%g s); aborting it",
                                    ereq.request_id, d.pool, bounds.request_s)
                    raise expired(what, bounds, d.pool) from None
                started = True
                done = chunk.finish_reason is not None
                yield chunk
            return
        except Exception as e:  # noqa: BLE001 - re-raised unless a safe retry applies
            if started or attempt == 2 or not _replica_gone(e):
                raise
            log.warning("request %s: engine replica of pool %s failed before output (%s); retrying once",
                        ereq.request_id, d.pool, type(e).__name__)
        finally:
            if not done:
                _cancel(gen, ereq.request_id)


def map_error(e: Exception, rid: str, d: Decision) -> ApiError:
    """Ray / vLLM failures -> typed API errors (Ray's task errors are also instances of the cause)."""
    from ray.exceptions import TaskCancelledError
    from ray.serve.exceptions import BackPressureError, RequestCancelledError

    if isinstance(e, BackPressureError):
        return ApiError(ErrorCode.RESOURCE_EXHAUSTED, f"pool {d.pool!r} is overloaded; retry later",
                        retry_after_s=RETRY_AFTER_S)
    if isinstance(e, (asyncio.CancelledError, RequestCancelledError, TaskCancelledError)):
        return ApiError(ErrorCode.CANCELLED, "request cancelled")
    if isinstance(e, ValueError):  # vLLM input validation (e.g. prompt longer than the context)
        return ApiError(ErrorCode.INVALID_ARGUMENT, f"prompt: {str(e).strip().splitlines()[-1][:300]}",
                        field="prompt")
    if _replica_gone(e):
        return ApiError(ErrorCode.UNAVAILABLE, f"engine replica unavailable ({type(e).__name__})",
                        retry_after_s=RETRY_AFTER_S)
    log.exception("request %s (pool %s, mode %s, k %d) failed", rid, d.pool, d.mode.value, d.k)
    return ApiError(ErrorCode.INTERNAL, f"internal error ({type(e).__name__}); request id {rid}")


def _replica_gone(e: BaseException) -> bool:
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
    from ray.serve.exceptions import DeploymentUnavailableError

    return isinstance(e, (ActorDiedError, ActorUnavailableError, RayActorError, DeploymentUnavailableError))


def _cancel(gen: Any, rid: str) -> None:
    """Cancel an engine call. A call whose assignment already failed (e.g. backpressure) re-raises
    that failure from cancel(); it is being reported to the caller already, so only log it here."""
    try:
        gen.cancel()
    except Exception as e:  # noqa: BLE001 - see docstring
        log.debug("request %s: nothing to cancel (%s)", rid, type(e).__name__)
