"""`cluster.engine.draft_take`: the engine core fetches drafts only after steps that asked for some.

The wiring on vLLM's own `EngineCore.post_step` (a stand-in engine core: which calls reach the
executor), and a real in-process vLLM engine with the per-request-K scheduler and n-gram drafting:
requests at K = 0 make no fetch, requests with a K do, and greedy output is the same.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from cluster.engine import draft_take
from tests.paths import LOCAL_CPU


class _Executor:
    def __init__(self):
        self.takes = 0

    def take_draft_token_ids(self):
        self.takes += 1
        return None


def _core(asked, batch_queue=None):
    scheduler = SimpleNamespace() if asked is None else SimpleNamespace(**{draft_take.ASKED_ATTR: asked})
    return SimpleNamespace(scheduler=scheduler, batch_queue=batch_queue, model_executor=_Executor(),
                           check_for_draft_tokens=True, async_scheduling=False)


def test_post_step_fetches_only_after_steps_that_asked_for_drafts(monkeypatch):
    from vllm.v1.engine.core import EngineCore

    monkeypatch.setattr(EngineCore, "post_step", EngineCore.post_step)  # undone after the test
    assert draft_take.skip_empty_takes() is True
    assert draft_take.skip_empty_takes() is False  # once per process
    cases = [(True, None, 1), (False, None, 0), (None, None, 1), (False, [object()], 1)]
    for asked, queue, takes in cases:
        core = _core(asked, queue)
        EngineCore.post_step(core, True)
        assert core.model_executor.takes == takes, (asked, queue)
    core = _core(True)
    EngineCore.post_step(core, False)  # no model step ran: vLLM fetches nothing either
    assert core.model_executor.takes == 0


@pytest.mark.engine
def test_a_real_engine_skips_the_fetch_at_k0_and_keeps_its_output(monkeypatch):
    """In-process vLLM (engine core and worker in this process, so the executor's calls can be
    counted), the n-gram pool's engine arguments with vLLM's own n-gram proposer."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm import LLM, SamplingParams
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    from cluster.config import load_config
    from cluster.ops.models import resolve_model
    from cluster.speculation import EXTRA_ARGS_K
    from deployments.vllm_args import engine_kwargs

    monkeypatch.setattr(EngineCore, "post_step", EngineCore.post_step)
    config = load_config(LOCAL_CPU)
    pool = config.pools["ngram"]
    kwargs = engine_kwargs(pool, resolve_model(pool.model, config), None, pool.model, dtype="float32")
    kwargs.pop("worker_extension_cls", None)
    kwargs.pop("enable_log_requests", None)  # an AsyncEngineArgs field
    kwargs["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 3,
                                    "prompt_lookup_min": 1, "prompt_lookup_max": 5}
    kwargs.update(max_num_seqs=4, distributed_executor_backend="uni")
    takes = []
    take = UniProcExecutor.take_draft_token_ids
    monkeypatch.setattr(UniProcExecutor, "take_draft_token_ids", lambda self: takes.append(1) or take(self))
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    llm = LLM(**kwargs)
    prompt = "Repeat after me, three times: the quick brown fox jumps over the lazy dog."
    prompts = [llm.get_tokenizer().apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                       add_generation_prompt=True)] * 2

    def run(k: int):
        del takes[:]
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, extra_args={EXTRA_ARGS_K: k})
        out = llm.generate(prompts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in out], len(takes)

    plain, plain_takes = run(0)
    drafted, drafted_takes = run(3)
    assert plain_takes == 0  # every step at K = 0: no fetch
    assert 0 < drafted_takes < 23  # with a K the drafts are fetched, and accepted: fewer steps than tokens
    assert drafted == plain and len(plain[0]) == 24
