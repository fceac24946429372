"""`specserve bench`: compare speculation configurations side by side on a running cluster, and
against stock vLLM servers (anchors) run with the same model and engine arguments.

`add_arguments(parser)` declares the options; `run(args) -> int` runs the phases against the public
HTTP APIs only, and writes `results/<YYYYmmdd-HHMMSS>-<git rev>/`. Exit code: 0 done,
1 a greedy output changed at a large logit gap (a losslessness bug) or no request succeeded,
2 the cluster or a stock server could not be reached or started, or an argument is invalid.

Steps of `run`: 1. inputs (prompts, the served model, its pools); 2. configurations: the cluster's
(`--configs`) and the baselines (`tools.bench.anchors`); 3. the trace's schedule
(`tools.bench.trace`); 4. plan and estimate (`--dry-run` stops here); 5. start the stock servers;
6. the measured phases (`tools.bench.phases`: warm-up, one-stream comparison, closed-loop sweep,
trace replay, Poisson); 7. stop the stock servers, summary and report (`tools.bench.report`, with
the verdicts against the anchors of `tools.bench.verdict`).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any, Optional

from tools.bench import anchors as A
from tools.bench import plan as P
from tools.bench import trace as T
from tools.bench.metrics import Sample, Slo
from tools.bench.phases import PhaseRun, estimate, log, print_estimate, repeat_bias, run_phases
from tools.bench.report import build_summary, git_short_rev, render_markdown, results_dir, write_results
from tools.bench.runner import SETTLE_S
from tools.bench.split import ALL, SPLITS, keep
from tools.bench.workload import (DEFAULT_PROMPTS_PATH, Prompt, interleave_tasks, load_prompt_pool, load_prompts,
                                    select, select_per_repeat)
from cluster.client import DEFAULT_URL, SpecServeClient
from cluster.client_wire import ClientError
from cluster.config import load_config
from cluster.ops.models import resolve_model
from cluster.ops.placement import vllm_cpu_build

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "cluster" / "configs" / "local-cpu.yaml"

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
    a("--prompts", default=str(DEFAULT_PROMPTS_PATH), help="Spec-Bench-format JSONL (question_id, category, turns); a comma list mixes files.")
    a("--split", default=ALL, choices=SPLITS,
      help="Which fixed half of the prompts to use (tools/bench/split.py): tune on 'tune', report on "
           "'untouched' (default: all).")
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
    a("--fresh-per-repeat", action="store_true",
      help="Every repeat of the comparisons draws its own --prompts-per-task prompts per task (disjoint, seeded, "
           "the same for every configuration), so that a drafter that remembers earlier outputs (suffix) does not "
           "meet its own answer to the same prompt again. Needs repeats x --prompts-per-task prompts per task.")
    a("--keep-outputs", action="store_true",
      help="Never ask the cluster's suffix trees to forget earlier outputs. By default they forget before a "
           "load phase or trace round only when another cluster configuration answered since (it got the same "
           "prompts) or the prompts come round again: a tree that holds a prompt's answer drafts it whole. "
           "Otherwise they keep what they served, as a stock suffix server does.")
    a("--allow-repeated-prompts", action="store_true",
      help="Run even where the load phases resend prompts while a stock suffix server is measured (it keeps its "
           "earlier answers and drafts them whole; by default the bench refuses).")
    a("--forget-outputs", action="store_true",
      help="Ask the cluster's suffix trees to forget before every load phase and trace round of a cluster "
           "configuration, even where they hold only that configuration's answers to other prompts (a stock "
           "suffix server keeps those).")
    a("--sampled-repeats", type=int, default=None, help="Repeats of each sampled comparison (1).")
    a("--settle-s", type=float, default=SETTLE_S,
      help=f"Quiet before each one-stream request ({SETTLE_S:g}): a vLLM engine's worker and engine core "
           "busy-poll for 1 s after their last step, and engines that share cores (the cluster's, the stock "
           "servers') slowed the next configuration's request by up to that second.")
    a("--sampled-configs", default=None,
      help="Configurations of the sampled comparison; 'best' = each mode at its fastest greedy K, "
           "'all' = the greedy list (default none,best,auto).")
    a("--concurrency", default=None, help="Closed-loop stream counts (quick '1,4', full '1,2,4,8,16,32').")
    a("--sweep-configs", default=None,
      help="Configurations of the load phases and the trace: names, 'best', 'all', 'stock' (every baseline) "
           "(default none,best,auto, and every baseline when there are baselines).")
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
    g = parser.add_argument_group("stock-vLLM anchors (tools.bench.anchors)").add_argument
    g("--baseline", action="append", default=[], metavar="NAME=SPEC",
      help="A stock vLLM server to compare with (repeatable): SPEC is a vLLM speculative-config JSON object "
           "or 'none'. The bench starts it with the model, dtype, engine arguments and environment of "
           "--baseline-pool's engine and stops it at the end; it runs in every phase like a configuration.")
    g("--baselines", default=None,
      help="Shorthand baselines, comma list: default (stock-none, stock-ngram:K for K = 1..max_k, "
           "stock-table: n-gram with vLLM's K-by-batch-size table, and stock-suffix when the pool sets "
           "suffix:), none, ngram:K, ngram:*, table, suffix (vLLM's SuffixDecoding with its defaults).")
    g("--baseline-url", action="append", default=[], metavar="NAME=URL",
      help="A stock server already running (repeatable; neither started nor stopped by the bench).")
    g("--config", default=str(DEFAULT_CONFIG), help="The cluster's config (the baselines copy one of its pools).")
    g("--baseline-pool", default=None, help="The pool the baselines copy (default: the first n-gram pool).")
    g("--skip-memory-check", action="store_true",
      help="Start the baselines even if their estimated memory exceeds the machine's available memory.")
    t = parser.add_argument_group("trace replay (tools.bench.trace)").add_argument
    t("--trace", default=None, metavar="RATE:S,...",
      help="Poisson segments (req/s : seconds), seeded by --seed, e.g. 0.08:90,0.6:60,0.08:90 (idle, burst, idle).")
    t("--trace-file", default=None,
      help="A CSV with a timestamp column (Azure LLM inference trace: TIMESTAMP,ContextTokens,GeneratedTokens; "
           "ISO or plain-seconds timestamps); GeneratedTokens, capped at --max-tokens, sets each max_tokens.")
    t("--trace-rate", type=float, default=None, help="--trace-file: rescale time so the mean rate is this (req/s).")
    t("--trace-window", dest="trace_window_s", type=float, default=None,
      help="Keep the arrivals of the first this many seconds (after rescaling).")
    t("--trace-max-requests", type=int, default=None, help="Keep at most this many arrivals.")
    t("--trace-rounds", type=int, default=3,
      help="Rounds of the replay: every sweep configuration replays the same schedule once per round, "
           "the order rotated and reversed from round to round, each round with the next prompts (3).")


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


def _comparison_repeats(args: argparse.Namespace, temperatures: list[float]) -> int:
    """The most repeats any comparison runs: the greedy one's (--repeats), each sampled one's (--sampled-repeats)."""
    return max([1] + ([args.repeats] if 0 in temperatures else [])
               + ([args.sampled_repeats] if any(t > 0 for t in temperatures) else []))


def _inputs(args: argparse.Namespace):
    """Step 1: temperatures, stream counts, the prompt file (its --split half), the task filter, the selected
    prompts and, with --fresh-per-repeat, one draw per repeat of the comparisons (the first is `prompts`)."""
    temperatures = _floats(args.temperatures, "--temperatures")
    levels = _ints(args.concurrency, "--concurrency")
    for name, value in (("--sweep-rounds", args.sweep_rounds), ("--trace-rounds", args.trace_rounds)):
        if value < 1:
            raise ValueError(f"{name}: expected a positive integer, got {value}")
    if args.sweep_requests is not None and args.sweep_requests < 1:
        raise ValueError(f"--sweep-requests: expected a positive integer, got {args.sweep_requests}")
    prompts_all = keep(load_prompts(args.prompts), args.split)
    tasks = [t.strip() for t in args.tasks.split(",")] if args.tasks else None
    draws: list[list[Prompt]] = []  # --fresh-per-repeat: the comparisons' prompts, one draw per repeat
    if args.fresh_per_repeat:
        draws = select_per_repeat(prompts_all, args.prompts_per_task, _comparison_repeats(args, temperatures),
                                  args.seed, tasks, args.max_prompt_chars)
    prompts = draws[0] if draws else select(prompts_all, args.prompts_per_task, args.seed, tasks,
                                            args.max_prompt_chars)
    if not prompts:
        raise ValueError("no prompt left after --tasks / --max-prompt-chars")
    return temperatures, levels, prompts_all, tasks, prompts, draws


def _baselines(args: argparse.Namespace, model_id: str, configs: list[P.BenchConfig],
               max_k: Optional[dict[str, int]]) -> tuple[list[A.Baseline], Optional[str], Any, Any]:
    """Step 2: the baselines (--baselines, --baseline, --baseline-url), and for the ones the bench
    starts the pool they copy and the cluster config (ValueError naming the flag)."""
    explicit = [A.parse_baseline(t) for t in args.baseline]
    external = [A.parse_baseline_url(t) for t in args.baseline_url]
    pool_name = pool = config = None
    if args.baselines or explicit:
        config = load_config(args.config)
        pool_name, pool = A.choose_pool(config, args.baseline_pool)
        if pool.model != model_id:
            raise ValueError(f"--baseline-pool {pool_name}: its model is {pool.model!r}, the cluster under test "
                             f"serves {model_id!r} (--config {args.config})")
    short = A.parse_baselines(args.baselines, pool, pool_name or "?") if args.baselines else []
    taken = {c.name for c in configs} | set(max_k or {})
    return A.merge_baselines([short, explicit, external], taken), pool_name, pool, config


def _stock_servers(args: argparse.Namespace, baselines: list[A.Baseline], pool, config, model_id: str,
                   folder: Path) -> list[A.StockServer]:
    """Step 5: the stock servers to start (their logs in the results folder), after a memory check."""
    started = [b for b in baselines if not b.url]
    if not started:
        return []

    servers = A.plan_servers(started, pool, resolve_model(pool.model, config), model_id,
                             config.models[pool.model].dtype, folder)
    if vllm_cpu_build() and not args.skip_memory_check:
        need, free = A.memory_needed_gib(servers[0].env, len(servers)), A.mem_available_gib()
        if free is not None and need > free:
            raise ValueError(f"{len(servers)} stock servers need about {need:.1f} GiB (KV cache + "
                             f"{A.STOCK_OVERHEAD_GIB} GiB each), {free:.1f} GiB is available: pass fewer baselines "
                             "(or --skip-memory-check)")
    return servers


def _print_plan(run_: PhaseRun, args, baselines: list[A.Baseline], pool_name: Optional[str],
                trace_source: str, n_started: int) -> None:
    levels, prompts, configs = run_.levels, run_.prompts, run_.configs
    log(f"bench: model {run_.model} at {args.url}; {len(prompts)} prompts in {len({p.task for p in prompts})} tasks, "
        f"max_tokens {args.max_tokens}; configs: {', '.join(c.name for c in configs)}; temperatures "
        f"{run_.temperatures}; streams {levels}; sweep {run_.sweep_spec} in {args.sweep_rounds} rounds of "
        f"{', '.join(str(P.sweep_requests(c, len(prompts), per_phase=args.sweep_requests)) for c in levels if c > 1)}"
        f" requests per phase; open loop {args.rate or 'off'} req/s"
        + (f"; fresh prompts in each of {len(run_.repeat_prompts)} repeats" if run_.repeat_prompts else ""))
    if baselines:
        log(f"bench: baselines (stock vLLM" + (f", started like pool {pool_name}'s engine" if pool_name else "")
            + "): " + "; ".join(b.describe() for b in baselines))
    sends = P.sweep_starts(levels, len(prompts), args.sweep_rounds, args.sweep_requests)[-1] \
        + len(run_.arrivals) * args.trace_rounds
    if sends:
        log(f"bench: the load phases send {sends} prompts, {min(sends, len(run_.sweep_prompts))} distinct, none of "
            f"the comparisons' where the prompts allow" + ("" if len(run_.sweep_prompts) >= sends else
                                                         " (too few for every phase its own: some come round again)"))
    if run_.arrivals:
        shape = T.schedule_shape(run_.arrivals)
        log(f"bench: trace {trace_source}: {shape['arrivals']} arrivals over {shape['span_s']:.0f} s (mean "
            f"{shape['mean_rate_rps']:.3f} req/s), replayed in {args.trace_rounds} rounds by the sweep configurations")
    tokens = [t.strip() for t in run_.sweep_spec.split(",")]
    n_sweep = len(P.expand_configs(run_.sweep_spec, configs, {}, run_.max_k)) + (P.BEST in tokens)
    for what, rounds, used in (("--sweep-rounds", args.sweep_rounds, any(c > 1 for c in levels)),
                               ("--trace-rounds", args.trace_rounds, bool(run_.arrivals))):
        if used and any(P.order_drift(n_sweep, rounds)):
            log(f"bench: {what} {rounds}: the last round's order has no reversed twin, so a drift in the "
                f"machine's speed over the run does not cancel between configurations; an even number balances it")
    print_estimate(f"bench: estimate at {args.assumed_tokens_per_s:g} tok/s one stream",
                   estimate(run_, args.assumed_tokens_per_s, n_started))


def run(args: argparse.Namespace) -> int:
    sweep_given = args.sweep_configs is not None
    args = _resolve(args)
    # 1. Inputs.
    try:
        temperatures, levels, prompts_all, tasks, prompts, draws = _inputs(args)
        with SpecServeClient(args.url, timeout_s=30.0, api_key=args.api_key) as c:
            models = c.models()
    except (ValueError, OSError) as e:
        log(f"bench: {e}")
        return 2
    except ClientError as e:
        log(f"bench: cannot list models at {args.url}: {e}")
        return 2
    if not models:
        log("bench: the cluster serves no model")
        return 2
    model = next((m for m in models if m.id == args.model), None) if args.model else models[0]
    if model is None:
        log(f"bench: model {args.model!r} not served; served: {[m.id for m in models]}")
        return 2
    max_k = P.mode_max_k(model.pools, by_mode=True) if model.pools else None

    # 2. Configurations: the cluster's, then the baselines; 3. the trace's arrival offsets.
    try:
        if args.configs:
            configs = P.parse_configs(args.configs, max_k)
        elif not model.pools:
            raise ValueError("the server lists no pools for this model: pass --configs")
        else:
            configs = (P.quick_configs if args.quick else P.discover_configs)(model.pools)
        baselines, pool_name, pool, config = _baselines(args, model.id, configs, max_k)
        offsets, generated, trace_source = T.offsets_from_args(args, args.seed)
    except (ValueError, OSError) as e:
        log(f"bench: {e}")
        return 2
    configs = configs + [b.config() for b in baselines]
    sweep_spec = args.sweep_configs + (f",{P.STOCK}" if baselines and not sweep_given else "")

    # 4. Plan and estimate. The load phases' prompts: fresh ones for every round where the file has
    # enough, tasks round-robin so that every phase (the next n of the cycled list) holds every task.
    load_sends = P.sweep_starts(levels, len(prompts), args.sweep_rounds, args.sweep_requests)[-1] \
        + len(offsets) * args.trace_rounds
    need = max(load_sends, args.max_requests if args.rate else 0)
    # Every prompt of each task, in a seeded order, tasks round-robin, the first `need`: a task with
    # fewer leaves its turns to the others, so the phases get as many distinct prompts as there are.
    unsent = load_prompt_pool(prompts_all, [p for draw in (draws or [prompts]) for p in draw])
    usable = interleave_tasks(select(unsent, len(unsent), args.seed + 1, tasks, args.max_prompt_chars))
    sweep_prompts = usable[:need]
    shape = P.PlanShape(
        n_compare_configs=len(configs), n_prompts=len(prompts), max_tokens=args.max_tokens,
        greedy_repeats=args.repeats if 0 in temperatures else 0,
        sampled_temperatures=len([t for t in temperatures if t > 0]), sampled_repeats=args.sampled_repeats,
        n_sweep_configs=P.count_configs(sweep_spec, configs), concurrency_levels=tuple(levels),
        n_sweep_prompts=len(prompts), poisson_duration_s=args.duration_s if args.rate else 0.0,
        n_warmup_modes=len(P.warm_configs(configs, model.pools)), sweep_rounds=args.sweep_rounds,
        sweep_requests_per_phase=args.sweep_requests)
    run_ = PhaseRun(args=args, model=model.id, configs=configs, sweep_spec=sweep_spec, prompts=prompts,
                    sweep_prompts=sweep_prompts, temperatures=temperatures, levels=levels, max_k=max_k or {},
                    shape=shape, pools=model.pools, repeat_prompts=draws,
                    arrivals=T.build_schedule(offsets, sweep_prompts, args.max_tokens, generated))
    sent = {p.text for draw in (draws or [prompts]) for p in draw}
    bias = repeat_bias([c.name for c in P.expand_configs(sweep_spec, configs, {}, max_k)], load_sends,
                       len(usable), any(p.text in sent for p in sweep_prompts))
    if bias and not getattr(args, "allow_repeated_prompts", False):
        log(f"bench: {bias}")
        return 2
    n_started = sum(1 for b in baselines if not b.url)
    _print_plan(run_, args, baselines, pool_name, trace_source, n_started)
    if args.dry_run:
        return 0

    # 5. Start the stock servers; 6. the measured phases.
    slo = Slo(args.slo_ttft_s, args.slo_tpot_s, args.slo_latency_s)
    folder = results_dir(Path(args.results_dir), rev=git_short_rev())
    meta = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "url": args.url, "model": model.id,
            "git_rev": git_short_rev(), "prompts_file": args.prompts, "max_tokens": args.max_tokens,
            "prompts": [p.question_id for p in run_.all_compared], "configs": [c.name for c in configs],
            "slo": slo.__dict__, "pools": model.pools,
            "args": {k: v for k, v in vars(args).items() if k != "api_key" and not callable(v)}}
    try:
        for b in baselines:
            if b.url:
                A.check_served(b.name, b.url, model.id)
        servers = _stock_servers(args, baselines, pool, config, model.id, folder)
    except (ValueError, OSError, A.StockServerError) as e:
        log(f"bench: {e}")
        return 2
    if baselines:
        meta.update(baseline_pool=pool_name, baselines={b.name: {"speculative_config": b.speculative_config,
                                                                  "url": b.url} for b in baselines},
                    stock_commands={s.name: s.argv for s in servers})
    if run_.arrivals:
        meta["trace"] = {**T.schedule_shape(run_.arrivals), "source": trace_source}
    if draws:
        meta["repeat_prompts"] = [[p.question_id for p in d] for d in draws]
    try:
        with A.StockFleet(servers, pool.startup_timeout_s if pool else 600.0, log=log,
                          external={b.name: b.url for b in baselines if b.url}) as urls:
            run_.stock_urls = urls
            asyncio.run(run_phases(run_))
    except KeyboardInterrupt:
        log("bench: interrupted; writing what was measured")
    except A.StockServerError as e:
        log(f"bench: {e}")
        return 2

    # 7. Summary and report.
    samples: list[Sample] = run_.samples
    summary = build_summary(samples, slo, args.tie_gap, anchors=tuple(b.name for b in baselines))
    if "trace" in summary:
        summary["trace"]["schedule"] = meta["trace"]
    meta["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    files = write_results(folder, samples, meta, summary, plots=not args.no_plots)
    print(render_markdown(summary, meta))
    log("bench: results in " + str(folder) + " (" + ", ".join(p.name for p in files.values()) + ")")
    ok = [s for s in samples if s.ok and s.phase not in ("reference", "warmup")]
    large = [m for m in summary["lossless"]["mismatches"] if m["verdict"] == "large-gap"]
    if large:
        log(f"bench: {len(large)} greedy divergences at a large logit gap "
            f"({', '.join(sorted({m['config'] for m in large}))}): the output changed")
    return 1 if large or not ok else 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="specserve bench", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
