"""Chaos: under a steady mixed gRPC load, kill an engine replica, the router and Redis in turn;
count requests sent, succeeded, failed with a documented error, failed otherwise, and hung (must be
zero), and the time each component takes to recover full capacity. Then, under gRPC and HTTP load,
kill only the vLLM engine core inside a live engine replica (`test_chaos_engine_core_death`).

Runs in its own cluster (tier `chaos`: `scripts/test --chaos`). Loopback only, bounded in time.

Documented failures while a component is down (docs: README "Failure semantics"):
- UNAVAILABLE: the engine replica (or its engine core) died mid-stream, or no output within the
  router's bounds; the router replica died under the call (its door's connection closed), or no
  router replica listens yet;
- RESOURCE_EXHAUSTED: a pool's queue is full;
- DEADLINE_EXCEEDED whose details name the router's `router.request_timeout_s`.
No INTERNAL: a dead router is a reset connection, which a client retries as UNAVAILABLE.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import grpc
import httpx
import pytest

from cluster.state.redis_server import parse_redis_url, start_local_redis
from specserve.v1 import specserve_pb2 as pb
from specserve.v1 import specserve_pb2_grpc as pb_grpc
from tests.e2e.conftest import launch_cluster

pytestmark = [pytest.mark.chaos, pytest.mark.engine]

CALL_DEADLINE_S = 150  # > router.request_timeout_s (120 s): a call past this is hung
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
        return "router.request_timeout_s" in details
    return False


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


# -- the engine core dies inside a live replica ----------------------------------------------------

# Kill -> the replica's process has ended: it fails its calls with EngineDead and retires itself
# (deployments/engine_death.py, 0.5 s grace). Left to its health checks, Serve would replace it only
# after three failed ones (~30 s), routing requests into it all the while.
ENGINE_DEATH_DETECTION_BOUND_S = 10.0
LONG_TOKENS = 400  # a stream that is surely still running when its engine core is killed


@dataclass
class Call:
    door: str  # grpc | http
    kind: str  # unary | stream | long-stream
    sent: float  # monotonic
    first: Optional[float] = None  # first streamed output received (streams only)
    done: float = 0.0
    outcome: str = ""  # ok | unavailable | hung | other:<what>
    replica: str = ""  # the engine replica that served it (HTTP only)


class DoorLoad:
    """Client threads on both doors, each sending requests back to back until stopped: gRPC unary and
    streams, HTTP plain and SSE, and one long stream per door. Every call is recorded (`Call`);
    `long_started[door]`: when that door's long stream under way got its third event (None between
    streams)."""

    def __init__(self, grpc_target: str, http_url: str):
        self.grpc_target, self.http_url = grpc_target, http_url
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.calls: list[Call] = []
        self.long_started: dict[str, Optional[float]] = {"grpc": None, "http": None}
        workers = [(self._grpc, "short", 0), (self._grpc, "short", 1), (self._grpc, "long", 2),
                   (self._http, "short", 3), (self._http, "long", 4)]
        self.threads = [threading.Thread(target=f, args=(what, i), daemon=True) for f, what, i in workers]

    def _record(self, call: Call) -> None:
        call.done = time.monotonic()
        if call.outcome.startswith("other") and call.done - call.sent >= CALL_DEADLINE_S - 1:
            call.outcome = "hung"
        with self.lock:
            self.calls.append(call)

    def _grpc(self, what: str, i: int) -> None:
        rng = random.Random(i)
        channel = grpc.insecure_channel(self.grpc_target)
        stub = pb_grpc.SpecServeStub(channel)
        while not self.stop.is_set():
            if what == "long":
                call = Call("grpc", "long-stream", time.monotonic())
                req = pb.GenerateRequest(prompt="1, 2, 3, 4, 5, 6, 7, 8, 9, 10,",
                                         sampling=pb.SamplingParams(max_tokens=LONG_TOKENS),
                                         speculative=pb.SpeculativeOverride(mode="none"))
            else:
                call = Call("grpc", rng.choice(["unary", "stream"]), time.monotonic())
                spec = rng.choice([pb.SpeculativeOverride(mode="ngram", k=2), pb.SpeculativeOverride(mode="none"), None])
                req = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=f"Repeat: {rng.random():.6f}")],
                                         sampling=pb.SamplingParams(max_tokens=16), speculative=spec)
            try:
                if call.kind == "unary":
                    stub.Generate(req, timeout=CALL_DEADLINE_S)
                else:
                    for n, _ in enumerate(stub.GenerateStream(req, timeout=CALL_DEADLINE_S)):
                        call.first = call.first or time.monotonic()
                        if what == "long" and n == 2:
                            self.long_started["grpc"] = time.monotonic()
                call.outcome = "ok"
            except grpc.RpcError as e:  # past the client's deadline: hung (`_record`)
                code = e.code()
                call.outcome = ("unavailable" if code == grpc.StatusCode.UNAVAILABLE
                                else f"other:{code.name}: {(e.details() or '')[:160]}")
            except Exception as e:  # noqa: BLE001 - counted, so a client thread never dies unseen
                call.outcome = f"other:{type(e).__name__}: {str(e)[:160]}"
            finally:
                if what == "long":
                    self.long_started["grpc"] = None
            self._record(call)
            if call.outcome != "ok":
                time.sleep(0.5)
        channel.close()

    def _http(self, what: str, i: int) -> None:
        rng = random.Random(i)
        with httpx.Client(timeout=httpx.Timeout(CALL_DEADLINE_S)) as client:
            while not self.stop.is_set():
                if what == "long":
                    call = Call("http", "long-stream", time.monotonic())
                    body = {"messages": [{"role": "user", "content": "Write a very long story about a dragon."}],
                            "max_tokens": LONG_TOKENS, "ignore_eos": True, "stream": True,
                            "specserve": {"speculative": {"mode": "none"}}}
                else:
                    call = Call("http", rng.choice(["unary", "stream"]), time.monotonic())
                    body = {"messages": [{"role": "user", "content": f"Repeat: {rng.random():.6f}"}], "max_tokens": 16,
                            "stream": call.kind == "stream"}
                try:
                    call.outcome, call.replica = self._http_call(client, body, call, what == "long")
                except httpx.TimeoutException:
                    call.outcome = "hung"
                except Exception as e:  # noqa: BLE001 - counted, so a client thread never dies unseen
                    call.outcome = f"other:{type(e).__name__}: {str(e)[:160]}"
                finally:
                    if what == "long":
                        self.long_started["http"] = None
                self._record(call)
                if call.outcome != "ok":
                    time.sleep(0.5)

    def _http_call(self, client: httpx.Client, body: dict, call: Call, long: bool) -> tuple[str, str]:
        """(outcome, replica) of one HTTP call: a failure must be 503 with Retry-After before any
        output, or an SSE error event `unavailable` after some."""
        with client.stream("POST", f"{self.http_url}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                if r.status_code == 503 and r.headers.get("retry-after", "").isdigit():
                    return "unavailable", ""
                return f"other:HTTP {r.status_code} retry-after={r.headers.get('retry-after')}: {r.text[:160]}", ""
            if not body["stream"]:
                r.read()
                return "ok", str(r.json().get("specserve", {}).get("replica", ""))
            events = 0
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    code = event["error"].get("code")
                    return ("unavailable", "") if code == "unavailable" else (f"other:SSE {code}", "")
                call.first, events = call.first or time.monotonic(), events + 1
                if long and events == 3:
                    self.long_started["http"] = time.monotonic()
                if event["choices"][0].get("finish_reason"):
                    return "ok", str(event.get("specserve", {}).get("replica", ""))
            return "other:SSE ended without a last chunk or an error", ""

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=CALL_DEADLINE_S + 10)
        assert not any(t.is_alive() for t in self.threads), "a client thread never returned (a hung call)"


def _tally(calls: list[Call]) -> dict[str, int]:
    return dict(Counter(c.outcome if not c.outcome.startswith("other") else "other" for c in calls))


def test_chaos_engine_core_death(chaos_cluster):
    """SIGKILL the vLLM engine core (`VLLM::EngineCore`) inside the n-gram pool's only engine replica,
    not the replica, while gRPC and HTTP clients send plain and streaming requests, a long stream per
    door under way. Asserts: no INTERNAL / 500 or other failure, every failure UNAVAILABLE (HTTP: 503
    with Retry-After, or an SSE error event `unavailable` mid-stream), the streams under way at the
    kill end so, nothing hangs, the replica retires within ENGINE_DEATH_DETECTION_BOUND_S and the
    pool serves again within RECOVERY_BOUND_S. Reports (printed, and `chaos-engine-death.json` beside
    the chaos report): detection (kill -> the replica's process ended), the replacement replica's
    start, time to serve again, and every outcome, among them the calls in flight at the kill."""
    c = chaos_cluster
    app = c.raw["name"]
    channel = grpc.insecure_channel(c.grpc_target)
    stub = pb_grpc.SpecServeStub(channel)
    _wait_recovered(stub, "ngram", time.monotonic())  # serving (after an earlier test's kills, too)
    report: dict = {"pool": "ngram"}
    replica_pids = _pids(f"ServeReplica:{app}:engine-ngram")
    assert replica_pids, "n-gram engine replica not found"
    status = httpx.get(f"{c.http_url}/v1/specserve/status", timeout=30).json()
    old_replica = str(status["pools"]["ngram"].get("engine", {}).get("replica", ""))
    with DoorLoad(c.grpc_target, c.http_url) as load:
        # Kill while an HTTP long stream is surely under way (its third event came under 2 s ago,
        # LONG_TOKENS are far off), and the gRPC one too if it comes within a minute.
        t_wait = time.monotonic()
        while True:
            now, started = time.monotonic(), dict(load.long_started)
            if started["http"] is not None and now - started["http"] < 2.0 and (
                    started["grpc"] is not None or now - t_wait > 60):
                break
            assert now - t_wait < 300, "no HTTP long stream got under way"
            time.sleep(0.05)
        cores = [p for p in _pids("EngineCore") if _parent_chain_has(p, replica_pids)]
        assert cores, "the n-gram replica's engine core not found"
        t_kill = time.monotonic()
        for pid in cores:
            _kill_quietly(pid)
        report["killed"] = {"engine_core_pids": cores, "replica_pids": replica_pids, "replica": old_replica,
                            "grpc_long_stream_under_way": started["grpc"] is not None}
        retired_s = replaced_s = None
        while (retired_s is None or replaced_s is None) and time.monotonic() - t_kill < RECOVERY_BOUND_S:
            now_pids = set(_pids(f"ServeReplica:{app}:engine-ngram"))
            if retired_s is None and not now_pids & set(replica_pids):
                retired_s = round(time.monotonic() - t_kill, 2)
            if replaced_s is None and now_pids - set(replica_pids):
                replaced_s = round(time.monotonic() - t_kill, 2)
            time.sleep(0.2)
        report["replica_retired_s"], report["replacement_started_s"] = retired_s, replaced_s
        serving_s = None
        while serving_s is None and time.monotonic() - t_kill < RECOVERY_BOUND_S:
            if _probe_ok(stub, "ngram"):
                serving_s = round(time.monotonic() - t_kill, 1)
            else:
                time.sleep(2)
        report["serving_again_s"] = serving_s
        time.sleep(15)  # serving steadily again
    channel.close()

    calls = load.calls
    in_flight = [x for x in calls if x.sent < t_kill < x.done]
    mid_stream = [x for x in in_flight if x.first is not None and x.first < t_kill]
    failed_after = [x.done - t_kill for x in calls if x.done > t_kill and x.outcome != "ok"]
    report.update(
        sent=len(calls), outcomes=_tally(calls),
        by_door={f"{d}/{k}": _tally([x for x in calls if (x.door, x.kind) == (d, k)])
                 for d, k in sorted({(x.door, x.kind) for x in calls})},
        in_flight_at_kill=_tally(in_flight), mid_stream_at_kill=_tally(mid_stream),
        # HTTP calls under way at the kill that succeeded on another replica: retried (no output yet)
        retried_onto_another_replica=sum(1 for x in in_flight if x.outcome == "ok" and x.replica
                                         and x.replica != old_replica),
        first_failure_after_kill_s=round(min(failed_after), 2) if failed_after else None,
        ok_after_serving_again=sum(1 for x in calls if x.outcome == "ok" and serving_s is not None
                                   and x.sent > t_kill + serving_s),
        other_examples=[f"{x.door}/{x.kind}: {x.outcome}" for x in calls if x.outcome.startswith("other")][:10],
    )
    print("engine core death report:", json.dumps(report, indent=2))
    out = Path(os.environ.get("SPECSERVE_CHAOS_REPORT", "results/chaos-report.json")).with_name("chaos-engine-death.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))

    assert report["outcomes"].get("other", 0) == 0, report  # no INTERNAL / 500, no 503 without Retry-After
    assert report["outcomes"].get("hung", 0) == 0, report
    assert mid_stream and all(x.outcome in ("unavailable", "ok") for x in mid_stream), report
    assert any(x.door == "http" and x.kind == "long-stream" and x.outcome == "unavailable" for x in mid_stream), report
    assert retired_s is not None and retired_s <= ENGINE_DEATH_DETECTION_BOUND_S, report
    assert serving_s is not None, report
    assert report["ok_after_serving_again"] > 0, report
