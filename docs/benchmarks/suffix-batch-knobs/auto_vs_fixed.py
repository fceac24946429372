"""`auto` against the cluster's fixed `suffix:16`, closed loop, tune half of Spec-Bench.

    scripts/up &    # then, once it serves (Redis emptied):
    .venv/bin/python docs/benchmarks/suffix-batch-knobs/auto_vs_fixed.py [STREAMS ROUNDS PROMPTS]

Rounds of PROMPTS fresh prompts (3 streams, 6 rounds, 18 prompts: `auto_vs_fixed_output.txt`);
each round warms every prompt's prefix first (1 token, no speculation), then runs both
configurations on them, the order alternated, the suffix trees emptied before each. Prints each
phase's configuration, round, tokens/s, engine steps and draft tokens; then per configuration its
rounds' tokens/s and wall seconds x streams / steps (ms/step-ish).
"""
import asyncio
import os
import random
import sys
import time

sys.path.insert(0, os.getcwd())
from cluster.client import AsyncSpecServeClient
from tools.bench.workload import load_prompts
from tools.bench.split import keep, TUNE

CONC = int(sys.argv[1]) if len(sys.argv) > 1 else 3
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 6
N = int(sys.argv[3]) if len(sys.argv) > 3 else 18
prompts = keep(load_prompts("cluster/data/specbench-dev.jsonl"), TUNE)
random.Random(5).shuffle(prompts)
CFG = {"auto": None, "suffix:16": {"mode": "suffix", "k": 16}}


async def phase(c, cfg, ps):
    q = list(ps); res = []
    async def worker():
        while q:
            p = q.pop(0)
            t = time.perf_counter()
            r = await c.generate_streamed(messages=p.messages, model="smollm2-135m", max_tokens=128,
                                          temperature=0.0, speculative=CFG[cfg])
            res.append((r, time.perf_counter() - t))
    t0 = time.perf_counter()
    await asyncio.gather(*[worker() for _ in range(CONC)])
    wall = time.perf_counter() - t0
    toks = sum(len(r.token_ids) for r, _ in res)
    steps = sum(r.spec.steps for r, _ in res if r.spec)
    return dict(cfg=cfg, tok_s=toks / wall, wall=wall, toks=toks, steps=steps,
                drafted=sum(r.spec.drafted for r, _ in res if r.spec))


async def main():
    async with AsyncSpecServeClient("http://127.0.0.1:8000", timeout_s=600) as c:
        out = []
        for r in range(ROUNDS):
            ps = prompts[r * N:(r + 1) * N]
            order = ["auto", "suffix:16"] if r % 2 == 0 else ["suffix:16", "auto"]
            for p in ps:  # warm the prefix cache: prefill is no phase's
                await c.generate_streamed(messages=p.messages, model="smollm2-135m", max_tokens=1,
                                          temperature=0.0, speculative={"mode": "none"})
            for cfg in order:
                await c.forget_outputs()
                x = await phase(c, cfg, ps); x["round"] = r; out.append(x)
                print(cfg, r, round(x["tok_s"], 1), x["steps"], x["drafted"], flush=True)  # config, round, tok/s, steps, drafts
        for cfg in CFG:
            xs = [x for x in out if x["cfg"] == cfg]
            print(cfg, "tok/s", [round(x["tok_s"], 1) for x in xs], "ms/step-ish", [round(1000 * x["wall"] * CONC / x["steps"], 1) for x in xs])


if __name__ == "__main__":
    asyncio.run(main())
