"""The router's verdict on a bench summary: auto against the best static configuration per task and
under load, with the selection-unbiased (cross-validated) and bootstrap comparisons beside it (the
verdict against the stock-vLLM anchors is `tools.bench.verdict`'s)."""

from __future__ import annotations

import math
import statistics
from typing import Any, Optional

from tools.bench.bootstrap import BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED, bootstrap_ci, paired_rate_ratio
from tools.bench.metrics import paired_ratios, ratio_spread
from tools.bench.plan import AUTO, NONE

# The router's targets: at one stream at least the best static configuration overall and
# within 5% of the best static one per task; under load at least 0.97 of the better of no speculation
# and the best static speculation at every level.
ROUTER_TASK_TOLERANCE = 0.95
ROUTER_LOAD_TOLERANCE = 0.97


def _load_tput(level: str, r: dict) -> float:
    # level 1 is the interleaved one-stream comparison: per-request rates, not the wall span
    return r["request_tokens_per_s" if level == "1" else "throughput_tokens_per_s"] or 0.0


def _spread_fields(rounds: Optional[list], reference_rounds: Optional[list], target: float) -> dict[str, Any]:
    """Per-round ratios of auto over its reference (paired round by round) and their spread."""
    ratios = paired_ratios(rounds or [], reference_rounds or [])
    return {"round_ratios": ratios, "round_ratio": ratio_spread(ratios, target)}


def _rate(x: Any) -> Optional[float]:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x


def _static(config: str, anchors: frozenset = frozenset()) -> bool:
    """A configuration the router's verdict compares against: a fixed mode and K (or none), not auto,
    not a K that grows within the request (`MODE:K+S`, reported as a row of its own), not a stock anchor."""
    return config != AUTO and "+" not in config and config not in anchors


def cross_validated_best(auto_rounds: Optional[list], static_rounds: dict[str, Optional[list]]) -> dict[str, Any]:
    """`auto` against a best static configuration chosen without looking at the repeat it is judged on.

    The plain verdict takes the maximum over the static configurations measured on the same data it
    judges with; over many configurations close to each other that maximum is biased upwards by the
    noise (winner's curse), so even a router as fast as the truly best one reads below 1. Here, for each
    repeat r, the best static is the one with the highest median tokens/s over the *other* repeats, and
    auto's tokens/s on r is compared with that configuration's on r. `cv_best_static` lists the choice
    per repeat (repeat order), `cv_ratio` = sum_r auto_r / sum_r chosen_r. All None with fewer than two
    repeats (nothing to choose on) or without per-repeat rows (`rounds`, summaries of older runs)."""
    none = {"cv_best_static": None, "cv_ratio": None, "cv_rounds": None}
    auto = {r["round"]: _rate(r.get("tokens_per_s")) for r in auto_rounds or []}
    auto = {k: v for k, v in auto.items() if v is not None}
    static = {c: {r["round"]: _rate(r.get("tokens_per_s")) for r in rs or []} for c, rs in static_rounds.items()}
    static = {c: {k: v for k, v in rates.items() if v is not None} for c, rates in static.items()}
    repeats = sorted(auto)
    if len(repeats) < 2:
        return none
    chosen, per_round = [], []
    for r in repeats:
        scores = {c: statistics.median(v for k, v in rates.items() if k != r)
                  for c, rates in static.items() if r in rates and any(k != r for k in rates)}
        if not scores:
            return none
        best = max(scores, key=scores.get)  # ties: the first in the summary's order
        chosen.append(best)
        per_round.append({"round": r, "best_static": best, "auto_tokens_per_s": auto[r],
                          "best_static_tokens_per_s": static[best][r]})
    den = sum(x["best_static_tokens_per_s"] for x in per_round)
    return {"cv_best_static": chosen,
            "cv_ratio": sum(x["auto_tokens_per_s"] for x in per_round) / den if den > 0 else None,
            "cv_rounds": per_round}


def paired_bootstrap_ci(auto: Optional[dict], other: Optional[dict], resamples: int = BOOTSTRAP_RESAMPLES,
                        seed: int = BOOTSTRAP_SEED) -> Optional[list[float]]:
    """95% interval (2.5% and 97.5% quantiles) of auto's tokens/s over another configuration's,
    resampling prompts with replacement (paired: a drawn prompt brings both configurations' numbers).
    Tokens/s as everywhere at one stream: summed output tokens / summed request latency. The tables
    are `per_prompt_table`s; only prompts in both count. None without two such prompts."""
    if not auto or not other:
        return None
    prompts = sorted(set(auto) & set(other))
    pairs = [(auto[p][0], auto[p][1], other[p][0], other[p][1]) for p in prompts]
    return bootstrap_ci(len(pairs), lambda idx: paired_rate_ratio(pairs, idx), resamples, seed)


def router_verdict(summary: dict[str, Any], temperature: str = "0") -> dict[str, Any]:
    """`auto` against the static configurations, from a built summary (pure). Ratios are auto's
    tokens/s over the reference's; each `ok` says whether the issue-4 target holds.

    Load levels use the tokens/s pooled over the sweep's rounds; the reference is the better of
    `none` and the best static speculation by those pooled numbers. `round_ratios` pairs auto with
    that same reference round by round (repeat by repeat at one stream), and `round_ratio` gives their
    min / median / max; `within_noise` says the rounds fall on both sides of the target, so the
    pooled verdict is inside the run's own noise. `within_noise` at the top lists those targets.

    The best static by the maximum over many noisy configurations is biased upwards (winner's curse),
    so next to `ratio` / `ok` (unchanged) the one-stream and per-task verdicts carry a
    selection-unbiased comparison: `cv_best_static`, `cv_ratio`, `cv_ok` from `cross_validated_best`
    (per task: auto's and the chosen configuration's tokens/s on the task; within a repeat their
    speedups' ratio is the same number), and at one stream `ratio_ci95`, a paired per-prompt bootstrap
    interval of auto over the (plain) best static (`paired_bootstrap_ci`). Each is None where the
    summary lacks the data (one repeat; summaries of older runs). `all_ok_cv` is `all_ok` with the
    cross-validated one-stream and per-task verdicts in place of the plain ones (None when one of them
    is None); the load levels' `ok` are the same in both."""
    verdict: dict[str, Any] = {}
    noisy: list[str] = []
    anchors = frozenset(summary.get("anchors") or ())
    rows = summary["comparison"].get(temperature, {})
    if AUTO in rows and any(_static(c, anchors) for c in rows):  # e.g. --configs auto with baselines: none
        static = {c: r["repeat_tokens_per_s"]["median"] for c, r in rows.items() if _static(c, anchors)}
        best = max(static, key=static.get)
        auto = rows[AUTO]["repeat_tokens_per_s"]["median"]
        cv = cross_validated_best(rows[AUTO].get("rounds"),
                                  {c: r.get("rounds") for c, r in rows.items() if _static(c, anchors)})
        verdict["one_stream"] = {"auto_tokens_per_s": auto, "best_static": best,
                                 "best_static_tokens_per_s": static[best],
                                 "ratio": auto / static[best], "ok": auto >= static[best],
                                 **_spread_fields(rows[AUTO].get("rounds"), rows[best].get("rounds"), 1.0),
                                 **cv, "cv_ok": None if cv["cv_ratio"] is None else cv["cv_ratio"] >= 1.0,
                                 "ratio_ci95": paired_bootstrap_ci(rows[AUTO].get("per_prompt"),
                                                                   rows[best].get("per_prompt")),
                                 "bootstrap_prompts": len(set(rows[AUTO].get("per_prompt") or ())
                                                          & set(rows[best].get("per_prompt") or ()))}
        if verdict["one_stream"]["round_ratio"]["within_noise"]:
            noisy.append("one_stream")
        tasks = {}
        for task, arow in rows[AUTO]["by_task"].items():
            # Speedups are over `none` in the same repeat: a run without it has no per-task verdict.
            speeds = {c: r["by_task"][task]["speedup"] for c, r in rows.items()
                      if _static(c, anchors) and task in r["by_task"]
                      and _rate(r["by_task"][task].get("speedup")) is not None}
            if _rate(arow.get("speedup")) is None or not speeds:
                continue
            tbest = max(speeds, key=speeds.get)
            ratio = arow["speedup"] / speeds[tbest]
            tcv = cross_validated_best(arow.get("rounds"), {c: r["by_task"][task].get("rounds") for c, r in rows.items()
                                                            if _static(c, anchors) and task in r["by_task"]})
            tasks[task] = {"auto_speedup": arow["speedup"], "best_static": tbest,
                           "best_static_speedup": speeds[tbest], "ratio": ratio,
                           "ok": ratio >= ROUTER_TASK_TOLERANCE, **tcv,
                           "cv_ok": None if tcv["cv_ratio"] is None else tcv["cv_ratio"] >= ROUTER_TASK_TOLERANCE}
        if tasks:
            verdict["by_task"] = tasks
    load = summary["load"]
    if AUTO in load:
        levels = {}
        for level, arow in load[AUTO].items():
            plain = _load_tput(level, load[NONE][level]) if level in load.get(NONE, {}) else None  # None: not run
            spec = {c: _load_tput(level, lv[level]) for c, lv in load.items()
                    if c != NONE and _static(c, anchors) and level in lv}
            sbest = max(spec, key=spec.get) if spec else None
            ref = max(plain or 0.0, spec[sbest] if sbest else 0.0)
            if ref <= 0:
                continue
            ref_cfg = NONE if plain is not None and plain >= ref else sbest
            auto = _load_tput(level, arow)
            levels[level] = {"auto_tokens_per_s": auto, "none_tokens_per_s": plain, "best_static": sbest,
                             "best_static_tokens_per_s": spec.get(sbest), "reference": ref_cfg,
                             "ratio": auto / ref, "ok": auto / ref >= ROUTER_LOAD_TOLERANCE,
                             **_spread_fields(arow.get("rounds"), load[ref_cfg][level].get("rounds"),
                                              ROUTER_LOAD_TOLERANCE)}
            if levels[level]["round_ratio"]["within_noise"]:
                noisy.append(f"load:{level}")
        verdict["load"] = levels
    parts = [verdict.get("one_stream", {}).get("ok", True)]
    parts += [t["ok"] for t in verdict.get("by_task", {}).values()]
    parts += [lv["ok"] for lv in verdict.get("load", {}).values()]
    verdict["all_ok"] = all(parts)
    cv_parts = [verdict["one_stream"]["cv_ok"]] if "one_stream" in verdict else []
    cv_parts += [t["cv_ok"] for t in verdict.get("by_task", {}).values()]
    load_ok = [lv["ok"] for lv in verdict.get("load", {}).values()]
    verdict["all_ok_cv"] = None if any(x is None for x in cv_parts) else all(cv_parts + load_ok)
    verdict["within_noise"] = noisy
    return verdict
