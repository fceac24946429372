"""The measured phases of `specserve bench`, run in order against the cluster and the stock anchors.

The phases know nothing of argument parsing or files: `run_phases(run)` takes a `PhaseRun` (what to
send, decided by `tools.bench.cli`) and appends one `Sample` per request to `run.samples`.

2. Warm-up (excluded): the no-speculation greedy reference with top-2 logprobs; every prompt of
   the comparison once through every engine with max_tokens 1 (`warm`); one request per configuration.
3. Greedy comparison at one stream, interleaved and repeated (cluster configurations and baselines);
   with `repeat_prompts` (--fresh-per-repeat) repeat r sends its own draw, and 2. ran all the draws.
4. Sampled comparison (its repeat r sends the same draw as the greedy repeat r).
5. Closed-loop sweep in rounds (`plan.sweep_round_orders`); before a cluster phase the suffix
   trees forget earlier outputs when another cluster configuration answered since or the prompts come
   round again (`must_forget`), and keep them otherwise; before each round its prompts go once
   through every engine the sweep's configurations reach. Every configuration then finds the same
   prompts in its engine's prefix cache: the prefix cache matches full blocks of a request's own
   prompt only, identical for every configuration, so none gets a prefill another one paid for,
   and no per-configuration nonce is needed (unless the cache evicts between the warm-up and the round).
6. Trace replay: the same arrival schedule for every configuration, in rounds ordered like the
   sweep's, its prompts warmed before each round.
7. Open-loop Poisson arrivals (prompts made cold for every configuration by a nonce).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Optional

from tools.bench import plan as P
from tools.bench.metrics import Sample, best_k_per_mode, group_by, repeat_spread
from tools.bench.runner import Job, Runner
from tools.bench.trace import Arrival, round_schedule
from tools.bench.workload import Prompt, round_prompts
from cluster.client import AsyncSpecServeClient

WARM_STREAMS = 4  # warm-up requests in flight at once (1 token each: mostly prefill)
STOCK_START_S = 60.0  # assumed start-up of one stock server (about 50 s here)
WARM_REQUEST_S = 0.5  # assumed time of one warm-up request (for the estimate)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def print_estimate(title: str, est: dict[str, float]) -> None:
    parts = ", ".join(f"{k} {v / 60:.1f}" for k, v in est.items() if k != "total" and v > 0)
    log(f"{title}: about {est['total'] / 60:.1f} min ({parts} min)")


@dataclass
class PhaseRun:
    args: object  # the resolved argparse namespace of `specserve bench`
    model: str
    configs: list[P.BenchConfig]  # the comparison's: the cluster's, then the baselines
    sweep_spec: str  # --sweep-configs, with 'stock' added when baselines were given and it was not
    prompts: list[Prompt]
    sweep_prompts: list[Prompt]
    temperatures: list[float]
    levels: list[int]
    max_k: dict[str, int]
    shape: P.PlanShape
    pools: list[dict] = field(default_factory=list)  # the cluster's, from /v1/models
    stock_urls: dict[str, str] = field(default_factory=dict)  # baseline name -> its server
    arrivals: list[Arrival] = field(default_factory=list)  # the trace's schedule (empty: no trace)
    samples: list[Sample] = field(default_factory=list)
    # --fresh-per-repeat: the comparisons' prompts per repeat (disjoint; the first is `prompts`); empty:
    # `prompts` in every repeat.
    repeat_prompts: list[list[Prompt]] = field(default_factory=list)

    def compared(self, repeat: int) -> list[Prompt]:
        """The prompts repeat `repeat` of a comparison sends, in the order of `plan.interleaved_order`."""
        return self.repeat_prompts[repeat] if self.repeat_prompts else self.prompts

    @property
    def all_compared(self) -> list[Prompt]:
        """Every prompt a comparison sends (the reference and the warm-up run each once)."""
        return unique_prompts([p for draw in self.repeat_prompts for p in draw]) or self.prompts


def unique_prompts(prompts: list[Prompt]) -> list[Prompt]:
    seen: dict[str, Prompt] = {}
    for p in prompts:
        seen.setdefault(p.question_id, p)
    return list(seen.values())


def warm_jobs(configs: list[P.BenchConfig], prompts: list[Prompt], pools: list[dict]) -> list[Job]:
    """Every prompt (once) through every engine `configs` reach, max_tokens 1 (`plan.warm_configs`)."""
    return [Job("warmup", target, p, max_tokens=1) for target in P.warm_configs(configs, pools)
            for p in unique_prompts(prompts)]


def trace_jobs(arrivals: list[Arrival], config: P.BenchConfig, round_: int) -> list[Job]:
    """One configuration's replay of the schedule: the same prompts, max_tokens and arrival indices."""
    return [Job("trace", config, a.prompt, concurrency=0, repeat=round_, max_tokens=a.max_tokens, arrival=a.index)
            for a in arrivals]


async def run_phases(run: PhaseRun) -> None:
    from tqdm import tqdm

    args, configs, prompts, samples = run.args, run.configs, run.prompts, run.samples
    bar = tqdm(total=len(run.all_compared) + len(configs) * len(prompts) * run.shape.greedy_repeats, file=sys.stderr,
               unit="req", dynamic_ncols=True)

    def done(s: Sample) -> None:
        samples.append(s)
        bar.update(1)
        bar.set_postfix_str(f"{s.phase} {s.config} c={s.concurrency}" + ("" if s.ok else f" ERR {s.error_status}"))

    async def send(jobs: list[Job], streams: int = 1) -> None:
        bar.total += len(jobs)
        await runner.run_closed_loop(jobs, streams)

    async def warm(cfgs: list[P.BenchConfig], phase_prompts: list[Prompt]) -> None:
        await send(warm_jobs(cfgs, phase_prompts, run.pools), WARM_STREAMS)

    stock = {name: AsyncSpecServeClient(url, timeout_s=args.timeout_s) for name, url in run.stock_urls.items()}
    try:
        async with AsyncSpecServeClient(args.url, timeout_s=args.timeout_s, api_key=args.api_key) as client:
            runner = Runner(client, model=run.model, max_tokens=args.max_tokens, top_p=args.top_p,
                            ignore_eos=args.ignore_eos, hint_workload_class=args.hint_workload_class, on_done=done,
                            stock_clients=stock, request_timeout_s=args.timeout_s)
            await _measure(run, runner, send, warm, bar)
    finally:
        for c in stock.values():
            await c.aclose()
        bar.close()


# Stock servers whose drafts depend only on the request itself, in the order the reference prefers them.
STATELESS_STOCK = ("stock-none", "stock-table", "stock-ngram:")


# Stock servers that learn from what they serve (a suffix tree per server, never emptied).
STATEFUL_STOCK = ("stock-suffix",)


def repeat_bias(sweep: list[str], sends: int, distinct: int, resends_compared: bool) -> Optional[str]:
    """Why the load phases would favour a stock suffix server, or None when they would not.

    A stock suffix server keeps every answer it gave: a prompt that comes round again (the phases
    need more than the `distinct` prompts they may use, or resend the one-stream comparison's) is
    drafted whole from its own earlier answer, while the cluster's trees forget before such a round
    (`must_forget`). The comparison would then measure memory, not drafting.

    >>> repeat_bias(["auto", "stock-suffix"], 111, 111, False) is None
    True
    >>> repeat_bias(["auto", "stock-table"], 298, 229, True) is None
    True
    >>> print(repeat_bias(["auto", "stock-suffix"], 298, 229, False))  # doctest: +ELLIPSIS
    the load phases send 298 prompts but only 229 distinct ones are left: stock-suffix would ...
    >>> "comparison sent" in repeat_bias(["stock-suffix"], 10, 50, True)
    True
    """
    stateful = [n for n in sweep if n in STATEFUL_STOCK]
    if not stateful or (sends <= distinct and not resends_compared):
        return None
    what = (f"send {sends} prompts but only {distinct} distinct ones are left" if sends > distinct
            else "resend prompts the one-stream comparison sent")
    return (f"the load phases {what}: {', '.join(stateful)} would draft those from its own earlier answers, "
            "which the cluster's suffix trees forget first; lower --sweep-requests, --sweep-rounds, --trace-rounds "
            "or --trace-max-requests, leave it out of --sweep-configs, or pass --allow-repeated-prompts")


def must_forget(cfg: P.BenchConfig, answered: set[str], prompts_repeat: bool) -> bool:
    """Whether the cluster's suffix trees must forget before `cfg`'s next load phase or trace round.

    The trees of a pool are shared by every cluster configuration it serves, and within a round every
    configuration gets the same prompts: after another cluster configuration (`answered`: the ones
    since the last forget) answered them, its greedy answers would draft them whole. Where the prompts
    come round again (`prompts_repeat`), a tree would meet its own answer. Otherwise the trees keep
    what they served, as in production and as a stock suffix server does (it cannot forget).

    >>> auto = P.BenchConfig("auto", None, None)
    >>> [must_forget(auto, a, r) for a, r in ((set(), False), ({"auto"}, False), ({"suffix:16"}, False),
    ...                                       ({"auto"}, True))]
    [False, False, True, True]
    >>> must_forget(P.baseline_config("stock-suffix"), {"auto"}, True)
    False
    """
    if cfg.baseline:
        return False
    return prompts_repeat or bool(answered - {cfg.name})


async def forget(runner: Runner, cfg: P.BenchConfig, args, answered: set[str], prompts_repeat: bool) -> None:
    """Before a load phase of a cluster configuration: its suffix trees drop what earlier phases
    served (`POST /v1/specserve/forget_outputs`) when `must_forget` says so (`--forget-outputs`
    passes `prompts_repeat`, so it forgets every time); `answered` is updated. `--keep-outputs`
    never forgets."""
    if cfg.baseline:
        return
    if not getattr(args, "keep_outputs", False) and must_forget(cfg, answered, prompts_repeat):
        answered.clear()
        try:
            out = await runner.client.forget_outputs()
            log(f"bench: {cfg.name}: suffix trees forgot " + ", ".join(
                f"{n}: {p.get('forgotten', p.get('error'))}" for n, p in out.get("pools", {}).items()))
        except Exception as e:  # noqa: BLE001 - an older cluster has no such route: measure anyway, say so
            log(f"bench: {cfg.name}: could not make the suffix trees forget ({type(e).__name__}: {e})")
    answered.add(cfg.name)


def reference_config(stock_urls) -> P.BenchConfig:
    """Where the greedy reference runs: a stock server that keeps nothing between requests when one
    runs, else the cluster without speculation. The cluster's suffix trees (and a stock suffix
    server's) learn every answer they serve, so a reference through them would hand the measured
    request its own answer as drafts.

    >>> [reference_config(u).name for u in ({}, {"stock-suffix": "u"}, {"stock-suffix": "u", "stock-ngram:3": "u"})]
    ['none', 'none', 'stock-ngram:3']
    """
    for prefix in STATELESS_STOCK:
        name = next((n for n in stock_urls if n == prefix or prefix.endswith(":") and n.startswith(prefix)), None)
        if name is not None:
            return P.baseline_config(name)
    return P.BenchConfig(P.NONE, P.NONE, 0)


async def _measure(run: PhaseRun, runner: Runner, send, warm, bar) -> None:
    args, configs, prompts, samples = run.args, run.configs, run.prompts, run.samples

    # 2. Warm-up (excluded): the reference with top-2 logprobs, every prompt in every engine, one
    # request per configuration.
    ref_cfg = reference_config(run.stock_urls)
    await runner.run_sequential([Job("reference", ref_cfg, p, logprobs=2) for p in run.all_compared])
    # cluster configurations whose answers the suffix trees hold (`forget`); a reference through the
    # cluster answered every compared prompt
    answered: set[str] = set() if ref_cfg.baseline else {"reference"}
    ref = [s for s in samples if s.phase == "reference" and s.ok]
    lat = sum(s.latency_s or 0 for s in ref)
    tps1 = sum(s.output_tokens for s in ref) / lat if lat else args.assumed_tokens_per_s
    await warm(configs, run.all_compared)
    await runner.run_sequential([Job("warmup", c, prompts[i % len(prompts)], max_tokens=8)
                                 for i, c in enumerate(configs)])
    if any(not c.baseline for c in configs):
        answered.add("warmup")  # the first tokens of some compared prompts' answers
    bar.clear()
    print_estimate(f"bench: measured {tps1:.1f} tok/s one stream (reference); estimate now",
                   estimate(run, max(tps1, 0.1)))

    # 3. Greedy comparison, one stream, interleaved and repeated.
    async def compare(cfgs: list[P.BenchConfig], temp: float, repeats: int, sent_before: bool = False) -> None:
        order = P.interleaved_order(len(cfgs), len(prompts), repeats)
        bar.total += len(order) if temp > 0 else 0
        jobs = [Job("compare", cfgs[ci], run.compared(r)[pi], temperature=temp, repeat=r,
                    seed=None if temp == 0 else args.seed * 100003 + r * 1009 + pi) for r, pi, ci in order]
        # every configuration answers a prompt back to back: a cluster one after another cluster one
        # (or after itself, where repeats or an earlier comparison sent the prompts) would find that
        # answer in the trees
        again = sent_before or (repeats > 1 and not run.repeat_prompts)
        for job in jobs:
            await forget(runner, job.config, args, answered, again)
            await runner.run_sequential([job], settle_s=args.settle_s)

    if 0 in run.temperatures:
        await compare(configs, 0.0, args.repeats)
    greedy = [s for s in samples if s.phase == "compare" and s.temperature == 0]
    tps = {cfg: repeat_spread(g)["median"] for cfg, g in group_by(greedy, lambda s: s.config).items()}
    best = best_k_per_mode(tps, {c.name: (c.mode, c.k) for c in configs if c.is_speculative and c.k})
    if best:
        log("bench: fastest K per mode (greedy, one stream): " + ", ".join(best.values()))

    # 4. Sampled comparison.
    sampled_cfgs = P.expand_configs(args.sampled_configs, configs, best, run.max_k)
    for temp in (t for t in run.temperatures if t > 0):
        await compare(sampled_cfgs, temp, args.sampled_repeats, sent_before=0 in run.temperatures)

    # 5. Closed-loop sweep in rounds: every configuration one phase per round, the order rotated and
    # reversed from round to round (and shifted per level); within a round all configurations get the
    # same prompts, warmed in every engine just before; each round and level the next ones (`starts`);
    # `repeat` is the round.
    sweep_cfgs = P.expand_configs(run.sweep_spec, configs, best, run.max_k)
    starts = P.sweep_starts(run.levels, len(prompts), args.sweep_rounds, args.sweep_requests)
    compared = {p.text for p in run.all_compared}
    repeat = (getattr(args, "forget_outputs", False)
              or starts[-1] + len(run.arrivals) * args.trace_rounds > len(run.sweep_prompts)
              or any(p.text in compared for p in run.sweep_prompts))
    for li, c in enumerate(lv for lv in run.levels if lv > 1):
        n = P.sweep_requests(c, len(prompts), per_phase=args.sweep_requests)
        for r, order in enumerate(P.sweep_round_orders(len(sweep_cfgs), args.sweep_rounds, shift=li)):
            phase_prompts = round_prompts(run.sweep_prompts, n, r, start=starts[li])
            await warm(sweep_cfgs, phase_prompts)
            for cfg in (sweep_cfgs[i] for i in order):
                await forget(runner, cfg, args, answered, repeat)
                await send([Job("sweep", cfg, p, concurrency=c, repeat=r) for p in phase_prompts], c)

    # 6. Trace replay: the schedule, identical for every configuration, in rounds ordered like the sweep's;
    # each round the next prompts (`trace.round_schedule`), the same for every configuration in it.
    if run.arrivals:
        offsets = [a.offset_s for a in run.arrivals]
        for r, order in enumerate(P.sweep_round_orders(len(sweep_cfgs), args.trace_rounds)):
            arrivals = round_schedule(run.arrivals, run.sweep_prompts, r, start=starts[-1])
            await warm(sweep_cfgs, [a.prompt for a in arrivals])
            for cfg in (sweep_cfgs[i] for i in order):
                await forget(runner, cfg, args, answered, repeat)
                bar.total += len(offsets)
                log(f"bench: trace round {r}: {cfg.name}, {len(offsets)} arrivals over {offsets[-1]:.0f} s")
                await runner.run_schedule(trace_jobs(arrivals, cfg, r), offsets)

    # 7. Open loop, Poisson arrivals, bounded in time and count (nonced: cold for every configuration).
    if args.rate and args.rate > 0:
        for i, cfg in enumerate(sweep_cfgs):
            bar.total += min(args.max_requests, int(args.rate * args.duration_s) + 1)
            jobs = [Job("poisson", cfg, run.sweep_prompts[j % len(run.sweep_prompts)], concurrency=0,
                        rate_rps=args.rate, nonce=f"p-{cfg.name}-{j}") for j in range(args.max_requests)]
            await runner.run_poisson(jobs, args.rate, args.duration_s, args.max_requests, seed=args.seed + i)


def expected_warm_requests(run_levels: list[int], n_prompts: int, sweep_rounds: int, per_phase: Optional[int],
                           n_engines: int, n_trace_prompts: int, trace_rounds: int) -> int:
    """Warm-up requests of the sweep and the trace (for the estimate)."""
    sweep = sum(P.sweep_requests(c, n_prompts, per_phase=per_phase) * sweep_rounds for c in run_levels if c > 1)
    return n_engines * (sweep + n_trace_prompts * trace_rounds)


def estimate(run_: "PhaseRun", tokens_per_s: float, n_started: int = 0) -> dict[str, float]:
    """Seconds per phase of the whole run at a one-stream decode rate (`plan.estimate_s` plus the
    stock servers' start, the per-round warm-ups and the trace)."""
    args = run_.args
    est = P.estimate_s(run_.shape, tokens_per_s)
    est["compare_sampled"] *= P.count_configs(args.sampled_configs, run_.configs) / max(len(run_.configs), 1)
    engines = len(P.warm_configs(run_.configs, run_.pools))
    est["warmup"] += WARM_REQUEST_S * expected_warm_requests(run_.levels, len(run_.prompts), args.sweep_rounds,
                                                  args.sweep_requests, engines, len(run_.arrivals), args.trace_rounds)
    est["stock_start"] = STOCK_START_S * n_started
    if run_.arrivals:
        est["trace"] = args.trace_rounds * P.count_configs(run_.sweep_spec, run_.configs) * (
            run_.arrivals[-1].offset_s + args.max_tokens / tokens_per_s + 0.25)
    est["total"] = sum(v for k, v in est.items() if k != "total")
    return est
