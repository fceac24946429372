"""One request's call to an engine pool, from the router: every wait bounded (`cluster.routing.deadline`),
one retry when a replica (or its vLLM engine core) dies before any output, an unfinished call
cancelled (which aborts it in vLLM), and Ray's and vLLM's failures mapped to typed API errors.

The engine handle is injected (a Ray Serve DeploymentHandle, or a test double with its call shape:
`handle.options(stream=True).generate.remote(req)` -> async iterator with cancel()). So is the local
lane (`deployments.router_lane`): `lane(req, start)` -> a call of the same shape that falls back to
`start()`, the handle call, when no lane of the pool answers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator, Callable, Optional

from cluster.api.types import ApiError, ErrorCode
from cluster.routing.deadline import RETRY_AFTER_S, Bounds, engine_wait, expired
from cluster.policy.decision import Decision
from deployments.engine import EngineChunk, EngineRequest
from deployments.engine_death import RETIRE_GRACE_S, EngineDead
from deployments.router_lane import LaneBusy, LaneGone

log = logging.getLogger("specserve.router")

# A replica whose engine died answers EngineDead until its process ends (RETIRE_GRACE_S later); a
# retry sent after that finds Serve routing around the dead actor instead of back into it.
DEAD_ENGINE_RETRY_PAUSE_S = 2 * RETIRE_GRACE_S


async def engine_chunks(handle: Any, bounds: Bounds, deadline_s: float, d: Decision, ereq: EngineRequest,
                        lane: Optional[Callable[[EngineRequest, Callable[[], Any]], Any]] = None,
                        ) -> AsyncIterator[EngineChunk]:
    """The engine's chunks for one request, with every wait bounded (`cluster.routing.deadline`): the first
    chunk within router.first_token_timeout_s, each later one within router.stream_idle_timeout_s
    (else UNAVAILABLE), and all of it before `deadline_s` (monotonic; else DEADLINE_EXCEEDED). A
    replica (or its engine core) that dies before the first chunk is retried once on the pool
    (nothing was delivered yet), within the same deadline (`retry_pause_s`); after that the stream
    ends with UNAVAILABLE. An unfinished call is cancelled, which aborts the request in vLLM and
    frees its KV cache. `lane`: the pool's local lane, tried before the handle (see module doc)."""
    def start() -> Any:
        return handle.options(stream=True).generate.remote(ereq)

    for attempt in (1, 2):
        gen = lane(ereq, start) if lane is not None else start()
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
            pause = retry_pause_s(e, started, attempt, deadline_s - time.monotonic())
            if pause is None:
                raise
            log.warning("request %s: engine replica of pool %s failed before output (%s); retrying once",
                        ereq.request_id, d.pool, "engine core died" if isinstance(e, EngineDead) else type(e).__name__)
            _cancel(gen, ereq.request_id)
            done = True  # nothing left to cancel in `finally`
            await asyncio.sleep(pause)
        finally:
            if not done:
                _cancel(gen, ereq.request_id)


def retry_pause_s(e: BaseException, started: bool, attempt: int, left_s: float) -> float | None:
    """How long to wait before retrying an engine call that failed with `e`, or None for no retry:
    only the first attempt, only before any output, only when the replica is gone; after an engine
    core's death, DEAD_ENGINE_RETRY_PAUSE_S (the dying replica's grace), cut to what is left of the
    deadline (`left_s`).

    >>> retry_pause_s(EngineDead("x"), False, 1, 60.0), retry_pause_s(EngineDead("x"), False, 1, 0.25)
    (1.0, 0.25)
    >>> retry_pause_s(EngineDead("x"), True, 1, 60.0), retry_pause_s(EngineDead("x"), False, 2, 60.0)
    (None, None)
    >>> retry_pause_s(RuntimeError("x"), False, 1, 60.0) is None
    True
    """
    if started or attempt != 1 or not _replica_gone(e):
        return None
    return max(min(DEAD_ENGINE_RETRY_PAUSE_S, left_s), 0.0) if isinstance(e, EngineDead) else 0.0


def map_error(e: Exception, rid: str, d: Decision) -> ApiError:
    """Ray / vLLM failures -> typed API errors (Ray's task errors are also instances of the cause)."""
    from ray.exceptions import TaskCancelledError
    from ray.serve.exceptions import BackPressureError, RequestCancelledError

    if isinstance(e, (BackPressureError, LaneBusy)):
        return ApiError(ErrorCode.RESOURCE_EXHAUSTED, f"pool {d.pool!r} is overloaded; retry later",
                        retry_after_s=RETRY_AFTER_S)
    if isinstance(e, (asyncio.CancelledError, RequestCancelledError, TaskCancelledError)):
        return ApiError(ErrorCode.CANCELLED, "request cancelled")
    if isinstance(e, ValueError):  # vLLM input validation (e.g. prompt longer than the context)
        return ApiError(ErrorCode.INVALID_ARGUMENT, f"prompt: {str(e).strip().splitlines()[-1][:300]}",
                        field="prompt")
    if isinstance(e, EngineDead):  # also Ray's task error carrying it
        return ApiError(ErrorCode.UNAVAILABLE, f"pool {d.pool!r}: the engine of the replica serving the request "
                                               "died; the pool is replacing it", retry_after_s=RETRY_AFTER_S)
    if _replica_gone(e):
        return ApiError(ErrorCode.UNAVAILABLE, f"engine replica unavailable ({type(e).__name__})",
                        retry_after_s=RETRY_AFTER_S)
    log.exception("request %s (pool %s, mode %s, k %d) failed", rid, d.pool, d.mode.value, d.k)
    return ApiError(ErrorCode.INTERNAL, f"internal error ({type(e).__name__}); request id {rid}")


def _replica_gone(e: BaseException) -> bool:
    """The replica cannot serve the call: its actor died or is unreachable, the deployment has no
    replica, or its vLLM engine core died (EngineDead, as Ray's task error carrying it)."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
    from ray.serve.exceptions import DeploymentUnavailableError

    return isinstance(e, (ActorDiedError, ActorUnavailableError, RayActorError, DeploymentUnavailableError,
                          EngineDead, LaneGone))


def _cancel(gen: Any, rid: str) -> None:
    """Cancel an engine call. A call whose assignment already failed (e.g. backpressure) re-raises
    that failure from cancel(); it is being reported to the caller already, so only log it here."""
    try:
        gen.cancel()
    except Exception as e:  # noqa: BLE001 - see docstring
        log.debug("request %s: nothing to cancel (%s)", rid, type(e).__name__)
