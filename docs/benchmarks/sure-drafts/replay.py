"""Above the batch bound, how many suffix drafts is the tree sure of? Tune half of Spec-Bench only.

    .venv/bin/python docs/benchmarks/sure-drafts/replay.py [--outputs /tmp/tune_outputs.json]

Greedy outputs (128 tokens) of the tune halves, as `../method-ceiling/replay.py` makes them (its
`--outputs` file); the Spec-Bench rows are replayed through one suffix cache in 3 shuffled orders
(`cluster.bench.prior_alpha.replay_cut`, K 16) with `min_token_prob` cut at each value: tokens a
step yields, drafts a step verifies, and the share of drafts accepted.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.getcwd())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--outputs", default="/tmp/tune_outputs.json")
    args = ap.parse_args()
    if not os.path.exists(args.outputs):
        sys.exit(f"{args.outputs}: run docs/benchmarks/method-ceiling/replay.py first (it writes the greedy outputs)")
    from cluster.bench.prior_alpha import replay_cut
    from cluster.bench.split import TUNE, keep
    from cluster.bench.workload import load_prompts

    # The Spec-Bench tune half comes first in the outputs file (the repeated-structure one after it).
    rows = json.load(open(args.outputs))[:len(keep(load_prompts("cluster/data/specbench-dev.jsonl"), TUNE))]
    for p in (0.5, 0.6, 0.7, 0.8, 0.9, 0.95):
        tau, delta, share = replay_cut(rows, p)
        print(f"min_token_prob {p}: tokens/step {tau:.3f}  drafts/step {delta:.3f}  accepted/drafted {share:.3f}")


if __name__ == "__main__":
    main()
