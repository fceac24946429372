"""`specserve bench`: compare speculation configurations side by side on a running cluster.

`add_arguments(parser)` declares the options; `run(args) -> int` runs the phases below against the
public HTTP API only, and writes `results/<YYYYmmdd-HHMMSS>-<git rev>/`. Exit code: 0 done,
1 a greedy output changed at a large logit gap (a losslessness bug) or no request succeeded,
2 the cluster could not be reached or an argument is invalid.

Phases: 1. plan and estimate; 2. warm-up (excluded): the no-speculation greedy reference with
top-2 logprobs, every prompt primed in every mode's pool, one request per configuration;
3. greedy comparison at one stream, interleaved, repeated; 4. sampled comparison; 5. closed-loop
concurrency sweep, in rounds: at each level every sweep configuration runs one short phase per
round, in an order rotated and reversed from round to round (`plan.sweep_round_orders`), and the
report pools each configuration's rounds; 6. open-loop Poisson arrivals; 7. report.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from pathlib import Path
from typing import Optional

from cluster.bench import plan as P
from cluster.bench.metrics import Sample, Slo, best_k_per_mode, group_by, repeat_spread
from cluster.bench.report import build_summary, git_short_rev, render_markdown, results_dir, write_results
from cluster.bench.runner import Job, Runner
from cluster.bench.workload import DEFAULT_PROMPTS_PATH, interleave_tasks, load_prompts, select
from cluster.client import DEFAULT_URL, AsyncSpecServeClient, ClientError, SpecServeClient

# Presets: --quick finishes in a few minutes on 2 CPU cores (SmolLM2-135M, ~10-20 tok/s one stream);
# the full defaults are sized by `plan.estimate_s` to stay under 65 minutes there (at 12 tok/s: 27 of
# them the load sweep in three rounds; one pass could not resolve the router's 3% load target).
PRESETS = {
    "quick": dict(prompts_per_task=2, max_tokens=48, repeats=1, temperatures="0", sampled_repeats=1,
                  sampled_configs="none,best,auto", concurrency="1,4", sweep_configs="none,best,auto",
                  sweep_rounds=2, rate=0.0, duration_s=30.0, max_requests=30),
    "full": dict(prompts_per_task=2, max_tokens=48, repeats=2, temperatures="0,0.7", sampled_repeats=1,
                 sampled_configs="none,best,auto", concurrency="1,2,4,8,16,32", sweep_configs="none,best,auto",
                 sweep_rounds=3, rate=1.0, duration_s=45.0, max_requests=60),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--url", default=DEFAULT_URL, help="Base URL of the cluster's HTTP API.")
    a("--model", default=None, help="Model id (default: the first of GET /v1/models).")
    a("--api-key", default=None, help="Bearer token, if the cluster asks for one.")
    a("--quick", action="store_true", help="Small run (a few minutes on 2 CPU cores).")
    a("--prompts", default=str(DEFAULT_PROMPTS_PATH), help="Spec-Bench-format JSONL (question_id, category, turns).")
    a("--tasks", default=None, help="Comma-separated tasks or categories to keep (default: all).")
    a("--prompts-per-task", type=int, default=None, help="Prompts drawn per task (quick 2, full 2).")
    a("--max-prompt-chars", type=int, default=6000, help="Skip longer prompts (they would not fit the context).")
    a("--max-tokens", type=int, default=None, help="Output tokens per request (quick 48, full 48).")
    a("--ignore-eos", action="store_true", help="Send ignore_eos so every request makes max_tokens tokens.")
    a("--configs", default=None,
      help="Comma list of none | auto | MODE | MODE:K | MODE:* (default: discovered: none, every mode at "
           "every K, auto; quick: none, each mode at a middle K, auto).")
    a("--temperatures", default=None, help="Comparison temperatures; 0 is greedy (quick '0', full '0,0.7').")
    a("--top-p", type=float, default=None, help="top_p of the sampled runs.")
    a("--repeats", type=int, default=None, help="Repeats of the greedy comparison (quick 1, full 2).")
    a("--sampled-repeats", type=int, default=None, help="Repeats of each sampled comparison (1).")
    a("--sampled-configs", default=None,
      help="Configurations of the sampled comparison; 'best' = each mode at its fastest greedy K, "
           "'all' = the greedy list (default none,best,auto).")
    a("--concurrency", default=None, help="Closed-loop stream counts (quick '1,4', full '1,2,4,8,16,32').")
    a("--sweep-configs", default=None, help="Configurations of the load phases (default none,best,auto).")
    a("--sweep-rounds", type=int, default=None,
      help="Rounds per load level: each round runs every sweep configuration for one phase, the order "
           "rotated and reversed from round to round; the report pools the rounds and shows the per-round "
           "spread of auto's ratio (quick 2, full 3).")
    a("--sweep-requests", type=int, default=None,
      help="Requests per phase (one configuration, one round) at each load level, at least 2 per stream "
           "(default: the number of prompts, so max(prompts, 2 x streams)).")
    a("--rate", type=float, default=None, help="Open-loop Poisson arrival rate, requests/s (0: no open loop).")
    a("--duration-s", type=float, default=None, help="Open loop: stop sending after this many seconds.")
    a("--max-requests", type=int, default=None, help="Open loop: stop sending after this many requests.")
    a("--slo-ttft-s", type=float, default=None, help="Goodput: TTFT objective (s).")
    a("--slo-tpot-s", type=float, default=None, help="Goodput: time-per-output-token objective (s).")
    a("--slo-latency-s", type=float, default=None, help="Goodput: end-to-end latency objective (s).")
    a("--tie-gap", type=float, default=0.05, help="Logit gap (nats) below which a greedy divergence is a near-tie.")
    a("--hint-workload-class", action="store_true", help="Send each prompt's workload class to the router.")
    a("--seed", type=int, default=0, help="Seed of prompt draws, sampled runs and arrivals.")
    a("--assumed-tokens-per-s", type=float, default=12.0, help="Single-stream decode rate for the first estimate.")
    a("--timeout-s", type=float, default=600.0, help="Per-request timeout.")
    a("--results-dir", default="results", help="Root folder of the results.")
    a("--no-plots", action="store_true", help="Skip the PNG plots.")
    a("--dry-run", action="store_true", help="Print the plan and the estimate, then stop.")


def _resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill unset options from the preset (--quick or full)."""
    preset = PRESETS["quick" if args.quick else "full"]
    for key, value in preset.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    return args


def _ints(text: str, name: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{name}: expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{name}: expected positive integers, got {text!r}")
    return values


def _floats(text: str, name: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{name}: expected comma-separated numbers, got {text!r}") from None


def _expand(spec: str, greedy_configs: list[P.BenchConfig], best: dict[str, str],
            max_k: dict[str, int]) -> list[P.BenchConfig]:
    """A config list that may name 'best' (each mode's fastest greedy K) or 'all' (the greedy list)."""
    by_name = {c.name: c for c in greedy_configs}
    out: list[P.BenchConfig] = []
    for token in (t.strip() for t in spec.split(",")):
        if token == P.BEST:
            picked = [by_name[name] for name in best.values()]
        elif token == "all":
            picked = list(greedy_configs)
        elif token:
            picked = P.parse_config(token, max_k)
        else:
            picked = []
        out += [c for c in picked if c not in out]
    return out


def _count_best(spec: str, greedy_configs: list[P.BenchConfig]) -> int:
    """Configurations a list will hold once 'best' is known (for the estimate)."""
    modes = {c.mode for c in greedy_configs if c.is_speculative and c.k is not None}
    n = 0
    for token in (t.strip() for t in spec.split(",") if t.strip()):
        n += len(modes) if token == P.BEST else len(greedy_configs) if token == "all" else 1
    return n


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _print_estimate(title: str, est: dict[str, float]) -> None:
    parts = ", ".join(f"{k} {v / 60:.1f}" for k, v in est.items() if k != "total" and v > 0)
    _log(f"{title}: about {est['total'] / 60:.1f} min ({parts} min)")


def run(args: argparse.Namespace) -> int:
    args = _resolve(args)
    try:
        temperatures = _floats(args.temperatures, "--temperatures")
        levels = _ints(args.concurrency, "--concurrency")
        if args.sweep_rounds < 1:
            raise ValueError(f"--sweep-rounds: expected a positive integer, got {args.sweep_rounds}")
        if args.sweep_requests is not None and args.sweep_requests < 1:
            raise ValueError(f"--sweep-requests: expected a positive integer, got {args.sweep_requests}")
        prompts_all = load_prompts(args.prompts)
        tasks = [t.strip() for t in args.tasks.split(",")] if args.tasks else None
        prompts = select(prompts_all, args.prompts_per_task, args.seed, tasks, args.max_prompt_chars)
        if not prompts:
            raise ValueError("no prompt left after --tasks / --max-prompt-chars")
        with SpecServeClient(args.url, timeout_s=30.0, api_key=args.api_key) as c:
            models = c.models()
    except (ValueError, OSError) as e:
        _log(f"bench: {e}")
        return 2
    except ClientError as e:
        _log(f"bench: cannot list models at {args.url}: {e}")
        return 2
    if not models:
        _log("bench: the cluster serves no model")
        return 2
    model = next((m for m in models if m.id == args.model), None) if args.model else models[0]
    if model is None:
        _log(f"bench: model {args.model!r} not served; served: {[m.id for m in models]}")
        return 2
    max_k = P.mode_max_k(model.pools) if model.pools else None
    try:
        if args.configs:
            configs = P.parse_configs(args.configs, max_k)
        elif not model.pools:
            raise ValueError("the server lists no pools for this model: pass --configs")
        else:
            configs = (P.quick_configs if args.quick else P.discover_configs)(model.pools)
    except ValueError as e:
        _log(f"bench: {e}")
        return 2

    # 1. Plan and estimate.
    sampled_temps = [t for t in temperatures if t > 0]
    n_tasks = len({p.task for p in prompts})
    # The sweep's prompts: fresh ones for every round where the file has enough, tasks round-robin so
    # that every phase (the next n of the cycled list) holds every task.
    need = max([P.sweep_requests(c, len(prompts), per_phase=args.sweep_requests) * args.sweep_rounds
                for c in levels if c > 1] + [args.max_requests if args.rate else 0, 0])
    sweep_prompts = interleave_tasks(select(prompts_all, max(1, math.ceil(need / max(n_tasks, 1))), args.seed + 1,
                                            tasks, args.max_prompt_chars)) if need else []
    shape = P.PlanShape(
        n_compare_configs=len(configs), n_prompts=len(prompts), max_tokens=args.max_tokens,
        greedy_repeats=args.repeats if 0 in temperatures else 0, sampled_temperatures=len(sampled_temps),
        sampled_repeats=args.sampled_repeats, n_sweep_configs=_count_best(args.sweep_configs, configs),
        concurrency_levels=tuple(levels), n_sweep_prompts=len(prompts),
        poisson_duration_s=args.duration_s if args.rate else 0.0,
        n_warmup_modes=len({c.mode for c in configs if c.mode not in (None, P.NONE)}),
        sweep_rounds=args.sweep_rounds, sweep_requests_per_phase=args.sweep_requests,
    )
    shape_sampled = _count_best(args.sampled_configs, configs)
    est = P.estimate_s(shape, args.assumed_tokens_per_s)
    est["compare_sampled"] *= shape_sampled / max(len(configs), 1)
    est["total"] = sum(v for k, v in est.items() if k != "total")
    _log(f"bench: model {model.id} at {args.url}; {len(prompts)} prompts in {n_tasks} tasks, max_tokens "
         f"{args.max_tokens}; configs: {', '.join(c.name for c in configs)}; temperatures {temperatures}; "
         f"streams {levels}; sweep {args.sweep_configs} in {args.sweep_rounds} rounds of "
         f"{', '.join(str(P.sweep_requests(c, len(prompts), per_phase=args.sweep_requests)) for c in levels if c > 1)}"
         f" requests per phase; open loop {args.rate or 'off'} req/s")
    _print_estimate(f"bench: estimate at {args.assumed_tokens_per_s:g} tok/s one stream", est)
    if args.dry_run:
        return 0
    slo = Slo(args.slo_ttft_s, args.slo_tpot_s, args.slo_latency_s)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    folder = results_dir(Path(args.results_dir), rev=git_short_rev())
    meta = {"started": started, "url": args.url, "model": model.id, "git_rev": git_short_rev(),
            "prompts_file": args.prompts, "max_tokens": args.max_tokens, "prompts": [p.question_id for p in prompts],
            "configs": [c.name for c in configs], "slo": slo.__dict__, "pools": model.pools,
            "args": {k: v for k, v in vars(args).items() if k != "api_key" and not callable(v)}}
    samples: list[Sample] = []
    try:
        asyncio.run(_phases(args, model.id, configs, prompts, sweep_prompts, temperatures, levels, max_k or {},
                            shape, samples))
    except KeyboardInterrupt:
        _log("bench: interrupted; writing what was measured")
    summary = build_summary(samples, slo, args.tie_gap)
    meta["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    files = write_results(folder, samples, meta, summary, plots=not args.no_plots)
    print(render_markdown(summary, meta))
    _log("bench: results in " + str(folder) + " (" + ", ".join(p.name for p in files.values()) + ")")
    ok = [s for s in samples if s.ok and s.phase not in ("reference", "warmup")]
    large = [m for m in summary["lossless"]["mismatches"] if m["verdict"] == "large-gap"]
    if large:
        _log(f"bench: {len(large)} greedy divergences at a large logit gap: speculation changed the output")
    return 1 if large or not ok else 0


async def _phases(args, model: str, configs: list[P.BenchConfig], prompts, sweep_prompts, temperatures,
                  levels: list[int], max_k: dict[str, int], shape: P.PlanShape, samples: list[Sample]) -> None:
    from tqdm import tqdm

    n_modes = shape.n_warmup_modes
    total = (len(prompts) * (1 + n_modes) + len(configs) + len(configs) * len(prompts) * shape.greedy_repeats)
    bar = tqdm(total=total, file=sys.stderr, unit="req", dynamic_ncols=True)

    def done(s: Sample) -> None:
        samples.append(s)
        bar.update(1)
        bar.set_postfix_str(f"{s.phase} {s.config} c={s.concurrency}" + ("" if s.ok else f" ERR {s.error_status}"))

    async with AsyncSpecServeClient(args.url, timeout_s=args.timeout_s, api_key=args.api_key) as client:
        runner = Runner(client, model=model, max_tokens=args.max_tokens, top_p=args.top_p,
                        ignore_eos=args.ignore_eos, hint_workload_class=args.hint_workload_class, on_done=done)
        none = P.BenchConfig(P.NONE, P.NONE, 0)

        # 2. Warm-up (excluded): the reference with top-2 logprobs, priming, one request per configuration.
        await runner.run_sequential([Job("reference", none, p, logprobs=2) for p in prompts])
        ref = [s for s in samples if s.phase == "reference" and s.ok]
        lat = sum(s.latency_s or 0 for s in ref)
        tps1 = sum(s.output_tokens for s in ref) / lat if lat else args.assumed_tokens_per_s
        first_of_mode = {}
        for c in configs:
            if c.mode not in (None, P.NONE):
                first_of_mode.setdefault(c.mode, c)
        await runner.run_sequential([Job("warmup", c, p, max_tokens=1) for c in first_of_mode.values() for p in prompts])
        await runner.run_sequential([Job("warmup", c, prompts[i % len(prompts)], max_tokens=8)
                                     for i, c in enumerate(configs)])
        est = P.estimate_s(shape, max(tps1, 0.1))
        est["compare_sampled"] *= _count_best(args.sampled_configs, configs) / max(len(configs), 1)
        est["total"] = sum(v for k, v in est.items() if k != "total")
        bar.clear()
        _print_estimate(f"bench: measured {tps1:.1f} tok/s one stream (reference); estimate now", est)

        # 3. Greedy comparison, one stream, interleaved and repeated.
        async def compare(cfgs: list[P.BenchConfig], temp: float, repeats: int) -> None:
            order = P.interleaved_order(len(cfgs), len(prompts), repeats)
            bar.total += len(order) if temp > 0 else 0
            jobs = [Job("compare", cfgs[ci], prompts[pi], temperature=temp, repeat=r,
                        seed=None if temp == 0 else args.seed * 100003 + r * 1009 + pi) for r, pi, ci in order]
            await runner.run_sequential(jobs)

        if 0 in temperatures:
            await compare(configs, 0.0, args.repeats)
        greedy = [s for s in samples if s.phase == "compare" and s.temperature == 0]
        tps = {cfg: repeat_spread(g)["median"] for cfg, g in group_by(greedy, lambda s: s.config).items()}
        best = best_k_per_mode(tps, {c.name: (c.mode, c.k) for c in configs if c.is_speculative and c.k})
        if best:
            _log("bench: fastest K per mode (greedy, one stream): " + ", ".join(best.values()))

        # 4. Sampled comparison.
        sampled_cfgs = _expand(args.sampled_configs, configs, best, max_k)
        for temp in (t for t in temperatures if t > 0):
            await compare(sampled_cfgs, temp, args.sampled_repeats)

        # 5. Closed-loop sweep in rounds: every configuration one phase per round, the order rotated and
        # reversed from round to round (and shifted per level); within a round all configurations get the
        # same prompts, each round the next ones; `repeat` carries the round; prompts made cold by a nonce.
        sweep_cfgs = _expand(args.sweep_configs, configs, best, max_k)
        for li, c in enumerate(l for l in levels if l > 1):
            n = P.sweep_requests(c, len(prompts), per_phase=args.sweep_requests)
            for r, order in enumerate(P.sweep_round_orders(len(sweep_cfgs), args.sweep_rounds, shift=li)):
                for cfg in (sweep_cfgs[i] for i in order):
                    bar.total += n
                    jobs = [Job("sweep", cfg, sweep_prompts[(r * n + i) % len(sweep_prompts)], concurrency=c,
                                repeat=r, nonce=f"s{c}-r{r}-{cfg.name}-{i}") for i in range(n)]
                    await runner.run_closed_loop(jobs, c)

        # 6. Open loop, Poisson arrivals, bounded in time and count.
        if args.rate and args.rate > 0:
            for i, cfg in enumerate(sweep_cfgs):
                bar.total += min(args.max_requests, int(args.rate * args.duration_s) + 1)
                jobs = [Job("poisson", cfg, sweep_prompts[j % len(sweep_prompts)], concurrency=0,
                            rate_rps=args.rate, nonce=f"p-{cfg.name}-{j}") for j in range(args.max_requests)]
                await runner.run_poisson(jobs, args.rate, args.duration_s, args.max_requests, seed=args.seed + i)
    bar.close()


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="specserve bench", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
