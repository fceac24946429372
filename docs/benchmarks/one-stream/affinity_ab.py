"""One stream through a running cluster: does pinning the n-gram pool's engine core and engine
replica to the serving core (`ray.pin_serving_cpus`) cost time against stock vLLM's suffix server?

Per tune prompt three requests, order rotated: the cluster (`auto`) with the engine core and replica
pinned as `specserve up` pins them (A), the same with both floating over every core (B), and a
stock-suffix server this script starts as `specserve bench` starts its anchors. The cluster's suffix
trees forget earlier outputs before each of its requests (A and B see the same prompt). Stop the
`specserve up` process's pinning pass first (`kill -STOP <pid>`; `kill -CONT` after): it would move
B's processes back. Every prompt warmed in every engine first; 1.2 s before each request.

    .venv/bin/python docs/benchmarks/one-stream/affinity_ab.py 3 45
"""
import json
import os
import sys
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
from cluster.bench import anchors as A  # noqa: E402
from engine_pair import interval  # noqa: E402  (this folder: the same paired bootstrap)
from cluster.bench.split import keep  # noqa: E402
from cluster.bench.workload import load_prompts  # noqa: E402
from cluster.config import load_config  # noqa: E402
from cluster.ops.models import resolve_model  # noqa: E402

CLUSTER = "http://127.0.0.1:8000"


def engine_processes() -> list[psutil.Process]:
    """The n-gram pool's engine replica and its engine core."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        if "ServeReplica:specserve:engine-ngram" in " ".join(p.info["cmdline"] or []):
            out += [p] + [c for c in p.children() if "VLLM::EngineCore" in " ".join(c.cmdline())]
    return out


def set_affinity(cpus: set[int]) -> None:
    for p in engine_processes():
        for t in p.threads():
            try:
                os.sched_setaffinity(t.id, cpus)
            except OSError:
                pass


def request(c: httpx.Client, url: str, model: str, text: str) -> tuple[int, float, str]:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 128,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    n, out, t = 0, [], time.perf_counter()
    with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                d = json.loads(line[6:])
                n = d["usage"]["completion_tokens"] if d.get("usage") else n
                out += [ch.get("delta", {}).get("content") or "" for ch in d.get("choices", [])]
    return n, time.perf_counter() - t, "".join(out)


def main() -> None:
    skip, n = int(sys.argv[1]), int(sys.argv[2])
    config = load_config(str(ROOT / "cluster" / "configs" / "local-cpu.yaml"))
    pool_name, pool = A.choose_pool(config, None)
    all_cpus = set(os.sched_getaffinity(0))
    pinned = {c for c in all_cpus if c not in set().union(*(p.cpu_affinity() for p in psutil.process_iter()
                                                             if p.name().startswith("VLLM::Worker")))} or all_cpus
    stock = A.plan_servers(A.parse_baselines("suffix", pool, pool_name), pool, resolve_model(pool.model, config),
                           pool.model, config.models[pool.model].dtype, Path("/tmp/affinity_ab"))[0]
    stock.start()
    per: dict[str, list] = {"A": [], "B": [], "stock": []}
    mismatches = 0
    try:
        stock.wait_ready(900)
        prompts = keep(load_prompts(), "tune")[skip:skip + n]
        with httpx.Client(timeout=600) as c:
            for p in prompts:
                for url in (CLUSTER, stock.url):
                    c.post(url + "/v1/chat/completions", json={"model": pool.model, "max_tokens": 1, "temperature": 0,
                           "messages": [{"role": "user", "content": p.text}]}).raise_for_status()
            for i, p in enumerate(prompts):
                order = ["A", "B", "stock"][i % 3:] + ["A", "B", "stock"][:i % 3]
                texts = set()
                for v in reversed(order) if (i // 3) % 2 else order:
                    if v != "stock":
                        set_affinity(pinned if v == "A" else all_cpus)
                        c.post(CLUSTER + "/v1/specserve/forget_outputs").raise_for_status()
                    time.sleep(1.2)
                    k, dt, text = request(c, stock.url if v == "stock" else CLUSTER, pool.model, p.text)
                    per[v].append((k, dt))
                    texts.add(text)
                mismatches += len(texts) > 1
    finally:
        set_affinity(pinned)
        stock.stop()
    rates = {v: sum(k for k, _ in x) / sum(s for _, s in x) for v, x in per.items()}
    print(f"{len(per['A'])} prompts, greedy mismatches {mismatches}; tok/s", {v: round(r, 2) for v, r in rates.items()})
    for a, b in (("A", "stock"), ("B", "stock"), ("B", "A")):
        print(f"{a} / {b}: {rates[a] / rates[b]:.3f} ({interval(per[a], per[b])})")


if __name__ == "__main__":
    main()
