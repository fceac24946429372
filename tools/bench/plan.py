"""What a benchmark run will do, decided before it starts: configurations, order and a time estimate.

Pure functions only. A *configuration* is what the bench asks of the router per request:
`none` (no speculation), `<mode>:<k>` (fixed mode and K), `<mode>` (fixed mode, the router picks K)
or `auto` (no override: the adaptive router decides). The default list is discovered from
`GET /v1/models` (`specserve.pools[*].modes` and `max_k`): none, every mode at every K, auto.
Order is interleaved (each prompt runs every configuration back to back, rotated from prompt to
prompt and repeat to repeat) so that drift on a noisy machine does not favour one configuration.
The load sweep interleaves too, in rounds of short phases (`sweep_round_orders`): a phase-per-
configuration sweep measured machine drift between phases (+21% for the same configuration
between two runs), larger than the 3% the router's load target asks to resolve.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

AUTO = "auto"
NONE = "none"
BEST = "best"  # in --sweep-configs: each mode at its fastest K of the greedy comparison
ALL = "all"  # in --sampled-configs / --sweep-configs: the greedy comparison's list
STOCK = "stock"  # in --sweep-configs: every stock-vLLM baseline (`tools.bench.anchors`)


@dataclass(frozen=True)
class BenchConfig:
    name: str
    mode: Optional[str]  # None: no override (auto)
    k: Optional[int]  # None: the router picks K
    # A stock-vLLM server (`tools.bench.anchors`), not the cluster: plain OpenAI requests, its own URL.
    baseline: bool = False

    def speculative(self) -> Optional[dict]:
        """The `specserve.speculative` override of the request body (None for auto and baselines)."""
        if self.mode is None or self.baseline:
            return None
        if self.mode == NONE:
            return {"mode": NONE}
        return {"mode": self.mode} if self.k is None else {"mode": self.mode, "k": self.k}

    @property
    def is_speculative(self) -> bool:
        """A cluster configuration with a fixed speculative mode (baselines are not: their mode is vLLM's)."""
        return not self.baseline and self.mode not in (None, NONE) and self.k != 0


def baseline_config(name: str) -> BenchConfig:
    """The configuration of a stock-vLLM baseline called `name`."""
    return BenchConfig(name, None, None, baseline=True)


def mode_max_k(pools: list[dict], by_mode: bool = False) -> dict[str, int]:
    """mode -> the largest K any pool serves it with (0 for none), from /v1/models pools: the pool's
    `max_k`, or with `by_mode` its `max_k_by_mode` entry where it lists one (a suffix pool drafts up
    to 16 though its `max_k` is 6: what the server accepts; the default configuration lists stay at
    `max_k`)."""
    out: dict[str, int] = {}
    for pool in pools:
        modes = pool.get("modes") or [pool.get("method", NONE)]
        by = (pool.get("max_k_by_mode") or {}) if by_mode else {}
        for mode in modes:
            k = 0 if mode == NONE else int(by.get(mode) or pool.get("max_k") or 0)
            out[mode] = max(out.get(mode, 0), k)
    return out


def discover_configs(pools: list[dict]) -> list[BenchConfig]:
    """none, each speculative mode at each K 1..max_k (modes in pool order), auto."""
    max_k = mode_max_k(pools)
    configs = [BenchConfig(NONE, NONE, 0)]
    for mode, kmax in max_k.items():
        if mode != NONE:
            configs += [BenchConfig(f"{mode}:{k}", mode, k) for k in range(1, kmax + 1)]
    return configs + [BenchConfig(AUTO, None, None)]


def parse_config(token: str, max_k: Optional[dict[str, int]] = None) -> list[BenchConfig]:
    """One item of --configs: none | auto | MODE | MODE:K | MODE:* (all K of that mode).

    >>> parse_config("ngram:3")
    [BenchConfig(name='ngram:3', mode='ngram', k=3, baseline=False)]
    """
    token = token.strip()
    if token == AUTO:
        return [BenchConfig(AUTO, None, None)]
    if token == NONE or token == f"{NONE}:0":
        return [BenchConfig(NONE, NONE, 0)]
    mode, _, k = token.partition(":")
    if not mode or (max_k is not None and mode not in max_k):
        served = ", ".join(sorted(max_k or {}))
        raise ValueError(f"--configs: unknown mode in {token!r}" + (f"; served modes: {served}" if max_k else ""))
    if not k:
        return [BenchConfig(mode, mode, None)]
    if k == "*":
        if max_k is None:
            raise ValueError(f"--configs: {token!r} needs the server's pools to know the largest K")
        return [BenchConfig(f"{mode}:{i}", mode, i) for i in range(1, max_k[mode] + 1)]
    if not k.isdigit():
        raise ValueError(f"--configs: K must be a number or * in {token!r}")
    if int(k) == 0:
        return [BenchConfig(NONE, NONE, 0)]
    if max_k is not None and int(k) > max_k[mode]:
        raise ValueError(f"--configs: {token!r} exceeds the largest K ({max_k[mode]}) served for {mode}")
    return [BenchConfig(f"{mode}:{int(k)}", mode, int(k))]


def parse_configs(spec: str, max_k: Optional[dict[str, int]] = None) -> list[BenchConfig]:
    """Comma-separated --configs list -> configurations, duplicates dropped, order kept."""
    out: list[BenchConfig] = []
    for token in spec.split(","):
        if token.strip():
            out += [c for c in parse_config(token, max_k) if c not in out]
    if not out:
        raise ValueError("--configs: empty list")
    return out


def expand_configs(spec: str, greedy_configs: list[BenchConfig], best: dict[str, str],
                   max_k: Optional[dict[str, int]]) -> list[BenchConfig]:
    """A config list that may name 'best' (each mode's fastest greedy K), 'all' (the greedy list),
    'stock' (every baseline of the greedy list) or a baseline by its name; order kept, no duplicates.

    >>> cfgs = [BenchConfig(NONE, NONE, 0), BenchConfig("ngram:2", "ngram", 2), baseline_config("stock-none")]
    >>> [c.name for c in expand_configs("none,best,stock", cfgs, {"ngram": "ngram:2"}, {"ngram": 6})]
    ['none', 'ngram:2', 'stock-none']
    """
    by_name = {c.name: c for c in greedy_configs}
    out: list[BenchConfig] = []
    for token in (t.strip() for t in spec.split(",")):
        if token == BEST:
            picked = [by_name[name] for name in best.values()]
        elif token == ALL:
            picked = list(greedy_configs)
        elif token == STOCK:
            picked = [c for c in greedy_configs if c.baseline]
        elif token in by_name:
            picked = [by_name[token]]
        elif token:
            picked = parse_config(token, max_k)
        else:
            picked = []
        out += [c for c in picked if c not in out]
    return out


def count_configs(spec: str, greedy_configs: list[BenchConfig]) -> int:
    """Configurations a list will hold once 'best' is known (for the estimate)."""
    modes = {c.mode for c in greedy_configs if c.is_speculative and c.k is not None}
    n = 0
    for token in (t.strip() for t in spec.split(",") if t.strip()):
        n += (len(modes) if token == BEST else len(greedy_configs) if token == ALL
              else sum(c.baseline for c in greedy_configs) if token == STOCK else 1)
    return n


def warm_configs(configs: list[BenchConfig], pools: list[dict]) -> list[BenchConfig]:
    """One configuration per engine that `configs` can reach, for the 1-token warm-up of a phase's
    prompts (prefix caching: a configuration must not get a prefill for free because another one ran
    the same prompt first on the same engine, so every engine sees every prompt once beforehand).

    Each baseline is its own engine. A cluster pool (from /v1/models: name, method, modes, auto) is
    reached by `auto` unless the pool opts out of it (`auto: false`), and by every configuration
    whose mode it serves, and warmed through its own method (a mode no other pool's method is).
    Without pools listed, one configuration per mode used. A pool with several replicas is warmed on
    one of them only (whichever the router picks).

    >>> pools = [{"name": "ngram", "method": "ngram", "modes": ["ngram", "none"]},
    ...          {"name": "draft", "method": "eagle", "modes": ["eagle", "none"], "auto": False}]
    >>> [c.name for c in warm_configs([BenchConfig(NONE, NONE, 0), baseline_config("stock-none")], pools)]
    ['warm:ngram', 'warm:draft', 'stock-none']
    >>> [c.name for c in warm_configs([BenchConfig("ngram:3", "ngram", 3)], pools)]
    ['warm:ngram']
    >>> [c.name for c in warm_configs([BenchConfig("auto", None, None)], pools)]
    ['warm:ngram']
    """
    cluster = [c for c in configs if not c.baseline]
    out: list[BenchConfig] = []
    if pools:
        for pool in pools:
            modes = pool.get("modes") or [pool.get("method", NONE)]
            if any((c.mode is None and pool.get("auto", True)) or c.mode in modes for c in cluster):
                method = pool.get("method") or modes[0]
                out.append(BenchConfig(f"warm:{pool.get('name', method)}", method, 0 if method == NONE else None))
    else:
        for c in cluster:
            if c.mode is not None and all(w.mode != c.mode for w in out):
                out.append(BenchConfig(f"warm:{c.mode}", c.mode, 0 if c.mode == NONE else None))
    return out + [c for c in configs if c.baseline]


def quick_configs(pools: list[dict]) -> list[BenchConfig]:
    """The --quick subset: none, each speculative mode at a middle K (ceil(max_k / 2)), auto."""
    configs = [BenchConfig(NONE, NONE, 0)]
    for mode, kmax in mode_max_k(pools).items():
        if mode != NONE and kmax > 0:
            k = max(1, math.ceil(kmax / 2))
            configs.append(BenchConfig(f"{mode}:{k}", mode, k))
    return configs + [BenchConfig(AUTO, None, None)]


def interleaved_order(n_configs: int, n_prompts: int, repeats: int) -> list[tuple[int, int, int]]:
    """(repeat, prompt index, config index) in run order.

    Each prompt runs every configuration back to back; the configuration order is rotated by one
    per prompt and per repeat, so every configuration runs first, second, ... equally often
    over n_configs consecutive prompts, and it runs backwards on every other prompt, so a
    configuration does not always follow the same one (with a fixed cycle `ngram:5` always ran
    right after `ngram:4`, and a predecessor effect could not be ruled out).
    """
    order = []
    for r in range(repeats):
        for p in range(n_prompts):
            j = p + r
            shift = j % n_configs if n_configs else 0
            step = -1 if j % 2 else 1
            order += [(r, p, (shift + step * i) % n_configs) for i in range(n_configs)]
    return order


def rotated(items: list, shift: int) -> list:
    if not items:
        return []
    shift %= len(items)
    return items[shift:] + items[:shift]


def sweep_requests(concurrency: int, n_prompts: int, min_per_stream: int = 2,
                   per_phase: Optional[int] = None) -> int:
    """Requests of one sweep phase (one configuration, one round) at one concurrency level:
    `per_phase` (default: the number of prompts), but at least `min_per_stream` per stream."""
    return max(per_phase or n_prompts, min_per_stream * concurrency)


def sweep_starts(levels: list[int], n_prompts: int, rounds: int, per_phase: Optional[int] = None) -> list[int]:
    """Where in the load prompts each load level's rounds start, and (last) where the trace's do: one
    level after another, so no phase of a run resends a prompt an earlier phase sent while the
    prompts last (a stock suffix server remembers its answers across requests and phases).

    >>> sweep_starts([1, 4, 16], 10, 3)   # 10 a phase at 4 streams, 32 at 16; the trace from 126
    [0, 30, 126]
    >>> sweep_starts([1], 10, 3)
    [0]
    """
    starts = [0]
    for c in (c for c in levels if c > 1):
        starts.append(starts[-1] + sweep_requests(c, n_prompts, per_phase=per_phase) * rounds)
    return starts


def sweep_round_orders(n_configs: int, rounds: int, shift: int = 0) -> list[list[int]]:
    """Configuration indices of each round of one load level, in run order.

    Round r runs the list rotated by `shift + r // 2`, reversed in odd rounds (ABC, CBA, BCA, ACB,
    CAB, BAC for three): in every pair of rounds each configuration's two positions add up to
    n_configs - 1, so a drift linear in time cancels pair by pair, and no configuration always
    runs first or last. Three configurations over six rounds run all six orders. `shift` (the
    level's index) starts each level with another configuration.
    """
    if n_configs <= 0:
        return [[] for _ in range(max(rounds, 0))]
    orders = []
    for r in range(max(rounds, 0)):
        order = rotated(list(range(n_configs)), shift + r // 2)
        orders.append(order[::-1] if r % 2 else order)
    return orders


def order_drift(n_configs: int, rounds: int, shift: int = 0) -> list[float]:
    """Each configuration's mean position (0 = first) over the rounds of `sweep_round_orders`, less
    the middle (n_configs - 1) / 2: all zero where the orders cancel a drift linear in time. An odd
    number of rounds leaves its last round unpaired, and a slowing machine then favours the
    configurations that round runs early (the sign of the entry: negative runs earlier).

    >>> order_drift(4, 4), order_drift(4, 3)  # auto (index 0) first, last, last: 2.0 against 1.5
    ([0.0, 0.0, 0.0, 0.0], [0.5, -0.5, -0.167, 0.167])
    """
    orders = sweep_round_orders(n_configs, rounds, shift)
    if not orders or n_configs <= 0:
        return [0.0] * max(n_configs, 0)
    mid = (n_configs - 1) / 2.0
    return [round(sum(o.index(i) for o in orders) / len(orders) - mid, 3) for i in range(n_configs)]


def aggregate_tokens_per_s(concurrency: int, single_tokens_per_s: float, saturation: float = 0.15) -> float:
    """Assumed aggregate decode rate at `concurrency` streams: c / (1 + saturation * (c - 1)) times
    the single-stream rate (saturates at 1 / saturation times; 0.15 fits the batch-16 throughput measured here)."""
    c = max(concurrency, 1)
    return single_tokens_per_s * c / (1.0 + saturation * (c - 1))


@dataclass(frozen=True)
class PlanShape:
    """The sizes the estimate needs (all counts are of requests)."""

    n_compare_configs: int
    n_prompts: int
    max_tokens: int
    greedy_repeats: int
    sampled_temperatures: int  # how many sampled (temperature > 0) comparison passes
    sampled_repeats: int
    n_sweep_configs: int
    concurrency_levels: tuple[int, ...]
    n_sweep_prompts: int
    poisson_duration_s: float = 0.0  # per sweep configuration; 0: no Poisson phase
    n_warmup_modes: int = 3
    sweep_rounds: int = 1  # every sweep configuration runs once per round at each level
    sweep_requests_per_phase: Optional[int] = None  # None: n_sweep_prompts (see sweep_requests)


def estimate_s(shape: PlanShape, single_tokens_per_s: float, per_request_overhead_s: float = 0.25) -> dict[str, float]:
    """Seconds per phase (and 'total') of a plan, from an assumed single-stream decode rate."""
    tok = shape.max_tokens
    one = tok / single_tokens_per_s + per_request_overhead_s
    phases = {
        "warmup": shape.n_prompts * (one + shape.n_warmup_modes * per_request_overhead_s)
        + shape.n_compare_configs * (8 / single_tokens_per_s + per_request_overhead_s),
        "compare_greedy": shape.n_compare_configs * shape.n_prompts * shape.greedy_repeats * one,
        "compare_sampled": shape.n_compare_configs * shape.n_prompts * shape.sampled_temperatures
        * shape.sampled_repeats * one,
    }
    sweep = 0.0
    for c in shape.concurrency_levels:
        if c <= 1:
            continue  # level 1 is the greedy comparison's data
        n = sweep_requests(c, shape.n_sweep_prompts, per_phase=shape.sweep_requests_per_phase)
        sweep += n * tok / aggregate_tokens_per_s(c, single_tokens_per_s) + per_request_overhead_s * math.ceil(n / c)
    phases["sweep"] = shape.n_sweep_configs * max(shape.sweep_rounds, 1) * sweep
    phases["poisson"] = shape.n_sweep_configs * (shape.poisson_duration_s + (one if shape.poisson_duration_s else 0))
    phases["total"] = sum(phases.values())
    return phases
