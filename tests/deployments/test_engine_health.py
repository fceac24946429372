"""The engine replica's health check runs a real (bounded, rate-limited) generation; a stalled
engine fails it. The engine is a test double with AsyncLLM's call shape; the vLLM-backed path is
covered end to end by tests/e2e."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from cluster.config import load_config
from deployments.engine import EngineServer
from tests.paths import LOCAL_CPU

POOL = load_config(LOCAL_CPU).pools["ngram"]


class FakeEngine:
    def __init__(self, stall: bool = False):
        self.stall, self.generations = stall, 0

    async def check_health(self):
        return None

    def get_num_unfinished_requests(self):
        return 1

    async def generate(self, prompt, params, request_id):
        self.generations += 1
        if self.stall:
            await asyncio.sleep(3600)
        out = SimpleNamespace(token_ids=[7], text="x", logprobs=None, finish_reason="length", spec_decode_metrics=None)
        yield SimpleNamespace(outputs=[out], finished=True, prompt_token_ids=[1, 2])


def server(engine, **pool_overrides):
    return EngineServer("ngram", POOL.model_copy(update=pool_overrides), "m", engine=engine)


def test_health_probe_generates_and_is_rate_limited():
    engine = FakeEngine()
    s = server(engine, health_probe_interval_s=3600)
    asyncio.run(s.check_health())
    asyncio.run(s.check_health())
    assert engine.generations == 1  # second check within the interval: no new generation


def test_stalled_engine_fails_the_health_check():
    s = server(FakeEngine(stall=True), health_probe_interval_s=0, health_probe_timeout_s=0.2)
    with pytest.raises(RuntimeError, match="stalled"):
        asyncio.run(s.check_health())


class StuckRpcEngine(FakeEngine):
    """An engine core that never answers a collective_rpc (busy or wedged between steps)."""

    def __init__(self):
        super().__init__()
        self.timeouts = []

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.timeouts.append(timeout)
        await asyncio.sleep(3600)


def test_collective_rpc_calls_are_bounded(monkeypatch):
    import deployments.engine as engine_mod

    monkeypatch.setattr(engine_mod, "RPC_TIMEOUT_S", 0.2)
    engine = StuckRpcEngine()
    s = EngineServer("remote", POOL.model_copy(update={"method": "remote_draft", "max_k": 3}), "m",
                     engine=engine)
    with pytest.raises(TimeoutError, match="specserve_drafter_status took more than 0.2 s"):
        asyncio.run(s.drafter_status())
    assert engine.timeouts == [0.2]  # vLLM's executor gets the bound too
    # The load report, which the router polls four times a second, still answers, naming the failure.
    load = asyncio.run(asyncio.wait_for(s.load(), timeout=5))
    assert load["unfinished"] == 1 and "took more than" in load["remote_drafter"]["error"]


def test_the_load_report_does_not_carry_the_drafters_address():
    """The router's status page shows each pool's load report, without a key when auth is off."""
    import json

    from cluster.engine.remote_proposer import public_drafter_status

    status = {"endpoint": "10.20.30.40:45678", "breaker_open": False, "calls": 3, "last_error": None}

    class Engine(FakeEngine):
        async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            return [dict(status)]

    s = EngineServer("remote", POOL.model_copy(update={"method": "remote_draft", "max_k": 3}), "m",
                     engine=Engine())
    load = asyncio.run(s.load())
    assert "10.20.30.40" not in json.dumps(load)
    assert load["remote_drafter"]["has_endpoint"] is True and load["remote_drafter"]["calls"] == 3
    assert asyncio.run(s.drafter_status())["endpoint"] == "10.20.30.40:45678"  # the replica itself still knows
    assert public_drafter_status({"endpoint": None})["has_endpoint"] is False
