"""Chaos (issue 8): under a steady mixed gRPC load, kill an engine replica, the router and Redis in
turn; count requests sent, succeeded, failed with a documented error, failed otherwise, and hung
(must be zero), and the time each component takes to recover full capacity.

Runs in its own cluster (tier `chaos`: `scripts/test --chaos`). Loopback only, bounded in time.

Documented failures while a component is down (docs: README "Failure semantics"):
- UNAVAILABLE: the engine replica died mid-stream, or no output within the router's bounds;
- RESOURCE_EXHAUSTED: a pool's queue is full;
- INTERNAL whose details name a dead Ray actor: the router replica itself died under the call
  (Ray Serve's gRPC proxy reports an actor death that way);
- UNAVAILABLE from the proxy while no router replica is up;
- DEADLINE_EXCEEDED whose details name the server's bound: the router's `router.request_timeout_s`,
  or Ray's proxy giving up (its `request_timeout_s`, 10 s later).
A call that exceeds its client deadline counts as hung.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import pytest

from cluster.redis_server import parse_redis_url, start_local_redis
from specserve.v1 import specserve_pb2 as pb
from specserve.v1 import specserve_pb2_grpc as pb_grpc
from tests.e2e.conftest import launch_cluster

pytestmark = [pytest.mark.chaos, pytest.mark.engine]

CALL_DEADLINE_S = 150  # > router.request_timeout_s (120 s) and the proxy's 130 s: a call past this is hung
RECOVERY_BOUND_S = 400


def _chaos_overrides(raw: dict) -> None:
    raw["router"].update(first_token_timeout_s=60, stream_idle_timeout_s=30)
    for pool in raw["pools"].values():
        pool.update(health_probe_interval_s=5, health_probe_timeout_s=20, drain_grace_s=10)


@pytest.fixture(scope="module")
def chaos_cluster(tmp_path_factory):
    yield from launch_cluster(tmp_path_factory.mktemp("chaos"), "specserve-chaos", _chaos_overrides)


def _documented(code: grpc.StatusCode, details: str) -> bool:
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED):
        return True
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:  # the server's bound, not the client's deadline
        return "router.request_timeout_s" in details or "timed out after" in details
    return code == grpc.StatusCode.INTERNAL and any(
        s in details for s in ("ActorDiedError", "RayActorError", "ActorUnavailableError", "actor died",
                               "The actor died", "unexpectedly"))


class Load:
    """Three client threads sending unary and streaming calls in a loop until stopped."""

    def __init__(self, target: str):
        self.target = target
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.outcomes: Counter = Counter()
        self.undocumented: list[str] = []
        self.threads = [threading.Thread(target=self._worker, args=(i,), daemon=True) for i in range(3)]

    def _request(self, rng: random.Random) -> pb.GenerateRequest:
        spec = rng.choice([pb.SpeculativeOverride(mode="ngram", k=2), pb.SpeculativeOverride(mode="none"), None])
        return pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=f"Repeat: {rng.random():.6f}")],
                                  sampling=pb.SamplingParams(max_tokens=8, temperature=0.0), speculative=spec)

    def _worker(self, i: int) -> None:
        rng = random.Random(i)
        channel = grpc.insecure_channel(self.target)
        stub = pb_grpc.SpecServeStub(channel)
        while not self.stop.is_set():
            req = self._request(rng)
            try:
                if rng.random() < 0.5:
                    stub.Generate(req, timeout=CALL_DEADLINE_S)
                else:
                    list(stub.GenerateStream(req, timeout=CALL_DEADLINE_S))
                self._count("ok")
            except grpc.RpcError as e:
                code, details = e.code(), e.details() or ""
                if code == grpc.StatusCode.DEADLINE_EXCEEDED and not _documented(code, details):
                    self._count("hung")
                elif _documented(code, details):
                    self._count(f"documented:{code.name}")
                else:
                    self._count(f"undocumented:{code.name}")
                    with self.lock:
                        self.undocumented.append(f"{code.name}: {details[:200]}")
                time.sleep(0.5)
        channel.close()

    def _count(self, what: str) -> None:
        with self.lock:
            self.outcomes[what] += 1

    def snapshot(self) -> Counter:
        with self.lock:
            return Counter(self.outcomes)

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=CALL_DEADLINE_S + 10)
        assert not any(t.is_alive() for t in self.threads), "a client thread never returned"


def _pids(pattern: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _parent_chain_has(pid: int, ancestors: list[int]) -> bool:
    """Whether one of `ancestors` is a parent (or grandparent, ...) of `pid`."""
    while pid > 1:
        if pid in ancestors:
            return True
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return False


def _kill_quietly(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _probe_ok(stub, mode: str) -> bool:
    req = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="ping")],
                             sampling=pb.SamplingParams(max_tokens=2),
                             speculative=pb.SpeculativeOverride(mode=mode, **({"k": 1} if mode != "none" else {})))
    try:
        stub.Generate(req, timeout=30)
        return True
    except grpc.RpcError:
        return False


def _wait_recovered(stub, mode: str, t_kill: float) -> float:
    while True:
        if _probe_ok(stub, mode):
            return time.monotonic() - t_kill
        assert time.monotonic() - t_kill < RECOVERY_BOUND_S, f"{mode} not recovered in {RECOVERY_BOUND_S} s"
        time.sleep(2)


def test_chaos_kill_engine_router_redis(chaos_cluster):
    c = chaos_cluster
    app = c.raw["name"]
    channel = grpc.insecure_channel(c.grpc_target)
    stub = pb_grpc.SpecServeStub(channel)
    report: dict = {"phases": {}}
    with Load(c.grpc_target) as load:
        time.sleep(15)
        report["phases"]["steady"] = dict(load.snapshot())

        # 0. a stalled (not killed) engine: SIGSTOP the draft pool's vLLM engine core. The replica's
        #    health check runs a real 1-token generation, times out, and Ray Serve replaces it.
        old_replica = _pids(f"ServeReplica:{app}:engine-draft")
        stalled = [p for p in _pids("EngineCore") if _parent_chain_has(p, old_replica)]
        assert stalled, "draft engine core process not found"
        t_stop = time.monotonic()
        for pid in stalled:
            os.kill(pid, signal.SIGSTOP)
        c.cleanups.append(lambda: [_kill_quietly(p) for p in stalled])
        while set(_pids(f"ServeReplica:{app}:engine-draft")) & set(old_replica):
            assert time.monotonic() - t_stop < RECOVERY_BOUND_S, "stalled replica was never replaced"
            time.sleep(2)
        report["stalled_engine_replaced_s"] = round(time.monotonic() - t_stop, 1)
        report["stalled_engine_recovery_s"] = round(_wait_recovered(stub, "eagle", t_stop), 1)
        report["phases"]["after_engine_stall"] = dict(load.snapshot())

        # 1. an engine replica process (the ngram pool's only replica)
        pids = _pids(f"ServeReplica:{app}:engine-ngram")
        assert pids, "engine replica process not found"
        t_kill = time.monotonic()
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        report["engine_recovery_s"] = round(_wait_recovered(stub, "ngram", t_kill), 1)
        report["phases"]["after_engine_kill"] = dict(load.snapshot())

        # 2. the router replica
        pids = _pids(f"ServeReplica:{app}:router")
        assert pids, "router replica process not found"
        t_kill = time.monotonic()
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        time.sleep(1)
        report["router_recovery_s"] = round(_wait_recovered(stub, "none", t_kill), 1)
        report["phases"]["after_router_kill"] = dict(load.snapshot())

        # 3. Redis (the tuning state): requests go on; restart it on its port
        host, port, _ = parse_redis_url(c.redis_url)
        pids = _pids(f"redis-server.*:{port}")
        assert pids, "redis-server not found"
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        time.sleep(10)
        restarted = start_local_redis(port)
        c.cleanups.append(restarted.stop)
        time.sleep(10)
        report["phases"]["after_redis_kill"] = dict(load.snapshot())
    channel.close()

    totals = load.snapshot()
    report.update(
        sent=sum(totals.values()), succeeded=totals["ok"],
        failed_documented=sum(v for k, v in totals.items() if k.startswith("documented:")),
        failed_undocumented=sum(v for k, v in totals.items() if k.startswith("undocumented:")),
        hung=totals["hung"], outcomes=dict(totals), undocumented_examples=load.undocumented[:10],
    )
    print("chaos report:", json.dumps(report, indent=2))
    out = Path(os.environ.get("SPECSERVE_CHAOS_REPORT", "results/chaos-report.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    assert report["hung"] == 0, report
    assert report["failed_undocumented"] == 0, report
    assert report["succeeded"] > report["failed_documented"], report
