"""End to end: malformed, huge and out-of-range values written into the tuning keys of a
real Redis are ignored by the running router (a warning in its log and a Prometheus counter), and
requests keep being served on defaults with K within the pool's maximum."""

from __future__ import annotations

import glob
import os
import time

import httpx
import pytest
import redis

from cluster.state.tuning_cells import cell_key

pytestmark = pytest.mark.engine

PREFIX = "specserve:v3"
MODEL = "smollm2-135m"
PROMPTS = {
    "translation": "Translate German to English: Der Hund spielt im Garten mit dem Ball.",
    "summarization": "Summarize the following text in one sentence: " + "The council met on Monday. " * 10,
    "chat": "hello, how are you today?",
    "code": "Write a Python function that reverses a list.",
    "qa": "What is the capital of France?",
}


def _poison(client: redis.Redis) -> dict[str, str]:
    """Write one bad value per kind; returns {key: kind}."""
    key = lambda mode, wclass, bucket="1": cell_key(PREFIX, MODEL, mode, wclass, bucket)  # noqa: E731
    now = str(time.time())
    keys = {
        key("ngram", "chat"): "type",
        key("ngram", "code"): "fields",
        key("ngram", "qa"): "size",
        key("ngram", "summarization"): "value",  # more K per step than any pool
        key("none", "translation"): "value",  # negative counts
        key("ngram", "translation", "2-3"): "value",  # NaN
    }
    for k in keys:
        client.delete(k)
    ks = list(keys)
    client.set(ks[0], "not a hash")
    client.hset(ks[1], mapping={f"f{i}": i for i in range(5000)})
    client.hset(ks[2], mapping={"steps": "9" * (1 << 20)})
    client.hset(ks[3], mapping={"steps": 100, "k_steps": 3000, "accepted": 290, "drafted": 300, "updated": now})
    client.hset(ks[4], mapping={"steps": -5, "requests": -1, "updated": now})
    client.hset(ks[5], mapping={"steps": 10, "decode_s": "nan", "updated": now})
    return keys


def _metric_total(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def test_poisoned_tuning_keys_are_ignored_with_a_warning_and_a_metric(cluster):
    client = redis.Redis.from_url(cluster.redis_url)
    # A plausible-looking cell that claims every draft is accepted at K = 16: valid values, but K
    # must still stay within the pool's maximum (ngram: 6).
    greedy = cell_key(PREFIX, MODEL, "ngram", "translation", "1")
    client.hset(greedy, mapping={"requests": 50, "steps": 500, "drafted": 8000, "accepted": 8000,
                                 "rejected_steps": 0, "k_steps": 8000, "tokens": 8500, "decode_s": 50.0,
                                 "updated": str(time.time())})
    started = time.time()
    poisoned = _poison(client)
    max_k = {name: p["max_k"] for name, p in cluster.raw["pools"].items()}
    time.sleep(3)  # the router refreshes its view every second
    for _ in range(2):
        for wclass, text in PROMPTS.items():
            r = httpx.post(f"{cluster.http_url}/v1/chat/completions", timeout=300, json={
                "messages": [{"role": "user", "content": text}], "max_tokens": 8})
            assert r.status_code == 200, r.text
            s = r.json()["specserve"]
            assert s["decided_by"] == "policy"
            # suffix requests have their own bound (`suffix.max_k`, 16 by default); n-gram's stays 6
            bound = (cluster.raw["pools"][s["pool"]].get("suffix", {}).get("max_k", 16) if s["mode"] == "suffix"
                     else max_k[s["pool"]])
            assert 0 <= s["k"] <= bound, s

    # The Prometheus counter, by reason, through Ray's metrics agent.
    port = cluster.raw["ray"]["metrics_export_port"]
    deadline, text = time.monotonic() + 90, ""
    while time.monotonic() < deadline:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        if {f'reason="{k}"' for k in set(poisoned.values())} <= {
                part for line in text.splitlines() if line.startswith("ray_specserve_tuning_ignored_keys")
                for part in line.split(",") + [line]}:
            break
        time.sleep(2)
    lines = [line for line in text.splitlines() if line.startswith("ray_specserve_tuning_ignored_keys")]
    assert lines, "specserve_tuning_ignored_keys not exported"
    for kind in set(poisoned.values()):
        assert any(f'reason="{kind}"' in line for line in lines), (kind, lines)
    assert _metric_total(text, "ray_specserve_tuning_ignored_keys") >= len(poisoned)

    # The warning, in the router replica's Serve log (logs/serve/replica_<app>_router_*.log, where
    # an operator reads a replica's logs: `cluster.ops.logsafe.route_to_serve_log`), and in the replica
    # actor's stderr (logs/worker-*.err) through the root logger.
    for pattern in ("/tmp/ray/session_*/logs/serve/replica_*router*.log", "/tmp/ray/session_*/logs/worker-*.err"):
        logs = [p for p in glob.glob(pattern) if os.path.getmtime(p) >= started - 1]
        found = set()
        for path in logs:
            with open(path, errors="replace") as f:
                for line in f:
                    if "ignoring tuning key" in line:
                        found.update(k for k in poisoned if k in line)
        assert found == set(poisoned), (pattern, sorted(set(poisoned) - found), logs)
    # Repaired: the router deleted the bad keys so writers can rebuild them.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(client.type(k) not in (b"none", b"hash") or client.hlen(k) > 100
                                              for k in poisoned if client.exists(k)):
        time.sleep(1)
    assert client.type(list(poisoned)[0]) in (b"none", b"hash")
    client.delete(greedy)
