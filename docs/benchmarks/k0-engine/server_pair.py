"""Stock vLLM's OpenAI server with no speculation beside the same server with vLLM's batch-size table,
N closed-loop streams, in alternating phases: tokens/s, engine steps (vLLM's own /metrics), CPU
seconds per process (/proc), and optionally a py-spy profile of each model worker. Tune half only.
Both servers are built as `specserve bench` builds its stock anchors (`cluster.bench.anchors`).

    .venv/bin/python docs/benchmarks/k0-engine/server_pair.py [--streams 32] [--requests 192] \
        [--rounds 3] [--py-spy 60]
"""

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, os.getcwd())
from cluster.bench import anchors as A  # noqa: E402
from cluster.bench.split import keep  # noqa: E402
from cluster.bench.workload import load_prompts, round_prompts  # noqa: E402
from cluster.config import load_config  # noqa: E402
from cluster.ops.models import resolve_model  # noqa: E402

METRICS = ("prefix_cache_hits_total", "prefix_cache_queries_total", "iteration_tokens_total_count",
           "spec_decode_num_accepted_tokens_total")


def cpu_seconds(pgid: int) -> dict[str, float]:
    """CPU seconds (user + system) of every process in the server's process group, by title."""
    out = {}
    for p in Path("/proc").iterdir():
        try:
            stat = (p / "stat").read_text()
            f = stat[stat.rindex(")") + 2:].split()
            if p.name.isdigit() and int(f[2]) == pgid:
                name = stat[stat.index("(") + 1:stat.rindex(")")]
                out[name] = out.get(name, 0.0) + (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            pass
    return out


def metrics(url: str) -> dict[str, float]:
    got = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        m = re.match(r"vllm:([a-z_]+)(\{[^}]*\})? ([0-9.e+-]+)$", line)
        if m and m.group(1) in METRICS:
            got[m.group(1)] = got.get(m.group(1), 0.0) + float(m.group(3))
    return got


async def request(client: httpx.AsyncClient, url: str, model: str, text: str, max_tokens: int) -> int:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    n = 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage")
                n = usage["completion_tokens"] if usage else n
    return n


async def closed_loop(url: str, model: str, texts: list[str], streams: int) -> tuple[int, float]:
    queue, tokens = list(reversed(texts)), []
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=streams + 4)) as c:
        async def stream():
            while queue:
                tokens.append(await request(c, url, model, queue.pop(), 128))
        t = time.perf_counter()
        await asyncio.gather(*(stream() for _ in range(streams)))
        return sum(tokens), time.perf_counter() - t


async def warm(url: str, model: str, texts: list[str]) -> None:
    async with httpx.AsyncClient(timeout=600) as c:
        for t in texts:
            await request(c, url, model, t, 1)


def worker_pid(pgid: int) -> str:
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and os.getpgid(int(p.name)) == pgid and "VLLM::Worker" in (p / "comm").read_text():
                return p.name
        except OSError:
            pass
    raise RuntimeError("no model worker")


def profile_shares(path: Path) -> str:
    """Shares of a py-spy raw profile's samples in the model's forward pass, the logits, the rejection
    sampler and the drafter."""
    total, hits = 0, dict.fromkeys(("_model_forward", "compute_logits", "RejectionSampler", "propose"), 0)
    for line in path.read_text().splitlines():
        stack, n = line.rsplit(" ", 1)
        total += int(n)
        for key in hits:
            hits[key] += int(n) if key in stack else 0
    return ", ".join(f"{k} {100 * v / max(total, 1):.1f}%" for k, v in hits.items()) + f" of {total} samples"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--requests", type=int, default=192)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--py-spy", type=int, default=0, help="seconds of py-spy per phase on the model worker (0: none)")
    ap.add_argument("--out", default="/tmp/server_pair")
    a = ap.parse_args()
    config = load_config("cluster/configs/local-cpu.yaml")
    pool_name, pool = A.choose_pool(config, None)
    folder = Path(a.out)
    folder.mkdir(parents=True, exist_ok=True)
    servers = A.plan_servers(A.parse_baselines("none,table", pool, pool_name), pool, resolve_model(pool.model, config),
                             pool.model, config.models[pool.model].dtype, folder)
    prompts = keep(load_prompts(), "tune")
    texts = [p.text for p in prompts]
    rates = {s.name: [] for s in servers}
    for s in servers:
        s.start()
    try:
        for s in servers:
            s.wait_ready(900)
            asyncio.run(warm(s.url, pool.model, texts))
        for r in range(a.rounds):
            jobs = [p.text for p in round_prompts(prompts, a.requests, r)]
            for s in servers if r % 2 == 0 else list(reversed(servers)):
                time.sleep(2)
                m0, c0 = metrics(s.url), cpu_seconds(s.proc.pid)
                spy = None
                if a.py_spy:
                    spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "--nonblocking", "-p", worker_pid(s.proc.pid), "-r", "25",
                                            "-d", str(a.py_spy), "--format", "raw", "-o", str(folder / f"{s.name}-{r}.txt")],
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                tokens, secs = asyncio.run(closed_loop(s.url, pool.model, jobs, a.streams))
                if spy:
                    spy.wait()
                    print(f"  model worker profile: {profile_shares(folder / f'{s.name}-{r}.txt')}", flush=True)
                m1, c1 = metrics(s.url), cpu_seconds(s.proc.pid)
                steps = m1["iteration_tokens_total_count"] - m0["iteration_tokens_total_count"]
                worker = c1.get("VLLM::Worker", 0) - c0.get("VLLM::Worker", 0)
                rates[s.name].append(tokens / secs)
                print(f"round {r} {s.name}: {tokens / secs:.1f} tok/s, {steps:.0f} steps, {secs / steps * 1000:.1f} ms a "
                      f"step, model worker {worker / steps * 1000:.1f} CPU ms a step; prefix cache hits "
                      f"{m1['prefix_cache_hits_total'] - m0['prefix_cache_hits_total']:.0f} of "
                      f"{m1['prefix_cache_queries_total'] - m0['prefix_cache_queries_total']:.0f} tokens", flush=True)
        none, table = rates["stock-none"], rates["stock-table"]
        print("table / none per round", [round(t / n, 3) for t, n in zip(table, none)],
              "pooled", round(sum(table) / sum(none), 3))
    finally:
        for s in servers:
            s.stop()


if __name__ == "__main__":
    main()
