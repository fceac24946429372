"""Disaggregated speculation on a real cluster: a target pool whose vLLM engine drafts
through a separate drafter deployment. Greedy output is identical to no speculation on dev-set
prompts; killing the drafter replica mid-run fails no request, and speculation resumes. The same
small drafter also runs through vLLM's in-engine `draft_model` method (a second pool), lossless at
every K."""

from __future__ import annotations

import asyncio
import copy
import os
import signal
import subprocess
import time

import httpx
import pytest

from cluster.state.redis_server import free_port
from tests.e2e.conftest import launch_cluster
from tests.e2e.helpers import chat_all, dev_prompts

pytestmark = pytest.mark.engine

RESUME_BOUND_S = 120


def remote_overrides(raw: dict) -> None:
    """One target pool drafting remotely, shaped like the local `draft` pool, with a drafter deployment
    serving a standalone draft model (the target's first 4 layers: the drafter deployment runs a
    causal LM, whatever form the local draft pool's own drafter has)."""
    draft = raw["pools"]["draft"]
    draft.pop("auto", None)  # these are the config's only pools: auto must be able to choose them
    remote = copy.deepcopy(draft)
    remote.pop("drafter")
    remote.pop("prior_alpha", None)
    remote.update(method="remote_draft", remote_drafter="l4", max_k=4, remote_timeout_s=1.0, remote_reprobe_s=1.0,
                  max_ongoing_requests=32, max_queued_requests=64,
                  health_probe_timeout_s=90)  # a busy shared 2-core machine must not recycle the engine
    raw["models"]["smollm2-135m-draft-l4"] = {"source": f"truncate:{draft['model']}:4", "dtype": "float32"}
    raw["drafters"] = {"l4": {"model": "smollm2-135m-draft-l4", "replicas": 1, "resources": {"CPU": 1},
                              "port": free_port()}}  # known, for the hostile probes (the status page hides it)
    # The same small model through vLLM's own `draft_model` method, in-engine (the embedded default's
    # draft pool is an EAGLE head now, so this is where that method runs end to end).
    in_engine = copy.deepcopy(draft)
    in_engine.pop("prior_alpha", None)
    in_engine.update(method="draft_model", drafter="smollm2-135m-draft-l4", max_k=4)
    raw["pools"] = {"remote": remote, "draft": in_engine}


@pytest.fixture(scope="module")
def remote_cluster(tmp_path_factory):
    yield from launch_cluster(tmp_path_factory.mktemp("remote"), "specserve-remote-test", remote_overrides)


def _stats(resp: dict) -> dict:
    return resp["specserve"]


def test_greedy_output_identical_to_no_speculation(remote_cluster):
    prompts = dev_prompts(8)

    url = remote_cluster.http_url
    plain = asyncio.run(chat_all(url, prompts, {"mode": "none"}, max_tokens=48))
    remote = asyncio.run(chat_all(url, prompts, {"mode": "remote_draft", "k": 4}, max_tokens=48))
    for p, a, b in zip(prompts, plain, remote):
        assert _stats(b)["mode"] == "remote_draft" and _stats(b)["pool"] == "remote"
        assert _stats(a)["token_ids"] == _stats(b)["token_ids"], f"prompt {p['id']} ({p['category']}) differs"
    assert sum(_stats(b)["drafted"] for b in remote) > 0, "no draft came back from the drafter"
    assert sum(_stats(a)["drafted"] for a in plain) == 0


def test_in_engine_draft_model_is_lossless_at_every_k(remote_cluster):
    """vLLM's draft_model method (the same 4-layer drafter, inside the target's engine), K = 1..4."""
    prompts = dev_prompts(6)

    url = remote_cluster.http_url
    plain = asyncio.run(chat_all(url, prompts, {"mode": "none"}, max_tokens=32))
    runs = {k: asyncio.run(chat_all(url, prompts, {"mode": "draft_model", "k": k}, max_tokens=32)) for k in range(1, 5)}
    for k, results in runs.items():
        for p, a, b in zip(prompts, plain, results):
            assert _stats(b)["mode"] == "draft_model" and _stats(b)["pool"] == "draft" and _stats(b)["k"] == k
            assert _stats(a)["token_ids"] == _stats(b)["token_ids"], f"K={k}: prompt {p['id']} ({p['category']}) differs"
        assert sum(_stats(b)["drafted"] for b in results) > 0, f"K={k}: nothing drafted"


DRAFTER_MEMORY_BOUND_MIB = 64  # resident growth of the drafter replica over the hostile probes


def _drafter_rss_mib(app: str) -> float:
    import psutil

    pids = _pids(f"ServeReplica:{app}:drafter-l4")
    return sum(psutil.Process(p).memory_info().rss for p in pids) / (1 << 20)


def test_hostile_clients_neither_use_nor_stop_the_drafter(remote_cluster):
    """Against the live drafter replica: the status page does not say where it
    listens; garbage, an oversized prefix, a client without the secret, slowloris handshakes and
    a connection flood get nothing and stop nothing; the engines keep drafting through it, and its
    memory stays within DRAFTER_MEMORY_BOUND_MIB."""
    import socket
    import struct

    from cluster.engine.draft_wire import AuthError, client_handshake

    app, port = remote_cluster.raw["name"], remote_cluster.raw["drafters"]["l4"]["port"]
    status = httpx.get(f"{remote_cluster.http_url}/v1/specserve/status", timeout=30).text
    assert f":{port}" not in status and "has_endpoint" in status
    before = _drafter_rss_mib(app)
    addr = ("127.0.0.1", port)
    for payload in (os.urandom(4096), struct.pack(">I", 60 << 20), b"GET / HTTP/1.1\r\n\r\n"):
        with socket.create_connection(addr, timeout=10) as s:
            s.sendall(payload)
            s.settimeout(10)
            try:
                while s.recv(65536):
                    pass  # the drafter's hello, maybe an error frame, then the close
            except ConnectionResetError:
                pass
    with socket.create_connection(addr, timeout=10) as s, pytest.raises(AuthError):
        client_handshake(s, b"not-the-cluster-secret-0123", time.monotonic() + 10, 1 << 20)
    prompts = dev_prompts(4)
    asyncio.run(chat_all(remote_cluster.http_url, prompts[:1], {"mode": "remote_draft", "k": 4}, max_tokens=4))
    flood = []  # (the engines' own connection is fresh: it need not reconnect during the flood)
    for _ in range(80):  # past max_connections and the handshake cap; they trickle, never prove
        try:
            c = socket.create_connection(addr, timeout=5)
            c.sendall(b"\x00")
            flood.append(c)
        except OSError:
            break
    results = asyncio.run(chat_all(remote_cluster.http_url, prompts, {"mode": "remote_draft", "k": 4}, max_tokens=24))
    assert sum(_stats(r)["drafted"] for r in results) > 0, "the engines stopped drafting under the flood"
    for c in flood:
        c.close()
    after = _drafter_rss_mib(app)
    print(f"[hostile drafter] resident MiB before {before:.0f}, after {after:.0f}")
    assert after - before < DRAFTER_MEMORY_BOUND_MIB


def _pids(pattern: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_killing_the_drafter_fails_no_request_and_speculation_resumes(remote_cluster):
    app = remote_cluster.raw["name"]
    prompts = [p["text"] for p in dev_prompts(16)]
    results: list[dict] = []  # (t_done, drafted) per completed request
    errors: list[str] = []
    state = {"stop": False, "killed_at": None}

    async def worker(i: int, client: httpx.AsyncClient):
        n = 0
        while not state["stop"]:
            text = prompts[(i * 5 + n) % len(prompts)]
            n += 1
            body = {"messages": [{"role": "user", "content": text}], "max_tokens": 24, "temperature": 0.0,
                    "specserve": {"speculative": {"mode": "remote_draft", "k": 4}}}
            t0 = time.monotonic()
            try:
                r = await client.post(f"{remote_cluster.http_url}/v1/chat/completions", json=body, timeout=300)
            except httpx.HTTPError as e:
                errors.append(f"{type(e).__name__}: {e}")
                continue
            if r.status_code != 200:
                errors.append(f"{r.status_code}: {r.text[:300]}")
                continue
            results.append({"t0": t0, "t": time.monotonic(), "drafted": r.json()["specserve"]["drafted"]})

    async def run():
        async with httpx.AsyncClient() as client:
            tasks = [asyncio.create_task(worker(i, client)) for i in range(4)]
            t0 = time.monotonic()
            while sum(1 for r in results if r["drafted"] > 0) < 2:  # steady state, drafting
                assert time.monotonic() - t0 < RESUME_BOUND_S, f"no drafted request before the kill; errors {errors[:3]}"
                await asyncio.sleep(1)
            pids = _pids(f"ServeReplica:{app}:drafter-l4")
            assert pids, "drafter replica process not found"
            state["pids"] = pids
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            state["killed_at"] = time.monotonic()
            # Requests keep completing while the drafter is gone; then drafts come back.
            while True:
                await asyncio.sleep(2)
                resumed = [r for r in results if r["t0"] > state["killed_at"] + 1 and r["drafted"] > 0]
                if len(resumed) >= 2:
                    break
                assert time.monotonic() - state["killed_at"] < RESUME_BOUND_S, (
                    f"speculation did not resume within {RESUME_BOUND_S} s; errors {errors[:3]}")
            state["stop"] = True
            await asyncio.gather(*tasks)

    asyncio.run(run())
    assert not errors, f"{len(errors)} requests failed: {errors[:5]}"
    killed = state["killed_at"]
    during = [r for r in results if r["t0"] > killed and r["drafted"] == 0]
    assert during, "no request completed without drafts while the drafter was down"
    assert not set(_pids(f"ServeReplica:{app}:drafter-l4")) & set(state["pids"]), "the old drafter is still there"
