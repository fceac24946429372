"""End to end: the router decides per request from the workload class, writes its tuning
state to the real Redis, and keeps serving through a Redis outage (then resumes writing)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import redis

from cluster.policy import BUCKET_NAMES
from cluster.state.redis_server import parse_redis_url, start_local_redis

pytestmark = pytest.mark.engine

PREFIX = "specserve:v3"


def _requests_recorded(client: redis.Redis) -> int:
    total = 0
    for key in client.scan_iter(match=f"{PREFIX}:*", count=1000):
        if client.type(key) == b"hash":
            total += int(client.hget(key, "requests") or 0)
    return total


def _redis_pid(port: int) -> int:
    out = subprocess.run(["pgrep", "-f", f"redis-server.*:{port}|redis-server.*--port {port}"],
                         capture_output=True, text=True)
    pids = [int(p) for p in out.stdout.split()]
    assert pids, f"no redis-server found for port {port}"
    return pids[0]


def test_auto_decisions_follow_the_workload_class(cluster):
    url = cluster.http_url
    cases = {
        "summarization": "Summarize the following article in two sentences:\n" + "The city council met on Monday. " * 20,
        "translation": "Translate German to English: Der Hund spielt im Garten mit dem Ball.",
    }
    seen = {}
    for wclass, text in cases.items():
        r = httpx.post(f"{url}/v1/chat/completions", timeout=300, json={
            "messages": [{"role": "user", "content": text}], "max_tokens": 16})
        assert r.status_code == 200, r.text
        s = r.json()["specserve"]
        assert s["decided_by"] == "policy" and isinstance(s["explored"], bool)
        assert s["decision"]["load_bucket"] in BUCKET_NAMES and s["decision"]["k_by"] == "engine"
        assert 0.0 <= s["decision"]["k_step_alpha"] <= 1.0 and s["decision"]["scores"]
        assert s["workload_class"] == wclass
        seen[wclass] = s
    explicit = httpx.post(f"{url}/v1/chat/completions", timeout=300, json={
        "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8,
        "specserve": {"workload_class": "code"}}).json()["specserve"]
    assert explicit["workload_class"] == "code"


def test_redis_outage_fails_no_request_and_tuning_resumes(cluster):
    url = cluster.http_url
    host, port, _ = parse_redis_url(cluster.redis_url)
    client = redis.Redis(host=host, port=port, socket_timeout=1, socket_connect_timeout=1)
    failures: list[str] = []
    done = 0

    async def load(stop_at: float):
        nonlocal done
        async with httpx.AsyncClient() as http:
            async def stream_worker(i):
                nonlocal done
                while time.monotonic() < stop_at:
                    r = await http.post(f"{url}/v1/chat/completions", timeout=120, json={
                        "messages": [{"role": "user", "content": f"Summarize: item {i} costs {done} dollars."}],
                        "max_tokens": 6})
                    if r.status_code != 200:
                        failures.append(r.text[:200])
                    done += 1
            await asyncio.gather(*[stream_worker(i) for i in range(3)])

    # 1. warm: the tuner writes
    before = _requests_recorded(client)
    asyncio.run(load(time.monotonic() + 6))
    deadline = time.monotonic() + 10
    while _requests_recorded(client) <= before:
        assert time.monotonic() < deadline, "tuner did not write to Redis"
        time.sleep(0.5)
    # 2. kill Redis hard and keep the load on
    pid = _redis_pid(port)
    os.kill(pid, signal.SIGKILL)
    served_before_outage = done
    asyncio.run(load(time.monotonic() + 8))
    assert done > served_before_outage + 3, "too few requests during the outage to mean anything"
    assert not failures, f"{len(failures)} requests failed while Redis was down: {failures[:3]}"
    # 3. restart Redis on the same port (its AOF/RDB data dir is per port): writes resume within 10 s
    restarted = start_local_redis(port)
    cluster.cleanups.append(restarted.stop)
    at_restart = _requests_recorded(client)
    t_restart = time.monotonic()
    asyncio.run(load(time.monotonic() + 4))
    while _requests_recorded(client) <= at_restart:
        assert time.monotonic() - t_restart < 10 + 4, "tuner did not resume writing within 10 s of Redis returning"
        time.sleep(0.5)
    assert not failures


def test_tuning_command_prints_the_table(cluster):
    out = subprocess.run([sys.executable, "-m", "cluster.ops.cli", "tuning", "--config", str(cluster.config_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "smollm2-135m" in out.stdout and "suffix" in out.stdout  # auto drafts by suffix on the n-gram pool
    assert "step_ms_at_k" in out.stdout.splitlines()[1]
    out = subprocess.run([sys.executable, "-m", "cluster.ops.cli", "tuning", "--json", "--config", str(cluster.config_path)],
                         capture_output=True, text=True, timeout=120)
    rows = json.loads(out.stdout)
    # The step time per K that the policy's cost reads: a speculative cell has it at its requests' K.
    assert any(r["mode"] in ("ngram", "suffix") and any(int(k) > 0 and ms > 0 for k, ms in r["step_ms_at_k"].items()) for r in rows)


def test_prometheus_metrics_per_class_and_mode(cluster):
    port = cluster.raw["ray"]["metrics_export_port"]
    httpx.post(f"{cluster.http_url}/v1/chat/completions", timeout=300, json={
        "messages": [{"role": "user", "content": "Summarize: the cat sat on the mat."}], "max_tokens": 4,
        "specserve": {"speculative": {"mode": "ngram", "k": 2}}}).raise_for_status()
    deadline = time.monotonic() + 60  # Ray's metrics agent exports every few seconds
    text = ""
    while time.monotonic() < deadline:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        if "specserve_requests" in text and "specserve_drafted_tokens" in text:
            break
        time.sleep(2)
    lines = [line for line in text.splitlines() if line.startswith("ray_specserve_requests")]
    assert lines, "router metrics not exported"
    assert any('mode="ngram"' in line and 'workload_class="summarization"' in line for line in lines), lines[:5]
    assert "specserve_chosen_k" in text and "specserve_acceptance_length" in text
