"""What every specserve proposer inside vLLM's engine core shares: `propose` never raises, and it
drafts no more than the scheduler's bound on the step (`watch_step_cap`)."""

from __future__ import annotations

import logging
from typing import Optional


class NeverRaises:
    """A vLLM `custom_class` proposer whose `propose` returns no drafts instead of raising: it runs
    in vLLM's engine core, where an exception ends the engine. Subclasses implement `_propose` and
    set `errors = 0`; the failure is logged the 1st, 2nd, 4th, 8th ... time."""

    _log = logging.getLogger("specserve.proposer")
    _what = "proposer"
    errors = 0

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec, token_ids_cpu,
                slot_mappings=None) -> list[list[int]]:
        """sampled_token_ids: per running request, this step's tokens (empty mid-prefill);
        num_tokens_no_spec: [max_num_reqs] committed length; token_ids_cpu: [max_num_reqs, max_model_len]."""
        try:
            return self._propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        except Exception as e:  # noqa: BLE001 - a bug here must cost drafts, not the engine
            self.errors += 1
            if self.errors & (self.errors - 1) == 0:
                self._log.warning("%s: step without drafts after %s: %s (%d times)", self._what, type(e).__name__,
                                  str(e)[:200], self.errors)
            return [[] for _ in sampled_token_ids]

    def _propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu) -> list[list[int]]:
        raise NotImplementedError


def watch_step_cap(proposer, runner) -> None:
    """From now on, `proposer.step_cap` is the scheduler's bound on the drafts of the step being
    proposed for (`num_spec_tokens_to_schedule`: 0 when no request may verify any, e.g. in a step
    the draft gate runs plainly), which vLLM hands its own proposers but not a custom one: the
    runner's method is wrapped, on this runner only."""
    original = getattr(runner, "propose_draft_token_ids", None)
    if original is None:
        return

    def propose_draft_token_ids(scheduler_output, *args, **kwargs):
        proposer.step_cap = getattr(scheduler_output, "num_spec_tokens_to_schedule", None)
        return original(scheduler_output, *args, **kwargs)

    runner.propose_draft_token_ids = propose_draft_token_ids


def capped(k: int, step_cap: Optional[int]) -> int:
    """A request's K in a step bounded by `step_cap` (None: no bound known).

    >>> capped(6, None), capped(6, 2), capped(6, 0), capped(3, -1)
    (6, 2, 0, 0)
    """
    return k if step_cap is None else min(k, max(int(step_cap), 0))
