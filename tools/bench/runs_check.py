"""Does the policy's acceptance model predict what each K really gives? A check on real engines.

Greedy decoding is lossless, so the same prompt gives the same text at every K: only the number of
steps differs. This sends each selected prompt with explicit `ngram` K = 0..max (and the router's
default pool for K = 0), sums each (task, K) through the tuning state's own increments and
validation (what Redis would hold), then, from the cell measured at `--observed-k` alone, predicts
tokens per step at every K two ways, and prints them beside the measured value:

- geometric: E(α, K, p) from α and p of that cell (the policy's model before accepted runs);
- runs: E_run(K) from the cell's accepted runs (`cluster.policy.run_tokens_per_step`).

    python -m tools.bench.runs_check [--url http://127.0.0.1:8000] [--tasks summarization,translation]
        [--prompts-per-task 4] [--max-k 6] [--observed-k 6] [--max-tokens 96] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Mapping, Optional

from tools.bench.workload import load_prompts, select
from cluster.policy import CellStats, expected_tokens_per_step, run_tokens_per_step
from cluster.speculation import SpecStats
from cluster.state.tuning_cells import cell_from_requests


def cell_of(stats: list[SpecStats]) -> CellStats:
    """Requests summed as the tuning state sums them (no times: only step counts are compared)."""
    return cell_from_requests((s, 0.0) for s in stats)


def predictions(cells: Mapping[int, CellStats], observed_k: int) -> list[dict]:
    """One row per K: measured tokens per step, and both models' predictions from `observed_k`'s cell.

    >>> c = {0: CellStats(steps=10, tokens=11), 2: CellStats(steps=6, accepted=4, tokens=11, exposed_at=(4, 4),
    ...      accepted_at=(2, 2), rejected_steps=2, runs=(2, 0, 0, 0, 0, 1))}
    >>> [(r["k"], r["measured"], r["runs"]) for r in predictions(c, 2)]
    [(0, 1.0, 1.0), (2, 1.667, 1.667)]
    """
    base = cells[observed_k]
    alpha = base.alpha if base.alpha is not None else 0.0
    p = base.draft_rate if base.draft_rate is not None else 1.0
    rows = []
    for k, cell in sorted(cells.items()):
        measured = (cell.steps + cell.accepted) / cell.steps if cell.steps else None
        rows.append({
            "k": k, "steps": cell.steps, "measured": None if measured is None else round(measured, 3),
            "geometric": round(expected_tokens_per_step(alpha, k, p), 3),
            "runs": round(run_tokens_per_step(base.runs, base.draftless_steps, k), 3) if base.runs else None,
        })
    return rows


def errors(rows: list[dict], observed_k: int) -> dict[str, Optional[float]]:
    """Mean absolute relative error of each model over the rows with a measurement, K > 0 other
    than the observed K (where the runs reproduce the measurement by construction)."""
    out = {}
    for model in ("geometric", "runs"):
        errs = [abs(r[model] / r["measured"] - 1.0) for r in rows
                if r["k"] not in (0, observed_k) and r["measured"] and r[model]]
        out[model] = round(sum(errs) / len(errs), 4) if errs else None
    return out


def main(argv: Optional[list[str]] = None) -> int:
    from cluster.client import SpecServeClient

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--prompts", default=None, help="Spec-Bench JSONL (default: the dev set)")
    ap.add_argument("--tasks", default="summarization,translation,rag,math_reasoning,qa,mt_bench")
    ap.add_argument("--prompts-per-task", type=int, default=4)
    ap.add_argument("--max-k", type=int, default=6)
    ap.add_argument("--observed-k", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--max-prompt-chars", type=int, default=6000)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", default=None, help="write the rows as JSON here too")
    ap.add_argument("--report", default=None, help="print the report of a saved --out file (no requests)")
    args = ap.parse_args(argv)
    if args.report:
        with open(args.report) as f:
            saved = json.load(f)
        _print(saved, int(saved["args"]["observed_k"]))
        return 0
    if not 1 <= args.observed_k <= args.max_k:
        ap.error("--observed-k must be within 1..--max-k")

    tasks = [t for t in args.tasks.split(",") if t]
    prompts = select(load_prompts(args.prompts), args.prompts_per_task, args.seed, tasks, args.max_prompt_chars)
    stats: dict[tuple[str, int], list[SpecStats]] = {}
    with SpecServeClient(args.url) as client:
        for prompt in prompts:
            texts = set()
            for k in range(args.max_k + 1):
                spec = {"mode": "ngram", "k": k} if k else {"mode": "none", "k": 0}
                r = client.generate(messages=prompt.messages, max_tokens=args.max_tokens, temperature=0.0,
                                    speculative=spec, workload_class=prompt.workload_class)
                texts.add(tuple(r.token_ids) or r.text)
                stats.setdefault((prompt.task, k), []).append(r.spec.stats())
            if len(texts) != 1:
                print(f"warning: {prompt.question_id}: the text differs between K (near-ties?)", file=sys.stderr)
            print(f"# {prompt.question_id} ({prompt.task}) done", file=sys.stderr, flush=True)

    report = {"args": vars(args), "tasks": {}}
    for task in sorted({t for t, _ in stats}):
        cells = {k: cell_of(stats[(task, k)]) for k in range(args.max_k + 1)}
        rows = predictions(cells, args.observed_k)
        report["tasks"][task] = {"rows": rows, "runs": sum(cells[args.observed_k].runs)}
    cells = {k: cell_of([s for (t, kk), ss in stats.items() if kk == k for s in ss]) for k in range(args.max_k + 1)}
    report["all"] = {"rows": predictions(cells, args.observed_k)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    _print(report, args.observed_k)
    return 0


def _print(report: dict, observed_k: int) -> None:
    groups = [*report["tasks"].items(), ("all", report["all"])]
    print(f"tokens per step at each K, measured, and predicted from the cell measured at K = {observed_k}")
    print("task\tK\tsteps\tmeasured\tgeometric\truns")
    for task, t in groups:
        for r in t["rows"]:
            print(f"{task}\t{r['k']}\t{r['steps']}\t{r['measured']}\t{r['geometric']}\t{r['runs']}")
    print(f"mean |relative error| over K > 0 other than {observed_k}:")
    for task, t in groups:
        e = errors(t["rows"], observed_k)
        print(f"  {task}: geometric {e['geometric']}, runs {e['runs']}")


if __name__ == "__main__":
    raise SystemExit(main())
