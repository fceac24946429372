"""Would a stricter suffix cut pay in full batches? Tune halves of both prompt files only.

    .venv/bin/python docs/benchmarks/suffix-batch-knobs/replay.py [--outputs /tmp/tune_outputs.json]

Greedy outputs (128 tokens) of the tune halves, as `../method-ceiling/replay.py` makes them (its
`--outputs` file), replayed through one suffix cache in 3 shuffled orders
(`tools.bench.prior_alpha.replay_cut`, K 16, the pool's tree depth) with `min_token_prob`
(the tree's cumulative estimate that a draft token is accepted) at each value: tokens a step
yields (tau), drafts a step verifies (delta). In a batch of B requests a step costs B plain
request-steps plus beta for each verified draft token, so a request's goodput relative to plain
decoding is tau / (1 + beta * delta); beta is a draft token's cost against a request's share of a
step, swept because it depends on the machine and the batch size.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.getcwd())

PROBS = (0.1, 0.2, 0.3, 0.4, 0.45, 0.5, 0.55, 0.6, 0.7)
BETAS = (0.1, 0.2, 0.3, 0.4, 0.6)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--outputs", default="/tmp/tune_outputs.json")
    args = ap.parse_args()
    if not os.path.exists(args.outputs):
        sys.exit(f"{args.outputs}: run docs/benchmarks/method-ceiling/replay.py first (it writes the greedy outputs)")
    from tools.bench.prior_alpha import replay_cut
    from tools.bench.split import TUNE, keep
    from tools.bench.workload import load_prompts

    rows = json.load(open(args.outputs))
    n_spec = len(keep(load_prompts("cluster/data/specbench-dev.jsonl"), TUNE))  # Spec-Bench rows come first
    for name, part in (("both tune halves", rows), ("Spec-Bench tune half", rows[:n_spec]),
                       ("repeated-structure tune half", rows[n_spec:])):
        print(f"== {name} ({len(part)} prompts)")
        table(part, replay_cut)


def table(rows, replay_cut):
    stats = {}
    for p in PROBS:
        stats[p] = replay_cut(rows, p)
        print(f"min_token_prob {p}: tau {stats[p][0]:.3f}  delta {stats[p][1]:.3f}  accepted/drafted {stats[p][2]:.3f}")
    print("goodput against plain decoding, tau / (1 + beta * delta); in brackets against min_token_prob 0.1")
    for beta in BETAS:
        g0 = stats[PROBS[0]][0] / (1 + beta * stats[PROBS[0]][1])
        cells = [f"{p}: {t / (1 + beta * d):.3f} [{t / (1 + beta * d) / g0:.3f}]" for p, (t, d, _) in stats.items()]
        print(f"beta {beta}: " + "  ".join(cells))
    print()


if __name__ == "__main__":
    main()
