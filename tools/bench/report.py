"""Turns a run's samples into its results folder: raw JSON, summary JSON, a Markdown report, PNG plots.

`build_summary` is pure (samples in, nested dict out; its router verdict is `tools.bench.router_verdict`'s);
`render_markdown` is pure (summary in, text out); `write_results` and `plot` do the file I/O. A folder is
`<results root>/<YYYYmmdd-HHMMSS>-<git short rev>/` with `samples.json` (every raw sample and the
run's metadata), `summary.json`, `report.md` and the plots `speedup_by_task.png`,
`load_throughput.png`, `load_p99_latency.png`.
"""

from __future__ import annotations

import json
import math
import subprocess
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from tools.bench.metrics import (Sample, Slo, check_lossless, group_by, pooled_rate, repeat_spread, round_rates,
                                   speedup, summarize)
from tools.bench.bootstrap import BOOTSTRAP_RESAMPLES
from tools.bench.plan import AUTO, NONE
from tools.bench.router_verdict import ROUTER_LOAD_TOLERANCE, ROUTER_TASK_TOLERANCE, router_verdict
from tools.bench.verdict import add_verdicts, render_lines


def git_short_rev(cwd: Optional[Path] = None) -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=cwd, capture_output=True,
                             text=True, timeout=5, check=True)
        return out.stdout.strip() or "norev"
    except (OSError, subprocess.SubprocessError):
        return "norev"


def results_dir(root: Path, now: Optional[float] = None, rev: Optional[str] = None) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return Path(root) / f"{stamp}-{rev or git_short_rev()}"


# -- summary ------------------------------------------------------------------------------------------


def _config_order(samples: list[Sample]) -> list[str]:
    seen: list[str] = []
    for s in samples:
        if s.config not in seen:
            seen.append(s.config)
    return seen


def build_summary(samples: list[Sample], slo: Slo = Slo(), tie_gap: float = 0.05,
                  anchors: tuple[str, ...] = ()) -> dict[str, Any]:
    """Everything the report shows, per configuration, task and load level. `anchors`: the stock-vLLM
    baselines' names (rows like any configuration; judged apart in `tools.bench.verdict`)."""
    reference = {s.prompt_id: s for s in samples if s.phase == "reference" and s.ok}
    compare = [s for s in samples if s.phase == "compare"]
    out: dict[str, Any] = {"comparison": {}, "load": {}, "poisson": {}, "anchors": list(anchors)}

    # 1. The side-by-side comparison at one stream, per temperature.
    for temp, group in sorted(group_by(compare, lambda s: s.temperature).items()):
        configs = _config_order(group)
        by_cfg = group_by(group, lambda s: s.config)
        rows = {}
        base = repeat_spread(by_cfg.get(NONE, []))["median"]
        for cfg in configs:
            row = summarize(by_cfg[cfg], slo)
            spread = repeat_spread(by_cfg[cfg])
            row["repeat_tokens_per_s"] = spread
            row["rounds"] = round_rates(by_cfg[cfg], slo, wall=False)  # per repeat, for the router's spread
            row["speedup"] = speedup(spread["median"], base)
            row["by_task"] = {}
            for task, tgroup in sorted(group_by(by_cfg[cfg], lambda s: s.task).items()):
                trow = summarize(tgroup, slo)
                tbase = repeat_spread([s for s in by_cfg.get(NONE, []) if s.task == task])["median"]
                trow["repeat_tokens_per_s"] = repeat_spread(tgroup)
                trow["rounds"] = round_rates(tgroup, slo, wall=False)  # per repeat, for the router's cross-validation
                trow["speedup"] = speedup(trow["repeat_tokens_per_s"]["median"], tbase)
                row["by_task"][task] = trow
            if AUTO in by_cfg:  # per prompt, for the router's paired bootstrap
                row["per_prompt"] = per_prompt_table(by_cfg[cfg])
            rows[cfg] = row
        out["comparison"][f"{temp:g}"] = rows

    # 2. Losslessness of the greedy runs against the no-speculation reference.
    greedy = [s for s in compare if s.temperature == 0]
    counts, mismatches = check_lossless(reference, greedy, tie_gap)
    out["lossless"] = {"tie_gap": tie_gap, "references": len(reference), "by_config": counts,
                       "mismatches": [asdict(m) for m in mismatches]}

    # 3. Load levels: closed-loop sweep (level 1 is the greedy comparison) and open loop. A sweep
    # level runs in rounds (the samples' `repeat`), one phase per configuration and round: its
    # throughput and goodput pool the phases (summed tokens / summed phase spans).
    sweep = [s for s in samples if s.phase == "sweep"]
    sweep_temps = {s.temperature for s in sweep} or {0.0}
    for cfg in _config_order(sweep):
        levels = {}
        one = [s for s in compare if s.config == cfg and s.temperature in sweep_temps]
        if one:
            levels["1"] = summarize(one, slo)
            levels["1"]["rounds"] = round_rates(one, slo, wall=False)
        for c, group in sorted(group_by([s for s in sweep if s.config == cfg], lambda s: s.concurrency).items()):
            levels[str(c)] = _pooled_level(group, slo)
        out["load"][cfg] = levels
    if sweep:
        out["sweep_order"] = sweep_phase_order(sweep)
    for cfg, group in group_by([s for s in samples if s.phase == "poisson"], lambda s: s.config).items():
        out["poisson"][cfg] = summarize(group, slo)
    if AUTO in out["load"] or any(AUTO in rows for rows in out["comparison"].values()):
        out["router"] = router_verdict(out)
    add_verdicts(out, samples, slo, list(anchors))
    return out


def per_prompt_table(samples: list[Sample]) -> dict[str, list[float]]:
    """prompt id -> [output tokens, summed latency s] of one configuration's successful requests,
    summed over the repeats (prompts without a successful request are left out)."""
    out: dict[str, list[float]] = {}
    for s in samples:
        if s.ok and s.latency_s:
            entry = out.setdefault(s.prompt_id, [0, 0.0])
            entry[0] += s.output_tokens
            entry[1] += s.latency_s
    return out


def _pooled_level(group: list[Sample], slo: Slo) -> dict[str, Any]:
    """`summarize` of one configuration at one sweep level, with span, throughput and goodput
    pooled over its rounds' phases, and the per-round rows under `rounds`."""
    row = summarize(group, slo)
    rounds = round_rates(group, slo, wall=True)
    row["span_s"] = sum(r["time_s"] for r in rounds)
    row["throughput_tokens_per_s"] = pooled_rate(rounds)
    row["goodput_tokens_per_s"] = pooled_rate(rounds, "good_tokens")
    row["rounds"] = rounds
    return row


def sweep_phase_order(sweep: list[Sample]) -> dict[str, list[list[str]]]:
    """level -> per round, the configurations in the order their phases started (as run)."""
    out: dict[str, list[list[str]]] = {}
    for c, level in sorted(group_by(sweep, lambda s: s.concurrency).items()):
        rounds = []
        for _, group in sorted(group_by(level, lambda s: s.repeat).items()):
            starts = {cfg: min(s.start_s for s in g) for cfg, g in group_by(group, lambda s: s.config).items()}
            rounds.append(sorted(starts, key=starts.get))
        out[str(c)] = rounds
    return out


# -- Markdown -----------------------------------------------------------------------------------------


def fmt(x: Any, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def _ms(x: Optional[float]) -> str:
    return fmt(None if x is None or math.isnan(x) else x * 1000.0, 0)


def _kdist(d: dict, explored: int = 0, buckets: Optional[dict] = None) -> str:
    """`mode:K×n ...`, how many of those the router's exploration draw chose, and the load buckets
    the requests were admitted at."""
    notes = [f"explored {explored}"] * bool(explored)
    if buckets and set(buckets) != {"1"}:  # one stream is always admitted at 1: not worth a note
        notes.append("at " + " ".join(f"{b}×{n}" for b, n in buckets.items()))
    return " ".join(f"{k}×{v}" for k, v in d.items()) + (f" ({'; '.join(notes)})" if notes else "")


def _kcell(r: dict) -> str:
    return _kdist(r["k_distribution"], r.get("explored", 0), r.get("load_buckets"))


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def render_markdown(summary: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = [f"# specserve bench — {meta.get('started', '')}", ""]
    for key in ("url", "model", "git_rev", "prompts_file", "max_tokens", "prompts", "configs", "slo"):
        if key in meta:
            lines.append(f"- **{key}**: `{meta[key]}`")
    lines += ["", "Times in ms; tokens/s = output tokens / summed request latency (one stream); "
              "speedup against `none` (median over repeats); acceptance length = accepted / steps + 1.", ""]
    for temp, rows in summary["comparison"].items():
        lines += [f"## One stream, temperature {temp}", ""]
        header = ["config", "tok/s med", "tok/s min", "speedup", "TTFT p50", "TPOT p50", "TPOT p99", "lat mean",
                  "lat p50", "lat p90", "lat p99", "goodput tok/s", "drafted", "accepted", "acc len", "K chosen",
                  "errors"]
        table = []
        for cfg, r in rows.items():
            table.append([cfg, fmt(r["repeat_tokens_per_s"]["median"]), fmt(r["repeat_tokens_per_s"]["min"]),
                          fmt(r["speedup"]), _ms(r["ttft_s"]["p50"]), _ms(r["tpot_s"]["p50"]), _ms(r["tpot_s"]["p99"]),
                          _ms(r["latency_s"]["mean"]), _ms(r["latency_s"]["p50"]), _ms(r["latency_s"]["p90"]),
                          _ms(r["latency_s"]["p99"]), fmt(r["request_goodput_tokens_per_s"]), str(r["drafted"]),
                          str(r["accepted"]), fmt(r["acceptance_length"]), _kcell(r),
                          str(r["errors"])])
        lines += _table(header, table) + [""]
        tasks = sorted({t for r in rows.values() for t in r["by_task"]})
        lines += [f"### Speedup by task (temperature {temp}; acceptance length in brackets)", ""]
        table = [[cfg] + [f"{fmt(r['by_task'][t]['speedup'])} ({fmt(r['by_task'][t]['acceptance_length'])})"
                          if t in r["by_task"] else "-" for t in tasks] for cfg, r in rows.items()]
        lines += _table(["config"] + tasks, table) + [""]

    ll = summary["lossless"]
    lines += ["## Losslessness (greedy, token by token against `none` with logprobs)", ""]
    table = [[cfg, str(c["compared"]), str(c["mismatches"]), str(c["near_tie"]), str(c["large_gap"]),
              str(c["unknown_gap"])] for cfg, c in ll["by_config"].items()]
    lines += _table(["config", "compared", "mismatches", "near-tie", "large gap", "gap unknown"], table)
    lines += ["", f"Near-tie: the reference's top-1 minus top-2 logprob < {ll['tie_gap']} nats at the first "
              "divergent position (numerics); a large gap means speculation changed the output (a bug).", ""]
    if ll["mismatches"]:
        table = [[m["config"], m["prompt_id"], m["task"], str(m["repeat"]), str(m["position"]),
                  str(m["reference_token"]), str(m["token"]), fmt(m["gap"], 4), m["verdict"]]
                 for m in ll["mismatches"][:200]]
        lines += _table(["config", "prompt", "task", "repeat", "position", "ref token", "token", "gap", "verdict"],
                        table) + [""]

    if summary["load"]:
        lines += ["## Load (closed loop, greedy; level 1 is the one-stream comparison)", "",
                  "Above one stream every configuration ran one short phase per round, configurations "
                  "interleaved in an order rotated and reversed from round to round; throughput and goodput "
                  "pool the rounds (summed tokens / summed phase spans); `per round` lists each round's "
                  "tokens/s (at one stream: each repeat's).", ""]
        order = summary.get("sweep_order") or {}
        if order:
            lines += ["Phase order per round: " + "; ".join(
                f"{c} streams: " + " ".join(f"[{', '.join(r)}]" for r in rounds)
                for c, rounds in order.items()), ""]
        header = ["config", "streams", "requests", "throughput tok/s", "per round", "goodput tok/s", "TTFT p50",
                  "TTFT p99", "TPOT p50", "TPOT p99", "ITL p99", "lat p50", "lat p99", "acc len", "K chosen", "errors"]
        table = []
        for cfg, levels in summary["load"].items():
            for c, r in levels.items():
                one = c == "1"  # the interleaved comparison: per-request rates, not wall span
                tput = r["request_tokens_per_s" if one else "throughput_tokens_per_s"]
                good = r["request_goodput_tokens_per_s" if one else "goodput_tokens_per_s"]
                per_round = " / ".join(fmt(x["tokens_per_s"], 1) for x in r.get("rounds") or [])
                table.append([cfg, c, str(r["requests"]), fmt(tput), per_round or "-", fmt(good),
                              _ms(r["ttft_s"]["p50"]), _ms(r["ttft_s"]["p99"]), _ms(r["tpot_s"]["p50"]),
                              _ms(r["tpot_s"]["p99"]), _ms(r["itl_s"]["p99"]), _ms(r["latency_s"]["p50"]),
                              _ms(r["latency_s"]["p99"]), fmt(r["acceptance_length"]), _kcell(r),
                              str(r["errors"])])
        lines += _table(header, table) + [""]
    if summary.get("router"):
        lines += _router_lines(summary["router"])
    if summary["poisson"]:
        lines += ["## Open loop (Poisson arrivals)", ""]
        header = ["config", "requests", "throughput tok/s", "goodput tok/s", "good", "TTFT p50", "TTFT p99",
                  "TPOT p99", "lat p50", "lat p99", "acc len", "K chosen", "errors"]
        table = [[cfg, str(r["requests"]), fmt(r["throughput_tokens_per_s"]), fmt(r["goodput_tokens_per_s"]),
                  str(r["good_requests"]), _ms(r["ttft_s"]["p50"]), _ms(r["ttft_s"]["p99"]), _ms(r["tpot_s"]["p99"]),
                  _ms(r["latency_s"]["p50"]), _ms(r["latency_s"]["p99"]), fmt(r["acceptance_length"]),
                  _kcell(r), str(r["errors"])] for cfg, r in summary["poisson"].items()]
        lines += _table(header, table) + [""]
    return "\n".join(lines + render_lines(summary)) + "\n"  # render_lines: the anchors' and the trace's sections


def _spread_text(spread: dict[str, Any]) -> str:
    return " / ".join(fmt(spread.get(k), 3) for k in ("min", "median", "max"))


def _router_lines(v: dict[str, Any]) -> list[str]:
    yes = lambda ok: "yes" if ok else "**no**"  # noqa: E731
    lines = ["## The router (`auto`) against static configurations", ""]
    one = v.get("one_stream")
    if one:
        spread = one.get("round_ratio") or {}
        per_repeat = ""
        if spread.get("n", 0) > 1:
            per_repeat = (f" Per repeat: {_spread_text(spread)} over {spread['n']} repeats, "
                          f"{spread['below_target']} below 1" + (", so within the noise" if spread["within_noise"]
                                                                 else "") + ".")
        lines += [f"One stream, greedy: auto {fmt(one['auto_tokens_per_s'])} tok/s, best static "
                  f"`{one['best_static']}` {fmt(one['best_static_tokens_per_s'])} tok/s: ratio "
                  f"{fmt(one['ratio'], 3)} (target >= 1: {yes(one['ok'])}).{per_repeat}", ""]
        unbiased = _unbiased_text(one)
        if unbiased:
            lines += [unbiased, ""]
    if v.get("by_task"):
        table = [[t, fmt(r["auto_speedup"]), r["best_static"], fmt(r["best_static_speedup"]), fmt(r["ratio"], 3),
                  yes(r["ok"]), "-" if r.get("cv_ratio") is None else f"{fmt(r['cv_ratio'], 3)} {yes(r['cv_ok'])}"]
                 for t, r in v["by_task"].items()]
        lines += _table(["task", "auto speedup", "best static", "its speedup", "ratio",
                         f">= {ROUTER_TASK_TOLERANCE}", f"cv ratio, >= {ROUTER_TASK_TOLERANCE}"], table)
        lines += ["", "*cv ratio*: auto over the task's best static chosen on the other repeats and measured on "
                  "this one, summed over the repeats (selection-unbiased; `-`: one repeat or an older summary).", ""]
    if v.get("load"):
        table = []
        for c, r in v["load"].items():
            spread = r.get("round_ratio") or {}
            n = spread.get("n", 0)
            verdict = yes(r["ok"]) + (" (within the noise)" if spread.get("within_noise") else "")
            table.append([c, fmt(r["auto_tokens_per_s"]), fmt(r["none_tokens_per_s"]), str(r["best_static"]),
                          fmt(r["best_static_tokens_per_s"]), fmt(r["ratio"], 3),
                          _spread_text(spread) if n else "-", f"{spread['below_target']} of {n}" if n else "-",
                          verdict])
        lines += _table(["streams", "auto tok/s", "none tok/s", "best static", "its tok/s", "ratio to the better",
                         "per round min / median / max", "rounds below", f">= {ROUTER_LOAD_TOLERANCE}"], table)
        lines += ["", "Tokens/s pooled over the rounds; a round's ratio is auto over the same reference (the "
                  "better of the pooled `none` and best static) in the same round (level 1: the same repeat). "
                  "*Within the noise*: some rounds meet the target and some do not, so more rounds or longer "
                  "phases are needed before the verdict means anything.", ""]
    noisy = v.get("within_noise") or []
    cv_all = v.get("all_ok_cv")
    lines += [f"All router targets met: {yes(v['all_ok'])}." + (f" Within the run's noise: {', '.join(noisy)}."
                                                               if noisy else "")
              + (f" With the selection-unbiased one-stream and per-task verdicts: {yes(cv_all)}."
                 if cv_all is not None else ""), ""]
    return lines


def _unbiased_text(one: dict[str, Any]) -> str:
    """The one-stream line of the selection-unbiased comparison ('' when the summary has neither)."""
    parts = []
    if one.get("cv_ratio") is not None:
        chosen = ", ".join(one["cv_best_static"])
        parts.append(f"auto / cv best = {fmt(one['cv_ratio'], 3)} ({chosen}; target >= 1: "
                     f"{'yes' if one['cv_ok'] else '**no**'})")
    ci = one.get("ratio_ci95")
    if ci:
        parts.append(f"paired bootstrap 95% CI of auto / {one['best_static']} over {one.get('bootstrap_prompts')} "
                     f"prompts: {fmt(ci[0], 3)}-{fmt(ci[1], 3)}")
    if not parts:
        return ""
    return ("Selection-unbiased (best static chosen on the other repeats, measured on this one; prompts "
            f"resampled {BOOTSTRAP_RESAMPLES} times): " + "; ".join(parts) + ".")


# -- files ---------------------------------------------------------------------------------------------


def plot(summary: dict[str, Any], folder: Path) -> list[Path]:
    """The PNG plots; returns the files written (none when there is nothing to draw)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    greedy = summary["comparison"].get("0")
    if greedy:
        tasks = sorted({t for r in greedy.values() for t in r["by_task"]})
        cfgs = [c for c in greedy if c != NONE]
        if tasks and cfgs:
            fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(tasks) * max(1, len(cfgs)) / 3), 4.5))
            width = 0.8 / len(cfgs)
            for i, cfg in enumerate(cfgs):
                ys = [greedy[cfg]["by_task"].get(t, {}).get("speedup", math.nan) for t in tasks]
                ax.bar([x + i * width for x in range(len(tasks))], ys, width, label=cfg)
            ax.axhline(1.0, color="black", linewidth=0.8)
            ax.set_xticks([x + 0.4 - width / 2 for x in range(len(tasks))], tasks, rotation=20)
            ax.set_ylabel("speedup vs none (tokens/s)")
            ax.set_title("Greedy, one stream: speedup by task")
            ax.legend(fontsize=7, ncol=2)
            fig.tight_layout()
            written.append(folder / "speedup_by_task.png")
            fig.savefig(written[-1], dpi=110)
            plt.close(fig)
    if summary["load"]:
        for name, key, ylabel in (("load_throughput.png", "throughput", "output tokens/s"),
                                  ("load_p99_latency.png", "p99", "p99 latency (s)")):
            fig, ax = plt.subplots(figsize=(6.5, 4.5))
            for cfg, levels in summary["load"].items():
                xs = sorted(int(c) for c in levels)
                if key == "throughput":
                    ys = [levels[str(c)]["request_tokens_per_s" if c == 1 else "throughput_tokens_per_s"] for c in xs]
                else:
                    ys = [levels[str(c)]["latency_s"]["p99"] for c in xs]
                ax.plot(xs, ys, marker="o", label=cfg)
            ax.set_xscale("log", base=2)
            ticks = sorted({int(c) for levels in summary["load"].values() for c in levels})
            ax.set_xticks(ticks, [str(t) for t in ticks])
            ax.set_xlabel("concurrent streams (closed loop, greedy)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{ylabel} against concurrency")
            ax.legend(fontsize=8)
            fig.tight_layout()
            written.append(folder / name)
            fig.savefig(written[-1], dpi=110)
            plt.close(fig)
    return written


def _clean(o: Any) -> Any:
    if isinstance(o, float) and (math.isnan(o) or math.isinf(o)):
        return None
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items()}
    if isinstance(o, list):
        return [_clean(v) for v in o]
    return o


def write_results(folder: Path, samples: list[Sample], meta: dict[str, Any], summary: dict[str, Any],
                  plots: bool = True) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    files = {"samples": folder / "samples.json", "summary": folder / "summary.json", "report": folder / "report.md"}
    files["samples"].write_text(json.dumps(_clean({"meta": meta, "samples": [s.to_dict() for s in samples]})))
    files["summary"].write_text(json.dumps(_clean(summary), indent=1))
    files["report"].write_text(render_markdown(summary, meta))
    if plots:
        for path in plot(summary, folder):
            files[path.stem] = path
    return files


def load_samples(path: Path) -> tuple[dict, list[Sample]]:
    data = json.loads(Path(path).read_text())
    return data.get("meta", {}), [Sample.from_dict(d) for d in data["samples"]]


def rerender(folder: Path, plots: bool = True, tasks: Optional[set[str]] = None,
             out: Optional[Path] = None) -> dict[str, Path]:
    """Rebuild a finished run's summary and report from its samples with the current report code
    (`python -m tools.bench.report DIR [--tasks a,b --out DIR2]`); the run's settings are kept.
    `tasks`: only these tasks' samples (a report of part of a mixed workload), written to `out`."""
    meta, samples = load_samples(Path(folder) / "samples.json")
    if tasks:
        samples = [s for s in samples if s.task in tasks]
        meta = {**meta, "tasks": sorted(tasks)}
    old = json.loads((Path(folder) / "summary.json").read_text())
    slo = Slo(**{k: v for k, v in (meta.get("slo") or {}).items() if k in ("ttft_s", "tpot_s", "latency_s")})
    summary = build_summary(samples, slo, (old.get("lossless") or {}).get("tie_gap", 0.05),
                            anchors=tuple(old.get("anchors") or ()))
    if "trace" in summary and "trace" in meta:
        summary["trace"]["schedule"] = meta["trace"]
    return write_results(Path(out or folder), samples, meta, summary, plots=plots)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(prog="python -m tools.bench.report", description=rerender.__doc__.split("\n")[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--tasks", default=None, help="comma list: report only these tasks (needs --out)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if a.tasks and not a.out:
        ap.error("--tasks needs --out (the run's own report stays whole)")
    files = rerender(a.folder, tasks={t.strip() for t in a.tasks.split(",")} if a.tasks else None, out=a.out)
    print(", ".join(str(p) for p in files.values()))
