"""The engine core gets its model worker's drafts without the extra round trip vLLM makes per step.

After every step of a speculative engine, vLLM's engine core makes one more round trip to its
model worker for the drafts proposed during the step (`EngineCore.post_step` ->
`take_draft_token_ids`). It lies between two steps: the worker waits for it before the next step
starts, and the engine core, asleep until the worker's reply, must get its core back. When the
per-request-K scheduler asked the proposer for no drafts in a step (`num_spec_tokens_to_schedule`
0: every running request is at K = 0, as in a step the draft gate runs plainly), there is nothing to
fetch: vLLM clears each request's drafts when it schedules it, and the worker drops its own at the
start of the next step. `skip_empty_takes()` makes the engine core skip the round trip then; the
scheduler (`cluster.engine.vllm_scheduler`) calls it in the engine core's process and says, per
step, whether it asked for drafts (`ASKED_ATTR`). Engines that pipeline batches (vLLM's batch
queue) keep vLLM's behaviour.

After a step that did ask for drafts, the fetch can still be saved where the worker carries the
drafts back with the step's sampled tokens: `carry_drafts(runner)` (installed by the lookup
proposer when its replica attaches it, `cluster.engine.lookup_proposer`) makes the runner's
`sample_tokens` take its own drafts as soon as it has proposed them and attach them to its output
(`CARRIED_ATTR`); the scheduler keeps them from `update_from_output` (`carried_from`) and the
engine core hands them to the scheduler where it would have fetched them, in the same place of the
step (after the step's output is judged). An output without them (an engine not carrying, vLLM's
empty output) is fetched as before.
"""

from __future__ import annotations

from typing import Any, Optional

ASKED_ATTR = "specserve_drafts_asked"  # on the scheduler: did the step just run ask for drafts?
CARRIED_ATTR = "specserve_drafts"  # on a step's output (the worker's drafts), and on the scheduler (boxed)


def carried_from(model_runner_output: Any) -> Optional[tuple]:
    """The drafts a step's output carries, boxed ((drafts,), drafts None when the step proposed none),
    or None when it carries none (they must be fetched).

    >>> from types import SimpleNamespace as N
    >>> carried_from(N(specserve_drafts="d")), carried_from(N(specserve_drafts=None)), carried_from(N())
    (('d',), (None,), None)
    """
    if not hasattr(model_runner_output, CARRIED_ATTR):
        return None
    return (getattr(model_runner_output, CARRIED_ATTR),)


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
    """Make this process's vLLM engine cores skip the draft fetch after steps that asked for none,
    and apply the drafts a step's output carried instead of fetching them (see module doc).
    Returns False if it already did."""
    from vllm.v1.engine.core import EngineCore

    if getattr(EngineCore.post_step, "specserve_skips", False):
        return False
    post_step = EngineCore.post_step

    def skipping_post_step(self, model_executed: bool) -> None:
        if not take_needed(self):
            return
        box = getattr(self.scheduler, CARRIED_ATTR, None)
        if box is not None and model_executed and self.check_for_draft_tokens and not self.async_scheduling:
            setattr(self.scheduler, CARRIED_ATTR, None)
            if box[0] is not None:
                self.scheduler.update_draft_token_ids(box[0])
            return
        post_step(self, model_executed)

    skipping_post_step.specserve_skips = True  # type: ignore[attr-defined]
    EngineCore.post_step = skipping_post_step
    return True


def carry_drafts(runner: Any) -> bool:
    """Make `runner` (a vLLM model runner, in its worker's process) attach its drafts to each
    step's output (see module doc). Returns False if it already does or has no `sample_tokens`."""
    # lazy: vLLM's output types; the pure functions above are testable without vLLM
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

    original = getattr(runner, "sample_tokens", None)
    if original is None or getattr(original, "specserve_carries", False):
        return False

    def sample_tokens(*args, **kwargs):
        output = original(*args, **kwargs)
        if type(output) is ModelRunnerOutput and output is not EMPTY_MODEL_RUNNER_OUTPUT:
            setattr(output, CARRIED_ATTR, runner.take_draft_token_ids())
        return output

    sample_tokens.specserve_carries = True  # type: ignore[attr-defined]
    runner.sample_tokens = sample_tokens
    return True
