"""`auto` against the stock-vLLM anchors (and against every other configuration), with paired
bootstrap intervals; and the trace replay's per-configuration table. Pure: samples in, dicts and
Markdown lines out.

Words (with those of `tools.bench.metrics`):
- *anchor*: a stock-vLLM baseline (`tools.bench.anchors`); the *best anchor* is the anchor with the
  highest throughput (lowest mean latency on the trace), the *best other* the same over every
  configuration but auto, anchors and cluster configurations alike.
- *throughput ratio*: auto's over the other's, higher is better for auto. Its statistic is the
  request rate, summed output tokens / summed request latency: at one stream that is the tokens/s
  of the comparison; at a closed-loop level of c streams, throughput = c x that rate while the c
  streams are busy (Little's law), so the ratio is the throughput ratio without a phase's ramp-down
  tail. `wall_ratio` gives the pooled wall-span ratio of the load table beside it.
- *paired bootstrap*: units are requests matched across the two configurations: at one stream by
  prompt (repeats summed), at a load level by (round, prompt, occurrence), every configuration
  getting the same prompts in a round, on the trace by (round, arrival index). A draw resamples
  units with replacement, the same units for both, and recomputes the ratio; the 95% interval is
  the 2.5 and 97.5% quantiles of BOOTSTRAP_RESAMPLES draws, seeded.
- *rounds as clusters*: under load and on the trace each configuration runs its own phase of a
  round, and a machine's speed moves between minutes, so one phase's requests share a speed.
  A draw takes rounds with replacement, then requests within each drawn round (two-stage), and the
  interval holds the round-to-round spread. At one stream each prompt goes through every
  configuration in turn, seconds apart: the drift is paired out and requests alone are resampled.
- *verdict*: `win` when the interval's lower bound is >= 1, `loss` when its upper bound is < 1, `tie`
  when it holds 1. *target met* (the issue's target): ratio >= 1.00 and lower bound >= 0.97. Latency
  (lower is better) is judged on its inverse (the other's latency / auto's).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

from tools.bench.bootstrap import (BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED, bootstrap_ci, clustered_bootstrap_ci,
                                     clusters_by, paired_rate_ratio)
from tools.bench.metrics import Sample, Slo, group_by, meets_slo, paired_ratios, pooled_rate, round_rates, tpot_s
from tools.bench.plan import AUTO
from tools.bench.stalls import STALL_GAP_S, stall_table, without_stalls
from cluster.percentile import percentile

TARGET_RATIO, TARGET_LOWER = 1.00, 0.97


# -- the statistics -------------------------------------------------------------------------------------------


def classify(ratio: Optional[float], ci: Optional[list[float]], higher_is_better: bool = True) -> dict[str, Any]:
    """win / tie / loss from the interval, and whether the issue's target holds.

    >>> classify(1.04, [1.01, 1.08])["verdict"], classify(1.0, [0.98, 1.03]), classify(0.9, [0.85, 0.95])["verdict"]
    ('win', {'verdict': 'tie', 'target_met': True}, 'loss')
    >>> classify(1.2, [1.0, 1.5], higher_is_better=False)  # latency 20% above the other's
    {'verdict': 'tie', 'target_met': False}
    """
    if ratio is None or not math.isfinite(ratio) or ratio <= 0:
        return {"verdict": None, "target_met": None}
    if not higher_is_better:  # judge the inverse: the other's latency over auto's
        ratio = 1.0 / ratio
        ci = None if ci is None or min(ci) <= 0 else [1.0 / ci[1], 1.0 / ci[0]]
    if ci is None:
        return {"verdict": None, "target_met": None}
    verdict = "win" if ci[0] >= 1.0 else "loss" if ci[1] < 1.0 else "tie"
    return {"verdict": verdict, "target_met": ratio >= TARGET_RATIO and ci[0] >= TARGET_LOWER}


def request_rate(samples: list[Sample]) -> float:
    ok = [s for s in samples if s.ok]
    lat = sum(s.latency_s or 0.0 for s in ok)
    return sum(s.output_tokens for s in ok) / lat if lat > 0 else math.nan


def _unit_rates(samples: list[Sample], key: Callable[[Sample], Any]) -> dict[Any, tuple[float, float]]:
    """unit -> (tokens, latency) of its successful samples (summed)."""
    out: dict[Any, tuple[float, float]] = {}
    for s in samples:
        if s.ok and s.latency_s:
            unit = key(s)
            tokens, latency = out.get(unit, (0.0, 0.0))
            out[unit] = (tokens + s.output_tokens, latency + s.latency_s)
    return out


def paired_units(a: list[Sample], b: list[Sample],
                 key: Callable[[Sample], Any]) -> tuple[list[Any], list[tuple[float, ...]]]:
    """The keys present (and successful) on both sides, and per key (tokens a, latency a, tokens b,
    latency b)."""
    ta, tb = _unit_rates(a, key), _unit_rates(b, key)
    keys = [k for k in sorted(ta, key=repr) if k in tb]
    return keys, [(*ta[k], *tb[k]) for k in keys]


def occurrence_keys(samples: list[Sample]) -> dict[int, tuple]:
    """id(sample) -> (round, prompt, n-th occurrence of that prompt in its configuration's phase of
    the round, by start time): a closed-loop phase may send a prompt more than once."""
    out, seen = {}, {}
    for s in sorted(samples, key=lambda s: (s.repeat, s.start_s)):
        n = seen.get((s.config, s.repeat, s.prompt_id), 0)
        seen[(s.config, s.repeat, s.prompt_id)] = n + 1
        out[id(s)] = (s.repeat, s.prompt_id, n)
    return out


def throughput_ratio(auto: list[Sample], other: list[Sample], key: Callable[[Sample], Any],
                     wall: bool, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED,
                     round_of: Optional[Callable[[Any], Any]] = None) -> dict[str, Any]:
    """auto over one other configuration: ratio of request rates on the paired units, its interval
    (rounds as clusters when `round_of` maps a unit's key to its round), the per-round ratios (wall
    spans at a load level, summed latency at one stream) and the verdict."""
    keys, units = paired_units(auto, other, key)
    ratio = paired_rate_ratio(units, list(range(len(units)))) if units else math.nan
    ci = clustered_bootstrap_ci(clusters_by(keys, round_of), lambda idx: paired_rate_ratio(units, idx), resamples, seed)
    ra, rb = round_rates(auto, wall=wall), round_rates(other, wall=wall)
    row = {"ratio": ratio, "ci95": ci, "units": len(units), "round_ratios": paired_ratios(ra, rb),
           **classify(ratio, ci)}
    if wall:
        b = pooled_rate(rb)
        row["wall_ratio"] = pooled_rate(ra) / b if b and math.isfinite(b) else math.nan
    return row


# -- the verdicts -----------------------------------------------------------------------------------------------


def _best(scores: dict[str, float], higher: bool = True) -> Optional[str]:
    finite = {c: v for c, v in scores.items() if v is not None and math.isfinite(v)}
    if not finite:
        return None
    return (max if higher else min)(finite, key=finite.get)


def _against(by_cfg: dict[str, list[Sample]], anchors: list[str], score: Callable[[list[Sample]], float],
             judge: Callable[[list[Sample], list[Sample]], dict], higher: bool = True) -> dict[str, Any]:
    """auto judged against the best anchor and the best other configuration (None where absent)."""
    scores = {c: score(g) for c, g in by_cfg.items() if c != AUTO}
    out: dict[str, Any] = {"auto": score(by_cfg[AUTO])}
    for label, pool in (("vs_best_anchor", [c for c in scores if c in anchors]), ("vs_best_other", list(scores))):
        best = _best({c: scores[c] for c in pool}, higher)
        out[label] = None if best is None else {"config": best, "value": scores[best],
                                                **judge(by_cfg[AUTO], by_cfg[best])}
    return out


def hindsight_choice(by_cfg: dict[str, list[Sample]], anchors: list[str], key: Callable[[Sample], Any],
                     resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED) -> Optional[dict[str, Any]]:
    """The anchors chosen per prompt in hindsight: each prompt served by the anchor that was fastest
    on it. Its rate over the best single anchor's is the most any per-request choice among those
    engines could gain on these prompts (a router that knew each answer's speed in advance); auto
    over it shows how much of that auto took. None with fewer than two anchors present.

    >>> from tools.bench.metrics import Sample
    >>> def s(cfg, pid, lat): return Sample("compare", cfg, pid, "c", "t", 0.0, 1, latency_s=lat, token_ids=[1] * 10)
    >>> by = {"auto": [s("auto", "a", 1.0), s("auto", "b", 1.0)], "x": [s("x", "a", 1.0), s("x", "b", 2.0)],
    ...       "y": [s("y", "a", 2.0), s("y", "b", 1.0)]}
    >>> h = hindsight_choice(by, ["x", "y"], lambda s: s.prompt_id, resamples=50)
    >>> h["best_anchor"], round(h["ratio"], 3), round(h["auto_ratio"], 3)   # 20 tokens in 2 s, not 3 s
    ('x', 1.5, 1.0)
    """
    present = [a for a in anchors if by_cfg.get(a)]
    if len(present) < 2 or AUTO not in by_cfg:
        return None
    best = _best({a: request_rate(by_cfg[a]) for a in present})
    tables = {a: _unit_rates(by_cfg[a], key) for a in present + [AUTO]}
    shared = sorted(set.intersection(*(set(t) for t in tables.values())), key=repr)
    if len(shared) < 2:
        return None
    pick = [min((tables[a][k] for a in present), key=lambda tl: tl[1] / tl[0] if tl[0] else math.inf) for k in shared]
    versus_best = [(*pick[i], *tables[best][k]) for i, k in enumerate(shared)]
    auto_versus = [(*tables[AUTO][k], *pick[i]) for i, k in enumerate(shared)]
    picked = {a: sum(1 for i, k in enumerate(shared) if tables[a][k] is pick[i]) for a in present}
    return {"best_anchor": best, "units": len(shared), "picked": picked,
            "ratio": paired_rate_ratio(versus_best, list(range(len(shared)))),
            "ci95": bootstrap_ci(len(shared), lambda idx: paired_rate_ratio(versus_best, idx), resamples, seed),
            "auto_ratio": paired_rate_ratio(auto_versus, list(range(len(shared)))),
            "auto_ci95": bootstrap_ci(len(shared), lambda idx: paired_rate_ratio(auto_versus, idx), resamples, seed)}


def _one_stream_judge(resamples: int, seed: int) -> Callable[[list[Sample], list[Sample]], dict[str, Any]]:
    """auto against another configuration at one stream: the throughput ratio paired by prompt."""
    return lambda a, b: throughput_ratio(a, b, lambda s: s.prompt_id, wall=False, resamples=resamples, seed=seed)


def _by_task(compare: list[Sample], anchors: list[str], resamples: int, seed: int) -> dict[str, Any]:
    """Per task, auto against the anchor that is best on that task (n-gram on one, suffix on another)."""
    out = {}
    for task, group in sorted(group_by(compare, lambda s: s.task).items()):
        cfgs = group_by(group, lambda s: s.config)
        if AUTO in cfgs and len(cfgs) > 1:
            out[task] = _against(cfgs, anchors, request_rate, _one_stream_judge(resamples, seed))
    return out


def anchor_verdicts(samples: list[Sample], anchors: list[str], resamples: int = BOOTSTRAP_RESAMPLES,
                    seed: int = BOOTSTRAP_SEED) -> dict[str, Any]:
    """{"one_stream": ..., "load": {streams: ...}}: auto's throughput against the best anchor and the
    best other configuration. One stream: the greedy comparison, paired by prompt. A level: the
    sweep's phases at that many streams, paired by (round, prompt, occurrence), rounds as clusters;
    the best is chosen by the pooled wall-span throughput of the load table."""
    out: dict[str, Any] = {}
    compare = [s for s in samples if s.phase == "compare" and s.temperature == 0]
    by_cfg = group_by(compare, lambda s: s.config)
    if AUTO in by_cfg and len(by_cfg) > 1:
        judge = _one_stream_judge(resamples, seed)
        out["one_stream"] = _against(by_cfg, anchors, request_rate, judge)
        stalls = stall_table(compare)
        calm_samples = [without_stalls(s) for s in compare] if any(r["stalled"] for r in stalls.values()) else None
        if calm_samples is not None:
            calm = group_by(calm_samples, lambda s: s.config)
            out["one_stream"]["stalls"] = stalls
            out["one_stream"]["without_stalls"] = _against(calm, anchors, request_rate, judge)
            out["one_stream"]["without_stalls"]["hindsight"] = hindsight_choice(
                calm, anchors, lambda s: s.prompt_id, resamples, seed)
        hindsight = hindsight_choice(by_cfg, anchors, lambda s: s.prompt_id, resamples, seed)
        if hindsight is not None:
            out["one_stream"]["hindsight"] = hindsight
        # Per task: the anchor that is best on that task may differ (n-gram on one, suffix on another).
        by_task = _by_task(compare, anchors, resamples, seed)
        if len(by_task) > 1:
            out["one_stream_by_task"] = by_task
            if calm_samples is not None:
                out["one_stream_by_task_without_stalls"] = _by_task(calm_samples, anchors, resamples, seed)
    load = {}
    for c, level in sorted(group_by([s for s in samples if s.phase == "sweep"], lambda s: s.concurrency).items()):
        by_cfg = group_by(level, lambda s: s.config)
        if AUTO not in by_cfg or len(by_cfg) < 2:
            continue
        keys = occurrence_keys(level)
        load[str(c)] = _against(by_cfg, anchors, lambda g: pooled_rate(round_rates(g, wall=True)),
                                lambda a, b: throughput_ratio(a, b, lambda s: keys[id(s)], wall=True,
                                                              resamples=resamples, seed=seed,
                                                              round_of=lambda k: k[0]))
    if load:
        out["load"] = load
    return out


def trace_numbers(group: list[Sample], slo: Slo, span_s: Optional[float] = None) -> dict[str, Any]:
    """Throughput over the span (output tokens / (last end - first start), or the given span),
    latency, TTFT and TPOT of the successful requests, goodput (requests meeting every SLO per s)."""
    ok = [s for s in group if s.ok]
    if span_s is None:
        span_s = (max(s.end_s for s in group) - min(s.start_s for s in group)) if group else 0.0
    lat = [s.latency_s for s in ok if s.latency_s is not None]
    ttft = [s.ttft_s for s in ok if s.ttft_s is not None]
    tpot = [t for s in ok if (t := tpot_s(s)) is not None]
    good = sum(1 for s in ok if meets_slo(s, slo))
    tokens = sum(s.output_tokens for s in ok)
    mean = lambda xs: sum(xs) / len(xs) if xs else math.nan  # noqa: E731
    return {"requests": len(group), "failures": len(group) - len(ok), "output_tokens": tokens, "span_s": span_s,
            "throughput_tokens_per_s": tokens / span_s if span_s > 0 else math.nan, "good_requests": good,
            "goodput_requests_per_s": good / span_s if span_s > 0 else math.nan,
            "latency_mean_s": mean(lat), "latency_p50_s": percentile(lat, 50), "latency_p99_s": percentile(lat, 99),
            "ttft_mean_s": mean(ttft), "ttft_p99_s": percentile(ttft, 99), "tpot_mean_s": mean(tpot)}


def trace_table(samples: list[Sample], slo: Slo = Slo()) -> dict[str, Any]:
    """config -> trace_numbers pooled over the rounds (span = summed round spans) with `rounds`."""
    out = {}
    for cfg, group in group_by(samples, lambda s: s.config).items():
        rounds = [{"round": r, **trace_numbers(g, slo)} for r, g in sorted(group_by(group, lambda s: s.repeat).items())]
        out[cfg] = {**trace_numbers(group, slo, span_s=sum(r["span_s"] for r in rounds)), "rounds": rounds}
    return out


def latency_ratio(auto: list[Sample], other: list[Sample], resamples: int = BOOTSTRAP_RESAMPLES,
                  seed: int = BOOTSTRAP_SEED) -> dict[str, Any]:
    """auto's mean latency / the other's, and p99 / p99, over arrivals both served in the same round;
    paired bootstrap over (round, arrival index), rounds as clusters."""
    def by_arrival(samples: list[Sample]) -> dict[tuple, float]:
        return {(s.repeat, s.arrival): s.latency_s for s in samples if s.ok and s.latency_s is not None}

    a, b = by_arrival(auto), by_arrival(other)
    keys = sorted(set(a) & set(b), key=repr)
    rows = [(a[k], b[k]) for k in keys]
    clusters = clusters_by(keys, lambda k: k[0])

    def mean_ratio(idx: list[int]) -> float:
        sb = sum(rows[i][1] for i in idx)
        return sum(rows[i][0] for i in idx) / sb if sb > 0 else math.nan

    def p99_ratio(idx: list[int]) -> float:
        pb = percentile([rows[i][1] for i in idx], 99)
        return percentile([rows[i][0] for i in idx], 99) / pb if pb > 0 else math.nan

    everything = list(range(len(rows)))
    ratio = mean_ratio(everything) if rows else math.nan
    ci = clustered_bootstrap_ci(clusters, mean_ratio, resamples, seed)
    p99 = p99_ratio(everything) if rows else math.nan
    return {"ratio": ratio, "ci95": ci, "arrivals": len({k[1] for k in keys}), "units": len(rows),
            **classify(ratio, ci, higher_is_better=False),
            "p99_ratio": p99, "p99_ci95": clustered_bootstrap_ci(clusters, p99_ratio, resamples, seed + 1)}


def trace_verdict(samples: list[Sample], anchors: list[str], resamples: int = BOOTSTRAP_RESAMPLES,
                  seed: int = BOOTSTRAP_SEED) -> Optional[dict[str, Any]]:
    """auto's mean latency (and p99) on the trace against the best anchor and the best other
    configuration (the lowest mean latency)."""
    by_cfg = group_by(samples, lambda s: s.config)
    if AUTO not in by_cfg or len(by_cfg) < 2:
        return None
    return _against(by_cfg, anchors, lambda g: trace_numbers(g, Slo())["latency_mean_s"],
                    lambda a, b: latency_ratio(a, b, resamples, seed), higher=False)


def round_orders(samples: list[Sample]) -> list[list[str]]:
    """Per round (the samples' `repeat`), the configurations in the order their first request started."""
    out = []
    for _, group in sorted(group_by(samples, lambda s: s.repeat).items()):
        starts = {cfg: min(s.start_s for s in g) for cfg, g in group_by(group, lambda s: s.config).items()}
        out.append(sorted(starts, key=starts.get))
    return out


def resent_arrivals(samples: list[Sample]) -> int:
    """Trace arrivals (of one configuration, the first by name) whose prompt an earlier round sent.

    >>> S = lambda c, r, p: Sample("trace", c, p, "qa", "qa", 0.0, 0, repeat=r)
    >>> resent_arrivals([S("a", 0, "x"), S("a", 0, "y"), S("a", 1, "z"), S("a", 1, "x"), S("b", 1, "y")])
    1
    """
    if not samples:
        return 0
    first = min(s.config for s in samples)
    seen: dict[str, int] = {}
    for s in samples:
        if s.config == first:
            seen[s.prompt_id] = min(seen.get(s.prompt_id, s.repeat), s.repeat)
    return sum(1 for s in samples if s.config == first and seen[s.prompt_id] < s.repeat)


def add_verdicts(summary: dict[str, Any], samples: list[Sample], slo: Slo, anchors: list[str]) -> None:
    """Put the trace table and the verdicts against the anchors into a built summary."""
    trace = [s for s in samples if s.phase == "trace"]
    if trace:
        summary["trace"] = {"configs": trace_table(trace, slo), "verdict": trace_verdict(trace, anchors),
                            "order": round_orders(trace), "resent": resent_arrivals(trace)}
    verdicts = anchor_verdicts(samples, anchors)
    if verdicts:
        summary["anchor_verdicts"] = verdicts


# -- Markdown --------------------------------------------------------------------------------------------------


def _f(x: Any, digits: int = 3) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{digits}f}"


def _ms(x: Any) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x * 1000:.0f}"


def _ci(ci: Optional[list[float]]) -> str:
    return "-" if not ci else f"{ci[0]:.3f}-{ci[1]:.3f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return (["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
            + ["| " + " | ".join(r) + " |" for r in rows] + [""])


def _verdict_row(phase: str, auto: Any, side: Optional[dict], latency: bool = False) -> list[str]:
    if side is None:
        return [phase, "-", "-", "-", "-", "-", "-", "-"]
    per_round = " / ".join(_f(x) for x in side.get("round_ratios") or []) or "-"
    value = _ms if latency else (lambda x: _f(x, 2))
    return [phase, value(auto), f"`{side['config']}` {value(side['value'])}", _f(side["ratio"]),
            _ci(side["ci95"]), per_round if not latency else f"p99 {_f(side['p99_ratio'])} ({_ci(side['p99_ci95'])})",
            str(side["verdict"] or "-"), {True: "yes", False: "**no**", None: "-"}[side["target_met"]]]


def _stall_lines(one: dict[str, Any], sides: list[tuple[str, str]], header: list[str]) -> list[str]:
    """The one-stream stalls per configuration and auto's ratios with them taken out ([] if none)."""
    stalls, calm = one.get("stalls"), one.get("without_stalls")
    if not stalls or not calm:
        return []
    per = "; ".join(f"`{c}` {r['stalled']} of {r['requests']} requests, {_f(r['lost_s'], 1)} s "
                    f"({_f(100 * r['share'], 1)}% of its latency)" for c, r in stalls.items())
    rows = [_verdict_row(f"1 stream, {label}", calm["auto"], calm[key]) for label, key in sides]
    h = calm.get("hindsight")
    tail = [f"Without stalls, the anchors chosen per prompt in hindsight: {_f(h['ratio'])} ({_ci(h['ci95'])}) of "
            f"`{h['best_anchor']}`; auto / that choice {_f(h['auto_ratio'])} ({_ci(h['auto_ci95'])}).", ""] if h else []
    return [f"Stalls (an inter-chunk gap above {STALL_GAP_S} s, less the request's usual gap; "
            f"`tools.bench.stalls`): {per}. The same comparison with every configuration's stall time "
            "taken out of its latency:", ""] + _table(header, rows) + tail


def render_lines(summary: dict[str, Any]) -> list[str]:
    """The report's sections on the anchors and the trace ([] when the run had neither)."""
    lines: list[str] = []
    v = summary.get("anchor_verdicts") or {}
    trace = summary.get("trace")
    anchors = summary.get("anchors") or []
    if v or (trace and trace.get("verdict")):
        lines += ["## `auto` against the stock-vLLM anchors and every other configuration", "",
                  f"Anchors: {', '.join(f'`{a}`' for a in anchors) or 'none'}. Ratio = auto / "
                  "the other (throughput: summed tokens / summed request latency over requests paired by prompt; "
                  "trace: mean latency over arrivals paired by index, lower is better); 95% paired bootstrap "
                  f"interval over {BOOTSTRAP_RESAMPLES} draws (under load and on the trace, rounds first and "
                  "requests within them, so the interval holds the machine's drift between phases); win = interval above 1, loss = below, tie = holds 1; "
                  f"target: ratio >= {TARGET_RATIO:.2f} with lower bound >= {TARGET_LOWER} (latency: its inverse).", ""]
        header = ["phase", "auto", "against", "ratio", "95% CI", "per round (wall) / p99", "verdict", "target met"]
        sides = [("best anchor", "vs_best_anchor")] * bool(anchors) + [("best of all other configurations",
                                                                       "vs_best_other")]
        for label, key in sides:
            rows = []
            if v.get("one_stream"):
                rows.append(_verdict_row("1 stream", v["one_stream"]["auto"], v["one_stream"][key]))
            for c, lv in (v.get("load") or {}).items():
                row = _verdict_row(f"{c} streams", lv["auto"], lv[key])
                if lv[key] and lv[key].get("wall_ratio") is not None:
                    row[3] += f" (wall {_f(lv[key]['wall_ratio'])})"
                rows.append(row)
            if trace and trace.get("verdict"):
                tv = trace["verdict"]
                rows.append(_verdict_row("trace (mean latency ms)", tv["auto"], tv[key], latency=True))
            lines += [f"Against the {label}:", ""] + _table(header, rows)
        lines += _stall_lines(v.get("one_stream") or {}, sides, header)
        h = (v.get("one_stream") or {}).get("hindsight")
        if h:
            picks = ", ".join(f"`{a}` {n}" for a, n in h["picked"].items())
            lines += [f"The anchors chosen per prompt in hindsight (the fastest on each of {h['units']} prompts: {picks}): "
                      f"{_f(h['ratio'])} ({_ci(h['ci95'])}) of the best single anchor `{h['best_anchor']}`, the most a "
                      f"per-request choice among them could gain here; auto / that choice {_f(h['auto_ratio'])} "
                      f"({_ci(h['auto_ci95'])}).", ""]
        for key, what in (("one_stream_by_task", ""), ("one_stream_by_task_without_stalls", ", stalls taken out")):
            by_task = v.get(key) or {}
            if by_task and anchors:
                lines += [f"One stream per task, against the anchor that is best on that task{what}:", ""] + _table(
                    ["task"] + header[1:], [[f"`{t}`"] + _verdict_row("", tv["auto"], tv["vs_best_anchor"])[1:]
                                            for t, tv in by_task.items()])
    if trace:
        lines += ["## Trace replay (open loop, the same arrival schedule for every configuration)", ""]
        shape = trace.get("schedule") or {}
        if shape:
            lines += [f"Schedule: {shape.get('source', '')}; {shape.get('arrivals')} arrivals over "
                      f"{_f(shape.get('span_s'), 1)} s (mean {_f(shape.get('mean_rate_rps'))} req/s). Round orders: "
                      + " ".join(f"[{', '.join(o)}]" for o in trace.get("order") or []), ""]
        header = ["config", "requests", "failures", "throughput tok/s", "per round", "goodput req/s", "lat mean",
                  "lat p50", "lat p99", "TTFT mean", "TTFT p99", "TPOT mean"]
        rows = [[cfg, str(r["requests"]), str(r["failures"]), _f(r["throughput_tokens_per_s"], 2),
                 " / ".join(_f(x["throughput_tokens_per_s"], 1) for x in r["rounds"]), _f(r["goodput_requests_per_s"]),
                 _ms(r["latency_mean_s"]), _ms(r["latency_p50_s"]), _ms(r["latency_p99_s"]), _ms(r["ttft_mean_s"]),
                 _ms(r["ttft_p99_s"]), _ms(r["tpot_mean_s"])] for cfg, r in trace["configs"].items()]
        lines += ["Times in ms; throughput = output tokens / summed round spans (first send to last end); goodput = "
                  "requests meeting every given SLO per second.", ""] + _table(header, rows)
        if trace.get("resent"):
            lines += ["", f"**{trace['resent']} arrivals of later rounds resend a prompt of an earlier round** (too few "
                      "prompts for every round's own): a server that remembers answers across requests (stock "
                      "suffix decoding) drafts those from memory, so compare it on the first round only."]
    return lines
