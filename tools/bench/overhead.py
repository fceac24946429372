"""What the router adds to a request, apart from the hop to the engine: validation, classification,
the routing decision with the tuning snapshot, and the class α the engine's per-step K starts from.

Runs the router's own code in-process (`Router.plan`, the whole pre-engine path of a request)
over the dev set's prompts, with a real TuningStore against a real Redis (when one answers at the
config's URL) and with Redis unreachable (fail-open), and prints p50 / p99 / max in microseconds.
The hop from the router to an engine replica (the local lane, or Ray Serve's handle) is the same
whether the router or a static client picks the pool.

    python -m tools.bench.overhead [--config cluster/configs/local-cpu.yaml] [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from cluster.api.openai_body import routing_view
from cluster.routing.classifier import classify
from cluster.config import load_config
from cluster.percentile import percentile
from cluster.state.tuning import TuningStore
from deployments.router import Router

DEFAULT_PROMPTS = Path(__file__).resolve().parents[2] / "cluster" / "data" / "specbench-dev.jsonl"


def measure(router: Router, bodies: list[dict], repeats: int) -> list[float]:
    """Seconds per request for parse + validate + classify + route + class α (Router.plan)."""
    times = []
    for _ in range(repeats):
        for body in bodies:
            t0 = time.perf_counter()
            router.plan(routing_view(dict(body), chat=True)[0])
            times.append(time.perf_counter() - t0)
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(Path(__file__).resolve().parents[2] / "cluster" / "configs" / "local-cpu.yaml"))
    ap.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    cfg = load_config(args.config)
    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    bodies = [{"messages": [{"role": "user", "content": r["turns"][0]}], "max_tokens": 64} for r in rows]
    clf = lambda prompt, messages: classify(text=prompt, messages=messages)  # noqa: E731
    results = {}
    for label, url in (("redis up", cfg.redis.url), ("redis unreachable", "redis://127.0.0.1:1/0")):
        store = TuningStore(cfg.redis.model_copy(update={"url": url}), models=tuple(cfg.served_models()))
        time.sleep(1.5)  # let the background refresh load the view (or fail)
        router = Router(cfg, engines={}, tuning=store, classifier=clf)
        measure(router, bodies[:20], 1)  # warm-up
        ts = measure(router, bodies, args.repeats)
        results[label] = {"n": len(ts), "healthy": store.healthy, "p50_us": 1e6 * statistics.median(ts),
                          "p99_us": 1e6 * percentile(ts, 99, "nearest"), "max_us": 1e6 * max(ts)}
        store.close(flush=False)
    print("| tuning state | requests | Redis healthy | p50 (us) | p99 (us) | max (us) |")
    print("|---|---|---|---|---|---|")
    for label, r in results.items():
        print(f"| {label} | {r['n']} | {r['healthy']} | {r['p50_us']:.0f} | {r['p99_us']:.0f} | {r['max_us']:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
