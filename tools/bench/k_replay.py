"""Replay a bench's greedy outputs through n-gram lookup: exact tokens per step of any K policy.

At temperature 0 the output is the same text whatever the speculation (`specserve bench` checks it),
so the drafts n-gram lookup makes at each step, and how many of them the target accepts, follow from
the prompt and the output alone: the draft is what vLLM's own matcher
(`vllm.v1.spec_decode.ngram_proposer`) proposes from the context, and it is accepted up to its first
token that differs from the recorded output. That gives the tokens per step of *any* K policy — a
static K, a K per task or per prompt chosen with hindsight, or a K that changes within a request with
its own acceptance — without serving it. Time per step comes from the same run: each static
`ngram:K`'s measured decode time per step relative to `none`'s (same prompts, same repeats), charged
to every step taken at that K. So this answers "how much could a K policy win here at all?" before a
47-minute run is spent on it.

    python -m tools.bench.k_replay SAMPLES.json [--config cluster/configs/local-cpu.yaml]
        [--prompts cluster/data/specbench-heldout.jsonl] [--ngram MIN,MAX] [--price k|drafts]
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

import numpy as np

from tools.bench.plan import NONE, parse_config
from tools.bench.report import load_samples
from tools.bench.step_split import _greedy
from tools.bench.workload import load_prompts
from cluster.config import load_config
from cluster.ops.models import resolve_model
from cluster.speculation import SpecMode

Propose = Callable[[np.ndarray, int], np.ndarray]  # (context token ids, K) -> draft token ids


@dataclass(frozen=True)
class Step:
    k: int  # the K the policy set for the step
    drafted: int  # drafts the proposer made (fewer than K when the match ends sooner, 0 when none)
    accepted: int  # leading drafts equal to the recorded output


class StaticK:
    """The same K every step."""

    def __init__(self, k: int):
        self.name, self._k = f"static {k}", k

    def start(self):
        return self._k

    def k(self, state) -> int:
        return state

    def update(self, state, step: Step):
        return state


class GrowOnFullAccept:
    """A K that follows the request's own acceptance: +`up` after a step that accepted a full K
    drafts (a copy run goes on), back to `base` after a rejection (as Hugging Face's assisted
    generation heuristic does, here bounded by `top`)."""

    def __init__(self, base: int, top: int, up: int = 1):
        self.name, self._base, self._top, self._up = f"grow {base}..{top} +{up}", base, top, up

    def start(self):
        return self._base

    def k(self, state) -> int:
        return state

    def update(self, state, step: Step):
        if step.drafted == 0:
            return state
        if step.accepted == step.drafted == step.k:
            return min(self._top, state + self._up)
        return self._base


def grow_policies(costs: dict[int, float]) -> list[GrowOnFullAccept]:
    """The growing-K policies the run can price: every K from the base to the top one the run
    measured (the largest priced K stands for the engine's K_max, which bounds a growing K too).

    >>> [p.name for p in grow_policies({0: 1, 1: 1, 2: 1, 4: 1, 5: 1})]  # K = 3 not run: from 4 only
    ['grow 4..5 +1', 'grow 4..5 +2']
    """
    top = max(costs)
    return [GrowOnFullAccept(b, top, u) for b in (2, 3, 4, 5) for u in (1, 2)
            if top > b and all(k in costs for k in range(b, top + 1))]


def replay(prompt_ids: Sequence[int], output_ids: Sequence[int], policy, propose: Propose) -> list[Step]:
    """The steps decoding `output_ids` after `prompt_ids` takes under `policy`. The first output
    token comes from the prefill; each step then emits its accepted drafts plus one token.

    >>> table = lambda ctx, k: np.array([5, 6, 7][:k])  # always proposes 5, 6, 7
    >>> [(s.drafted, s.accepted) for s in replay([1], [9, 5, 6, 8, 5, 6, 7, 4], StaticK(3), table)]
    [(3, 2), (3, 3)]
    """
    out = np.asarray(output_ids, dtype=np.int32)
    context = np.concatenate([np.asarray(prompt_ids, dtype=np.int32), out[:1]])
    pos, steps, state = 1, [], policy.start()
    while pos < len(out):
        k = max(int(policy.k(state)), 0)
        drafts = propose(context, k)[:k] if k else np.empty(0, dtype=np.int32)
        accepted = 0  # drafts past the recorded end cannot be checked (the request stops there)
        while accepted < len(drafts) and pos + accepted < len(out) and drafts[accepted] == out[pos + accepted]:
            accepted += 1
        step = Step(k, len(drafts), accepted)
        steps.append(step)
        emitted = min(accepted + 1, len(out) - pos)
        context = np.concatenate([context, out[pos:pos + emitted]])
        pos += emitted
        state = policy.update(state, step)
    return steps


def ngram_proposer(min_n: int, max_n: int) -> Propose:
    """vLLM's n-gram matcher (the function its NgramProposer calls per request)."""
    from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens as match

    return lambda context, k: match(np.asarray(context, dtype=np.int32), min_n, max_n, 1 << 30, k)


def step_cost_by_k(samples: Iterable, ks: Iterable[int], phase: str = "compare") -> dict[int, float]:
    """Decode time per step of each static `ngram:K`, relative to `none`, over the (prompt, repeat)
    pairs both ran at one stream (drift between repeats cancels in the pairing). K = 0 is 1.

    >>> from tools.bench.metrics import Sample
    >>> mk = lambda c, s, t: Sample(phase="compare", config=c, prompt_id="p", category="qa", task="qa",
    ...     temperature=0.0, concurrency=1, token_ids=[1] * 9, latency_s=t + 0.1, ttft_s=0.1, spec={"steps": s})
    >>> step_cost_by_k([mk("none", 8, 0.8), mk("ngram:4", 5, 0.55)], [4])
    {0: 1.0, 4: 1.1}
    """
    per = {(x.config, x.prompt_id, x.repeat): (x.latency_s - x.ttft_s, int(x.spec["steps"]))
           for x in _greedy(samples, 1, phase)}
    costs = {0: 1.0}
    for k in ks:
        t = s = t0 = s0 = 0.0
        for (config, pid, rep), (secs, steps) in per.items():
            plain = per.get(("none", pid, rep))
            if config == f"ngram:{k}" and plain:
                t, s, t0, s0 = t + secs, s + steps, t0 + plain[0], s0 + plain[1]
        if s and s0:
            costs[k] = round((t / s) / (t0 / s0), 6)
    return costs


MAX_DRAFTS = 16  # PoolConfig.max_k's bound


def step_time_by_drafts(samples: Iterable, cases: Sequence["Case"], propose: Propose,
                        phase: str = "compare") -> dict[int, float]:
    """Decode time of a step by the number of tokens it drafted (0 = a plain step), relative to a plain
    step: least squares of each one-stream greedy `none` / `ngram:K` request's decode time on its
    steps split by drafts, the split replayed at its K. Tells apart what `step_cost_by_k` averages:
    whether a K is dear because it drafts more often, or because its steps verify a dearer count
    of tokens (here 1 and 6 drafts cost more than 2-5).

    >>> table = lambda ctx, k: np.array([5] * k, dtype=np.int32)  # always proposes k 5s, all accepted
    >>> from tools.bench.metrics import Sample
    >>> mk = lambda c, s: Sample(phase="compare", config=c, prompt_id="p", category="qa", task="qa",
    ...     temperature=0.0, concurrency=1, token_ids=[0] + [5] * 12, latency_s=s + 0.1, ttft_s=0.1,
    ...     spec={"steps": 1})  # the count is the replay's; the bench's only marks a usable sample
    >>> case = Case("p", "qa", (1,), tuple([0] + [5] * 12))
    >>> step_time_by_drafts([mk("none", 1.2), mk("ngram:2", 0.44), mk("ngram:3", 0.45)], [case], table)
    {0: 1.0, 2: 1.1, 3: 1.5}
    """
    by_id = {c.prompt_id: c for c in cases}
    rows, times, seen = [], [], {}
    for x in _greedy(samples, 1, phase):
        config = parse_config(x.config)[0]
        if (config.mode not in (NONE, SpecMode.NGRAM.value) or config.k is None or x.prompt_id not in by_id):
            continue
        k = config.k
        if (x.prompt_id, k) not in seen:
            c = by_id[x.prompt_id]
            seen[x.prompt_id, k] = [s.drafted for s in replay(c.prompt_ids, c.output_ids, StaticK(k), propose)]
        rows.append(np.bincount(seen[x.prompt_id, k], minlength=MAX_DRAFTS + 1)[:MAX_DRAFTS + 1])
        times.append(x.latency_s - x.ttft_s)
    if not rows:
        return {}
    a = np.array(rows, dtype=float)
    used = [d for d in range(a.shape[1]) if a[:, d].any()]
    coef, *_ = np.linalg.lstsq(a[:, used], np.array(times), rcond=None)
    t = dict(zip(used, coef))
    return {d: round(float(v / t[0]), 6) for d, v in t.items()} if t.get(0, 0) > 0 else {}


def steps_cost(steps: Sequence[Step], costs: dict[int, float], by_drafts: Optional[dict[int, float]] = None) -> float:
    """Time of `steps` in plain steps: each step costs its K's measured step time, or, with
    `by_drafts` (`step_time_by_drafts`), the time of a step that drafted as many tokens as it did
    (a grown K's steps draft more than the static K's average step; counts beyond the table cost
    its largest).

    >>> st = [Step(4, 4, 4), Step(4, 0, 0)]
    >>> steps_cost(st, {4: 1.05}), steps_cost(st, {4: 1.05}, {0: 1.0, 2: 1.1, 4: 1.2})
    (2.1, 2.2)
    """
    if by_drafts:
        top = max(by_drafts)
        return sum(by_drafts.get(s.drafted, by_drafts[top] if s.drafted > top else costs[s.k]) for s in steps)
    return sum(costs[s.k] for s in steps)


@dataclass(frozen=True)
class Case:
    prompt_id: str
    task: str
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]


def cases_from(samples: Iterable, prompts_file: Path, tokenizer, phase: str = "compare") -> list[Case]:
    """One case per prompt: its chat-templated prompt tokens (the bench's message for it) and
    `none`'s greedy output tokens."""
    prompts = {p.question_id: p for p in load_prompts(prompts_file)}
    seen, cases = set(), []
    for x in _greedy(samples, 1, phase):
        if x.config == "none" and x.prompt_id not in seen:
            seen.add(x.prompt_id)
            ids = tokenizer.apply_chat_template(prompts[x.prompt_id].messages, add_generation_prompt=True)
            ids = ids["input_ids"] if not isinstance(ids, list) else ids
            cases.append(Case(x.prompt_id, x.task, tuple(ids), tuple(x.token_ids)))
    return cases


def analyse(cases: Sequence[Case], costs: dict[int, float], propose: Propose, policies: Sequence = (),
            chosen: Optional[dict[str, list[int]]] = None, by_drafts: Optional[dict[int, float]] = None) -> dict:
    """Tokens per step and throughput (tokens per plain-step time) of every static K, the per-task and
    per-prompt best K with hindsight, `policies`, and the K `auto` chose (`chosen`: prompt -> Ks). Steps are
    priced by their K, or by their drafts with `by_drafts` (see `steps_cost`)."""
    ks = sorted(k for k in costs if k > 0)
    tokens = {c.prompt_id: len(c.output_ids) - 1 for c in cases}
    static = {c.prompt_id: {k: replay(c.prompt_ids, c.output_ids, StaticK(k), propose) for k in [0] + ks}
              for c in cases}
    time = {p: {k: steps_cost(st, costs, by_drafts) for k, st in by_k.items()} for p, by_k in static.items()}

    def rate(pick: Callable[[str], float]) -> float:
        return sum(tokens.values()) / sum(pick(p) for p in tokens)

    result = {"static": {k: {"tokens_per_step": sum(tokens.values()) / sum(len(static[p][k]) for p in tokens),
                             "rate": rate(lambda p, k=k: time[p][k])} for k in [0] + ks}}
    best = max(result["static"], key=lambda k: result["static"][k]["rate"])
    top = result["static"][best]["rate"]
    result["best_static"] = best
    by_task = defaultdict(list)
    for c in cases:
        by_task[c.task].append(c.prompt_id)
    result["by_task"] = {t: {k: sum(tokens[p] for p in ps) / sum(time[p][k] for p in ps) for k in [0] + ks}
                         for t, ps in sorted(by_task.items())}
    task_k = {t: max(r, key=r.get) for t, r in result["by_task"].items()}
    task_of = {c.prompt_id: c.task for c in cases}
    result["ceilings"] = {
        "per-task best K (hindsight)": rate(lambda p: time[p][task_k[task_of[p]]]) / top,
        "per-prompt best K (hindsight)": rate(lambda p: min(time[p].values())) / top,
    }
    result["task_k"] = task_k
    for pol in policies:
        steps = {c.prompt_id: replay(c.prompt_ids, c.output_ids, pol, propose) for c in cases}
        result["ceilings"][pol.name] = rate(lambda p: steps_cost(steps[p], costs, by_drafts)) / top
    if chosen:
        picked = {p: ks_ for p, ks_ in chosen.items() if p in time and all(k in time[p] for k in ks_)}
        if picked:
            ratio = (sum(len(picked[p]) * tokens[p] for p in picked)
                     / sum(time[p][k] for p in picked for k in picked[p]))
            best_rate = (sum(len(picked[p]) * tokens[p] for p in picked)
                         / sum(len(picked[p]) * time[p][best] for p in picked))
            result["ceilings"]["auto's chosen K, replayed"] = ratio / best_rate
    return result


def auto_choices(samples: Iterable, phase: str = "compare") -> dict[str, list[int]]:
    """prompt -> the n-gram K `auto` ran each of its greedy one-stream requests at (0 for `none`)."""
    out: dict[str, list[int]] = defaultdict(list)
    for x in samples:
        sp = x.spec or {}
        if x.config == "auto" and x.phase == phase and x.ok and x.temperature == 0.0 and x.concurrency == 1:
            if sp.get("mode") in ("ngram", "none"):
                out[x.prompt_id].append(int(sp.get("k", 0)) if sp.get("mode") == "ngram" else 0)
    return dict(out)


def _tokenizer(config_path: str, model: str, override: Optional[str]):
    from transformers import AutoTokenizer

    if override:
        return AutoTokenizer.from_pretrained(override)

    return AutoTokenizer.from_pretrained(resolve_model(model, load_config(config_path)))


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("samples")
    ap.add_argument("--config", default="cluster/configs/local-cpu.yaml")
    ap.add_argument("--prompts", default=None, help="prompts file (default: the one the bench recorded)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the config's model)")
    ap.add_argument("--ngram", default=None,
                    help="prompt_lookup_min,max of the replay (default: the config's n-gram pool's)")
    ap.add_argument("--price", choices=("k", "drafts"), default="k",
                    help="price a step by its K's measured step time (default) or by its drafts' (step_time_by_drafts)")
    args = ap.parse_args(argv)
    meta, samples = load_samples(Path(args.samples))
    costs = step_cost_by_k(samples, range(1, 9))
    if len(costs) < 2:
        print("no paired none / ngram:K one-stream samples to price a step", file=sys.stderr)
        return 2

    pool = next(p for p in load_config(args.config).pools.values() if p.method == SpecMode.NGRAM)
    min_n, max_n = (int(x) for x in args.ngram.split(",")) if args.ngram else (pool.ngram_min, pool.ngram_max)
    tok = _tokenizer(args.config, meta["model"], args.tokenizer)
    cases = cases_from(samples, Path(args.prompts or meta["prompts_file"]), tok)
    propose = ngram_proposer(min_n, max_n)
    by_drafts = step_time_by_drafts(samples, cases, propose)
    r = analyse(cases, costs, propose, grow_policies(costs), auto_choices(samples),
                by_drafts if args.price == "drafts" else None)
    measured = {}
    for k in r["static"]:
        runs = [(len(x.token_ids) - 1, x.spec["steps"]) for x in _greedy(samples, 1, "compare")
                if x.config == (f"ngram:{k}" if k else "none")]
        measured[k] = sum(t for t, _ in runs) / sum(s for _, s in runs) if runs else float("nan")
    best = r["best_static"]
    print(f"# {len(cases)} prompts replayed; step time per K from the run (x none): "
          + " ".join(f"{k}:{c:.3f}" for k, c in costs.items()))
    print("K\ttokens/step replayed\tmeasured\tthroughput vs best static")
    for k, row in r["static"].items():
        print(f"{k}\t{row['tokens_per_step']:.3f}\t{measured[k]:.3f}\t{row['rate'] / r['static'][best]['rate']:.3f}"
              + ("\t<- best" if k == best else ""))
    print("\ntask\t" + "\t".join(f"K={k}" for k in r["static"]))
    for t, row in r["by_task"].items():
        m = max(row.values())
        print(t + "\t" + "\t".join(f"{v / m:.3f}" for v in row.values()))
    print("\nstep time by drafts in the step (x a plain step; least squares over the requests): "
          + " ".join(f"{d}:{v:.3f}" for d, v in by_drafts.items()))
    print(f"\nvs best static (K = {best}; steps priced by {'their drafts' if args.price == 'drafts' else 'their K'}):")
    for name, v in r["ceilings"].items():
        print(f"  {name:36s} {v:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
