"""Router deployment: the ingress. Validates a request, decides pool / mode / K, streams from the engine.

It serves both front doors from one class: HTTP (OpenAI-compatible, `__call__` from the
`deployments.router_http.HttpDoor` mixin) and gRPC (`specserve.v1.SpecServe` and
`grpc.health.v1.Health` methods, called by Ray Serve's gRPC proxy by method name, from the
`deployments.router_grpc.GrpcDoor` mixin); this module is what both doors call. Dependencies (engine handles,
tuning store, classifier) are injected through `__init__`, so tests can build a Router without Ray. The decision itself is `cluster.routing.route.route`;
the call to the engine pool, with its bounded waits, is `deployments.engine_call`.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
from contextlib import aclosing
from dataclasses import replace
from typing import Any, AsyncIterator, Callable, Optional

from cluster.api.auth import AUTH_ERROR_MESSAGE, ApiKeyStore
from cluster.api.types import ApiError, ErrorCode, GenerateRequest, UpstreamError, check_prompt_size
from cluster.api.wire import Completion
from cluster.autoscale.policy import with_capacity
from cluster.config import ClusterConfig
from cluster.policy import class_model, load_bucket
from cluster.policy.teaching import Lesson, Teacher
from cluster.routing.deadline import Bounds
from cluster.routing.route import (Decision, LoadMeter, PoolView, decision_summary, drafting_mode, load_domain,
                                   per_step_k, pool_load, pool_views, resolve_model, route, with_load)
from deployments.engine import EngineChunk, EngineRequest
from deployments.engine_call import RETRY_AFTER_S, engine_chunks, map_error
from deployments.router_lane import REPORT_WINDOW_S
from deployments.router_grpc import GrpcDoor
from deployments.router_http import HttpDoor

log = logging.getLogger("specserve.router")

LOAD_POLL_INTERVAL_S = 0.25  # how often each pool's engine load is sampled
LOAD_POLL_TIMEOUT_S = 1.0
LOAD_REPORT_MAX_AGE_S = 2.0  # older engine load reports are ignored
FAILURE_LOG_INTERVAL_S = 60.0  # a recurring background failure is logged at most this often


def upstream_error(status: int, raw: str) -> UpstreamError:
    """vLLM's error answer as an error the door passes on as it is."""
    try:
        body = json.loads(raw)
    except ValueError:
        body = {"error": {"message": raw[:2000] or f"HTTP {status}", "type": "Error", "param": None, "code": status}}
    return UpstreamError(status, body)


def _default_classifier(prompt: Optional[str], messages: Optional[list[dict]]) -> str:
    return "chat"


class Router(HttpDoor, GrpcDoor):
    def __init__(
        self,
        config: ClusterConfig,
        engines: dict[str, Any],  # pool name -> DeploymentHandle of engine-<pool> (or a test double)
        tuning: Any = None,  # cluster.state.tuning store (optional)
        classifier: Optional[Callable[..., str]] = None,
        auth: Optional[ApiKeyStore] = None,  # None: no API key required
        metrics: Any = None,  # cluster.ops.metrics.RouterMetrics (optional)
        autoscale: Any = None,  # cluster.autoscale.ray_policy.AutoscaleRecords: the autoscaler's decisions (optional)
        lanes: Any = None,  # deployments.router_lane.Lanes: the engine replicas' lanes on this node (optional)
    ):
        self.config = config
        self.engines = engines
        self.tuning = tuning
        self.classify = classifier or _default_classifier
        self.views = {v.name: v for v in pool_views(config)}
        self.inflight: dict[str, int] = {name: 0 for name in config.pools}  # this router's view of load
        self.meter = LoadMeter()  # time-weighted in-flight per load domain: the load a request met
        self.served = config.served_models()
        self.auth = auth
        self.metrics = metrics
        self.autoscale = autoscale
        self.lanes = lanes
        # Engine replicas' own load reports, sampled in the background (see _poll_load).
        self.engine_load: dict[str, dict[str, tuple[float, float]]] = {name: {} for name in config.pools}
        # When this router's requests finished, per pool and replica (those newer than any report kept).
        self.finished: dict[str, dict[str, list[float]]] = {name: {} for name in config.pools}
        self._load_poll: Optional[asyncio.Task] = None
        self.health_open = auth is None or config.auth.allow_unauthenticated_health
        self.failures: collections.Counter = collections.Counter()  # what -> failures off the request path
        self.teacher = Teacher.from_config(config.router.teaching)  # what traffic teaches the tuner
        self._last_warn: dict[tuple[str, str], float] = {}  # (what, context) -> when last logged

    @property
    def bounds(self) -> Bounds:
        """A request's deadline and engine waits, from the router config (`cluster.routing.deadline`)."""
        return Bounds.from_config(self.config.router)

    def _authenticate(self, header_value: Optional[str]) -> Optional[str]:
        """The valid key's label (None without keys); else UNAUTHENTICATED, with one message whatever was wrong."""
        label = self.auth.check(header_value) if self.auth is not None else None
        if self.auth is not None and label is None:
            raise ApiError(ErrorCode.UNAUTHENTICATED, AUTH_ERROR_MESSAGE)
        return label

    # -- the decision ----------------------------------------------------------------------------

    def _live_pools(self, model: str) -> list[PoolView]:
        load = pool_load(self.inflight, self.engine_load, time.monotonic(), LOAD_REPORT_MAX_AGE_S, self.finished)
        views = list(self.views.values())
        if self.autoscale is not None:  # the replicas the autoscaler decided, a starting scale-up included
            views = with_capacity(views, self.autoscale.records(), time.time())
        return [v for v in with_load(views, load) if v.model == model]

    def _ensure_load_poll(self) -> None:
        if self._load_poll is None or self._load_poll.done():
            self._load_poll = asyncio.get_running_loop().create_task(self._poll_load())

    async def _poll_load(self) -> None:
        """Sample every pool's engine load (`EngineServer.load`: unfinished requests of the replica
        that answers) every LOAD_POLL_INTERVAL_S, off the request path. Ray's handle picks a
        replica per call, so over successive polls each replica of a pool reports; reports older
        than LOAD_REPORT_MAX_AGE_S are dropped (a replica that went away stops counting)."""
        while True:
            for name, handle in self.engines.items():
                try:
                    sent = time.monotonic()  # the report is no older than this
                    rep = await asyncio.wait_for(handle.load.remote(), timeout=LOAD_POLL_TIMEOUT_S)
                    self.engine_load[name][str(rep["replica"])] = (sent, float(rep["unfinished"]))
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # noqa: BLE001 - a busy or dying replica: keep the router's own count
                    self._failed("load_poll", e, f"pool {name}")
            await asyncio.sleep(LOAD_POLL_INTERVAL_S)

    def _failed(self, what: str, e: BaseException, context: str) -> None:
        """A failure off the request path (`what`: load_poll, get_tuning): counted in `failures` and
        the metrics, logged at WARNING with its context at most once a minute per what and context."""
        kind = type(e).__name__
        self.failures[what] += 1
        if self.metrics is not None:
            self.metrics.failure(what, kind)
        now = time.monotonic()
        if now - self._last_warn.get((what, context), -1e9) >= FAILURE_LOG_INTERVAL_S:
            self._last_warn[(what, context)] = now
            log.warning("%s failed (%s; %d failures so far): %s: %s", what, context, self.failures[what], kind,
                        str(e)[:300])

    def decide(self, req: GenerateRequest) -> tuple[str, Decision]:
        """Validated request -> (model, Decision). Pure apart from reading the live counters."""
        model = resolve_model(req.model, self.served)
        classified = req.format_class or self.classify(req.prompt, [m.model_dump() for m in req.messages] if req.messages else None)
        wclass = req.workload_class or classified
        spec = req.speculative
        mode, k = (spec.mode, spec.k) if spec else (None, None)
        if req.plain_field:  # served at K = 0 only (`cluster.engine.plain_params`)
            if mode not in (None, "none") or k:
                raise ApiError(ErrorCode.INVALID_ARGUMENT,
                               f"{req.plain_field}: served only without speculation (K = 0), but specserve.speculative "
                               f"asks for {mode} K {k}", field=req.plain_field)
            mode, k = "none", 0
        tuning = self.tuning.snapshot(model) if self.tuning is not None else None
        decision = route(self._live_pools(model), self.config.router, wclass, mode_override=mode, k_override=k,
                         tuning=tuning)
        if req.plain_field:
            decision.detail["plain_for"] = req.plain_field
        decision.detail["classified"] = classified  # what teaches the tuner (`cluster.policy.teaching`)
        if "load_bucket" not in decision.detail:  # the bucket its stats belong to: the load it met
            live = {v.name: v for v in self._live_pools(model)}
            decision.detail["load_bucket"] = load_bucket(live[decision.pool].load_batch + 1.0)
        if (self.tuning is not None and decision.decided_by == "policy" and self.metrics is not None
                and not self.tuning.healthy):
            self.metrics.fallback(wclass)
        pool = self.config.pools[decision.pool]
        if req.max_tokens >= pool.max_model_len:
            raise ApiError(ErrorCode.INVALID_ARGUMENT,
                           f"max_tokens: {req.max_tokens} must be below the model's context length "
                           f"({pool.max_model_len})", field="max_tokens")
        return model, decision

    # -- generation ------------------------------------------------------------------------------

    def plan(self, req: GenerateRequest, streamed: bool = True, openai: Optional[dict[str, Any]] = None,
             ) -> tuple[str, Decision, EngineRequest]:
        """Validate against the cluster and decide; raises ApiError before anything is sent.
        `streamed`: the caller reads the text as it comes (else the engine sends it at the end).
        `openai`: an OpenAI call for vLLM's serving layer (`EngineRequest.openai`)."""
        rid = req.ensure_request_id()
        check_prompt_size(req, self.config.api.limits.max_prompt_chars)
        model, d = self.decide(req)
        # The policy chose pool and method: the engine picks K at every step from the class's α
        # (`per_step_k`). A K the caller named, or the configured default's, is kept.
        if d.decided_by == "policy":
            d = per_step_k(d, self.config.pools[d.pool], self._class_alpha(model, d))
        step_alpha = d.detail.get("k_step_alpha")
        ereq = EngineRequest(
            request_id=rid, mode=d.mode.value, k=d.k, prompt=req.prompt,
            messages=[m.model_dump() for m in req.messages] if req.messages else None,
            max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p, seed=req.seed,
            stop=list(req.stop), logprobs=req.logprobs, ignore_eos=req.ignore_eos,
            k_step_alpha=step_alpha, streamed=streamed, openai=openai,
        )
        return model, d, ereq

    def _class_alpha(self, model: str, d: Decision) -> float:
        """α of the decision's class for its pool's method: learned from traffic (the tuning state),
        else the pool's prior."""
        view = self.views[d.pool]
        mode = drafting_mode(d, self.config.pools[d.pool])
        priors = next((a.prior_alpha for a in view.also if a.mode == mode), view.prior_alpha)
        tuning = self.tuning.snapshot(model) if self.tuning is not None else None
        return class_model(tuning, mode.value, d.workload_class, priors)[0]

    async def _stream(self, req: GenerateRequest, streamed: bool = True, client: str = "unknown",
                      deadline_s: Optional[float] = None, openai: Optional[dict[str, Any]] = None,
                      ) -> AsyncIterator[tuple[EngineChunk, Completion]]:
        """Yield (chunk, running completion) pairs; the last pair has the final stats. `client`:
        who sent it (`cluster.policy.teaching.client_id`); `deadline_s`: when it must be done (monotonic;
        default router.request_timeout_s from now, `cluster.routing.deadline`); `openai`: the call is
        served by vLLM's serving layer, whose error answer is raised as `UpstreamError`."""
        t0 = time.perf_counter()
        deadline_s = deadline_s if deadline_s is not None else self.bounds.deadline(time.monotonic())
        self._ensure_load_poll()
        model, d, ereq = self.plan(req, streamed, openai)
        rid = ereq.request_id
        comp = Completion(request_id=rid, model=model)
        self.inflight[d.pool] += 1
        domain = load_domain(self.views[d.pool])
        self.meter.change(domain, +1, time.monotonic())
        mark = self.meter.mark(domain, time.monotonic())
        replica = ""
        try:
            async with aclosing(engine_chunks(self.engines[d.pool], self.bounds, deadline_s, d, ereq,
                                              lane=self._lane(d.pool))) as chunks:
                async for chunk in chunks:
                    now = time.perf_counter()
                    replica = chunk.replica or replica
                    if chunk.http_status is not None and chunk.http_status >= 400:
                        raise upstream_error(chunk.http_status, chunk.raw)
                    if not comp.token_ids and chunk.token_ids:
                        comp.ttft_s = now - t0
                    comp.text += chunk.text
                    comp.token_ids.extend(chunk.token_ids)
                    if chunk.logprobs:
                        comp.logprobs = (comp.logprobs or []) + chunk.logprobs
                    if chunk.finish_reason is not None:
                        comp.finish_reason = chunk.finish_reason
                        comp.prompt_tokens = chunk.prompt_tokens
                        comp.completion_tokens = chunk.completion_tokens
                        comp.latency_s = now - t0
                        comp.stats = {**(chunk.stats or {}), "pool": d.pool, "replica": chunk.replica,
                                      "decided_by": d.decided_by, "workload_class": d.workload_class,
                                      "explored": bool(d.detail.get("explore")) if d.detail else False,
                                      "decision": decision_summary(d)}
                    yield chunk, comp
            if comp.finish_reason is None:
                raise ApiError(ErrorCode.UNAVAILABLE, "engine stream ended before the request finished",
                               retry_after_s=RETRY_AFTER_S)
            met = self._at_met_load(d, self.meter.mean_since(domain, mark, time.monotonic()))
            self._record(model, met, comp, Lesson.of(req, d), client)
        except ApiError:
            raise
        except Exception as e:  # noqa: BLE001 - mapped to a typed API error with context
            raise map_error(e, rid, d) from e
        finally:
            self.inflight[d.pool] -= 1
            self.meter.change(domain, -1, time.monotonic())
            if replica:
                self._note_finished(d.pool, replica)

    def _lane(self, pool: str) -> Optional[Callable[[EngineRequest, Callable[[], Any]], Any]]:
        """The pool's local lane (`deployments.router_lane`) when every replica that reported its load
        lately has one on this node; else None (the call goes by the pool's handle)."""
        if self.lanes is None:
            return None
        now = time.monotonic()
        reported = [r for r, (t, _) in self.engine_load[pool].items() if now - t <= REPORT_WINDOW_S]
        if not self.lanes.usable(pool, reported):
            return None
        return lambda ereq, start: self.lanes.call(pool, ereq, start)

    def _note_finished(self, pool: str, replica: str) -> None:
        """Remember when a request left `replica` (see `pool_load`); forget what no report predates."""
        now = time.monotonic()
        done = self.finished[pool].setdefault(replica, [])
        done.append(now)
        if done[0] < now - LOAD_REPORT_MAX_AGE_S:
            done[:] = [t for t in done if t >= now - LOAD_REPORT_MAX_AGE_S]

    def _at_met_load(self, d: Decision, met: Optional[float]) -> Decision:
        """`d` with the load bucket its statistics belong to: the mean load this router saw on the
        pool's load domain (its hardware group, or the pool per replica) over the request's life
        (`LoadMeter`), instead of the load at admission (kept as `admission_bucket`)."""
        if met is None:
            return d
        view = self.views[d.pool]
        if view.hardware_group is None:
            met /= max(view.replicas, 1)
        return replace(d, detail={**d.detail, "load_bucket": load_bucket(max(met, 1.0)),
                                  "admission_bucket": d.detail.get("load_bucket")})

    def _record(self, model: str, d: Decision, comp: Completion, lesson: Lesson, client: str) -> None:
        """Metrics and tuning state from a finished request; neither may ever fail the request. The
        tuning state learns only from what `self.teacher` admits (`cluster.policy.teaching`)."""
        try:
            if self.metrics is not None:
                self.metrics.observe(d, comp.stats)
            if self.tuning is None:
                return
            why = self.teacher.exclusion(lesson, client, time.monotonic())
            if why is None:
                self.tuning.record_completion(model, d, comp)  # in the bucket of the load it met
            elif self.metrics is not None:
                self.metrics.tuning_excluded(why)
        except Exception:  # noqa: BLE001 - see docstring; logged with context
            log.warning("recording stats of %s (pool %s, mode %s, k %d) failed", comp.request_id, d.pool,
                        d.mode.value, d.k, exc_info=True)

    def models_json(self) -> dict[str, Any]:
        data = []
        for m in self.served:
            pools = [{"name": n, "method": p.method.value, "max_k": p.max_k, "modes": [x.value for x in p.modes],
                      "max_k_by_mode": {x.value: p.mode_max_k(x) for x in p.modes}, "auto": p.auto}
                     for n, p in self.config.pools.items() if p.model == m]
            data.append({"id": m, "object": "model", "created": 0, "owned_by": "specserve",
                         "specserve": {"pools": pools}})
        return {"object": "list", "data": data}

    async def forget_outputs(self) -> dict[str, Any]:
        """Every pool that drafts from suffix trees drops its earlier requests' outputs
        (`EngineDeployment.forget_outputs`; a handle call reaches one replica of the pool)."""
        pools = {}
        for n, p in self.config.pools.items():
            if not p.uses_lookup_proposer:
                continue
            try:
                pools[n] = await asyncio.wait_for(self.engines[n].forget_outputs.remote(), timeout=30)
            except Exception as e:  # noqa: BLE001 - each pool answers for itself
                pools[n] = {"error": f"{type(e).__name__}: {e}"[:200]}
        return {"pools": pools}

    async def status(self) -> dict[str, Any]:
        """Pools with this router's in-flight count and one engine replica's own load report."""
        pools = {}
        for n, p in self.config.pools.items():
            entry: dict[str, Any] = {"method": p.method.value, "max_k": p.max_k, "inflight": self.inflight[n]}
            if self.lanes is not None:  # the pool's lanes on this router's node, and calls that took one
                entry["lanes"] = {"local": len(self.lanes.local(n)), "calls": self.lanes.calls.get(n, 0)}
            try:
                entry["engine"] = await asyncio.wait_for(self.engines[n].load.remote(), timeout=5)
            except Exception as e:  # noqa: BLE001 - status reports what it could not read
                entry["engine_error"] = f"{type(e).__name__}: {e}"[:200]
            pools[n] = entry
        return {
            "models": self.served,
            "pools": pools,
            "redis_ok": bool(self.tuning is not None and getattr(self.tuning, "healthy", False)),
            **({"autoscale": self.autoscale.records()} if self.autoscale is not None else {}),
        }
