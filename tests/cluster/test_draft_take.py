"""`cluster.engine.draft_take`: the engine core fetches drafts only after steps that asked for some,
and not at all when the worker sends them back with the sampled tokens.

The wiring on vLLM's own `EngineCore.post_step` (a stand-in engine core: which calls reach the
executor and the scheduler), vLLM's real output type through pickle (as the shared-memory queue
sends it), and a real in-process vLLM engine with the per-request-K scheduler and n-gram drafting
in a process of its own (`draft_take_engine.py`).
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from types import SimpleNamespace

import pytest

from cluster.engine import draft_take
from tests.paths import ROOT


class _Executor:
    def __init__(self):
        self.takes = 0

    def take_draft_token_ids(self):
        self.takes += 1
        return None


class _Scheduler(SimpleNamespace):
    def update_draft_token_ids(self, drafts):
        self.applied.append(drafts)


def _core(asked, batch_queue=None, carried=None):
    fields = {"applied": [], draft_take.CARRIED_ATTR: carried}
    if asked is not None:
        fields[draft_take.ASKED_ATTR] = asked
    return SimpleNamespace(scheduler=_Scheduler(**fields), batch_queue=batch_queue, model_executor=_Executor(),
                           check_for_draft_tokens=True, async_scheduling=False)


@pytest.fixture
def post_step(monkeypatch):
    from vllm.v1.engine.core import EngineCore

    monkeypatch.setattr(EngineCore, "post_step", EngineCore.post_step)  # undone after the test
    assert draft_take.skip_empty_takes() is True
    assert draft_take.skip_empty_takes() is False  # once per process
    return EngineCore.post_step


def test_post_step_fetches_only_after_steps_that_asked_for_drafts(post_step):
    cases = [(True, None, 1), (False, None, 0), (None, None, 1), (False, [object()], 1)]
    for asked, queue, takes in cases:
        core = _core(asked, queue)
        post_step(core, True)
        assert core.model_executor.takes == takes, (asked, queue)
    core = _core(True)
    post_step(core, False)  # no model step ran: vLLM fetches nothing either
    assert core.model_executor.takes == 0


def test_drafts_the_step_carried_are_applied_without_a_fetch(post_step):
    core = _core(True, carried=("drafts",))
    post_step(core, True)
    assert core.model_executor.takes == 0 and core.scheduler.applied == ["drafts"]
    assert getattr(core.scheduler, draft_take.CARRIED_ATTR) is None  # used once
    core = _core(True, carried=(None,))  # the step proposed none: nothing to apply, nothing to fetch
    post_step(core, True)
    assert core.model_executor.takes == 0 and core.scheduler.applied == []
    core = _core(False, carried=("drafts",))  # asked for none: neither
    post_step(core, True)
    assert core.model_executor.takes == 0 and core.scheduler.applied == []
    core = _core(True, carried=("drafts",))
    core.async_scheduling = True  # vLLM's asynchronous path has its own way: left to it
    post_step(core, True)
    assert core.scheduler.applied == []


def test_the_carried_drafts_survive_the_queue_to_the_engine_core():
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput

    out = ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0}, sampled_token_ids=[[5]])
    setattr(out, draft_take.CARRIED_ATTR, DraftTokenIds(["a"], [[1, 2, 3]]))
    box = draft_take.carried_from(pickle.loads(pickle.dumps(out)))
    assert box is not None and box[0].req_ids == ["a"] and box[0].draft_token_ids == [[1, 2, 3]]
    assert draft_take.carried_from(ModelRunnerOutput(req_ids=[], req_id_to_index={})) is None


def test_the_runner_carries_its_drafts_but_never_on_vllms_shared_empty_output():
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

    outputs = [ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0}), EMPTY_MODEL_RUNNER_OUTPUT, None]
    runner = SimpleNamespace(sample_tokens=lambda grammar: outputs.pop(0), take_draft_token_ids=lambda: "drafts")
    assert draft_take.carry_drafts(runner) is True and draft_take.carry_drafts(runner) is False
    assert draft_take.carried_from(runner.sample_tokens(None)) == ("drafts",)
    assert draft_take.carried_from(runner.sample_tokens(None)) is None  # the singleton stays untouched
    assert runner.sample_tokens(None) is None


@pytest.mark.engine
def test_a_real_engine_fetches_no_drafts_at_k0_nor_when_they_are_carried():
    proc = subprocess.run([sys.executable, "-m", "tests.cluster.draft_take_engine"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    r = json.loads(lines[-1][len("RESULT "):])
    assert r["k0"]["takes"] == 0 and r["k0"]["steps"] >= 24  # K = 0: a step per token, no fetch
    assert 0 < r["k3"]["takes"] < 23 and r["k3"]["steps"] < 23  # K = 3: fetched, and accepted
    assert r["carry_installed"] and r["k3_carried"]["takes"] == 0  # carried: no fetch ...
    assert r["k3_carried"]["steps"] == r["k3"]["steps"]  # ... and the same drafts verified
    assert r["k0"]["tokens"] == r["k3"]["tokens"] == r["k3_carried"]["tokens"]
    assert len(r["k0"]["tokens"][0]) == 24
