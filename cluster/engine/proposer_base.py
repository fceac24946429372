"""What every specserve proposer inside vLLM's engine core shares: `propose` never raises."""

from __future__ import annotations

import logging


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
