"""The death of a replica's vLLM engine core (`deployments.engine_death`), without Ray: the replica
fails every call at once with EngineDead, its health check fails at once and it retires (once).
Engines are test doubles with AsyncLLM's call shape raising vLLM's own EngineDeadError."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

from cluster.config import load_config
from deployments.engine import EngineInputError, EngineRequest, EngineServer
from deployments.engine_death import RETIRE_EXIT_CODE, EngineDead, engine_died, retire_process

POOL = load_config(Path(__file__).resolve().parents[2] / "cluster" / "configs" / "local-cpu.yaml").pools["ngram"]


# -- the replica ----------------------------------------------------------------------------------

class DyingEngine:
    """AsyncLLM's call shape: `outputs_first` outputs, then the engine core dies (`error` raised in
    every generate from then on, `errored` set, as vLLM's monitor thread does)."""

    def __init__(self, outputs_first: int = 0, error: Exception | None = None, errored_after: bool = True):
        self.outputs_first, self.error = outputs_first, error or EngineDeadError()
        self.errored_after, self.errored = errored_after, False
        self.health_error: Exception | None = None  # what check_health raises while `errored` is unset
        self.generations = self.health_checks = 0

    def get_num_unfinished_requests(self):
        return 1

    async def check_health(self):
        self.health_checks += 1
        if self.errored:
            raise EngineDeadError()
        if self.health_error is not None:
            raise self.health_error

    async def generate(self, prompt, params, request_id):
        self.generations += 1
        for i in range(self.outputs_first):
            out = SimpleNamespace(token_ids=[10 + i], text=f"<{i}>", logprobs=None, finish_reason=None,
                                  spec_decode_metrics=None)
            yield SimpleNamespace(outputs=[out], finished=False, prompt_token_ids=[1])
        self.errored = self.errored_after
        raise self.error


def replica(engine):
    retired = []
    s = EngineServer("ngram", POOL.model_copy(update={"health_probe_interval_s": 3600}), "/m", None, "m",
                     engine=engine, retire=lambda: retired.append(time.monotonic()))
    return s, retired


def drain(s, rid="r"):
    got = []

    async def run():
        async for c in s.generate(EngineRequest(request_id=rid, mode="none", k=0, prompt="p")):
            got.append(c)
    try:
        asyncio.run(run())
    except Exception as e:  # noqa: BLE001 - returned for the test to inspect
        return got, e
    return got, None


def test_death_before_output_fails_the_call_and_every_later_one_at_once_and_retires_once():
    engine = DyingEngine()
    s, retired = replica(engine)
    got, err = drain(s)
    assert got == [] and isinstance(err, EngineDead) and "engine core of replica" in str(err)
    assert len(retired) == 1
    got, err = drain(s, "r2")
    assert isinstance(err, EngineDead) and engine.generations == 1  # refused before reaching vLLM
    with pytest.raises(EngineDead):
        asyncio.run(s.check_health())
    assert engine.health_checks == 0 and len(retired) == 1  # at once, without asking the engine; retired once


def test_death_mid_stream_ends_the_stream_with_engine_dead_after_what_was_sent():
    s, retired = replica(DyingEngine(outputs_first=2))
    got, err = drain(s)
    assert got and got[0].token_ids == [10]  # the first token went out at once
    assert isinstance(err, EngineDead) and len(retired) == 1


def test_an_idle_replica_notices_the_death_in_its_load_report_and_health_check():
    engine = DyingEngine()
    s, retired = replica(engine)
    engine.errored = True  # vLLM's monitor thread saw the engine core exit; no request in flight
    report = asyncio.run(s.load())
    assert report["engine_dead"] is True and report["unfinished"] == 1 and len(retired) == 1
    with pytest.raises(EngineDead):
        asyncio.run(s.check_health())


def test_the_health_check_turns_vllms_engine_dead_error_into_engine_dead_and_retires():
    engine = DyingEngine()
    s, retired = replica(engine)
    s._last_probe_ok = time.monotonic()  # no probe generation in these checks
    asyncio.run(s.check_health())
    engine.health_error = EngineDeadError()  # vLLM's check, before our look at `errored`
    with pytest.raises(EngineDead):
        asyncio.run(s.check_health())
    assert engine.health_checks == 2 and len(retired) == 1


def test_other_engine_errors_are_not_death():
    s, retired = replica(DyingEngine(error=EngineGenerateError(), errored_after=False))
    _, err = drain(s)
    assert isinstance(err, EngineGenerateError) and not isinstance(err, EngineDead) and retired == []
    s, retired = replica(DyingEngine(error=EngineGenerateError(), errored_after=True))  # raced the death
    _, err = drain(s)
    assert isinstance(err, EngineDead) and len(retired) == 1
    s, retired = replica(DyingEngine(error=ValueError("prompt too long"), errored_after=False))
    _, err = drain(s)
    assert isinstance(err, EngineInputError) and retired == []


def test_engine_died():
    assert engine_died(EngineDeadError(), errored=False)
    assert engine_died(RuntimeError("anything"), errored=True)
    assert not engine_died(EngineGenerateError(), errored=False)


def test_retire_process_exits_after_the_grace():
    codes = []
    t0 = time.monotonic()
    timer = retire_process(0.05, exit_fn=codes.append)
    timer.join(timeout=5)
    assert codes == [RETIRE_EXIT_CODE] and time.monotonic() - t0 >= 0.05


def test_a_replica_that_started_its_own_engine_retires_its_process(monkeypatch):
    monkeypatch.setattr(EngineServer, "_start_engine", lambda self, kwargs: DyingEngine())
    s = EngineServer("ngram", POOL, "/m", None, "m")
    assert s._retire is retire_process
    injected, _ = replica(DyingEngine())
    assert injected._retire is not retire_process
