"""Load ramp against a running cluster, sampling the autoscaler: does the pool scale with the load,
and does the router's K follow? Writes a timeline CSV, the autoscaler's records (JSONL, replayable
as test fixtures), a summary JSON and a plot (replicas, request rate, K, p99 TPOT over time).

    python -m tools.bench.autoscale_ramp --config CLUSTER.yaml --url http://127.0.0.1:38000 \\
        --phases 0.1:90,1.5:240,0.1:300 --out docs/benchmarks/autoscale-ramp

Phases are `rate:seconds`, sent one after another with the benchmark's open-loop Poisson runner
(`tools.bench.runner.Runner.run_poisson`, router decides: config `auto`); the pool's record is
read from Redis every `--sample-s` (what `specserve status` shows).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import time
from pathlib import Path
from typing import Optional

from cluster.autoscale.ray_policy import AutoscaleRecords
from tools.bench.metrics import Sample
from tools.bench.plan import parse_config
from tools.bench.runner import Job, Runner
from tools.bench.workload import load_prompts, select
from cluster.config import load_config
from cluster.percentile import percentile


def parse_phases(spec: str) -> list[tuple[float, float]]:
    """'0.1:90,1.5:240' -> [(0.1, 90.0), (1.5, 240.0)] (requests/s, seconds)."""
    out = []
    for tok in spec.split(","):
        rate, _, dur = tok.partition(":")
        out.append((float(rate), float(dur)))
    return out


def tpot_s(s: Sample) -> Optional[float]:
    """Client-side time per output token after the first (None for failed or 1-token requests)."""
    if not s.ok or s.ttft_s is None or s.latency_s is None or s.output_tokens < 2:
        return None
    return (s.latency_s - s.ttft_s) / (s.output_tokens - 1)


def timeline(samples: list[Sample], records: list[dict], t0_unix: float, bin_s: float = 10.0,
             window_s: float = 30.0) -> list[dict]:
    """One row per `bin_s`: replicas (running / target, last record in the bin), arrivals per second
    in the bin, mean K and K counts of the requests sent in the bin, p99 TPOT of the requests that
    finished in the last `window_s`, and the autoscaler's action."""
    end = max([s.end_s for s in samples] + [r["time_unix_s"] - t0_unix for r in records] + [0.0])
    rows = []
    for i in range(int(end // bin_s) + 1):
        lo, hi = i * bin_s, (i + 1) * bin_s
        sent = [s for s in samples if lo <= s.start_s < hi]
        ks = [int(s.spec.get("k", 0)) for s in sent if s.ok]
        done = [t for s in samples if hi - window_s <= s.end_s < hi and (t := tpot_s(s)) is not None]
        recs = [r for r in records if lo <= r["time_unix_s"] - t0_unix < hi]
        last = recs[-1] if recs else {}
        rows.append({
            "t_s": hi, "running": last.get("running"), "target": last.get("target"),
            "rate_rps": round(len(sent) / bin_s, 3), "mean_k": round(sum(ks) / len(ks), 3) if ks else None,
            "k_counts": json.dumps({str(k): ks.count(k) for k in sorted(set(ks))}),
            "p99_tpot_s": round(percentile(done, 99, "nearest_rank"), 4) if done else None, "errors": sum(1 for s in sent if not s.ok),
            "load": last.get("load"), "carry": last.get("carry"),
            "action": ",".join(sorted({r["action"] for r in recs})) if recs else None,
        })
    return rows


def plot(rows: list[dict], phases: list[tuple[float, float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [r["t_s"] for r in rows]
    fig, ax = plt.subplots(4, 1, figsize=(9, 9), sharex=True)
    ax[0].step(t, [r["running"] for r in rows], where="post", label="running")
    ax[0].step(t, [r["target"] for r in rows], where="post", linestyle="--", label="target")
    ax[0].set_ylabel("replicas")
    ax[0].legend(loc="upper right")
    ax[1].bar(t, [r["rate_rps"] for r in rows], width=-8, align="edge", color="tab:gray", label="sent")
    edge = 0.0
    for rate, dur in phases:
        ax[1].hlines(rate, edge, edge + dur, colors="tab:red", label="Poisson rate" if edge == 0 else None)
        edge += dur
    ax[1].set_ylabel("requests/s")
    ax[1].legend(loc="upper right")
    ax[2].plot(t, [r["mean_k"] for r in rows], marker=".", label="mean K of requests sent")
    ax[2].set_ylabel("K")
    ax[3].plot(t, [r["p99_tpot_s"] for r in rows], marker=".", color="tab:purple", label="p99 TPOT (30 s window)")
    ax[3].set_ylabel("p99 TPOT (s)")
    ax[3].set_xlabel("time since the ramp started (s)")
    for a in ax:
        a.grid(alpha=0.3)
    ax[0].set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summarize(samples: list[Sample], records: list[dict], phases: list[tuple[float, float]], t0_unix: float) -> dict:
    out = {"phases": []}
    edge = 0.0
    for rate, dur in phases:
        sent = [s for s in samples if edge <= s.start_s < edge + dur]
        ok = [s for s in sent if s.ok]
        ks = [int(s.spec.get("k", 0)) for s in ok]
        tp = [t for s in ok if (t := tpot_s(s)) is not None]
        recs = [r for r in records if edge <= r["time_unix_s"] - t0_unix < edge + dur]
        out["phases"].append({
            "rate_rps": rate, "duration_s": dur, "sent": len(sent), "ok": len(ok),
            "mean_k": round(sum(ks) / len(ks), 3) if ks else None,
            "k_counts": {str(k): ks.count(k) for k in sorted(set(ks))},
            "p50_tpot_s": round(sorted(tp)[len(tp) // 2], 4) if tp else None,
            "p99_tpot_s": round(percentile(tp, 99, "nearest_rank"), 4) if tp else None,
            "replicas_running": sorted({r["running"] for r in recs}), "replicas_target": sorted({r["target"] for r in recs}),
        })
        edge += dur
    out["changes"] = changes(records, t0_unix)
    return out


def changes(records: list[dict], t0_unix: float) -> list[dict]:
    """Every scale change the policy made, from the records' `last_change` (an up/down tick may fall
    between two samples; the last change stays in every later record), in time order."""
    seen, out = set(), []
    for r in records:
        c = r.get("last_change")
        if c and c["time_unix_s"] not in seen:
            seen.add(c["time_unix_s"])
            out.append({"t_s": round(c["time_unix_s"] - t0_unix, 1), "action": c["action"], "reason": c["reason"]})
    return sorted(out, key=lambda c: c["t_s"])


async def run(args) -> int:
    from cluster.client import AsyncSpecServeClient

    cfg = load_config(args.config)
    pool = args.pool or next(n for n, p in cfg.pools.items() if p.autoscaling is not None)
    phases = parse_phases(args.phases)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = select(load_prompts(args.prompts), args.prompts_per_task, args.seed, None, args.max_prompt_chars)
    auto = parse_config("auto")[0]
    reader = AutoscaleRecords(cfg.redis.model_dump(mode="json"), [pool], start=False)
    records: list[dict] = []
    seen: set = set()
    samples: list[Sample] = []
    t0_unix = time.time()
    stop = asyncio.Event()

    async def sample_records() -> None:
        while not stop.is_set():
            try:
                rec = (await asyncio.to_thread(reader.fetch)).get(pool)
            except Exception as e:  # noqa: BLE001 - a missed sample is reported, not fatal
                print(f"[ramp] record read failed: {e}")
                rec = None
            if rec is not None and rec["time_unix_s"] not in seen:
                seen.add(rec["time_unix_s"])
                records.append(rec)
            try:
                await asyncio.wait_for(stop.wait(), timeout=args.sample_s)
            except asyncio.TimeoutError:
                pass

    sampler = asyncio.create_task(sample_records())
    async with AsyncSpecServeClient(args.url, timeout_s=args.timeout_s) as client:
        runner = Runner(client, model=None, max_tokens=args.max_tokens, on_done=samples.append,
                        t0=time.perf_counter())
        t0_unix = time.time()
        for i, (rate, dur) in enumerate(phases):
            print(f"[ramp] phase {i}: {rate} req/s for {dur:.0f} s")
            jobs = [Job("poisson", auto, prompts[j % len(prompts)], concurrency=0, rate_rps=rate,
                        nonce=f"ramp{i}-{j}") for j in range(int(rate * dur * 3) + 10)]
            # each phase runs its full duration; its stragglers finish during the next phase
            task = asyncio.create_task(runner.run_poisson(jobs, rate, dur, len(jobs), seed=args.seed + i))
            await asyncio.sleep(dur)
            if i == len(phases) - 1:
                await task
        await asyncio.sleep(args.tail_s)
    stop.set()
    await sampler
    reader.close()

    rows = timeline(samples, records, t0_unix)
    with open(out / "timeline.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    a = cfg.pools[pool].autoscaling
    with open(out / "autoscaler_records.jsonl", "w") as f:
        for r in records:  # with the pool's policy config, so a test can replay each decision
            f.write(json.dumps({**r, "config": a.model_dump(mode="json"),
                                "max_carry": float(cfg.pools[pool].max_ongoing_requests)}) + "\n")
    with open(out / "requests.jsonl", "w") as f:
        for s in samples:
            f.write(json.dumps({"start_s": round(s.start_s, 3), "end_s": round(s.end_s, 3), "ok": s.ok,
                                "status": s.error_status, "k": s.spec.get("k"), "mode": s.spec.get("mode"),
                                "ttft_s": s.ttft_s, "latency_s": s.latency_s, "tokens": s.output_tokens,
                                "task": s.task}) + "\n")
    summary = summarize(samples, records, phases, t0_unix)
    summary.update(t0_unix=t0_unix, pool=pool, phases_spec=args.phases, max_tokens=args.max_tokens, url=args.url,
                   autoscaling=a.model_dump(mode="json"), records=len(records), requests=len(samples))
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    plot(rows, phases, out / "autoscale.png", f"pool {pool}: load ramp {args.phases} (req/s:s)")
    print(json.dumps(summary, indent=2))
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="the running cluster's config (its Redis and pool)")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--pool", default=None, help="pool to watch (default: the first with autoscaling)")
    p.add_argument("--phases", default="0.1:90,1.5:240,0.1:300", help="rate:seconds,... sent in order")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--prompts", default=None)
    p.add_argument("--prompts-per-task", type=int, default=6)
    p.add_argument("--max-prompt-chars", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sample-s", type=float, default=2.0)
    p.add_argument("--tail-s", type=float, default=0.0, help="keep sampling this long after the last phase")
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--out", required=True)
    return asyncio.run(run(p.parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
