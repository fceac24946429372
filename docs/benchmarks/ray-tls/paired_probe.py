"""Time to first token and a round trip through the engine replica, two clusters side by side,
requests alternating between them (which goes first alternates too), each prompt sent once to each.

    python docs/benchmarks/ray-tls/paired_probe.py http://127.0.0.1:8000 http://127.0.0.1:8100 \
        docs/benchmarks/vllm-api/ttft/short-prompts/prompts.jsonl --out result.json

TTFT: a streamed chat request, plain decoding (`specserve.speculative.mode: none`), 2 tokens,
greedy; the time from sending to the first content chunk. Round trip: `GET /version` (answered by
vLLM's app in the engine replica, so it crosses the router and one handle call). Prints the median
of B minus A with a 95% bootstrap interval over the pairs, and each side's median.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import httpx


def ttft(client: httpx.Client, url: str, text: str) -> float:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 2, "temperature": 0.0,
            "stream": True, "specserve": {"speculative": {"mode": "none"}}}
    t0 = time.perf_counter()
    with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                return time.perf_counter() - t0
    raise RuntimeError(f"{url}: no content chunk")


def version(client: httpx.Client, url: str) -> float:
    t0 = time.perf_counter()
    client.get(f"{url}/version", timeout=30).raise_for_status()
    return time.perf_counter() - t0


def paired(a: list[float], b: list[float], draws: int = 2000, seed: int = 7) -> dict:
    d = [y - x for x, y in zip(a, b)]
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(d, k=len(d))) for _ in range(draws))
    ms = lambda v: round(v * 1000, 2)  # noqa: E731
    return {"pairs": len(d), "median_b_minus_a_ms": ms(statistics.median(d)),
            "ci95_ms": [ms(meds[int(0.025 * draws)]), ms(meds[int(0.975 * draws) - 1])],
            "mean_b_minus_a_ms": ms(statistics.mean(d)), "a_p50_ms": ms(statistics.median(a)),
            "b_p50_ms": ms(statistics.median(b))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("prompts")
    ap.add_argument("--versions", type=int, default=200)
    ap.add_argument("--out")
    args = ap.parse_args()
    texts = [json.loads(line)["turns"][0] for line in open(args.prompts) if line.strip()]
    out: dict = {"a": args.a, "b": args.b}
    with httpx.Client() as client:
        for url in (args.a, args.b):  # warm both: connections, and one request through each engine
            ttft(client, url, "Say hello.")
        ta, tb, va, vb = [], [], [], []
        for i, text in enumerate(texts):
            for url in ((args.a, args.b) if i % 2 == 0 else (args.b, args.a)):
                (ta if url == args.a else tb).append(ttft(client, url, text))
        for i in range(args.versions):
            for url in ((args.a, args.b) if i % 2 == 0 else (args.b, args.a)):
                (va if url == args.a else vb).append(version(client, url))
    out["ttft"], out["version_round_trip"] = paired(ta, tb), paired(va, vb)
    print(json.dumps(out, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
