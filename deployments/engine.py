"""Engine deployment: one vLLM AsyncLLM per replica of a pool, streaming tokens with speculative stats.

The engine knows nothing about routing: it serves whatever K (0..K_max) each request carries,
inside one engine, through `cluster.engine.vllm_scheduler.PerRequestKScheduler`. It is a plain class
(`EngineServer`); `deployments/app.py` turns it into a Ray Serve deployment.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import aclosing
from typing import Any, AsyncIterator, Awaitable, Callable, Optional

from cluster.autoscale.policy import LatencyWindow
from cluster.engine.coalesce import flush
from cluster.engine.remote_proposer import public_drafter_status
from deployments.vllm_args import engine_kwargs, speculative_config  # noqa: F401 - the replica's and tests' entry
from cluster.config_pool import PoolConfig
from cluster.speculation import SpecMode
from deployments.engine_death import EngineDead, engine_died
from deployments.engine_openai import OpenAIDoor
from deployments.engine_types import (EngineChunk, EngineRequest, collect, extra_args,  # noqa: F401 - re-exported
                                      join_chunks, stats_from_output)

log = logging.getLogger("specserve.engine")

# How often the drafter watch asks a healthy proposer for its status. Each ask is an RPC into the
# engine's model worker, after which vLLM's worker busy-polls its message queue for a second
# (shm_broadcast's SpinCondition): asked every second, an idle worker never left that loop and took
# ~90% of its core from whatever shares it.
DRAFTER_HEALTHY_CHECK_S = 30.0


def drafter_watch_interval_s(healthy: bool, reprobe_s: float) -> float:
    """Seconds until the drafter watch looks again: `remote_reprobe_s` while the proposer has no
    drafter or its breaker is open, DRAFTER_HEALTHY_CHECK_S (or reprobe_s, if longer) while it drafts.

    >>> drafter_watch_interval_s(False, 2.0), drafter_watch_interval_s(True, 2.0), drafter_watch_interval_s(True, 60.0)
    (2.0, 30.0, 60.0)
    """
    return max(reprobe_s, DRAFTER_HEALTHY_CHECK_S) if healthy else reprobe_s


# A call into the engine's workers (`collective_rpc`: pointing the remote proposer at a drafter,
# reading its counters) waits at most this long; it runs between engine steps, so a stuck engine
# core would otherwise hold every caller (the router's load poll asks four times a second).
RPC_TIMEOUT_S = 10.0
ATTACH_RETRY_S = 5.0  # a failed attach of the lookup proposer is tried again after this


class EngineInputError(ValueError):
    """The engine refused the request's input (e.g. prompt plus max_tokens beyond the context)."""


class EngineServer(OpenAIDoor):
    """One engine replica: owns an AsyncLLM, serves EngineRequests as streams of EngineChunks.

    Once its engine core is known dead (`deployments.engine_death`), every call fails at once with
    `EngineDead` and `retire` runs, once: in a Serve replica (`deployments.app.EngineReplica`), the
    replica's process ends after a short grace so that Ray Serve replaces it."""

    def __init__(
        self,
        pool_name: str,
        pool: PoolConfig,
        served_name: str,
        engine: Any,
        drafter_endpoint: Optional[Callable[[], Awaitable[str]]] = None,
        retire: Optional[Callable[[], Any]] = None,
    ):
        """`engine`: a started AsyncLLM (`deployments.engine_start.start_vllm`). `retire`: ends the
        replica's process once the engine is known dead (`retire_process` for an engine this process
        started; None: nothing)."""
        self.pool_name = pool_name
        self.pool = pool
        self.served_name = served_name
        self.replica = f"{pool_name}-{id(self):x}"
        self._retire = retire if retire is not None else (lambda: None)
        self._dead: Optional[str] = None  # why the engine is known dead
        self.engine = engine
        self._tokenizer = None
        self._last_probe_ok = float("-inf")
        # Finished requests over the autoscaler's window (latency percentiles, token rates).
        self._finished = LatencyWindow(pool.autoscaling.metrics_window_s if pool.autoscaling else 30.0)
        # method remote_draft: where the drafter deployment answers (asked through a Serve handle).
        self._drafter_endpoint = drafter_endpoint
        self._drafter_watch: Optional[asyncio.Task] = None
        self._lookup_attached = False  # pools with the lookup proposer: its runner handed in
        self._lookup_tried = float("-inf")
        self.lane: Any = None  # deployments.engine_lane.LaneServer, started by the Serve replica

    # -- requests -----------------------------------------------------------------------------

    def _prompt(self, req: EngineRequest) -> str:
        if req.messages is not None:
            if self._tokenizer is None:
                self._tokenizer = self.engine.get_tokenizer()
            return self._tokenizer.apply_chat_template(req.messages, tokenize=False, add_generation_prompt=True)
        return req.prompt or ""

    def _sampling_params(self, req: EngineRequest):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            max_tokens=req.max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            seed=req.seed,
            stop=req.stop or None,
            logprobs=req.logprobs,
            ignore_eos=req.ignore_eos,
            output_kind=RequestOutputKind.DELTA,
            extra_args=extra_args(req),
        )

    async def generate(self, req: EngineRequest) -> AsyncIterator[EngineChunk]:
        """Stream the completion of `req`. Cancelling the consumer aborts the request in vLLM."""
        self._check_alive()
        self._ensure_drafter_watch()
        if self.pool.uses_lookup_proposer and not self._lookup_attached:
            await self._attach_lookup()
        if req.k > self.pool.mode_max_k(SpecMode.parse(req.mode)):
            raise ValueError(f"k={req.k} exceeds pool {self.pool_name!r} max_k={self.pool.mode_max_k(SpecMode.parse(req.mode))} "
                             f"for mode {req.mode!r}")
        if req.openai is not None:
            async with aclosing(self._openai_chunks(req)) as chunks:
                async for chunk in chunks:
                    yield chunk
            return
        prompt = self._prompt(req)
        params = self._sampling_params(req)
        completion_tokens = 0
        t_start, t_first = time.monotonic(), None
        pending: list[EngineChunk] = []  # outputs gathered into the next chunk (cluster.engine.coalesce)
        pending_tokens, sent_any, t_sent = 0, False, t_start
        async with aclosing(self._engine_outputs(prompt, params, req.request_id)) as outs:
            async for out in outs:
                c = out.outputs[0]
                completion_tokens += len(c.token_ids)
                if t_first is None and c.token_ids:
                    t_first = time.monotonic()
                chunk = EngineChunk(text=c.text, token_ids=list(c.token_ids), replica=self.replica)
                if req.logprobs is not None and c.logprobs:
                    chunk.logprobs = [{tid: lp.logprob for tid, lp in pos.items()} for pos in c.logprobs]
                if out.finished:
                    chunk.finish_reason = c.finish_reason or "stop"
                    chunk.prompt_tokens = len(out.prompt_token_ids or [])
                    chunk.completion_tokens = completion_tokens
                    metrics = getattr(c, "spec_decode_metrics", None)
                    chunk.stats = stats_from_output(req.mode, req.k, completion_tokens, metrics).to_dict()
                    if not req.request_id.startswith("health-"):
                        now = time.monotonic()
                        first = t_first if t_first is not None else now
                        self._finished.add(now, first - t_start, now - first, completion_tokens,
                                           int(chunk.stats.get("accepted", 0)), req.k)
                pending.append(chunk)
                pending_tokens += len(chunk.token_ids)
                if flush(pending_tokens, sent_any, out.finished, self.engine.get_num_unfinished_requests(),
                         self.pool.stream_chunks_per_step, req.streamed, time.monotonic() - t_sent):
                    yield pending[0] if len(pending) == 1 else join_chunks(pending)
                    pending, pending_tokens, sent_any, t_sent = [], 0, True, time.monotonic()

    async def _engine_outputs(self, prompt: str, params: Any, request_id: str):
        """vLLM's output stream, with its input-validation errors turned into EngineInputError and
        the death of its engine core (before or during the stream) into EngineDead."""
        from vllm.exceptions import VLLMClientError

        try:
            async with aclosing(self.engine.generate(prompt, params, request_id)) as outs:
                async for out in outs:
                    yield out
        except Exception as e:  # noqa: BLE001 - sorted below; anything else is re-raised as is
            if engine_died(e, self._errored()):
                raise self._engine_dead(f"{type(e).__name__} in generate") from None
            if isinstance(e, (VLLMClientError, ValueError)):
                raise EngineInputError(str(e).strip().splitlines()[-1][:300] if str(e).strip() else type(e).__name__) from None
            raise

    # -- engine death (deployments.engine_death) ---------------------------------------------------

    def _errored(self) -> bool:
        return getattr(self.engine, "errored", False) is True  # AsyncLLM's bool; a test double may lack it

    def _engine_dead(self, why: str) -> EngineDead:
        """Note that the engine is dead (the first time: log it and retire) and return the error
        every call gets from now on."""
        if self._dead is None:
            self._dead = why
            log.error("pool %s: the vLLM engine core of replica %s died (%s); failing its calls and "
                      "retiring the replica", self.pool_name, self.replica, why)
            try:
                self._retire()
            except Exception:  # noqa: BLE001 - the calls fail with EngineDead regardless
                log.exception("pool %s: retiring replica %s failed", self.pool_name, self.replica)
        return EngineDead(f"pool {self.pool_name!r}: the engine core of replica {self.replica} died ({self._dead})")

    def _check_alive(self) -> None:
        """EngineDead if the engine is known dead, or vLLM now reports it errored."""
        if self._dead is None and self._errored():
            self._engine_dead("vLLM reports the engine errored")
        if self._dead is not None:
            raise self._engine_dead(self._dead)

    async def load(self) -> dict[str, Any]:
        """Live load of this replica (cheap, non-blocking). The router asks four times a second, so
        an idle replica notices here that its engine died (and retires)."""
        try:
            self._check_alive()
        except EngineDead:
            pass  # the report still answers; `engine_dead` says it
        out = {
            "pool": self.pool_name,
            "replica": self.replica,
            "unfinished": self.engine.get_num_unfinished_requests(),
            "max_k": self.pool.max_k,
            **({"engine_dead": True} if self._dead is not None else {}),
        }
        if self.pool.method == SpecMode.REMOTE_DRAFT and self._dead is None:
            try:
                out["remote_drafter"] = public_drafter_status(await self.drafter_status())
            except TimeoutError as e:  # the load report stays cheap and answers
                out["remote_drafter"] = {"error": str(e)}
        return out

    # -- remote drafter (method remote_draft) ----------------------------------------------------

    def _ensure_drafter_watch(self) -> None:
        if self._drafter_endpoint is not None and (self._drafter_watch is None or self._drafter_watch.done()):
            self._drafter_watch = asyncio.get_running_loop().create_task(self._watch_drafter())

    async def _watch_drafter(self) -> None:
        """Keep the proposer in the engine process pointed at a live drafter replica: when it has
        none, or its breaker is open, ask the drafter deployment (any replica) where it answers.
        A dead drafter never fails a request here: the engine decodes without drafts meanwhile."""
        while True:
            healthy = False
            try:
                status = await self.drafter_status()
                healthy = status.get("endpoint") is not None and not status.get("breaker_open")
                if not healthy:
                    endpoint = await asyncio.wait_for(self._drafter_endpoint(), timeout=10.0)
                    if endpoint != status.get("endpoint"):
                        await self._rpc("specserve_set_drafter", endpoint)
                        log.info("pool %s: drafting remotely on %s (was %s: %s)", self.pool_name, endpoint,
                                 status.get("endpoint"), status.get("last_error"))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - drafter gone or Serve busy: retry; decoding goes on
                log.warning("pool %s: no drafter endpoint yet (%s: %s)", self.pool_name, type(e).__name__, e)
            await asyncio.sleep(drafter_watch_interval_s(healthy, self.pool.remote_reprobe_s))

    async def drafter_status(self, reset_samples: bool = False) -> dict[str, Any]:
        """The remote proposer's counters and call-time quantiles (rtt, transport overhead)."""
        if self.pool.method != SpecMode.REMOTE_DRAFT:
            return {}
        return (await self._rpc("specserve_drafter_status", reset_samples))[0]

    async def _attach_lookup(self) -> None:
        """Hand the lookup proposer its model runner (once; until then it drafts n-gram for every
        request). A failure is retried at most every ATTACH_RETRY_S; the request goes on (a dead
        engine fails it in the engine call, as always)."""
        now = time.monotonic()
        if now - self._lookup_tried < ATTACH_RETRY_S:
            return
        self._lookup_tried = now
        try:
            status = (await self._rpc("specserve_attach_lookup"))[0]
            self._lookup_attached = bool(status.get("attached"))
        except Exception as e:  # noqa: BLE001 - drafting falls back to n-gram; serving goes on
            log.warning("pool %s: lookup proposer not attached (%s: %s); n-gram drafts for every mode meanwhile",
                        self.pool_name, type(e).__name__, e)

    async def forget_outputs(self) -> dict[str, Any]:
        """Drop earlier requests' outputs from this replica's suffix trees (`LookupProposer.forget`):
        for a tenant whose outputs must not shape later drafts, or a benchmark that must not meet its
        own answers again. A pool without the lookup proposer has nothing to forget."""
        self._check_alive()
        if not self.pool.uses_lookup_proposer:
            return {"pool": self.pool_name, "replica": self.replica, "forgotten": 0}
        forgotten = (await self._rpc("specserve_forget_outputs"))[0]
        log.info("pool %s: forgot %d earlier outputs", self.pool_name, forgotten)
        return {"pool": self.pool_name, "replica": self.replica, "forgotten": int(forgotten)}

    async def _rpc(self, method: str, *args: Any) -> list[Any]:
        """`AsyncLLM.collective_rpc` bounded by RPC_TIMEOUT_S, here and in vLLM's executor (TimeoutError naming it)."""
        try:
            return await asyncio.wait_for(self.engine.collective_rpc(method, timeout=RPC_TIMEOUT_S, args=args),
                                          timeout=RPC_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise TimeoutError(f"pool {self.pool_name}: engine call {method} took more than {RPC_TIMEOUT_S:g} s") from None

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Ray Serve's custom autoscaling metrics of this replica (`cluster.autoscale.policy.ReplicaMetrics`):
        requests in the engine, and over the window: finished requests, tokens and accepted tokens per
        second, p99 TPOT and TTFT (-1 when none finished), mean K. Ray averages them per replica."""
        return {"unfinished": float(self.engine.get_num_unfinished_requests()),
                # calls on the local lane, which Serve does not count
                "lane_ongoing": float(self.lane.ongoing if self.lane is not None else 0),
                **self._finished.summary(time.monotonic())}

    async def check_health(self) -> None:
        """Ray Serve's health check: the engine's own check every time, and a real 1-token
        generation at most every `health_probe_interval_s`, bounded by `health_probe_timeout_s`,
        so a silently dead or stalled engine fails the check and Ray Serve replaces the replica. A
        dead engine core fails it at once (EngineDead), and the replica retires."""
        self._check_alive()
        self._ensure_drafter_watch()
        if self.pool.uses_lookup_proposer and not self._lookup_attached:
            await self._attach_lookup()
        try:
            await self.engine.check_health()
        except Exception as e:  # noqa: BLE001 - a dead engine is EngineDead; other failures as they are
            if engine_died(e, self._errored()):
                raise self._engine_dead(f"{type(e).__name__} in check_health") from None
            raise
        now = time.monotonic()
        if now - self._last_probe_ok < self.pool.health_probe_interval_s:
            return
        probe = EngineRequest(request_id=f"health-{self.replica}-{int(now * 1000)}", mode="none", k=0,
                              prompt="ping", max_tokens=1)
        try:
            await asyncio.wait_for(collect(self.generate(probe)), timeout=self.pool.health_probe_timeout_s)
        except asyncio.TimeoutError:
            raise RuntimeError(f"engine of pool {self.pool_name} did not generate 1 token in "
                               f"{self.pool.health_probe_timeout_s:.0f} s (stalled)") from None
        self._last_probe_ok = time.monotonic()

    def shutdown(self) -> None:
        """Stop serving, once: later calls fail with `EngineDead` ("shutting down", which does not
        retire the process), the drafter watch stops and the engine shuts down. Idempotent."""
        if getattr(self, "_shut", False):
            return
        self._shut = True
        lane = getattr(self, "lane", None)
        if lane is not None:
            lane.close()
        if getattr(self, "_dead", "") is None:  # a stopped engine is not a dead one: nothing to retire
            self._dead = "the replica is shutting down"
        watch = getattr(self, "_drafter_watch", None)
        if watch is not None and not watch.done():
            watch.cancel()
        engine = getattr(self, "engine", None)
        if engine is not None and hasattr(engine, "shutdown"):
            try:
                engine.shutdown()
            except Exception:  # noqa: BLE001 - best effort: the process is going away
                log.warning("pool %s: engine shutdown failed", getattr(self, "pool_name", "?"), exc_info=True)

    def __del__(self):  # Ray Serve's hook when it stops a replica
        self.shutdown()
