"""Engine or serving path? specserve's n-gram-pool engine (its proposer, per-request-K scheduler,
speculative config and metrics: `deployments.vllm_args.engine_kwargs`) behind vLLM's own OpenAI
server, without Ray, beside a stock server without speculation (`--no-async-scheduling`, as
specserve's engines run), both started as `specserve bench` starts its anchors (model, dtype,
environment, core binding). The engine's lookup proposer is attached through vLLM's dev-mode
`/collective_rpc`, as the engine replica attaches it; requests to it carry the per-request
arguments the engine replica sets (`vllm_xargs`: mode and K).

Then, against those two and the running cluster, at 1 and 16 streams: plain decoding (K = 0) per
tune prompt, closed loop, phases rotated per round, every prompt warmed in every server first.

    .venv/bin/python docs/benchmarks/k0-engine/ours_in_stock_server.py ROUNDS REQUESTS_PER_PHASE
"""
import asyncio
import json
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
from cluster.bench import anchors as A  # noqa: E402
from cluster.bench.split import keep  # noqa: E402
from cluster.bench.workload import load_prompts  # noqa: E402
from cluster.config import load_config  # noqa: E402
from cluster.ops.models import resolve_model  # noqa: E402
from cluster.speculation import EXTRA_ARGS_K, EXTRA_ARGS_MODE  # noqa: E402
from deployments.vllm_args import engine_kwargs  # noqa: E402

CLUSTER = "http://127.0.0.1:8000"
NONE_XARGS = {EXTRA_ARGS_K: 0, EXTRA_ARGS_MODE: "none"}


def servers():
    config = load_config(str(ROOT / "cluster" / "configs" / "local-cpu.yaml"))
    pool_name, pool = A.choose_pool(config, None)
    path = resolve_model(pool.model, config)
    dtype = config.models[pool.model].dtype
    stock, ours = A.plan_servers([A.Baseline("stock-none-sync"), A.Baseline("ours-none")], pool, path, pool.model,
                                 dtype, Path("/tmp/ours_in_stock"))
    stock.argv.append("--no-async-scheduling")
    theirs = set(A.stock_engine_args(pool, path, pool.model, dtype))
    kwargs = engine_kwargs(pool, path, None, pool.model, dtype)
    for key, value in kwargs.items():
        if key not in theirs and key != "speculative_config":
            ours.argv += A.cli_flag(key, value)
    ours.argv += ["--speculative-config", json.dumps(kwargs["speculative_config"])]
    ours.env["VLLM_SERVER_DEV_MODE"] = "1"
    return pool.model, stock, ours


async def one(client: httpx.AsyncClient, url: str, model: str, text: str, max_tokens: int) -> tuple[int, float]:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0}
    if url == CLUSTER:
        body["specserve"] = {"speculative": {"mode": "none"}}
    elif "ours" in url:
        body["vllm_xargs"] = NONE_XARGS
    t = time.perf_counter()
    r = await client.post(url.split("#")[0] + "/v1/chat/completions", json=body)
    r.raise_for_status()
    return int(r.json()["usage"]["completion_tokens"]), time.perf_counter() - t


async def phase(client, url, model, texts, streams) -> float:
    queue = list(texts)
    tokens = 0

    async def worker():
        nonlocal tokens
        while queue:
            n, _ = await one(client, url, model, queue.pop(), 128)
            tokens += n

    t = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(streams)))
    return tokens / (time.perf_counter() - t)


async def measure(urls: dict[str, str], model: str, rounds: int, per_phase: int) -> None:
    prompts = [p.text for p in keep(load_prompts(), "tune")]
    names = list(urls)
    async with httpx.AsyncClient(timeout=600) as client:
        for text in prompts[:per_phase * rounds] + prompts[-12:]:
            for name in names:
                await one(client, urls[name], model, text, 1)
        for streams in (1, 16):
            per = {n: [] for n in names}
            for r in range(rounds):
                n = 12 if streams == 1 else per_phase
                texts = prompts[r * n:(r + 1) * n] if streams > 1 else prompts[-12:]
                order = names[r % len(names):] + names[:r % len(names)]
                for name in (order if r % 2 == 0 else order[::-1]):
                    await asyncio.sleep(2)
                    per[name].append(await phase(client, urls[name], model, texts, streams))
            print(f"{streams} stream(s), tok/s per round: " + "; ".join(
                f"{n} " + " / ".join(f"{x:.1f}" for x in v) for n, v in per.items()), flush=True)
            base = per["stock-none-sync"]
            for n in names:
                print(f"  {n} / stock-none-sync: " + " / ".join(f"{a / b:.3f}" for a, b in zip(per[n], base))
                      + f"  (pooled {sum(per[n]) / sum(base):.3f})", flush=True)


def main() -> None:
    rounds, per_phase = int(sys.argv[1]), int(sys.argv[2])
    model, stock, ours = servers()
    for s in (stock, ours):
        s.start()
    try:
        for s in (stock, ours):
            s.wait_ready(900)
        r = httpx.post(ours.url + "/collective_rpc", json={"method": "specserve_attach_lookup"}, timeout=120)
        print("attach:", r.status_code, r.text[:200], flush=True)
        asyncio.run(measure({"cluster": CLUSTER, "stock-none-sync": stock.url, "ours-none": ours.url + "#ours"},
                            model, rounds, per_phase))
    finally:
        for s in (stock, ours):
            s.stop()


if __name__ == "__main__":
    main()
