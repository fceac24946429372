"""Per-request K inside one vLLM engine: a scheduler that trims each request's drafts to its own K.

vLLM fixes `num_speculative_tokens` (K_max) per engine. This scheduler (passed to the engine as
`scheduler_cls`) reads each request's K from `SamplingParams.extra_args[EXTRA_ARGS_K]`, caps it per
step by the engine's current batch size with the pool's cap table (sent with each request by the
router from the tuned state, else the engine's start-up `k_cap_by_batch`), so a long request that
meets a load spike stops paying for speculation, and

1. trims the drafts the proposer returned for the request to that K before they are scheduled
   for verification (`update_draft_token_ids`, the synchronous-scheduling path), and
2. tells the proposer to draft only as many tokens as the largest K in the running batch
   (`SchedulerOutput.num_spec_tokens_to_schedule`), so K = 0 batches do no drafting work.

Verification and rejection sampling are vLLM's own, so the output distribution is unchanged.
The decision is the pure function `effective_k`; the class only wires it into vLLM.
"""

from __future__ import annotations

import bisect
from typing import Any, Optional, Sequence

from cluster.speculation import EXTRA_ARGS_K, EXTRA_ARGS_K_CAP

# Key under vLLM's `additional_config` holding specserve's engine-side settings.
ADDITIONAL_CONFIG_KEY = "specserve"
KCapTable = Sequence[tuple[int, int]]  # [(min_batch_size, k_cap), ...] sorted by min_batch_size


def k_cap_for_batch(batch_size: int, table: Optional[KCapTable]) -> Optional[int]:
    """The K cap that applies at `batch_size`: the entry with the largest min_batch_size <= it.

    >>> k_cap_for_batch(5, [(1, 6), (4, 2), (16, 0)])
    2
    >>> k_cap_for_batch(3, None) is None
    True
    """
    if not table:
        return None
    starts = [start for start, _ in table]
    i = bisect.bisect_right(starts, batch_size) - 1
    return None if i < 0 else table[i][1]


def requested_k(extra_args: Optional[dict[str, Any]], k_max: int) -> int:
    """The K a request asked for (K_max when it names none; clamped to 0..K_max)."""
    if not extra_args or EXTRA_ARGS_K not in extra_args:
        return k_max
    try:
        k = int(extra_args[EXTRA_ARGS_K])
    except (TypeError, ValueError):
        return 0  # validated at the API edge; never let a bad value crash the engine
    return max(0, min(k, k_max))


def cap_table_from(extra_args: Optional[dict[str, Any]]) -> Optional[list[tuple[int, int]]]:
    """The cap table a request carries (sent by the router from the tuned state), or None.

    Malformed tables are ignored (None), never an engine error.
    """
    raw = (extra_args or {}).get(EXTRA_ARGS_K_CAP)
    if not isinstance(raw, (list, tuple)) or not raw or len(raw) > 64:
        return None
    try:
        table = sorted((int(a), int(b)) for a, b in raw)
    except (TypeError, ValueError):
        return None
    return table if all(a >= 1 and b >= 0 for a, b in table) else None


def effective_k(k_requested: int, k_max: int, batch_size: int, table: Optional[KCapTable] = None) -> int:
    """K used for one request in one step: its own K, bounded by the engine's K_max and load cap."""
    k = max(0, min(k_requested, k_max))
    cap = k_cap_for_batch(batch_size, table)
    return k if cap is None else min(k, max(0, cap))


def _make_scheduler_cls():
    # vLLM is imported lazily so that the pure functions above are testable without it.
    from vllm.v1.core.sched.scheduler import Scheduler

    class PerRequestKScheduler(Scheduler):
        """vLLM Scheduler whose drafts are trimmed to each request's own K (see module doc)."""

        def __init__(self, vllm_config, *args, **kwargs):
            super().__init__(vllm_config, *args, **kwargs)
            # The engine deployment passes its load cap in vLLM's free-form `additional_config`.
            extra = (vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY, {})
            table = extra.get("k_cap_by_batch") or None
            self.k_cap_table = sorted((int(a), int(b)) for a, b in table) if table else None

        def _k_for(self, request, batch_size: int) -> int:
            extra = request.sampling_params.extra_args if request.sampling_params is not None else None
            k_req = requested_k(extra, self.num_spec_tokens)
            table = cap_table_from(extra) or self.k_cap_table
            return effective_k(k_req, self.num_spec_tokens, batch_size, table)

        def update_draft_token_ids(self, draft_token_ids) -> None:
            batch_size = len(self.running)
            for i, req_id in enumerate(draft_token_ids.req_ids):
                request = self.requests.get(req_id)
                if request is None:
                    continue
                k = self._k_for(request, batch_size)
                drafts = draft_token_ids.draft_token_ids[i]
                if len(drafts) > k:
                    draft_token_ids.draft_token_ids[i] = list(drafts[:k])
            super().update_draft_token_ids(draft_token_ids)

        def schedule(self, *args, **kwargs):
            output = super().schedule(*args, **kwargs)
            if self.num_spec_tokens and self.running:
                batch_size = len(self.running)
                k_batch = max(self._k_for(r, batch_size) for r in self.running)
                output.num_spec_tokens_to_schedule = min(output.num_spec_tokens_to_schedule, k_batch)
            return output

    return PerRequestKScheduler


def __getattr__(name: str):
    # `scheduler_cls="cluster.vllm_scheduler.PerRequestKScheduler"` resolves through here.
    if name == "PerRequestKScheduler":
        cls = _make_scheduler_cls()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


SCHEDULER_CLS_PATH = "cluster.vllm_scheduler.PerRequestKScheduler"
