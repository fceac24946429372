"""Remote drafting: a vLLM proposer (`speculative_config.method = "custom_class"`) that asks a drafter
deployment (`deployments/drafter.py`) for the whole running batch's drafts once per target step.

It runs inside vLLM's engine-core process, on the step's critical path, so:

- one TCP round trip per step (`cluster.draft_wire`), no Ray on that path; the engine replica finds
  the drafter through a Serve handle and hands its address in (`RemoteDraftWorkerExtension`);
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
import socket
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from cluster.draft_wire import WireError, recv_frame, send_frame
from cluster.percentile import percentile
from cluster.vllm_scheduler import ADDITIONAL_CONFIG_KEY, cap_table_from, effective_k, requested_k

log = logging.getLogger("specserve.remote_proposer")

PROPOSER_CLS_PATH = "cluster.remote_proposer.RemoteDraftProposer"
WORKER_EXTENSION_PATH = "cluster.remote_proposer.RemoteDraftWorkerExtension"
REMOTE_CONFIG_KEY = "remote_drafter"  # under additional_config[ADDITIONAL_CONFIG_KEY]


class DrafterUnavailable(ConnectionError):
    """The drafter did not answer in time, refused, or answered garbage; the step goes on without drafts."""


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


# -- the transport ----------------------------------------------------------------------------------


class TcpDraftClient:
    """One persistent connection to one drafter replica; any error closes it (reconnect next call)."""

    def __init__(self, endpoint: str):
        host, _, port = endpoint.rpartition(":")
        self.endpoint = endpoint
        self._addr = (host, int(port))
        self._sock: Optional[socket.socket] = None

    def call(self, msg: dict, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        try:
            if self._sock is None:
                self._sock = socket.create_connection(self._addr, timeout=timeout_s)
                self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock.settimeout(max(deadline - time.monotonic(), 1e-3))
            send_frame(self._sock, msg)
            reply = recv_frame(self._sock)
        except (OSError, WireError) as e:  # socket.timeout is an OSError
            self.close()  # a late reply must never be read as the next step's
            raise DrafterUnavailable(f"{type(e).__name__}: {e}") from None
        if not isinstance(reply, dict) or "error" in reply:
            raise DrafterUnavailable(f"{reply.get('error') if isinstance(reply, dict) else reply!r}"[:300])
        return reply

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None


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
                 reprobe_s: float = 2.0, clock: Callable[[], float] = time.monotonic, samples: int = 4096):
        self.connect = connect
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
        starts = [min(self.sent.get(w.req_id, 0), len(w.tokens)) for _, w in todo]
        msg = {
            "client": self.client_id,
            "evict": sorted(self._to_evict),
            "seqs": [[w.req_id, s, [int(t) for t in w.tokens[s:]], int(w.k)] for (_, w), s in zip(todo, starts)],
        }
        t0 = time.perf_counter()
        try:
            if self._client is None:
                self._client = self.connect(self.endpoint)
            reply = self._client.call(msg, self.timeout_s)
            got, resync = reply["drafts"], reply["resync"]
            if len(got) != len(todo) or len(resync) != len(todo):
                raise DrafterUnavailable(f"{len(got)} drafts for {len(todo)} sequences")
        except (DrafterUnavailable, KeyError, TypeError) as e:
            self.failures += 1
            self.last_error = str(e)[:300]
            self.breaker.failure(self.clock())
            if self._client is not None:
                self._client.close()
                self._client = None
            return drafts
        rtt = time.perf_counter() - t0
        self.calls += 1
        self.rtt_s.append(rtt)
        self.overhead_s.append(max(rtt - float(reply.get("compute_s", 0.0)), 0.0))
        self.breaker.success()
        self._to_evict.clear()
        for (i, w), d, r in zip(todo, got, resync):
            if r is not None and r >= 0:
                self.sent[w.req_id] = int(r)  # the drafter lost state: resend from there next step
                self.resyncs += 1
                continue
            self.sent[w.req_id] = len(w.tokens)
            drafts[i] = [int(t) for t in d[: w.k]]
            self.drafted += len(drafts[i])
        return drafts

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


class RemoteDraftProposer:
    """vLLM `custom_class` proposer. `propose` gets the batch's tokens from vLLM; the request ids
    and each request's SamplingParams come from the model runner, which the worker extension
    attaches after start-up (until then, and without an endpoint, steps run without drafts)."""

    def __init__(self, vllm_config):
        spec = vllm_config.speculative_config
        self.k_max = int(spec.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        extra = (vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY, {}) or {}
        table = extra.get("k_cap_by_batch") or None
        self.k_cap_table = sorted((int(a), int(b)) for a, b in table) if table else None
        s = remote_settings(vllm_config)
        self.session = RemoteDraftSession(
            TcpDraftClient, timeout_s=float(s.get("timeout_s", 0.05)),
            failures_to_open=int(s.get("failures_to_open", 2)), reprobe_s=float(s.get("reprobe_s", 2.0)),
        )
        self.session.set_endpoint(s.get("endpoint"))
        self.runner = None

    def load_model(self, *args, **kwargs) -> None:
        pass  # the drafter's model lives in the drafter deployment

    def attach(self, runner) -> None:
        self.runner = runner

    def _k(self, req_id: str, batch_size: int) -> int:
        state = self.runner.requests.get(req_id)
        params = getattr(state, "sampling_params", None)
        extra = params.extra_args if params is not None else None
        k = requested_k(extra, self.k_max)
        return effective_k(k, self.k_max, batch_size, cap_table_from(extra) or self.k_cap_table)

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec, token_ids_cpu,
                slot_mappings=None) -> list[list[int]]:
        """sampled_token_ids: per running request, this step's tokens (empty mid-prefill);
        num_tokens_no_spec: [max_num_reqs] committed length; token_ids_cpu: [max_num_reqs, max_model_len]."""
        n = len(sampled_token_ids)
        if self.runner is None:
            return [[] for _ in range(n)]
        req_ids = self.runner.input_batch.req_ids
        batch: list[SeqWork] = []
        for i in range(n):
            num_tokens = int(num_tokens_no_spec[i])
            k = 0
            if sampled_token_ids[i] and num_tokens < self.max_model_len:
                k = min(self._k(req_ids[i], n), self.max_model_len - num_tokens - 1)
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
