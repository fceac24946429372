"""The engine core fetches its model worker's drafts only after steps that asked for drafts.

After every step of a speculative engine, vLLM's engine core makes one more round trip to its
model worker for the drafts proposed during the step (`EngineCore.post_step` ->
`take_draft_token_ids`). It lies between two steps: the worker waits for it before the next step
starts, and the engine core, asleep until the worker's reply, must get its core back. When the
per-request-K scheduler asked the proposer for no drafts in a step (`num_spec_tokens_to_schedule`
0: every running request is at K = 0, as above the pool's `step_k_max_batch`), there is nothing to
fetch: vLLM clears each request's drafts when it schedules it, and the worker drops its own at the
start of the next step. `skip_empty_takes()` makes the engine core skip the round trip then; the
scheduler (`cluster.engine.vllm_scheduler`) calls it in the engine core's process and says, per
step, whether it asked for drafts (`ASKED_ATTR`). Engines that pipeline batches (vLLM's batch
queue) keep vLLM's behaviour.
"""

from __future__ import annotations

from typing import Any

ASKED_ATTR = "specserve_drafts_asked"  # on the scheduler: did the step just run ask for drafts?


def take_needed(engine_core: Any) -> bool:
    """Whether the drafts of the step just run must be fetched: unless the scheduler says it asked
    for none (a scheduler that does not say, or a pipelining engine, always fetches).

    >>> from types import SimpleNamespace as N
    >>> take_needed(N(batch_queue=None, scheduler=N(specserve_drafts_asked=False)))
    False
    >>> take_needed(N(batch_queue=None, scheduler=N(specserve_drafts_asked=True)))
    True
    >>> take_needed(N(batch_queue=None, scheduler=N())), take_needed(N(batch_queue=[1], scheduler=N(specserve_drafts_asked=False)))
    (True, True)
    """
    if getattr(engine_core, "batch_queue", None) is not None:
        return True
    return bool(getattr(engine_core.scheduler, ASKED_ATTR, True))


def skip_empty_takes() -> bool:
    """Make this process's vLLM engine cores skip the draft fetch after steps that asked for none
    (see module doc). Returns False if it already did."""
    from vllm.v1.engine.core import EngineCore

    if getattr(EngineCore.post_step, "specserve_skips", False):
        return False
    post_step = EngineCore.post_step

    def skipping_post_step(self, model_executed: bool) -> None:
        if take_needed(self):
            post_step(self, model_executed)

    skipping_post_step.specserve_skips = True  # type: ignore[attr-defined]
    EngineCore.post_step = skipping_post_step
    return True
