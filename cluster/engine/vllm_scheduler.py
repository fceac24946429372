"""Per-request K inside one vLLM engine: a scheduler that trims each request's drafts to its own K.

vLLM fixes `num_speculative_tokens` (K_max) per engine. This scheduler (passed to the engine as
`scheduler_cls`) gives every request its own K at every step, by one of two rules:

- **per step** (the router's requests: `SamplingParams.extra_args[EXTRA_ARGS_K_STEP]` carries the
  class's acceptance): the K is chosen jointly with the whole batch by
  `cluster.engine.step_k.choose_step_ks`, up to the request's ceiling (`EXTRA_ARGS_K`, the pool's
  max_k), from the drafts the proposer found, the request's own recent acceptance and the engine's
  step time, which the scheduler measures on its own decode steps (`StepCost`: from the end of
  `schedule` to `update_from_output`, the model's forward pass, sampling and drafting). Before each
  step the draft gate (`cluster.engine.draft_gate`) says whether these requests may verify drafts
  at all at the current batch size; it learns from every decode step it governed (`gate_step`):
  the tokens the step yielded and the engine core's whole cycle from that step's `schedule` to the
  next.
- **fixed** (a K the caller named, or the configured default's): the request verifies
  min(K, drafts found) at every step, and counts in the step's cost. Suffix-mode requests, whose
  drafts are self-limiting (`drafts_self_limiting`), are kept whole up to their ceiling the same way.

The scheduler

1. trims the drafts the proposer returned for each request to its K before they are scheduled for
   verification (`update_draft_token_ids`, the synchronous-scheduling path), and
2. tells the proposer to draft only as many tokens as the largest ceiling in the running batch
   (`SchedulerOutput.num_spec_tokens_to_schedule`), so batches that may verify nothing do no
   drafting work, and the engine core does not fetch drafts after such a step, nor after any step
   whose worker sent its drafts with the sampled tokens (`cluster.engine.draft_take`).

Verification and rejection sampling are vLLM's own, so the output distribution is unchanged.
The decisions are pure functions (`requested_k`, `step_ceiling`, `step_k.choose_step_ks`); the
class only wires them into vLLM.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional, Sequence

from cluster.engine.draft_gate import DraftGate, bucket_label, bucket_of
from cluster.engine.draft_take import ASKED_ATTR, CARRIED_ATTR, carried_from, skip_empty_takes
from cluster.engine.worker_wait import block_on_replies
from cluster.speculation import EXTRA_ARGS_K, EXTRA_ARGS_K_STEP, EXTRA_ARGS_MODE, SpecMode
from cluster.engine.step_k import (PRIOR_RELATIVE_COST, RequestDrafts, StepCost, StepCostLine, acceptance, batch_optimism,
                                   choose_step_ks, next_acceptance)

_ACCEPT = "_specserve_accept"  # (successes, failures) of a per-step-K request's recent drafts
# Key under vLLM's `additional_config` holding specserve's engine-side settings, the settings of
# the batch at which per-step-K requests draft (`PoolConfig.step_k_max_batch`, `step_k_explore`), and how
# the engine core waits for its workers (`PoolConfig.engine_core_wait`, `cluster.engine.worker_wait`).
ADDITIONAL_CONFIG_KEY = "specserve"
STEP_K_MAX_BATCH_KEY = "step_k_max_batch"
STEP_K_EXPLORE_KEY = "step_k_explore"  # `PoolConfig.step_k_explore`: the draft gate's learning (0: the bound alone)
ENGINE_CORE_WAIT_KEY = "engine_core_wait"
GATE_LOG_EVERY_S = 120.0  # how often the engine core logs the draft gate's table

# Under vLLM's logger: the scheduler runs in the engine core's process, where only vLLM configures logging.
log = logging.getLogger("vllm.specserve.scheduler")
def requested_k(extra_args: Optional[dict[str, Any]], k_max: int) -> int:
    """The K a request asked for (K_max when it names none; clamped to 0..K_max)."""
    if not extra_args or EXTRA_ARGS_K not in extra_args:
        return k_max
    try:
        k = int(extra_args[EXTRA_ARGS_K])
    except (TypeError, ValueError):
        return 0  # validated at the API edge; never let a bad value crash the engine
    return max(0, min(k, k_max))


def step_alpha_from(extra_args: Optional[dict[str, Any]]) -> Optional[float]:
    """The class α a per-step-K request carries, or None (a fixed K; malformed values too).

    >>> step_alpha_from({"specserve_k_step": 0.6}), step_alpha_from({"specserve_k_step": "x"}), step_alpha_from(None)
    (0.6, None, None)
    >>> step_alpha_from({"specserve_k_step": float("nan")}) is None
    True
    """
    raw = (extra_args or {}).get(EXTRA_ARGS_K_STEP)
    if raw is None or isinstance(raw, bool):
        return None
    try:
        alpha = float(raw)
    except (TypeError, ValueError):
        return None
    return alpha if 0.0 <= alpha <= 1.0 else None


def drafts_self_limiting(extra_args: Optional[dict[str, Any]]) -> bool:
    """Whether a request's drafts already stop where they stop being likely, so the per-step choice
    keeps them whole (up to its ceiling, which the batch bound still sets to 0): suffix decoding
    drafts as far as its tree's match length and `min_token_prob` allow, and its acceptance rises
    with depth (tune halves: 0.58 at the first draft, 0.80 at the second, 0.88-0.97 from the
    third to the twelfth), which the geometric α^j of `choose_step_ks` would cut short.

    >>> drafts_self_limiting({"specserve_mode": "suffix"}), drafts_self_limiting({"specserve_mode": "ngram"})
    (True, False)
    >>> drafts_self_limiting(None)
    False
    """
    return (extra_args or {}).get(EXTRA_ARGS_MODE) == SpecMode.SUFFIX.value


def step_ceiling(k_requested: int, k_max: int, drafting: bool) -> int:
    """The largest K a per-step-K request may verify this step: its ceiling, or 0 in a step the draft
    gate runs plainly (`cluster.engine.draft_gate`).

    >>> step_ceiling(6, 6, True), step_ceiling(6, 6, False), step_ceiling(9, 6, True), step_ceiling(-1, 6, True)
    (6, 0, 6, 0)
    """
    return max(0, min(k_requested, k_max)) if drafting else 0


def gate_step(num_scheduled_tokens: dict[str, int], spec_tokens: Optional[dict[str, list]],
              governed: dict[str, bool]) -> Optional[int]:
    """The batch size of a step the draft gate may learn from, else None: a decode-only step
    (`step_shape`) with at least one request whose K the engine chooses (`governed`), and no drafts
    from a request with a caller's K (those drafts are not the gate's to choose, and would be
    counted against the arm).

    >>> gate_step({"a": 1, "b": 3}, {"b": [5, 6]}, {"a": True, "b": True})
    2
    >>> gate_step({"a": 1, "b": 3}, {"b": [5, 6]}, {"a": True, "b": False}) is None  # a caller's drafts
    True
    >>> gate_step({"a": 1, "b": 1}, {}, {"a": False, "b": False}) is None  # no request the gate governs
    True
    """
    shape = step_shape(num_scheduled_tokens, spec_tokens)
    if shape is None or not any(governed.get(r, False) for r in num_scheduled_tokens):
        return None
    if any((spec_tokens or {}).get(r) and not governed.get(r, False) for r in num_scheduled_tokens):
        return None
    return shape[0]


def step_shape(num_scheduled_tokens: dict[str, int], spec_tokens: Optional[dict[str, list]]) -> Optional[tuple[int, int]]:
    """(requests, drafts verified) of a decode-only step, None when a request prefills in it (its
    time is not a decode step's).

    >>> step_shape({"a": 1, "b": 4}, {"b": [7, 8, 9]}), step_shape({"a": 300}, {}), step_shape({}, {})
    ((2, 3), None, None)
    """
    if not num_scheduled_tokens:
        return None
    spec_tokens = spec_tokens or {}
    drafts = 0
    for req_id, n in num_scheduled_tokens.items():
        d = len(spec_tokens.get(req_id) or ())
        if n != 1 + d:
            return None
        drafts += d
    return len(num_scheduled_tokens), drafts


def extra_args_of(request) -> Optional[dict[str, Any]]:
    """The specserve settings a vLLM request carries (`SamplingParams.extra_args`), None for no
    request or none set."""
    params = getattr(request, "sampling_params", None)
    return params.extra_args if params is not None else None


def _make_scheduler_cls():
    # vLLM is imported lazily so that the pure functions above are testable without it.
    from vllm.v1.core.sched.scheduler import Scheduler

    class PerRequestKScheduler(Scheduler):
        """vLLM Scheduler whose drafts are trimmed to each request's own K (see module doc)."""

        def __init__(self, vllm_config, *args, **kwargs):
            super().__init__(vllm_config, *args, **kwargs)
            # The engine deployment passes its load cap in vLLM's free-form `additional_config`.
            extra = (vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY, {})
            self.start_state(extra)
            if extra.get(ENGINE_CORE_WAIT_KEY) == "block":  # this process is the engine core
                block_on_replies()
            skip_empty_takes()  # this process is the engine core: drafts carried back or not needed, no fetch

        def start_state(self, extra: dict[str, Any]) -> None:
            """specserve's own state, from its `additional_config` entry: the step-time line and the
            draft gate."""
            max_batch = extra.get(STEP_K_MAX_BATCH_KEY)
            self.gate = DraftGate(prior_max_batch=int(max_batch) if max_batch is not None else None,
                                  explore=float(extra.get(STEP_K_EXPLORE_KEY, 0.0)))
            self._draft_next = self.gate.prior(1)  # the gate's arm for the drafts verified in the next step
            # The gate's step in flight: [perf_counter at its schedule, requests, drafting, tokens once judged]
            self._gate_step: Optional[list] = None
            self._gate_logged = time.monotonic()
            self._gate_compared: set[int] = set()  # buckets whose first comparison was logged
            self.step_cost = StepCost()
            self._step_started: Optional[tuple[float, int, int]] = None  # (perf_counter, requests, drafts)

        def _k_for(self, request) -> int:
            """The largest K the request may verify this step: a per-step request's ceiling (0 in a
            step the draft gate runs plainly; `update_draft_token_ids` picks within it), or a fixed K."""
            extra = extra_args_of(request)
            k_req = requested_k(extra, self.num_spec_tokens)
            if step_alpha_from(extra) is not None:
                return step_ceiling(k_req, self.num_spec_tokens, self._draft_next)
            return k_req

        def update_draft_token_ids(self, draft_token_ids) -> None:
            batch_size = len(self.running)
            rows, choices = [], []  # (index, request) and what the step K choice sees of each
            for i, req_id in enumerate(draft_token_ids.req_ids):
                request = self.requests.get(req_id)
                if request is None:
                    continue
                extra = extra_args_of(request)
                alpha = step_alpha_from(extra)
                k = self._k_for(request)
                drafts = len(draft_token_ids.draft_token_ids[i])
                if alpha is not None:
                    alpha = acceptance(alpha, *getattr(request, _ACCEPT, (0.0, 0.0)),
                                       optimism=batch_optimism(batch_size))
                rows.append((i, request))
                choices.append(RequestDrafts(alpha=alpha or 0.0, drafts=drafts, ceiling=k,
                                             fixed=alpha is None or drafts_self_limiting(extra)))
            line = self.step_cost.line() or StepCostLine(*PRIOR_RELATIVE_COST)
            for (i, request), k in zip(rows, choose_step_ks(choices, line)):
                drafts = draft_token_ids.draft_token_ids[i]
                if len(drafts) > k:
                    draft_token_ids.draft_token_ids[i] = list(drafts[:k])
            super().update_draft_token_ids(draft_token_ids)

        def update_from_output(self, scheduler_output, model_runner_output):
            setattr(self, CARRIED_ATTR, carried_from(model_runner_output))  # the drafts the worker sent along
            if self._step_started is not None:  # the decode step just run: its time to the cost line
                t0, n_req, n_drafts = self._step_started
                self._step_started = None
                self.step_cost.observe(n_req, n_drafts, time.perf_counter() - t0)
            if self._gate_step is not None and self._gate_step[3] is None:  # its tokens, for the gate's arm
                self._gate_step[3] = sum(len(t) for t in model_runner_output.sampled_token_ids)
            # Before vLLM's own bookkeeping: the acceptance of per-step-K requests from this step's
            # outcome (drafts scheduled, tokens sampled: accepted = sampled - 1, as vLLM counts them).
            scheduled = scheduler_output.scheduled_spec_decode_tokens
            sampled = model_runner_output.sampled_token_ids
            index = model_runner_output.req_id_to_index
            for req_id, drafts in (scheduled or {}).items():
                request = self.requests.get(req_id)
                if request is None or step_alpha_from(extra_args_of(request)) is None:
                    continue
                i = index.get(req_id)
                if i is None or i >= len(sampled) or not len(sampled[i]):
                    continue
                drafted = sum(1 for t in drafts if t >= 0)  # -1: a draft the grammar invalidated
                setattr(request, _ACCEPT, next_acceptance(*getattr(request, _ACCEPT, (0.0, 0.0)), drafted,
                                                          max(len(sampled[i]) - 1, 0)))
            return super().update_from_output(scheduler_output, model_runner_output)

        def schedule(self, *args, **kwargs):
            # The gate's last step is done when the next one is scheduled: its time is the engine
            # core's whole cycle (forward, sampling, drafting, and the bookkeeping of what it
            # yielded), not only the worker's part of it.
            cycle_start = time.perf_counter()
            if self._gate_step is not None:
                t0, n_req, drafting, tokens = self._gate_step
                self._gate_step = None
                if tokens:
                    self.gate.observe(n_req, drafting, tokens, cycle_start - t0)
                    self._log_gate(n_req)
            output = super().schedule(*args, **kwargs)
            # This step verifies what the gate's last arm let through: measure it for that arm.
            governed = {r: step_alpha_from(extra_args_of(self.requests.get(r))) is not None
                        for r in output.num_scheduled_tokens}
            gate_n = gate_step(output.num_scheduled_tokens, output.scheduled_spec_decode_tokens, governed)
            drafting_now = self._draft_next
            if self.num_spec_tokens and self.running:
                # The drafts proposed in this step are verified in the next one: the gate picks that
                # step's arm now, and the proposer drafts for the ceilings it allows.
                self._draft_next = self.gate.allows(len(self.running))
                k_batch = max(self._k_for(r) for r in self.running)
                output.num_spec_tokens_to_schedule = min(output.num_spec_tokens_to_schedule, k_batch)
            # The cost line is of steps after which the proposer drafts (those the K choice is for):
            # decode steps only, as a prefill's time is not a decode step's.
            shape = step_shape(output.num_scheduled_tokens, output.scheduled_spec_decode_tokens)
            proposing = getattr(output, "num_spec_tokens_to_schedule", 0) > 0
            setattr(self, ASKED_ATTR, proposing)  # nothing to fetch after a step that asked for no drafts
            self._step_started = None if shape is None or not proposing else (time.perf_counter(), *shape)
            self._gate_step = None if gate_n is None else [cycle_start, gate_n, drafting_now, None]
            return output

        def _log_gate(self, batch_size: int) -> None:
            """When the arms at a batch size are first compared by measurement, and every
            GATE_LOG_EVERY_S, the gate's table to the engine's log."""
            bucket = bucket_of(batch_size)
            if bucket not in self._gate_compared and self.gate.compares(batch_size):
                self._gate_compared.add(bucket)
                row = next(r for r in self.gate.table() if r["batch"] == bucket_label(bucket))
                log.info("draft gate: batch %s now compares its arms: %s", row["batch"], row)
            now = time.monotonic()
            if now - self._gate_logged >= GATE_LOG_EVERY_S and self.gate.arms:
                self._gate_logged = now
                log.info("draft gate (per batch size: steps, tokens/s of each arm): %s", self.gate.table())

    return PerRequestKScheduler


def __getattr__(name: str):
    # `scheduler_cls="cluster.engine.vllm_scheduler.PerRequestKScheduler"` resolves through here.
    if name == "PerRequestKScheduler":
        cls = _make_scheduler_cls()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


SCHEDULER_CLS_PATH = "cluster.engine.vllm_scheduler.PerRequestKScheduler"
