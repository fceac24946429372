"""One stream through a running cluster: does how the serving core is shared cost time against stock
vLLM's suffix server?

`relay`: would the processes that relay each streamed chunk (router, engine replica, Serve's proxy)
cost the engine less on the model workers' core (B: they run while a worker waits for its engine
core) than on the engine core's (A, as `specserve up` pins them)?
`affinity`: does pinning the n-gram pool's engine core and engine replica to the serving core
(`ray.pin_serving_cpus`) cost time? `nice`: does the engine core wait for the serving path (Ray's
proxy, the router, the engine replica's front end, Ray's daemons) on that core, so that giving it
precedence (every other process of the machine but the model workers at nice 10) helps?
`spin`: does the engine core cost the serving path time by spinning while its model worker computes
(A, vLLM's own wait) rather than sleeping (B, `engine_core_wait: block`)? Needs a cluster whose engine
core reads the switch: `git apply docs/benchmarks/one-stream/spin_switch.patch` before `scripts/up`
(the engine core then spins unless the `SPIN_OFF` file exists; not kept in the code).
`rt`: does the engine core wait for the relays on the serving core when its worker's reply wakes
it? B runs its threads at SCHED_FIFO 1 (root), so it preempts them at once; A as `specserve up` runs it.

Per tune prompt three requests, order rotated: the cluster (`auto`) as `specserve up` runs it (A),
the same switched (B: floating, or reniced), and a
stock-suffix server this script starts as `specserve bench` starts its anchors. The cluster's suffix
trees forget earlier outputs before each of its requests (A and B see the same prompt). For
`affinity` and `relay`, stop the `specserve up` process's pinning pass first (`kill -STOP <pid>`; `kill -CONT`
after): it would move B's processes back. `nice` renices every process of the machine but the
engines and the stock server, and sets them back to 0 (not to what they were) at the end. Requests
go through the bench's client (`cluster.client`), streamed. Every prompt warmed in every engine
first; 1.2 s before each request.

    .venv/bin/python docs/benchmarks/one-stream/affinity_ab.py affinity 3 45
    .venv/bin/python docs/benchmarks/one-stream/affinity_ab.py nice 3 45
    .venv/bin/python docs/benchmarks/one-stream/affinity_ab.py spin 3 30
    .venv/bin/python docs/benchmarks/one-stream/affinity_ab.py rt 3 30
"""
import os
import sys
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
from tools.bench import anchors as A  # noqa: E402
from engine_pair import interval  # noqa: E402  (this folder: the same paired bootstrap)
from tools.bench.runner import STOCK_EXTRA  # noqa: E402
from tools.bench.split import keep  # noqa: E402
from tools.bench.workload import load_prompts  # noqa: E402
from cluster.client import SpecServeClient  # noqa: E402
from cluster.config import load_config  # noqa: E402
from cluster.ops.cpu_pinning import Proc, reserved_cpus  # noqa: E402
from cluster.ops.models import resolve_model  # noqa: E402

CLUSTER = "http://127.0.0.1:8000"
# `ingress`: B sends to the router replica's own HTTP port (Ray Serve's direct ingress, on with
# RAY_SERVE_THROUGHPUT_OPTIMIZED=1: `ss -ltnp` shows it), A through Serve's proxy as clients do.
DIRECT = os.environ.get("DIRECT_INGRESS_URL", "http://127.0.0.1:30000")


def engine_processes() -> list[psutil.Process]:
    """The n-gram pool's engine replica and its engine core."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        if "ServeReplica:specserve:engine-ngram" in " ".join(p.info["cmdline"] or []):
            out += [p] + [c for c in p.children() if "VLLM::EngineCore" in " ".join(c.cmdline())]
    return out


RELAY = ("ServeReplica:specserve:router", "ServeReplica:specserve:engine-ngram", "ProxyActor")


def relay_processes() -> list[psutil.Process]:
    """The processes that relay every streamed chunk: the router, the n-gram engine replica (not its
    engine core) and Serve's proxy."""
    return [p for p in psutil.process_iter(["cmdline"]) if any(r in " ".join(p.info["cmdline"] or []) for r in RELAY)]


def set_affinity(cpus: frozenset[int], procs=None) -> None:
    for p in engine_processes() if procs is None else procs:
        for t in p.threads():
            try:
                os.sched_setaffinity(t.id, cpus)
            except OSError:
                pass


ENGINE = ("VLLM::EngineCore", "VLLM::Worker")


def set_niceness(level: int, stock_pids: set[int]) -> None:
    """Every thread of every process but the engines' cores and workers (and the stock server's
    processes) at nice `level` (per thread on Linux)."""
    for p in psutil.process_iter(["cmdline", "pid"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if p.info["pid"] in stock_pids or any(e in cmd for e in ENGINE):
            continue
        try:
            for t in p.threads():
                os.setpriority(os.PRIO_PROCESS, t.id, level)
        except (OSError, psutil.Error):
            pass


def set_realtime(on: bool) -> None:
    """B of `rt`: every thread of the n-gram pool's engine core at SCHED_FIFO 1 (needs root or
    CAP_SYS_NICE), so that it takes the serving core from the relays the moment its worker's reply
    wakes it; A: SCHED_OTHER, as it runs. Safe only with `engine_core_wait: block` (a spinning engine
    core at a real-time priority would keep the relays off that core)."""
    policy, param = (os.SCHED_FIFO, os.sched_param(1)) if on else (os.SCHED_OTHER, os.sched_param(0))
    for p in engine_processes():
        if "VLLM::EngineCore" not in " ".join(p.cmdline()):
            continue
        for t in p.threads():
            os.sched_setscheduler(t.id, policy, param)


SPIN_OFF = Path("/tmp/specserve-nospin")


def set_spin(on: bool) -> None:
    """B of `spin`: the engine core waits for its model worker blocked instead of spinning."""
    if on:
        SPIN_OFF.unlink(missing_ok=True)
    else:
        SPIN_OFF.touch()


def main() -> None:
    if len(sys.argv) != 4 or sys.argv[1] not in ("affinity", "nice", "ingress", "relay", "spin", "rt"):
        sys.exit("usage: affinity_ab.py affinity|nice|ingress|relay|spin|rt SKIP N")
    mode, skip, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    config = load_config(str(ROOT / "cluster" / "configs" / "local-cpu.yaml"))
    pool_name, pool = A.choose_pool(config, None)
    all_cpus = frozenset(os.sched_getaffinity(0))
    procs = [Proc(p.pid, p.info["name"] or "", frozenset(p.info["cpu_affinity"] or all_cpus))
             for p in psutil.process_iter(["name", "cpu_affinity"])]
    pinned = reserved_cpus(procs, all_cpus) or all_cpus  # where `specserve up` pins serving processes
    stock = A.plan_servers(A.parse_baselines("suffix", pool, pool_name), pool, resolve_model(pool.model, config),
                           pool.model, config.models[pool.model].dtype, Path("/tmp/affinity_ab"))[0]
    stock.start()
    stock_pids: set[int] = set()
    per: dict[str, list] = {"A": [], "B": [], "stock": []}
    mismatches = 0
    try:
        stock.wait_ready(900)
        root = psutil.Process(stock.proc.pid)
        stock_pids = {root.pid} | {c.pid for c in root.children(recursive=True)}
        prompts = keep(load_prompts(), "tune")[skip:skip + n]
        with SpecServeClient(CLUSTER) as cluster, SpecServeClient(stock.url) as stocks, \
                SpecServeClient(DIRECT) as direct:
            def ask(v: str, text: str, max_tokens: int):
                client, extra = (stocks, STOCK_EXTRA) if v == "stock" else (cluster, None)
                if v == "B" and mode == "ingress":
                    client = direct
                return client.generate_streamed(messages=[{"role": "user", "content": text}], model=pool.model,
                                                max_tokens=max_tokens, temperature=0, extra=extra)
            for p in prompts:
                for v in ("A", "stock"):
                    ask(v, p.text, 1)
            for i, p in enumerate(prompts):
                order = ["A", "B", "stock"][i % 3:] + ["A", "B", "stock"][:i % 3]
                texts = set()
                for v in reversed(order) if (i // 3) % 2 else order:
                    if mode == "nice":
                        set_niceness(10 if v == "B" else 0, stock_pids)
                    if v != "stock":
                        if mode == "spin":
                            set_spin(v == "A")
                        if mode == "rt":
                            set_realtime(v == "B")
                        if mode == "affinity":
                            set_affinity(pinned if v == "A" else all_cpus)
                        if mode == "relay":  # B: the relays on the model workers' core, off the engine core's
                            set_affinity(pinned if v == "A" else all_cpus - pinned, relay_processes())
                        httpx.post(CLUSTER + "/v1/specserve/forget_outputs", timeout=60).raise_for_status()
                    time.sleep(1.2)
                    r = ask(v, p.text, 128)
                    per[v].append((len(r.token_ids), r.latency_s))
                    texts.add(r.text)
                mismatches += len(texts) > 1
    finally:
        if mode == "affinity":
            set_affinity(pinned)
        if mode == "relay":
            set_affinity(pinned, relay_processes())
        elif mode == "spin":
            set_spin(True)
        elif mode == "rt":
            set_realtime(False)
        else:
            set_niceness(0, stock_pids)
        stock.stop()
    rates = {v: sum(k for k, _ in x) / sum(s for _, s in x) for v, x in per.items()}
    print(f"{len(per['A'])} prompts, greedy mismatches {mismatches}; tok/s", {v: round(r, 2) for v, r in rates.items()})
    for a, b in (("A", "stock"), ("B", "stock"), ("B", "A")):
        print(f"{a} / {b}: {rates[a] / rates[b]:.3f} ({interval(per[a], per[b])})")


if __name__ == "__main__":
    main()
