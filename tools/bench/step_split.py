"""Where a bench's one-stream ratio comes from: tokens per step against time per step, per config.

tokens/s of a decode = tokens per step / time per step. Greedy decoding gives the same text at every
K, so between two configurations only these two factors differ, and the router can only choose the
first (through K) while the second is the engine's. This splits a `specserve bench` run's samples
(`samples.json`) into both, per configuration (and per task), with the time per step per repeat
(drift between repeats is the machine's) and, from each configuration's accepted runs, what the
policy's runs model (`cluster.policy.run_tokens_per_step`) predicts at other K, so a shortfall can
be read as "chose a K with fewer tokens per step" or "its steps were slower".
`--same-k` instead pairs each `auto` request with the static run of the mode and K it chose (same
prompt, same repeat): whatever differs there is not the choice of K (the router's own cost, the
per-step cap, or noise).

    python -m tools.bench.step_split SAMPLES.json [--concurrency 1] [--tasks math_reasoning,qa]
        [--configs ngram:3,ngram:5,auto] [--k 2,3,4,5,6] [--same-k]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Iterable, Optional

from tools.bench.metrics import Sample
from tools.bench.report import load_samples
from cluster.policy import run_tokens_per_step
from cluster.speculation import RUN_CAP


def _greedy(samples: Iterable[Sample], concurrency: int, phase: str) -> Iterable[Sample]:
    """The successful greedy samples of `phase` at `concurrency` that report their step count: the
    only ones whose tokens and steps compare across configurations."""
    return (x for x in samples if x.phase == phase and x.concurrency == concurrency and x.ok
            and x.temperature == 0.0 and (x.spec or {}).get("steps"))


def _decode_per_step(x: Sample) -> tuple[float, float]:
    """(seconds, tokens) per step of a decode; the first token comes from the prefill."""
    steps = x.spec["steps"]
    return (x.latency_s - x.ttft_s) / steps, (x.output_tokens - 1) / steps


def split(samples: Iterable[Sample], concurrency: int = 1, phase: str = "compare",
          ks: tuple[int, ...] = (2, 3, 4, 5, 6)) -> list[dict]:
    """Rows per (task, config) and ("ALL", config) of the successful greedy samples at `concurrency`.

    Decode tokens are the tokens after the first (the first comes from the prefill); time per step
    is (latency - TTFT) / steps.

    >>> s = [Sample(phase="compare", config="ngram:2", prompt_id="p", category="qa", task="qa", temperature=0.0,
    ...             concurrency=1, token_ids=list(range(7)), latency_s=0.5, ttft_s=0.1,
    ...             spec={"steps": 4, "spec_steps": 2, "run_lengths": [0, 0, 1, 0, 1]})]
    >>> r = split(s, ks=(2, 4))[1]  # [0] is the ALL row
    >>> (r["task"], r["config"], r["tokens_per_step"], r["ms_per_step"], r["draftless"], r["predicted"])
    ('qa', 'ngram:2', 1.5, 100.0, 2, {2: 2.0, 4: 2.5})
    """
    agg: dict[tuple[str, str], dict] = {}
    for x in _greedy(samples, concurrency, phase):
        sp = x.spec
        decode_s = x.latency_s - x.ttft_s
        for key in ((x.task, x.config), ("ALL", x.config)):
            a = agg.setdefault(key, {"n": 0, "tokens": 0, "steps": 0, "spec_steps": 0, "decode_s": 0.0,
                                     "runs": [0] * (RUN_CAP + 1), "by_repeat": {}})
            a["n"] += 1
            a["tokens"] += x.output_tokens - 1
            a["steps"] += int(sp["steps"])
            a["spec_steps"] += int(sp.get("spec_steps") or 0)
            a["decode_s"] += decode_s
            rep = a["by_repeat"].setdefault(x.repeat, [0.0, 0])
            rep[0] += decode_s
            rep[1] += int(sp["steps"])
            for length, g in enumerate(sp.get("run_lengths") or []):
                a["runs"][min(length, RUN_CAP)] += int(g)
    rows = []
    for (task, config), a in sorted(agg.items()):
        draftless = a["steps"] - a["spec_steps"]
        rows.append({
            "task": task, "config": config, "requests": a["n"],
            "tokens_per_step": round(a["tokens"] / a["steps"], 3),
            "ms_per_step": round(1000 * a["decode_s"] / a["steps"], 1),
            "ms_per_step_by_repeat": [round(1000 * t / s, 1) for _, (t, s) in sorted(a["by_repeat"].items()) if s],
            "draftless": draftless,
            "predicted": ({k: round(run_tokens_per_step(a["runs"], draftless, k), 3) for k in ks}
                          if sum(a["runs"]) else {}),
        })
    return rows


def same_k(samples: Iterable[Sample], concurrency: int = 1, phase: str = "compare",
           config: str = "auto") -> list[dict]:
    """Per task and ALL: `config`'s greedy requests against the static `mode:k` run of the K each one
    chose, same prompt and repeat; medians of the per-pair ratios (config over static) of latency,
    time per decode step and tokens per step.

    >>> mk = lambda c, lat, steps, k=None: Sample(phase="compare", config=c, prompt_id="p", category="qa",
    ...     task="qa", temperature=0.0, concurrency=1, token_ids=list(range(9)), latency_s=lat, ttft_s=0.2,
    ...     spec={"steps": steps, "mode": "ngram", "k": k})
    >>> r = same_k([mk("auto", 1.0, 4, k=3), mk("ngram:3", 0.8, 4), mk("ngram:4", 9.0, 2)])[1]
    >>> (r["task"], r["pairs"], r["latency"], r["ms_per_step"], r["tokens_per_step"])
    ('qa', 1, 1.25, 1.333, 1.0)
    """
    keep = {(x.config, x.prompt_id, x.repeat): x for x in _greedy(samples, concurrency, phase)}
    pairs: dict[str, list[tuple[float, float, float]]] = {}
    for (c, prompt, rep), x in keep.items():
        static = keep.get((f"{x.spec.get('mode')}:{x.spec.get('k')}", prompt, rep)) if c == config else None
        if static is None:
            continue
        (ms, tps), (ms_static, tps_static) = _decode_per_step(x), _decode_per_step(static)
        ratio = (x.latency_s / static.latency_s, ms / ms_static if ms_static else float("nan"),
                 tps / tps_static if tps_static else float("nan"))
        for task in ("ALL", x.task):
            pairs.setdefault(task, []).append(ratio)
    return [{"task": t, "pairs": len(v), **{name: round(statistics.median(col), 3) for name, col in
                                            zip(("latency", "ms_per_step", "tokens_per_step"), zip(*v))}}
            for t, v in sorted(pairs.items())]


def format_rows(rows: list[dict], ks: tuple[int, ...]) -> str:
    head = ("| task | config | requests | tokens/step | ms/step | ms/step per repeat | "
            + " | ".join(f"runs model K={k}" for k in ks) + " |")
    out = [head, "|" + "---|" * (6 + len(ks))]
    for r in rows:
        pred = [f"{r['predicted'][k]:.3f}" if k in r["predicted"] else "-" for k in ks]
        out.append(f"| {r['task']} | {r['config']} | {r['requests']} | {r['tokens_per_step']:.3f} | "
                   f"{r['ms_per_step']:.1f} | {' / '.join(map(str, r['ms_per_step_by_repeat']))} | "
                   + " | ".join(pred) + " |")
    return "\n".join(out)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench.step_split", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("samples", help="a bench run's samples.json")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--tasks", default=None, help="comma-separated tasks (ALL is the sum); default: every one")
    p.add_argument("--configs", default=None, help="comma-separated configs; default: every one")
    p.add_argument("--k", default="2,3,4,5,6", help="K at which the runs model predicts tokens per step")
    p.add_argument("--same-k", action="store_true",
                   help="pair each auto request with the static run of the K it chose (medians of the ratios)")
    args = p.parse_args(argv)
    ks = tuple(int(k) for k in args.k.split(","))
    if args.same_k:
        rows = same_k(load_samples(args.samples)[1], args.concurrency)
        rows = [r for r in rows if not args.tasks or r["task"] in args.tasks.split(",")]
        if not rows:
            print("no auto request has a static run of its K at that concurrency", file=sys.stderr)
            return 1
        print("| task | pairs | latency auto/static | ms/step auto/static | tokens/step auto/static |\n|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['task']} | {r['pairs']} | {r['latency']:.3f} | {r['ms_per_step']:.3f} | {r['tokens_per_step']:.3f} |")
        return 0
    rows = split(load_samples(args.samples)[1], args.concurrency, ks=ks)
    if args.tasks:
        rows = [r for r in rows if r["task"] in args.tasks.split(",")]
    if args.configs:
        rows = [r for r in rows if r["config"] in args.configs.split(",")]
    if not rows:
        print("no greedy samples at that concurrency", file=sys.stderr)
        return 1
    print(format_rows(rows, ks))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
