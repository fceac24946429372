"""Node loss on a multi-node Ray cluster on this machine (cluster/configs/local-multinode.yaml, with a
spare node of each kind): while clients send requests, kill every process of one worker node (its
node process, raylet, workers and their vLLM engine cores) with SIGKILL.

- The drafter's node: the target keeps serving without drafts (no request fails), and drafting
  resumes once Serve has placed a new drafter replica on the spare drafter node.
- The node of one of the target pool's two replicas: a request in flight there ends (UNAVAILABLE,
  never a hang), requests keep succeeding on the survivor, and the pool is back to two replicas
  once Serve has started one on the spare target node.

Reports detection, serving-again and recovery times and request counts to
results/chaos-node-loss.json (BENCHMARKS.md section 6). Chaos tier: `scripts/test --chaos`.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter

import httpx
import psutil
import pytest

from tests.e2e.conftest import ROOT, launch_cluster
from tests.paths import CONFIGS

pytestmark = [pytest.mark.chaos, pytest.mark.engine]

REPORT = ROOT / "results" / "chaos-node-loss.json"
CALL_TIMEOUT_S = 150  # > router.request_timeout_s (120 s): a call past this is hung
RECOVERY_BOUND_S = 420
PROMPT = "Repeat this list exactly: apples, pears, plums, cherries, apples, pears, plums, cherries, apples, pears."


def _overrides(raw: dict) -> None:
    raw["pools"].pop("ngram")
    remote = raw["pools"]["remote"]
    remote.update(replicas=2, health_probe_interval_s=5, drain_grace_s=10)
    raw["router"].update(first_token_timeout_s=60, stream_idle_timeout_s=30)
    raw["ray"]["nodes"] = [
        {"name": "target-1", "num_cpus": 1, "resources": {"specserve_target": 1}},
        {"name": "target-2", "num_cpus": 1, "resources": {"specserve_target": 1}},
        {"name": "target-spare", "num_cpus": 1, "resources": {"specserve_target": 1}},
        {"name": "drafter-1", "num_cpus": 1, "resources": {"specserve_drafter": 1}},
        {"name": "drafter-spare", "num_cpus": 1, "resources": {"specserve_drafter": 1}},
    ]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from launch_cluster(tmp_path_factory.mktemp("nodeloss"), "specserve-nodeloss", _overrides,
                              base=CONFIGS / "local-multinode.yaml")


def _placement(cluster) -> dict[str, list[str]]:
    """Deployment -> the nodes of its RUNNING replicas (`specserve status`)."""
    out = subprocess.run([sys.executable, "-m", "cluster.ops.cli", "status", "--url", cluster.http_url,
                          "--config", str(cluster.config_path), "--ray-timeout", "20"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    status = json.loads(out.stdout)
    deployments = status.get("applications", {}).get(cluster.raw["name"], {}).get("deployments", {})
    return {d: [r["node"] for r in v.get("on_nodes", [])] for d, v in deployments.items()
            if v.get("replicas", {}).get("RUNNING")}


def _kill_node(cluster, name: str) -> int:
    """SIGKILL every process of worker node `name` at once; the number killed."""
    root = None
    for p in psutil.Process(cluster.proc.pid).children(recursive=True):
        try:
            cmd = p.cmdline()
        except psutil.NoSuchProcess:
            continue
        if "cluster.ops.ray_node" in cmd and "--name" in cmd and cmd[cmd.index("--name") + 1] == name:
            root = p
            break
    assert root is not None, f"no node process for node {name!r}"
    procs = [root] + root.children(recursive=True)
    for p in procs:
        try:
            os.kill(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(procs)


class Load:
    """`streams` clients sending remote_draft requests back to back; every outcome with its times."""

    def __init__(self, url: str, streams: int = 3):
        self.url, self.streams = url, streams
        self.results: list[dict] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(streams)]

    def __enter__(self) -> "Load":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(CALL_TIMEOUT_S + 10)

    def _run(self, i: int) -> None:
        n = 0
        while not self._stop.is_set():
            body = {"prompt": f"[{i}.{n}] {PROMPT}", "max_tokens": 32, "temperature": 0.0,
                    "specserve": {"speculative": {"mode": "remote_draft", "k": 4}}}
            t0 = time.monotonic()
            try:
                r = httpx.post(f"{self.url}/v1/completions", json=body, timeout=CALL_TIMEOUT_S)
                outcome = "ok" if r.status_code == 200 else f"http {r.status_code}"
                spec = r.json().get("specserve", {}) if r.status_code == 200 else {}
            except httpx.TimeoutException:
                outcome, spec = "hung", {}
            except httpx.HTTPError as e:
                outcome, spec = f"transport {type(e).__name__}", {}
            self.results.append({"t0": t0, "t1": time.monotonic(), "outcome": outcome,
                                 "drafted": spec.get("drafted", 0)})
            n += 1

    def since(self, t: float) -> list[dict]:
        return [r for r in list(self.results) if r["t0"] >= t]


def _wait(pred, bound_s: float, every_s: float = 2.0) -> float:
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < bound_s, f"not within {bound_s} s"
        time.sleep(every_s)
    return time.monotonic() - t0


def test_node_loss_under_load(cluster):
    report: dict = {}
    where = _placement(cluster)
    assert sorted(where["engine-remote"]) in (["target-1", "target-2"], ["target-1", "target-spare"],
                                              ["target-2", "target-spare"]), where
    drafter_node = where["drafter-l4"][0]
    assert drafter_node.startswith("drafter-"), where

    with Load(cluster.http_url) as load:
        _wait(lambda: sum(r["outcome"] == "ok" and r["drafted"] > 0 for r in load.results) >= 6, 120)

        # 1. The drafter's node.
        t_kill = time.monotonic()
        before = [r for r in load.results if r["outcome"] == "ok"]
        killed = _kill_node(cluster, drafter_node)
        undrafted = _wait(lambda: any(r["drafted"] == 0 for r in load.since(t_kill + 0.5)), 120, 0.5)
        resumed = _wait(lambda: any(r["drafted"] > 0 for r in load.since(t_kill + undrafted + 1)), RECOVERY_BOUND_S)
        after = [r for r in load.results if r["t1"] >= t_kill]
        moved = _placement(cluster)["drafter-l4"]
        report["drafter_node"] = {
            "node": drafter_node, "processes_killed": killed, "first_request_without_drafts_s": round(undrafted, 1),
            "drafting_resumed_s": round(undrafted + 1 + resumed, 1), "new_drafter_on": moved,
            "requests": dict(Counter(r["outcome"] for r in after))}
        assert all(r["outcome"] == "ok" for r in after), report["drafter_node"]
        assert moved and moved[0] != drafter_node

        # 2. The node of one target replica (the other replica keeps serving).
        victim = sorted(_placement(cluster)["engine-remote"])[0]
        t_kill = time.monotonic()
        killed = _kill_node(cluster, victim)
        time.sleep(20)
        serving_again = min((r["t1"] - t_kill for r in load.since(t_kill) if r["outcome"] == "ok"), default=None)
        back = _wait(lambda: len(_placement(cluster).get("engine-remote", [])) == 2
                     and victim not in _placement(cluster)["engine-remote"], RECOVERY_BOUND_S, 5)
        time.sleep(15)  # requests on the restored pool
        t_stop = time.monotonic()
    # Every request has ended here (the load's threads are joined).
    at_risk = [r for r in load.results if r["t0"] < t_kill < r["t1"]]
    after = [r for r in load.results if t_kill <= r["t0"] < t_stop]
    slow = [r for r in after if r["t1"] - r["t0"] > 10]
    report["target_node"] = {
        "node": victim, "processes_killed": killed, "in_flight_at_kill": dict(Counter(r["outcome"] for r in at_risk)),
        "first_success_after_kill_s": None if serving_again is None else round(serving_again, 1),
        "pool_back_to_2_replicas_s": round(20 + back, 1), "replicas_on": _placement(cluster)["engine-remote"],
        "requests_started_after_kill": dict(Counter(r["outcome"] for r in after)),
        "of_those_over_10s": [{"started_after_kill_s": round(r["t0"] - t_kill, 1), "took_s": round(r["t1"] - r["t0"], 1),
                               "outcome": r["outcome"], "drafted": r["drafted"]} for r in slow]}
    report["latency_before_any_kill_s"] = round(statistics.median(r["t1"] - r["t0"] for r in before), 2)
    report["all_requests"] = dict(Counter(r["outcome"] for r in load.results))
    REPORT.parent.mkdir(exist_ok=True)
    REPORT.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    assert "hung" not in report["all_requests"], report
    assert all(o == "ok" or o == "http 503" for o in report["target_node"]["in_flight_at_kill"]), report
    assert set(report["target_node"]["requests_started_after_kill"]) == {"ok"}, report
    assert serving_again is not None and serving_again < 30, report
