"""How an engine replica gathers vLLM's outputs into chunks (cluster/engine/coalesce.py): sizes follow
the batch, the first token and the end go at once, nothing is lost or reordered. The engine is a
test double with AsyncLLM's call shape; tests/e2e/test_foundation.py runs the real path."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

from cluster.config import load_config
from deployments.engine import EngineRequest, EngineServer
from deployments.engine_types import collect
from tests.paths import LOCAL_CPU

POOL = load_config(LOCAL_CPU).pools["ngram"]


class StepEngine:
    """Emits `steps` outputs (a list of token lists, one per engine step) while `batch` requests run."""

    def __init__(self, steps: list[list[int]], batch: int, step_s: float = 0.0):
        self.steps, self.batch, self.step_s = steps, batch, step_s

    def get_num_unfinished_requests(self):
        return self.batch

    async def generate(self, prompt, params, request_id):
        for i, ids in enumerate(self.steps):
            last = i == len(self.steps) - 1
            lp = [{t: SimpleNamespace(logprob=-float(t))} for t in ids] if params.logprobs is not None else None
            out = SimpleNamespace(token_ids=ids, text="".join(f"<{t}>" for t in ids), logprobs=lp,
                                  finish_reason="length" if last else None, spec_decode_metrics=None)
            yield SimpleNamespace(outputs=[out], finished=last, prompt_token_ids=[1, 2, 3])
            await asyncio.sleep(self.step_s)


def chunks(steps, batch, chunks_per_step=4, streamed=True, logprobs=None, step_s=0.0):
    s = EngineServer("ngram", POOL.model_copy(update={"stream_chunks_per_step": chunks_per_step}), "m",
                     engine=StepEngine(steps, batch, step_s))
    req = EngineRequest(request_id="r", mode="none", k=0, prompt="p", streamed=streamed, logprobs=logprobs)

    async def run():
        return [c async for c in s.generate(req)]
    return asyncio.run(run())


ONE_TOKEN_STEPS = [[t] for t in range(10, 20)]  # 10 steps, one token each


def test_chunks_grow_with_the_batch_and_keep_every_token_in_order():
    assert [len(c.token_ids) for c in chunks(ONE_TOKEN_STEPS, batch=1)] == [1] * 10
    assert [len(c.token_ids) for c in chunks(ONE_TOKEN_STEPS, batch=4)] == [1] * 10
    big = chunks(ONE_TOKEN_STEPS, batch=16)  # ceil(16 / 4) = 4 tokens a chunk
    assert [len(c.token_ids) for c in big] == [1, 4, 4, 1]
    assert [t for c in big for t in c.token_ids] == list(range(10, 20))
    assert "".join(c.text for c in big) == "".join(f"<{t}>" for t in range(10, 20))
    assert [c.finish_reason for c in big] == [None, None, None, "length"]
    assert big[-1].completion_tokens == 10 and big[-1].prompt_tokens == 3 and big[-1].stats["mode"] == "none"


def test_multi_token_steps_fill_a_chunk_at_once():
    steps = [[1], [2, 3, 4], [5], [6, 7], [8]]
    sizes = [len(c.token_ids) for c in chunks(steps, batch=12)]  # 3 tokens a chunk
    assert sizes == [1, 3, 3, 1]


def test_not_streamed_sends_the_first_token_then_everything_at_the_end():
    out = chunks(ONE_TOKEN_STEPS, batch=1, streamed=False)
    assert [len(c.token_ids) for c in out] == [1, 9]
    assert out[-1].finish_reason == "length"


def test_no_bound_sends_every_output_and_logprobs_follow_their_tokens():
    assert [len(c.token_ids) for c in chunks(ONE_TOKEN_STEPS, batch=64, chunks_per_step=None)] == [1] * 10
    out = chunks(ONE_TOKEN_STEPS, batch=32, logprobs=1)  # 8 tokens a chunk
    assert [len(c.token_ids) for c in out] == [1, 8, 1]
    assert all([list(p) for p in c.logprobs] == [[t] for t in c.token_ids] for c in out)


def test_collect_of_a_gathered_stream_is_the_whole_output():
    async def run():
        s = EngineServer("ngram", POOL, "m", engine=StepEngine(ONE_TOKEN_STEPS, 16))
        return await collect(s.generate(EngineRequest(request_id="r", mode="none", k=0, prompt="p")))
    whole = asyncio.run(run())
    assert whole.token_ids == list(range(10, 20)) and whole.finish_reason == "length"


def test_nothing_is_held_past_the_hold_time(monkeypatch):
    """A long unary request still sends something every MAX_HOLD_S, so the router's idle timeout
    does not fire on a request that is making progress."""
    import cluster.engine.coalesce

    monkeypatch.setattr(cluster.engine.coalesce, "MAX_HOLD_S", 0.05)
    out = chunks([[t] for t in range(40)], batch=1, streamed=False, step_s=0.01)
    assert 4 <= len(out) <= 20, [len(c.token_ids) for c in out]
    assert [t for c in out for t in c.token_ids] == list(range(40))
