"""Disaggregated drafter benchmark: the same drafter in-engine (pool `draft`, vLLM's draft_model
proposer) and in its own deployment (pool `remote`, `cluster.engine.remote_proposer`), side by side in one
run on one cluster, at concurrency 1 and 8, with plain decoding (K = 0) as the floor.

It starts its own cluster in-process from the base config (only the `draft` pool kept, a drafter
deployment of the same drafter model, and a `remote` pool otherwise identical to `draft`), drives it
over HTTP with explicit mode and K, and reads the remote proposer's per-step call times through a
Serve handle: round trip (rtt) and transport overhead (rtt minus the drafter's own compute).
It also times a Ray Serve handle call to the drafter replica (the transport not chosen).

    python -m tools.bench.remote [--base cluster/configs/local-cpu.yaml] [--k 4] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from cluster.ops.shutdown import stop_cluster
from cluster.ops.up import start_cluster

DEFAULT_BASE = Path(__file__).resolve().parents[2] / "cluster" / "configs" / "local-cpu.yaml"
DEFAULT_PROMPTS = Path(__file__).resolve().parents[2] / "cluster" / "data" / "specbench-dev.jsonl"


def bench_config(base: dict, http_port: int, grpc_port: int, redis_port: int, metrics_port: int,
                 timeout_s: float) -> dict:
    """`base` with only its `draft` pool, plus a drafter deployment of the same drafter model and a
    `remote` pool that is `draft` in every other respect."""
    raw = copy.deepcopy(base)
    draft = raw["pools"]["draft"]
    draft.pop("auto", None)  # the only pools of this config: auto must be able to choose them
    remote = copy.deepcopy(draft)
    remote.pop("drafter")
    remote.update(method="remote_draft", remote_drafter="bench", remote_timeout_s=timeout_s, remote_reprobe_s=1.0)
    raw["pools"] = {"draft": draft, "remote": remote}
    for pool in raw["pools"].values():  # a shared, busy machine must not recycle an engine mid-phase
        pool["health_probe_timeout_s"] = max(float(pool.get("health_probe_timeout_s", 20)), 120.0)
    raw["drafters"] = {"bench": {"model": draft["drafter"], "replicas": 1, "resources": {"CPU": 1}}}
    raw["name"] = "specserve-bench-remote"
    raw["api"].update(http_port=http_port, grpc_port=grpc_port)
    raw["redis"]["url"] = f"redis://127.0.0.1:{redis_port}/0"
    raw.setdefault("ray", {})["metrics_export_port"] = metrics_port
    return raw


def prompts(n: int) -> list[str]:
    rows = [json.loads(line) for line in DEFAULT_PROMPTS.read_text().splitlines() if line.strip()]
    step = max(len(rows) // n, 1)
    return [r["turns"][0] for r in rows[::step][:n]]


async def run_phase(url: str, texts: list[str], concurrency: int, mode: str, k: int, max_tokens: int) -> dict:
    """Every prompt once, `concurrency` at a time; tokens/s = completion tokens / wall time."""
    sem = asyncio.Semaphore(concurrency)
    out: list[dict] = [None] * len(texts)  # type: ignore[list-item]

    async def one(i: int, client: httpx.AsyncClient):
        async with sem:
            spec = {"mode": mode} if k == 0 else {"mode": mode, "k": k}
            body = {"messages": [{"role": "user", "content": texts[i]}], "max_tokens": max_tokens,
                    "temperature": 0.0, "specserve": {"speculative": spec}}
            r = await client.post(f"{url}/v1/chat/completions", json=body, timeout=600)
            r.raise_for_status()
            j = r.json()
            out[i] = {"tokens": j["usage"]["completion_tokens"], **{
                key: j["specserve"][key] for key in ("token_ids", "drafted", "accepted", "steps", "pool", "mode")}}

    async with httpx.AsyncClient() as client:
        t0 = time.perf_counter()
        await asyncio.gather(*[one(i, client) for i in range(len(texts))])
        wall = time.perf_counter() - t0
    tokens = sum(o["tokens"] for o in out)
    drafted, accepted, steps = (sum(o[key] for o in out) for key in ("drafted", "accepted", "steps"))
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, "drafted": drafted,
            "accepted": accepted, "acceptance_length": 1 + accepted / steps if steps else 1.0,
            "pool": out[0]["pool"], "token_ids": [o["token_ids"] for o in out]}


def handle_call_times(handle, n: int) -> dict:
    """A Serve handle call to the drafter replica from this driver (no work in the call)."""
    xs = []
    for _ in range(n):
        t0 = time.perf_counter()
        handle.endpoint.remote().result()
        xs.append(time.perf_counter() - t0)
    xs.sort()
    return {"n": n, "p50": xs[n // 2], "p99": xs[min(n - 1, int(0.99 * n))]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default=str(DEFAULT_BASE))
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prompts-c1", type=int, default=6)
    ap.add_argument("--prompts-c8", type=int, default=16)
    ap.add_argument("--timeout-s", type=float, default=1.0, help="remote_timeout_s of the remote pool")
    ap.add_argument("--ports", default="48000,49000,46390,48090", help="http,grpc,redis,metrics")
    ap.add_argument("--out", default=None, help="write the JSON report here")
    args = ap.parse_args(argv)

    from ray import serve

    http, grpc, redis, metrics = (int(p) for p in args.ports.split(","))
    raw = bench_config(yaml.safe_load(Path(args.base).read_text()), http, grpc, redis, metrics, args.timeout_s)
    cfg_path = Path(tempfile.mkdtemp(prefix="bench-remote-")) / "cluster.yaml"
    cfg_path.write_text(yaml.safe_dump(raw, sort_keys=False))
    config, redis_handle, fwd, nodes = start_cluster(str(cfg_path))
    url = f"http://127.0.0.1:{http}"
    report: dict[str, Any] = {"config": raw, "k": args.k, "max_tokens": args.max_tokens, "phases": []}
    try:
        engine = serve.get_deployment_handle("engine-remote", app_name=config.name)
        drafter = serve.get_deployment_handle("drafter-bench", app_name=config.name)
        warm = prompts(2)
        for mode, k in (("draft_model", args.k), ("remote_draft", args.k), ("none", 0)):
            asyncio.run(run_phase(url, warm, 2, mode, k, 8))  # warm both engines and the drafter
        report["ray_handle_call_s"] = handle_call_times(drafter, 200)
        for conc, n in ((1, args.prompts_c1), (8, args.prompts_c8)):
            texts = prompts(n)
            for mode, k in (("none", 0), ("draft_model", args.k), ("remote_draft", args.k)):
                if mode == "remote_draft":
                    before = engine.drafter_status.remote(True).result()  # and reset the call-time samples
                phase = asyncio.run(run_phase(url, texts, conc, mode, k, args.max_tokens))
                phase.update(concurrency=conc, mode=mode, k=k, loadavg_1m=os.getloadavg()[0])
                if mode == "remote_draft":
                    phase["remote"] = engine.drafter_status.remote(False).result()
                    for key in ("calls", "failures", "skipped_open", "resyncs", "drafted"):  # this phase's
                        phase["remote"][key] -= before[key]
                    phase["drafter"] = drafter.stats.remote().result()
                report["phases"].append(phase)
                print(f"c={conc} {mode:12s} K={k}: {phase['tokens_per_s']:.2f} tok/s "
                      f"(drafted {phase['drafted']}, accepted {phase['accepted']}, pool {phase['pool']})", flush=True)
        # Greedy: every mode gave the same tokens for the same prompt at the same concurrency.
        for conc in (1, 8):
            ids = [p["token_ids"] for p in report["phases"] if p["concurrency"] == conc]
            report[f"identical_c{conc}"] = all(x == ids[0] for x in ids)
    finally:
        stop_cluster(redis_handle, fwd, nodes)
    for p in report["phases"]:
        p.pop("token_ids")
    print(render(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    return 0


def render(report: dict) -> str:
    ms = lambda s: f"{s * 1000:.1f}"  # noqa: E731
    lines = ["| concurrency | mode | K | tokens/s | drafted | accepted | acceptance length | remote call p50 / p99 ms "
             "| transport overhead p50 / p99 ms | failed calls | machine load (1 min) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in report["phases"]:
        r = p.get("remote")
        call = f"{ms(r['rtt_s']['p50'])} / {ms(r['rtt_s']['p99'])}" if r and r["rtt_s"].get("n") else ""
        over = f"{ms(r['overhead_s']['p50'])} / {ms(r['overhead_s']['p99'])}" if r and r["overhead_s"].get("n") else ""
        fails = str(r["failures"]) if r else ""
        lines.append(f"| {p['concurrency']} | {p['mode']} | {p['k']} | {p['tokens_per_s']:.2f} | {p['drafted']} | "
                     f"{p['accepted']} | {p['acceptance_length']:.2f} | {call} | {over} | {fails} | {p['loadavg_1m']:.1f} |")
    h = report.get("ray_handle_call_s")
    if h:
        lines.append(f"\nRay Serve handle call to the drafter replica (driver, no work): p50 {ms(h['p50'])} ms, "
                     f"p99 {ms(h['p99'])} ms over {h['n']} calls.")
    lines.append(f"Greedy tokens identical across modes: c=1 {report.get('identical_c1')}, "
                 f"c=8 {report.get('identical_c8')}.")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
