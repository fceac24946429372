"""A replaced engine replica is as fast as the one it replaced: the embedded config's cluster
(`ray.pin_serving_cpus` on) and stock vLLM's suffix server beside it, four streams on the untouched
half of the shipped prompts, in rounds that alternate the two; then the n-gram pool's vLLM engine
core is killed under load, the replica retires, Ray Serve starts a replacement, and the same rounds
run again on fresh prompts. Asserts that the replacement's model worker is bound to the cores the
original's was, that its replica and engine core were moved off them like the original's, and that
the cluster's throughput against the stock server after the failover is within noise of the ratio
before it (a replacement computing on the serving core read 0.69-0.74x of stock-suffix, against
1.0x before).

Runs in its own cluster (tier `chaos`: `scripts/test --chaos`). Writes `failover.json` beside the
chaos report (`SPECSERVE_CHAOS_REPORT`, default results/)."""

from __future__ import annotations

import json
import os
import signal
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest

from tools.bench import anchors as A
from tools.bench.split import UNTOUCHED, keep
from tools.bench.workload import interleave_tasks, load_prompts
from cluster.config import load_config
from cluster.ops.cpu_pinning import WORKER, program
from cluster.ops.models import resolve_model
from tests.e2e.conftest import launch_cluster

pytestmark = [pytest.mark.chaos, pytest.mark.engine]

POOL = "ngram"
STREAMS, PER_STREAM, MAX_TOKENS, ROUNDS = 4, 2, 128, 3
# The ratio (cluster / stock) after the failover over the ratio before: one round varies about 10% on
# this machine, the mean of three less; the failure this guards against read 0.71-0.87.
MIN_RATIO_KEPT = 0.88
RECOVERY_BOUND_S = 400
PIN_BOUND_S = 30  # the pinning pass runs every 5 s


@pytest.fixture(scope="module")
def failover_cluster(tmp_path_factory):
    yield from launch_cluster(tmp_path_factory.mktemp("failover"), "specserve-failover")


@pytest.fixture(scope="module")
def stock_suffix(failover_cluster, tmp_path_factory):
    """Stock vLLM's OpenAI server with its suffix decoding, started like the pool's engine (the bench's
    `stock-suffix` baseline)."""
    config = load_config(failover_cluster.config_path)
    pool = config.pools[POOL]
    model_id = httpx.get(f"{failover_cluster.http_url}/v1/models", timeout=30).json()["data"][0]["id"]
    servers = A.plan_servers([A.suffix_baseline()], pool, resolve_model(pool.model, config), model_id,
                             config.models[pool.model].dtype, tmp_path_factory.mktemp("stock"))
    with A.StockFleet(servers, timeout_s=600) as urls:
        yield urls["stock-suffix"], model_id


# -- processes ---------------------------------------------------------------------------------------------


def _title(p: psutil.Process) -> str:
    """The process's program (a busy replica's title names its task too: `...engine-ngram.generate`)."""
    try:
        cmd = p.cmdline()
        return program(cmd[0] if cmd else p.name())
    except psutil.Error:
        return ""


def _engine_tree(root_pid: int, app: str) -> dict:
    """The pool's engine replica, its engine core and model worker: {name: (pid, cores)}, the ones found."""
    out: dict = {}
    for p in psutil.Process(root_pid).children(recursive=True):
        if _title(p) == f"ray::ServeReplica:{app}:engine-{POOL}":
            out["replica"] = (p.pid, sorted(p.cpu_affinity()))
            for c in p.children(recursive=True):
                t = _title(c)
                try:
                    if t.startswith("VLLM::EngineCore"):
                        out["engine_core"] = (c.pid, sorted(c.cpu_affinity()))
                    elif t.startswith(WORKER):
                        out["worker"] = (c.pid, sorted(c.cpu_affinity()))
                except psutil.Error:
                    continue
    return out


def _pinned(tree: dict) -> bool:
    """The tree is complete and its replica and engine core are off the worker's cores."""
    if not {"replica", "engine_core", "worker"} <= tree.keys():
        return False
    worker = set(tree["worker"][1])
    return not (set(tree["replica"][1]) & worker) and not (set(tree["engine_core"][1]) & worker)


def _wait(what: str, check, bound_s: float, poll_s: float = 1.0, show=lambda: None):
    t0 = time.monotonic()
    while True:
        got = check()
        if got:
            print(f"failover: {what} after {time.monotonic() - t0:.1f} s", flush=True)
            return got, time.monotonic() - t0
        assert time.monotonic() - t0 < bound_s, f"{what}: not within {bound_s} s; {show()}"
        time.sleep(poll_s)


# -- load --------------------------------------------------------------------------------------------------


def _chat(client: httpx.Client, url: str, model: str, text: str) -> int:
    r = client.post(f"{url}/v1/chat/completions", timeout=300, json={
        "model": model, "messages": [{"role": "user", "content": text}],
        "max_tokens": MAX_TOKENS, "temperature": 0.0})
    assert r.status_code == 200, f"{url}: {r.status_code} {r.text[:300]}"
    return r.json()["usage"]["completion_tokens"]


def _throughput(url: str, model: str, texts: list[str]) -> float:
    """Output tokens per second of STREAMS closed-loop streams sending `texts` (each once)."""
    per = [texts[i::STREAMS] for i in range(STREAMS)]

    def stream(mine: list[str]) -> int:
        with httpx.Client() as client:
            return sum(_chat(client, url, model, t) for t in mine)

    t0 = time.monotonic()
    with ThreadPoolExecutor(STREAMS) as pool:
        tokens = sum(pool.map(stream, per))
    return tokens / (time.monotonic() - t0)


class Background:
    """Two streams of short requests to the cluster until stopped: the load the kill lands in."""

    def __init__(self, url: str, model: str):
        self.url, self.model = url, model
        self.stop = threading.Event()
        self.outcomes: dict[str, int] = {}
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(2)]

    def _run(self, i: int) -> None:
        n = 0
        with httpx.Client() as client:
            while not self.stop.is_set():
                n += 1
                try:
                    r = client.post(f"{self.url}/v1/chat/completions", timeout=150, json={
                        "model": self.model, "max_tokens": 32, "temperature": 0.0,
                        "messages": [{"role": "user", "content": f"Count from {i * 1000 + n} upwards."}]})
                    key = str(r.status_code)
                except httpx.HTTPError as e:
                    key = type(e).__name__
                self.outcomes[key] = self.outcomes.get(key, 0) + 1

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=200)


def _rounds(c_url: str, s_url: str, model: str, prompts: list[str]) -> dict:
    """ROUNDS rounds, each the stock server and the cluster on prompts of their own, in alternating
    order; the first two prompts warm both prefix caches equally."""
    with httpx.Client() as client:
        for url in (s_url, c_url):
            _chat(client, url, model, prompts.pop())
    out: dict = {"stock": [], "cluster": []}
    n = STREAMS * PER_STREAM
    for r in range(ROUNDS):
        order = [("stock", s_url), ("cluster", c_url)][::1 if r % 2 == 0 else -1]
        for name, url in order:
            mine, prompts[:] = prompts[:n], prompts[n:]
            out[name].append(round(_throughput(url, model, mine), 1))
            print(f"failover: round {r} {name}: {out[name][-1]} tok/s", flush=True)
    out["ratio"] = round(statistics.mean(out["cluster"]) / statistics.mean(out["stock"]), 3)
    return out


# -- the test ----------------------------------------------------------------------------------------------


def test_a_replaced_engine_computes_where_the_original_did(failover_cluster, stock_suffix):
    c = failover_cluster
    s_url, model = stock_suffix
    app = c.raw["name"]
    prompts = [p.text for p in interleave_tasks(keep(load_prompts(), UNTOUCHED))]
    need = 2 * (2 + ROUNDS * 2 * STREAMS * PER_STREAM)
    assert len(prompts) >= need, f"{len(prompts)} untouched prompts, {need} needed: none may be sent twice"
    report: dict = {}

    tree = lambda: _engine_tree(c.proc.pid, app)  # noqa: E731
    original, _ = _wait("the original engine pinned", lambda: (t := tree()) and _pinned(t) and t, PIN_BOUND_S,
                        show=tree)
    report["original"] = original
    report["before"] = _rounds(c.http_url, s_url, model, prompts)

    with Background(c.http_url, model) as load:
        time.sleep(3)
        t_kill = time.monotonic()
        os.kill(original["engine_core"][0], signal.SIGKILL)
        replacement, _ = _wait(
            "a replacement engine replica with its worker",
            lambda: (t := tree()) and t.get("replica", (0,))[0] != original["replica"][0] and "worker" in t and t,
            RECOVERY_BOUND_S, show=tree)
        report["replacement_worker_s"] = round(time.monotonic() - t_kill, 1)
        _wait("the replacement serves", lambda: httpx.post(f"{c.http_url}/v1/chat/completions", timeout=150, json={
            "model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}],
            "specserve": {"speculative": {"mode": "ngram"}}}).status_code == 200, RECOVERY_BOUND_S, poll_s=2)
        report["serving_again_s"] = round(time.monotonic() - t_kill, 1)
    report["background_outcomes"] = load.outcomes

    replacement, _ = _wait("the replacement pinned", lambda: (t := tree()) and _pinned(t) and t, PIN_BOUND_S,
                           show=tree)
    report["replacement"] = replacement
    report["after"] = _rounds(c.http_url, s_url, model, prompts)
    report["ratio_kept"] = round(report["after"]["ratio"] / report["before"]["ratio"], 3)
    print("failover report:", json.dumps(report, indent=2))
    out = Path(os.environ.get("SPECSERVE_CHAOS_REPORT", "results/chaos-report.json")).with_name("failover.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")

    assert replacement["worker"][1] == original["worker"][1], report  # the cores it computes on
    assert replacement["replica"][1] == original["replica"][1], report
    assert replacement["engine_core"][1] == original["engine_core"][1], report
    assert report["ratio_kept"] >= MIN_RATIO_KEPT, report
