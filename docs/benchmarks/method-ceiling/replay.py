"""How much can choosing the drafting method (or the suffix knobs) per request or per class gain at
one stream, with no measurement noise? Tune halves of both prompt files only.

    .venv/bin/python docs/benchmarks/method-ceiling/replay.py [--outputs /tmp/tune_outputs.json]

Greedy outputs (128 tokens) come from a plain engine built like the n-gram pool's
(`tools.bench.prior_alpha._greedy_outputs`); each output is replayed through vLLM's n-gram matcher
(lookup 1..5) and through arctic-inference's suffix cache (`tools.bench.prior_alpha.SuffixReplay`:
one cache over all prompts in a shuffled order, as a serving engine meets them), counting per step
the drafts and how many the output accepts (`tools.bench.k_replay.replay`). A request's time = TTFT + per step (STEP_S + DRAFT_S x
drafts), fitted on `auto`'s one-stream requests of tune-half bench runs (26.5 ms a step, 1.44 ms a
draft; the stock servers' own fit, 25 ms and 4 ms, is printed too). Rates are summed tokens / summed
time, as the bench's one-stream rate.
"""

import argparse
import itertools
import json
import os
import random
import sys
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, os.getcwd())

TTFT_S = 0.12
PROBS = (0.1, 0.2, 0.3, 0.4, 0.5)  # min_token_prob values swept
COSTS = {"tune-half auto fit": (0.0265, 0.00144), "stock servers' fit": (0.025, 0.004)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--outputs", default="/tmp/tune_outputs.json")
    args = ap.parse_args()
    if not os.path.exists(args.outputs):
        from tools.bench.prior_alpha import _greedy_outputs
        rows = _greedy_outputs("cluster/configs/local-cpu.yaml", "ngram", "tune", 128,
                               ["cluster/data/specbench-dev.jsonl", "cluster/data/repeated-structure.jsonl"])
        json.dump(rows, open(args.outputs, "w"))
    rows = json.load(open(args.outputs))
    from tools.bench.k_replay import StaticK, ngram_proposer, replay
    from tools.bench.prior_alpha import SuffixReplay

    ngram = ngram_proposer(1, 5)

    def run(order, kind, k=16, factor=1.0, offset=0.0, prob=0.1):
        """(output tokens, steps, drafted tokens) per prompt, replayed in `order`: n-gram lookup at
        K = k, or one suffix cache over all of them (the pools' tree depth, these knobs)."""
        suffix = SuffixReplay(SimpleNamespace(max_tree_depth=24, max_cached_requests=10000, max_spec_factor=factor,
                                              max_spec_offset=offset, min_token_prob=prob)) if kind == "suffix" else None
        out = {}
        for i in order:
            _, ids, o = rows[i]
            if kind == "ngram":
                steps = replay(ids, o, StaticK(k), ngram)
            else:
                steps = suffix.steps(ids, o, k)
            out[i] = (len(o), len(steps), sum(s.drafted for s in steps))
        return out

    def secs(r, cost):
        return TTFT_S + r[1] * cost[0] + r[2] * cost[1]

    def rate(res, idx, cost):
        return sum(res[i][0] for i in idx) / sum(secs(res[i], cost) for i in idx)

    classes = sorted({r[0] for r in rows})
    n = len(rows)
    print(f"{n} tune-half prompts, classes: {', '.join(classes)}")
    grid = {f"factor {f} offset {o} min_prob {p}": dict(factor=f, offset=o, prob=p)
            for f, o, p in itertools.product((1.0, 1.5, 2.0, 3.0), (0.0, 1.0, 2.0), PROBS)}
    for seed in (1, 2, 3):
        order = list(range(n))
        random.Random(seed).shuffle(order)
        res = {"ngram K=6": run(order, "ngram", 6), "ngram K=3": run(order, "ngram", 3), "suffix": run(order, "suffix")}
        knobs = {name: run(order, "suffix", **kw) for name, kw in grid.items()}
        for label, cost in COSTS.items():
            base = rate(res["suffix"], range(n), cost)
            line = [f"order {seed}, {label}: suffix {base:.2f} tok/s"]
            for name in ("ngram K=6", "ngram K=3"):
                line.append(f"{name} {rate(res[name], range(n), cost) / base:.3f}")
            pick = sum(res['suffix'][i][0] for i in range(n)) / sum(
                min(secs(res["ngram K=6"][i], cost), secs(res["ngram K=3"][i], cost), secs(res["suffix"][i], cost))
                for i in range(n))
            line.append(f"per-request hindsight among the three {pick / base:.3f}")
            best_ngram = {c: max(rate(res[m], [i for i in range(n) if rows[i][0] == c], cost)
                            / rate(res["suffix"], [i for i in range(n) if rows[i][0] == c], cost)
                            for m in ("ngram K=6", "ngram K=3")) for c in classes}
            line.append("best n-gram / suffix per class " + " ".join(f"{c} {v:.2f}" for c, v in best_ngram.items()))
            best_global = max(knobs, key=lambda k: rate(knobs[k], range(n), cost))
            line.append(f"best single knob setting ({best_global}) {rate(knobs[best_global], range(n), cost) / base:.3f}")
            line.append("min_prob alone (factor 1.0 offset 0.0) " + " ".join(
                f"{p} {rate(knobs[f'factor 1.0 offset 0.0 min_prob {p}'], range(n), cost) / base:.3f}" for p in PROBS))
            gains = []
            for rep in range(20):  # per-class knob choice, chosen on one half of the prompts, judged on the other
                a = set(random.Random(rep).sample(range(n), n // 2))
                b = [i for i in range(n) if i not in a]
                choice = {c: max(knobs, key=lambda k: rate(knobs[k], [i for i in a if rows[i][0] == c] or b, cost))
                          for c in classes}
                gains.append(sum(secs(res["suffix"][i], cost) for i in b)
                             / sum(secs(knobs[choice[rows[i][0]]][i], cost) for i in b))
            line.append(f"per-class knob choice, cross-validated {np.mean(gains):.3f} ({min(gains):.3f}-{max(gains):.3f})")
            print("; ".join(line))


if __name__ == "__main__":
    main()
