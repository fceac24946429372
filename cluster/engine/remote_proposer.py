"""Remote drafting: a vLLM proposer (`speculative_config.method = "custom_class"`) that asks a drafter
deployment (`deployments/drafter.py`) for the whole running batch's drafts once per target step.

It runs inside vLLM's engine-core process, on the step's critical path, so:

- one TCP round trip per step (`cluster.engine.draft_client` over `cluster.engine.draft_wire`), no Ray on
  that path; the engine replica finds the drafter through a Serve handle and hands its address in
  (`RemoteDraftWorkerExtension`);
- each sequence sends only its tokens since the last successful call (the drafter keeps state);
- a request whose K is 0 is not sent (its K comes from its SamplingParams, as in the scheduler);
- every call has a strict timeout, after which the step proceeds with no drafts (plain decoding);
- a circuit breaker stops paying that timeout on every step while the drafter is down, and lets
  one probe through every `reprobe_s`, so speculation resumes when the drafter is back.

Verification stays vLLM's: drafts only change how many tokens a step yields, never which.
The bookkeeping (`RemoteDraftSession`) and the breaker are plain classes, tested without vLLM.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from cluster.engine.draft_client import DrafterUnavailable, connector, plan_call
from cluster.engine.draft_limits import BadFrame, parse_reply
from cluster.percentile import percentile
from cluster.engine.proposer_base import NeverRaises, capped, watch_step_cap
from cluster.engine.vllm_scheduler import ADDITIONAL_CONFIG_KEY, requested_k

log = logging.getLogger("specserve.remote_proposer")

PROPOSER_CLS_PATH = "cluster.engine.remote_proposer.RemoteDraftProposer"
WORKER_EXTENSION_PATH = "cluster.engine.remote_proposer.RemoteDraftWorkerExtension"
REMOTE_CONFIG_KEY = "remote_drafter"  # under additional_config[ADDITIONAL_CONFIG_KEY]


# -- the breaker ------------------------------------------------------------------------------------


class CircuitBreaker:
    """Closed: every step calls. After `failures_to_open` consecutive failures: open, and a step may
    call only once every `reprobe_s` (a probe); a successful call closes it again."""

    def __init__(self, failures_to_open: int = 2, reprobe_s: float = 2.0):
        self.failures_to_open = failures_to_open
        self.reprobe_s = reprobe_s
        self.consecutive_failures = 0
        self.opened_at: Optional[float] = None
        self.last_probe_at = float("-inf")

    @property
    def is_open(self) -> bool:
        return self.opened_at is not None

    def allow(self, now: float) -> bool:
        if not self.is_open:
            return True
        if now - self.last_probe_at >= self.reprobe_s:
            self.last_probe_at = now
            return True
        return False

    def success(self) -> None:
        self.consecutive_failures = 0
        self.opened_at = None

    def failure(self, now: float) -> None:
        self.consecutive_failures += 1
        if self.consecutive_failures >= self.failures_to_open and not self.is_open:
            self.opened_at = now
            self.last_probe_at = now


# -- the bookkeeping --------------------------------------------------------------------------------


@dataclass
class SeqWork:
    """One running request in one step: its id, committed tokens, and the K it gets this step."""

    req_id: str
    tokens: Sequence[int]  # the request's committed tokens (prompt + output so far); may be a numpy row
    k: int


class RemoteDraftSession:
    """What one target engine has sent to its drafter, and the per-step call with its timeout.

    `step(batch)` -> drafts per request (a list per entry of `batch`, empty when none).
    """

    def __init__(self, connect: Callable[[str], Any], timeout_s: float = 0.05, failures_to_open: int = 2,
                 reprobe_s: float = 2.0, clock: Callable[[], float] = time.monotonic, samples: int = 4096,
                 vocab_size: Optional[int] = None):
        self.connect = connect  # endpoint -> a client with open(deadline), call(msg, deadline), close()
        self.vocab_size = vocab_size  # the target's: no draft id at or past it reaches vLLM
        self.timeout_s = timeout_s
        self.breaker = CircuitBreaker(failures_to_open, reprobe_s)
        self.clock = clock
        self.client_id = uuid.uuid4().hex[:12]
        self.endpoint: Optional[str] = None
        self._client = None
        self.sent: dict[str, int] = {}  # req_id -> committed tokens the drafter has
        self._to_evict: set[str] = set()
        # Counters and samples for status(): rtt = the whole call; overhead = rtt - drafter compute.
        self.calls = self.failures = self.skipped_open = self.resyncs = self.drafted = 0
        self.rtt_s: deque = deque(maxlen=samples)
        self.overhead_s: deque = deque(maxlen=samples)
        self.last_error: Optional[str] = None

    def set_endpoint(self, endpoint: Optional[str]) -> None:
        if endpoint == self.endpoint:
            return
        if self._client is not None:
            self._client.close()
        self.endpoint, self._client = endpoint, None
        self.sent.clear()  # a new drafter knows none of our sequences
        self._to_evict.clear()
        self.breaker.success()  # give the new endpoint a chance at once

    def step(self, batch: list[SeqWork]) -> list[list[int]]:
        live = {w.req_id for w in batch}
        for gone in [r for r in self.sent if r not in live]:
            del self.sent[gone]
            self._to_evict.add(gone)
        drafts: list[list[int]] = [[] for _ in batch]
        todo = [(i, w) for i, w in enumerate(batch) if w.k > 0 and len(w.tokens) > 0]
        if not todo or self.endpoint is None:
            return drafts
        now = self.clock()
        if not self.breaker.allow(now):
            self.skipped_open += 1
            return drafts
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.timeout_s
        try:
            if self._client is None:
                self._client = self.connect(self.endpoint)
            limits = self._client.open(deadline)
            calls, seqs, evict = plan_call(todo, self.sent, self._to_evict, limits)
            if not seqs:
                return drafts
            raw = self._client.call({"client": self.client_id, "evict": evict, "seqs": seqs}, deadline)
            vocab = min(limits.vocab_size, self.vocab_size or limits.vocab_size)
            got, resync, compute_s = parse_reply(raw, [k for _, _, _, k in calls], [len(w.tokens) for _, w, _, _ in calls],
                                                 vocab)
        except Exception as e:  # noqa: BLE001 - unreachable, refused, malformed (BadFrame) or a bug: no drafts
            self._failed(e)
            return drafts
        rtt = time.perf_counter() - t0
        self.calls += 1
        self.rtt_s.append(rtt)
        self.overhead_s.append(max(rtt - compute_s, 0.0))
        self.breaker.success()
        self._to_evict.difference_update(evict)
        for (i, w, _, _), d, r in zip(calls, got, resync):
            if r >= 0:
                self.sent[w.req_id] = r  # the drafter lost state: resend from there next step
                self.resyncs += 1
                continue
            self.sent[w.req_id] = len(w.tokens)
            drafts[i] = d
            self.drafted += len(d)
        return drafts

    def _failed(self, e: Exception) -> None:
        self.failures += 1
        kind = "" if isinstance(e, (DrafterUnavailable, BadFrame)) else f"{type(e).__name__}: "
        self.last_error = (kind + str(e))[:300]
        self.breaker.failure(self.clock())
        if self._client is not None:
            self._client.close()
            self._client = None

    def status(self) -> dict[str, Any]:
        return {
            "endpoint": self.endpoint, "breaker_open": self.breaker.is_open, "calls": self.calls,
            "failures": self.failures, "skipped_open": self.skipped_open, "resyncs": self.resyncs,
            "drafted": self.drafted, "sequences": len(self.sent), "last_error": self.last_error,
            "rtt_s": _quantiles(self.rtt_s), "overhead_s": _quantiles(self.overhead_s),
        }

    def reset_samples(self) -> None:
        self.rtt_s.clear()
        self.overhead_s.clear()


def public_drafter_status(status: dict[str, Any]) -> dict[str, Any]:
    """A session's status without where the drafter listens: for the engine's load report, which
    the router's status page shows (without a key when auth is off)."""
    out = {k: v for k, v in status.items() if k != "endpoint"}
    if "endpoint" in status:
        out["has_endpoint"] = status["endpoint"] is not None
    return out


def _quantiles(xs) -> dict[str, float]:
    if not xs:
        return {"n": 0}
    q = {f"p{p}": percentile(xs, p, "nearest_rank") for p in (50, 90, 99)}
    return {"n": len(xs), **q, "max": max(xs), "mean": sum(xs) / len(xs)}


# -- vLLM glue --------------------------------------------------------------------------------------


def remote_settings(vllm_config) -> dict[str, Any]:
    return ((vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY, {}) or {}).get(REMOTE_CONFIG_KEY, {}) or {}


def target_vocab_size(vllm_config) -> Optional[int]:
    try:
        return int(vllm_config.model_config.get_vocab_size())
    except Exception:  # noqa: BLE001 - a config without it (tests): the drafter's announced vocabulary bounds ids
        return None


class RemoteDraftProposer(NeverRaises):
    """vLLM `custom_class` proposer. `propose` gets the batch's tokens from vLLM; the request ids
    and each request's SamplingParams come from the model runner, which the worker extension
    attaches after start-up (until then, and without an endpoint, steps run without drafts)."""

    _log, _what = log, "remote proposer"

    def __init__(self, vllm_config):
        spec = vllm_config.speculative_config
        self.k_max = int(spec.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        s = remote_settings(vllm_config)
        self.session = RemoteDraftSession(
            connector(), timeout_s=float(s.get("timeout_s", 0.05)),
            failures_to_open=int(s.get("failures_to_open", 2)), reprobe_s=float(s.get("reprobe_s", 2.0)),
            vocab_size=target_vocab_size(vllm_config),
        )
        self.session.set_endpoint(s.get("endpoint"))
        self.runner = None
        self.step_cap: Optional[int] = None  # this step's bound from the scheduler (None: unknown)
        self.errors = 0

    def load_model(self, *args, **kwargs) -> None:
        pass  # the drafter's model lives in the drafter deployment

    def attach(self, runner) -> None:
        """Take the runner's batch from now on, and the scheduler's bound on each step's drafts
        (`watch_step_cap`: the drafter is not asked for drafts no request may verify)."""
        if self.runner is runner:
            return
        self.runner = runner
        watch_step_cap(self, runner)

    def _k(self, req_id: str) -> int:
        state = self.runner.requests.get(req_id)
        params = getattr(state, "sampling_params", None)
        return capped(requested_k(params.extra_args if params is not None else None, self.k_max), self.step_cap)

    def _propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu) -> list[list[int]]:
        n = len(sampled_token_ids)
        if self.runner is None:
            return [[] for _ in range(n)]
        req_ids = self.runner.input_batch.req_ids
        batch: list[SeqWork] = []
        for i in range(n):
            num_tokens = int(num_tokens_no_spec[i])
            k = 0
            if sampled_token_ids[i] and num_tokens < self.max_model_len:
                k = min(self._k(req_ids[i]), self.max_model_len - num_tokens - 1)
            batch.append(SeqWork(req_ids[i], token_ids_cpu[i, :num_tokens], max(k, 0)))
        return self.session.step(batch)


class RemoteDraftWorkerExtension:
    """Mixed into vLLM's worker (`worker_extension_cls`); the engine replica calls these through
    `AsyncLLM.collective_rpc` to hand the proposer its runner and the drafter's address."""

    def specserve_set_drafter(self, endpoint: Optional[str]) -> dict[str, Any]:
        drafter = self.model_runner.drafter
        drafter.attach(self.model_runner)
        drafter.session.set_endpoint(endpoint)
        return drafter.session.status()

    def specserve_drafter_status(self, reset_samples: bool = False) -> dict[str, Any]:
        drafter = self.model_runner.drafter
        drafter.attach(self.model_runner)
        status = drafter.session.status()
        if reset_samples:
            drafter.session.reset_samples()
        return status
