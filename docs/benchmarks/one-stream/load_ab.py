"""Under load through a running cluster: does a switch of the serving core's sharing change throughput
when the serving path has STREAMS streams to relay? `nice`: every process of the machine but the
engine cores, the model workers and this script at nice 10 (`affinity_ab.py nice`'s B). `spin`: the
engine core sleeps while its model worker computes instead of spinning (`affinity_ab.py spin`'s B,
which says what the cluster needs for the switch). `rt`: the engine core at SCHED_FIFO 1
(`affinity_ab.py rt`'s B). `take`: the engine core fetches drafts from its model worker after every
step, as vLLM does, where the cluster skips the fetch after steps that asked for none
(`cluster/engine/draft_take.py`); needs a cluster whose engine core reads the switch:
`git apply docs/benchmarks/one-stream/take_switch.patch` before `scripts/up` (it then fetches every
step while the `TAKE_ALWAYS` file exists). `shortspin`: the engine core spins (`sched_yield`) for up
to 2 ms after each reply it reads before it blocks, so the short round trips of a step (sampling,
the draft fetch) find it awake; needs `shortspin_switch.patch` applied likewise (`SHORT_SPIN`).

Per round, one slice of tune prompts goes twice at STREAMS closed-loop streams of MODE (`auto`, or
`none` for plain decoding, which leaves the router's choices out of the comparison), once as the
cluster runs (A) and once switched (B), the order alternating by round; the cluster's suffix trees
forget earlier outputs before each pass, and the round's prompts are warmed (1 token) before it,
so A and B see the same prefix cache. Each pass's throughput is its output tokens over its wall
time; the ratio B / A is reported per round and as a mean with a t interval over rounds (a round in
which the machine slowed one pass reads far from the others: look at them). The script's own
process stays at nice 0 (a client is not on the serving machine in production).

    .venv/bin/python docs/benchmarks/one-stream/load_ab.py SWITCH MODE STREAMS ROUNDS N_PER_ROUND SKIP
    .venv/bin/python docs/benchmarks/one-stream/load_ab.py nice auto 32 4 64 0
    .venv/bin/python docs/benchmarks/one-stream/load_ab.py nice none 32 6 64 0
    .venv/bin/python docs/benchmarks/one-stream/load_ab.py spin none 16 12 16 0
    .venv/bin/python docs/benchmarks/one-stream/load_ab.py spin auto 4 8 12 0
    .venv/bin/python docs/benchmarks/one-stream/load_ab.py take auto 16 8 32 0
    .venv/bin/python docs/benchmarks/one-stream/load_ab.py take none 1 6 8 0
    .venv/bin/python docs/benchmarks/one-stream/load_ab.py take auto 1 8 8 0
    .venv/bin/python docs/benchmarks/one-stream/load_ab.py shortspin auto 1 6 8 0
"""
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
from affinity_ab import CLUSTER, set_niceness, set_realtime, set_spin  # noqa: E402  (this folder)
from tools.bench.plan import BenchConfig  # noqa: E402
from tools.bench.runner import Job, Runner  # noqa: E402
from tools.bench.split import keep  # noqa: E402
from tools.bench.workload import load_prompts  # noqa: E402
from cluster.client import AsyncSpecServeClient  # noqa: E402

CONFIGS = {"auto": BenchConfig("auto", None, None), "none": BenchConfig("none", "none", None)}
TAKE_ALWAYS = Path("/tmp/specserve-take-always")  # read by take_switch.patch
SHORT_SPIN = Path("/tmp/specserve-spin-short")  # read by shortspin_switch.patch
T95 = {2: 12.71, 3: 4.30, 4: 3.18, 5: 2.78, 6: 2.57, 7: 2.45, 8: 2.36}  # two-sided t, n-1 degrees of freedom


def file_switch(path: Path):
    """B on while `path` exists (read by a switch patch in the cluster)."""
    return lambda b: path.touch() if b else path.unlink(missing_ok=True)


async def one_pass(runner: Runner, config: BenchConfig, prompts: list, streams: int) -> tuple[int, float]:
    jobs = [Job("load", config, p, concurrency=streams) for p in prompts]
    t = time.perf_counter()
    samples = await runner.run_closed_loop(jobs, streams)
    wall = time.perf_counter() - t
    failed = [s for s in samples if not s.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, e.g. {failed[0].error}")
    return sum(len(s.token_ids) for s in samples), wall


async def main() -> None:
    if len(sys.argv) != 7 or sys.argv[1] not in ("nice", "spin", "rt", "take", "shortspin") or sys.argv[2] not in CONFIGS:
        sys.exit("usage: load_ab.py nice|spin|rt|take|shortspin auto|none STREAMS ROUNDS N_PER_ROUND SKIP")
    switch, config = sys.argv[1], CONFIGS[sys.argv[2]]
    streams, rounds, n, skip = map(int, sys.argv[3:])
    prompts = keep(load_prompts(), "tune")
    slices = [[prompts[(skip + r * n + i) % len(prompts)] for i in range(n)] for r in range(rounds)]
    mine = {os.getpid()}
    switch_to_b = {"nice": lambda b: set_niceness(10 if b else 0, mine), "rt": set_realtime,
                   "spin": lambda b: set_spin(not b),
                   "take": file_switch(TAKE_ALWAYS), "shortspin": file_switch(SHORT_SPIN)}[switch]  # B on (True) or back to as the cluster runs
    ratios = []
    async with AsyncSpecServeClient(CLUSTER) as client:
        runner = Runner(client, model=None, max_tokens=128)
        try:
            for r, chunk in enumerate(slices):
                # This round's prompts are warmed now: the passes push earlier prompts out of the prefix
                # cache, so prompts warmed up front could be cold by their round, and its first pass
                # alone would pay their prefill.
                await runner.run_closed_loop([Job("warm", config, p, max_tokens=1) for p in chunk], streams)
                rate = {}
                for v in ("AB" if r % 2 == 0 else "BA"):
                    switch_to_b(v == "B")
                    httpx.post(CLUSTER + "/v1/specserve/forget_outputs", timeout=60).raise_for_status()
                    await asyncio.sleep(1.2)
                    tokens, wall = await one_pass(runner, config, chunk, streams)
                    rate[v] = tokens / wall
                ratios.append(rate["B"] / rate["A"])
                print(f"round {r}: A {rate['A']:.1f} tok/s, B {rate['B']:.1f} tok/s, B / A {ratios[-1]:.3f}", flush=True)
        finally:
            switch_to_b(False)
    mean = statistics.mean(ratios)
    half = T95.get(len(ratios), 2.0) * statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else float("nan")
    print(f"{config.name}, {streams} streams, {rounds} rounds of {n}: B / A {mean:.3f} ({mean - half:.3f}-{mean + half:.3f})")


if __name__ == "__main__":
    asyncio.run(main())
