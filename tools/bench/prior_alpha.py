"""Cold-start n-gram (or suffix) acceptance per workload class, from the tune half of the prompts only.

    python -m tools.bench.prior_alpha [--config cluster/configs/local-cpu.yaml] [--pool ngram]
        [--method ngram|suffix] [--prompts FILE ...] [--split tune] [--max-tokens 128] [--min-prompts 5]

Decodes every prompt of the split greedily without speculation in one offline vLLM engine built like
the pool's (`deployments.engine.engine_kwargs`), replays each output through vLLM's own n-gram matcher
at the pool's `ngram_min..ngram_max` with K = the pool's max_k (`tools.bench.k_replay.replay`), and
prints α per class (as the router classifies the prompt): the chance a draft is accepted given the
ones before it were, counted as the engine's per-request acceptance counts it (each accepted draft a
success, each step whose drafts were not all accepted one failure), and the share of steps that
found a draft at all. A class with fewer than `--min-prompts` prompts is served by `"*"`, pooled
over those thin classes. The output is the pool's `prior_alpha` and `prior_draft_rate` lines.

`--method suffix` replays the pool's SuffixDecoding settings instead (`PoolConfig.suffix`) through
arctic-inference's suffix tree, over the prompts in file order with one cache, so each request's
drafts may come from the outputs of the requests before it, as in a serving engine (the line is
the pool's `suffix.prior_alpha`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from collections import defaultdict
from types import SimpleNamespace
from typing import Iterable, Optional, Sequence

from tools.bench.anchors import stock_engine_args, stock_env
from tools.bench.k_replay import StaticK, Step, ngram_proposer, replay
from tools.bench.split import TUNE, SPLITS, keep
from tools.bench.workload import load_prompts
from cluster.config import load_config
from cluster.ops.models import resolve_model
from cluster.routing.classifier import classify
from cluster.speculation import SpecMode

POOLED = "*"


def counts(steps: Iterable[Step]) -> tuple[int, int, int, int]:
    """(successes, failures, drafting steps, steps) of one request's replayed steps.

    >>> counts([Step(6, 6, 6), Step(6, 3, 1), Step(6, 0, 0)])
    (7, 1, 2, 3)
    """
    s = f = drafting = n = 0
    for step in steps:
        n += 1
        if step.drafted:
            drafting += 1
            s += step.accepted
            f += 1 if step.accepted < step.drafted else 0
    return s, f, drafting, n


def class_alphas(per_request: Sequence[tuple[str, tuple[int, int, int, int]]], min_prompts: int = 5) -> dict[str, float]:
    """α per class from (class, counts) rows. `"*"`, which serves every class not listed, is pooled
    over the thin classes' prompts (over all prompts when no class is thin).

    >>> class_alphas([("a", (8, 2, 5, 9)), ("a", (6, 4, 5, 9)), ("b", (1, 9, 5, 9))], min_prompts=2)
    {'a': 0.7, '*': 0.1}
    >>> class_alphas([("a", (8, 2, 5, 9))], min_prompts=1)
    {'a': 0.8, '*': 0.8}
    """
    by: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for cls, (s, f, _, _) in per_request:
        by[cls][0] += s
        by[cls][1] += f
        by[cls][2] += 1
    listed = {cls for cls, (s, f, n) in by.items() if n >= min_prompts and s + f > 0}
    out = {cls: round(by[cls][0] / (by[cls][0] + by[cls][1]), 2) for cls in sorted(listed)}
    rest = [v for cls, v in by.items() if cls not in listed] or list(by.values())
    s, f = sum(v[0] for v in rest), sum(v[1] for v in rest)
    out[POOLED] = round(s / (s + f), 2) if s + f else 0.0
    return out


def class_draft_rates(per_request: Sequence[tuple[str, tuple[int, int, int, int]]], min_prompts: int = 5) -> dict[str, float]:
    """The share of steps that drafted, per class, pooled into `"*"` as `class_alphas` pools α
    (the same classes are listed, so the two lines go together).

    >>> class_draft_rates([("a", (8, 2, 5, 9)), ("a", (6, 4, 4, 9)), ("b", (1, 9, 3, 9))], min_prompts=2)
    {'a': 0.5, '*': 0.33}
    """
    listed = set(class_alphas(per_request, min_prompts)) - {POOLED}
    by: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for cls, (_, _, drafting, steps) in per_request:
        key = cls if cls in listed else POOLED
        by[key][0] += drafting
        by[key][1] += steps
    if POOLED not in by:  # no thin class: "*" pools every prompt
        by[POOLED] = [sum(v[0] for v in by.values()), sum(v[1] for v in by.values())]
    return {cls: round(d / n, 2) if n else 0.0 for cls, (d, n) in sorted(by.items(), key=lambda kv: (kv[0] == POOLED, kv[0]))}


def position_acceptance(steps: Iterable[Step]) -> str:
    """Per draft position j (1-based): the share of steps that drafted j tokens or more and had the
    first j - 1 accepted in which the j-th was accepted too; `j:share(steps)`.

    >>> position_acceptance([Step(3, 3, 3), Step(3, 3, 1), Step(3, 2, 0)])
    '1:0.67(3) 2:0.50(2) 3:1.00(1)'
    """
    out = []
    for j in range(1, max((s.drafted for s in steps), default=0) + 1):
        reached = [s for s in steps if s.drafted >= j and s.accepted >= j - 1]
        if reached:
            out.append(f"{j}:{sum(1 for s in reached if s.accepted >= j) / len(reached):.2f}({len(reached)})")
    return " ".join(out)


class SuffixReplay:
    """Replays requests one after another through one suffix cache, as the engine's lookup
    proposer drafts for mode suffix (`cluster.engine.lookup_proposer`). `settings`: the pool's
    suffix settings (max_tree_depth, max_cached_requests, max_spec_factor, max_spec_offset,
    min_token_prob)."""

    def __init__(self, settings):
        # lazy: an optional native extension (scripts/bootstrap.sh builds it); only --method suffix needs it
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.s = settings
        self.cache = SuffixDecodingCache(max_tree_depth=settings.max_tree_depth,
                                         max_cached_requests=settings.max_cached_requests)
        self.n = 0

    def steps(self, prompt_ids: Sequence[int], output_ids: Sequence[int], k: int) -> list[Step]:
        import numpy as np

        self.n += 1
        rid, seen = f"r{self.n}", [len(prompt_ids)]
        self.cache.start_request(rid, np.asarray(prompt_ids, dtype=np.int32))

        def propose(context, k):
            self.cache.add_active_response(rid, [int(t) for t in context[seen[0]:]])
            seen[0] = len(context)
            return np.asarray(self.cache.speculate(
                rid, np.asarray(context[-self.s.max_tree_depth:], dtype=np.int32), max_spec_tokens=k,
                max_spec_factor=self.s.max_spec_factor, max_spec_offset=self.s.max_spec_offset,
                min_token_prob=self.s.min_token_prob).token_ids, dtype=np.int32)

        steps = replay(prompt_ids, output_ids, StaticK(k), propose)
        self.cache.add_active_response(rid, [int(t) for t in list(prompt_ids) + list(output_ids)][seen[0]:])
        self.cache.stop_request(rid)
        return steps


def replay_cut(rows: Sequence[tuple[str, Sequence[int], Sequence[int]]], min_token_prob: float,
               seeds: Sequence[int] = (0, 1, 2), k: int = 16, depth: int = 24) -> tuple[float, float, float]:
    """Greedy (name, prompt_ids, output_ids) rows replayed through one fresh suffix cache per seed,
    in that seed's shuffled order, drafting up to `k` with `min_token_prob` as the cut: tokens a
    step yields, drafts a step verifies, and the share of drafts accepted, over all seeds."""
    toks = steps = drafted = accepted = 0
    for seed in seeds:
        order = list(range(len(rows)))
        random.Random(seed).shuffle(order)
        cache = SuffixReplay(SimpleNamespace(max_tree_depth=depth, max_cached_requests=10000, max_spec_factor=1.0,
                                             max_spec_offset=0.0, min_token_prob=min_token_prob))
        for i in order:
            _, ids, out = rows[i]
            st = cache.steps(ids, out, k)
            toks, steps = toks + len(out), steps + len(st)
            drafted += sum(x.drafted for x in st)
            accepted += sum(x.accepted for x in st)
    return toks / max(steps, 1), drafted / max(steps, 1), accepted / max(drafted, 1)


def _greedy_outputs(config_path: str, pool_name: str, split: str, max_tokens: int,
                    files: Sequence[str] = ()) -> list[tuple[str, list[int], list[int]]]:
    """(class, prompt ids, greedy output ids) per prompt of the split, from a plain engine built like
    the pool's (the stock anchors' arguments and environment: `tools.bench.anchors`)."""
    config = load_config(config_path)
    pool = config.pools[pool_name]
    kwargs = stock_engine_args(pool, resolve_model(pool.model, config), pool.model, config.models[pool.model].dtype)
    os.environ.update(stock_env(pool))  # the pool's KV cache size and Intel OpenMP, for the spawned engine
    from vllm import LLM, SamplingParams

    llm = LLM(**kwargs)
    tok = llm.get_tokenizer()
    rows = []
    prompts = [p for f in files for p in keep(load_prompts(f), split)] if files else keep(load_prompts(), split)
    for p in prompts:
        text = tok.apply_chat_template(p.messages, tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False).input_ids
        if len(ids) + max_tokens < pool.max_model_len:
            rows.append((classify(messages=p.messages), ids))
    # The engine decodes the very ids the matcher replays (no second tokenization).
    outs = llm.generate([{"prompt_token_ids": ids} for _, ids in rows],
                        SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    return [(cls, ids, list(o.outputs[0].token_ids)) for (cls, ids), o in zip(rows, outs)]


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.prior_alpha", description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="cluster/configs/local-cpu.yaml")
    ap.add_argument("--pool", default="ngram")
    ap.add_argument("--method", default="ngram", choices=("ngram", "suffix"))
    ap.add_argument("--prompts", nargs="*", default=(), help="Spec-Bench-format files, in order (default: the shipped dev file)")
    ap.add_argument("--k", type=int, default=None, help="K of the replay (default: the pool's bound for the method)")
    ap.add_argument("--split", default=TUNE, choices=SPLITS)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--min-prompts", type=int, default=5)
    args = ap.parse_args(argv)

    pool = load_config(args.config).pools[args.pool]
    outputs = _greedy_outputs(args.config, args.pool, args.split, args.max_tokens, args.prompts)
    k = args.k or pool.mode_max_k(SpecMode(args.method))
    if args.method == "suffix":
        suffix = SuffixReplay(pool.suffix_settings)
        steps = [(cls, suffix.steps(ids, out, k)) for cls, ids, out in outputs]
    else:
        propose = ngram_proposer(pool.ngram_min, pool.ngram_max)
        steps = [(cls, replay(ids, out, StaticK(k), propose)) for cls, ids, out in outputs]
    rows = [(cls, counts(st)) for cls, st in steps]
    print("# accepted at draft position j given j-1 accepted (drafted there): "
          + position_acceptance([s for _, st in steps for s in st]), file=sys.stderr)
    for cls in sorted({c for c, _ in rows}):
        s, f, d, n = (sum(r[1][i] for r in rows if r[0] == cls) for i in range(4))
        print(f"# {cls}: {sum(1 for r in rows if r[0] == cls)} prompts, alpha {s / max(s + f, 1):.2f}, "
              f"drafting steps {d / max(n, 1):.2f}", file=sys.stderr)
    prefix = "suffix." if args.method == "suffix" else ""
    print(f"{prefix}prior_alpha: " + json.dumps(class_alphas(rows, args.min_prompts)))
    print(f"{prefix}prior_draft_rate: " + json.dumps(class_draft_rates(rows, args.min_prompts)))
    return 0


if __name__ == "__main__":  # vLLM spawns its engine core: the guard is required
    sys.exit(main())
