"""Paired time-to-first-token differences from a `specserve bench` samples file.

    python docs/benchmarks/vllm-api/ttft/paired_ttft.py SAMPLES.json[.gz] none stock-none

For each prompt and repeat of the one-stream greedy comparison, config A's TTFT minus config B's
(the same prompt, sent to each once, interleaved); prints the median difference with a 95%
bootstrap interval over the pairs, the mean, and both configs' own medians. Standard library only.
"""

from __future__ import annotations

import gzip
import json
import random
import statistics
import sys


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["samples"]


def pairs(samples: list[dict], a: str, b: str) -> list[tuple[float, float]]:
    ttft = {}
    for s in samples:
        if s["phase"] == "compare" and s["concurrency"] == 1 and s["ok"] and s["temperature"] == 0:
            ttft[(s["config"], s["prompt_id"], s["repeat"])] = s["ttft_s"]
    return [(t, ttft[(b, p, r)]) for (c, p, r), t in ttft.items() if c == a and (b, p, r) in ttft]


def main(path: str, a: str, b: str, resamples: int = 2000) -> str:
    matched = pairs(load(path), a, b)
    diff = [x - y for x, y in matched]
    rng = random.Random(0)
    boots = sorted(statistics.median(rng.choices(diff, k=len(diff))) for _ in range(resamples))
    lo, hi = boots[int(0.025 * resamples)], boots[int(0.975 * resamples) - 1]
    return (f"{a} - {b}: {len(diff)} pairs, median {statistics.median(diff) * 1e3:+.1f} ms "
            f"(95% {lo * 1e3:+.1f} to {hi * 1e3:+.1f}), mean {statistics.mean(diff) * 1e3:+.1f} ms; "
            f"TTFT p50 {statistics.median([x for x, _ in matched]) * 1e3:.0f} against "
            f"{statistics.median([y for _, y in matched]) * 1e3:.0f} ms")


if __name__ == "__main__":
    print(main(*sys.argv[1:4]))
