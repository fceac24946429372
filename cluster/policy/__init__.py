"""Adaptive choice of speculative mode and K: pure functions over plain data (no I/O, no clock).

Contract: `choose_auto(pools, router, workload_class, tuning, rng)` returns the `Decision` that
maximises the expected goodput of one request of `workload_class` at each pool's current load,
from the tuned state `tuning` (a `TuningView`, or None for priors only): the pool and drafting
method, each candidate scored at its best K. The request's K itself is chosen by its engine at
every step (`cluster.engine.step_k`), starting from the class's α learned here.

Modules, each built on the ones before it: `cells` (load buckets and the tuning state),
`params` (knobs and cold-start priors), `model` (expected tokens per step), `cost` (step cost and
score), `choice` (`choose_auto`), `rows` (`tuning_rows`).

Words are those of `cluster.speculation`; in addition:

- **alpha** (α): the chance that a drafted token is accepted given the ones before it were
  (a geometric model), in the steps that drafted anything.
- **draft rate** (p): the share of steps that drafted anything. A model drafter always drafts
  (p = 1); n-gram lookup drafts only where the text repeats (8-55% of steps per class for SmolLM2
  here) and a step without drafts costs nothing extra. Expected output tokens per step with K:
  E(α, K, p) = 1 + p·(α + ... + α^K) = 1 + p·((1 - α^(K+1)) / (1 - α) - 1).
  Draftless steps are not rejections: counted as such they would put α for n-gram at 0.10-0.30
  where its drafted tokens are accepted at 0.6-0.9, and make K = 1 look best where K = 4-5 is.
- **accepted runs**: drafts come in bursts (n-gram lookup copies a span whole or misses at once),
  not independently per position, and a run that K cuts short goes on in the next step. Each
  response reports its runs (`cluster.speculation.accepted_runs`: [L] = runs of L tokens, a
  property of the text and the proposer, not of K), the tuning state sums them per class, and
  E_run(K) = (D + sum (L + 1)·g_L) / (D + sum g_L·ceil((L + 1) / (K + 1))) (D: draftless steps)
  is exact where the geometric E is not: it knows that K = 5 saves no step over K = 4 on a copy of
  12 tokens. E(K) blends E_run with the geometric E (the prior) by the runs' count against
  `prior_runs`. (Fitted at K = 6, the geometric model expects ~10% more tokens per step from
  K = 6 than from K = 4 for summarization, where the same prompts measure 1.88 and 1.83.)
- **rejected steps**: steps that ended on a rejected draft, or drafted nothing (the tuning state
  counts both). The draftless ones (steps minus the exposure of draft position 0) are taken out
  for α: its estimate is accepted / (accepted + rejected drafting steps), the maximum-likelihood
  estimate under the geometric model truncated at the drafted length
  (`cluster.state.tuning_cells.increments_from_stats` counts the trials); p's is drafting steps / steps.
- **step cost** (f, c): extra time of one step, relative to a plain step at the same load:
  step time(K) / step time(0) = 1 + f + c·K for K > 0, where c (cost per K) = verify cost (grows
  with batch size: verifying K more tokens per request is nearly free at batch 1 and not at batch
  16) + the proposer's cost per draft token, and f is the proposer's fixed cost of a step that
  drafts at all (a model drafter's extra forward pass and its bookkeeping: the EAGLE pool's
  configured prior is 0.32 of a plain step per step and 0.02 per token, BENCHMARKS.md section 9.3;
  n-gram lookup costs nothing). The prior is the pool's `prior_draft_cost` (measured on its hardware)
  or a built-in table. Measured decode seconds per step of a mode against plain decoding in the
  same load bucket fit both terms apart (regression of step time on K over the requests) when K
  varied, else scale the prior's f + c·K; blended with the prior by step counts. Both terms are
  needed: a drafting n-gram step pays ~0.2 of a plain step and a token ~0.02 more at 4 streams,
  which one per-token term read at the mean K prices at 0.087 per token, and a GPU-like linear
  1 + 0.05·K for EAGLE prices K = 1 10% faster than plain decoding where it measures 0.85x.
  The line is the prior of a **step time per K**: every request adds its steps and decode time to
  its K's counters (`s{K}` / `t{K}`), and where a K has enough steps its measured overhead (each
  class against its own plain steps) replaces the line by step counts (`step_overheads`). The
  cost is not linear here: n-gram steps at K = 6 take ~5% more than at K = 4, and at K = 1 ~6%
  more than plain ones (`MEASURED_STEP_REL` in tests/cluster/test_policy.py), which a line fitted
  through auto's traffic reads as 0.004 per draft token.
- **score** of (pool, K): expected output tokens per unit of plain-step time at batch 1,
  E(K) / (step_rel(batch) · (1 + overhead(K))), overhead(K) = f + c·K or its measured value at K
  — proportional to the request's tokens per second.
- **load bucket**: the batch the request joins (`PoolView.load_batch + 1`: the pool's batch per
  replica, or the whole hardware group's load when pools share hardware) bucketed as
  1, 2-3, 4-7, 8-15, 16+. A request is decided in the bucket of its admission; its statistics are
  recorded in the bucket of the mean load it met over its life (`cluster.routing.route.LoadMeter`).
- **joining step time**: pools of one hardware group are engines time-sharing the same cores; a
  request joining an idle one while another is busy meets both engines' steps
  (`joining_step_rel`), so traffic stays on the busy engine unless the other is far better.

α, p and the runs are learned per (mode, workload class) from every load bucket's traffic
(acceptance depends on the text and the drafter, not on the batch); cost per K and step time per
bucket. Cold start uses priors (p = 1 until steps say otherwise): the pool's measured
`prior_alpha` when configured, else a Spec-Bench-like table (n-gram α per class; at batch 16
speculation costs throughput, 63.8 vs 70.1 tok/s here), and converges from live traffic as counts
outweigh the prior's pseudo-counts. Exploration: with probability ε (shrinking with data) every
pool draws α from its Beta posterior and its run shares from their Dirichlet posterior, and the
best sampled (pool, K) wins (Thompson sampling), so a confidently worse pool is almost never
tried; the draw is bounded by its regret: only a (pool, K) whose score at an optimistic α
(2 sigma up) comes within 5% of the exploiting choice may be drawn, so a draw never buys a
request plain decoding (which teaches nothing about α) where speculation is known to pay; counts
are capped so the posterior never freezes. Ties (within `tie_tol`) go to the cheapest proposer for K = 0, then to the less
loaded pool, or, for pools that share hardware, to the busier one.
"""

from cluster.policy.cells import (
    BUCKET_BATCH, BUCKET_NAMES, LOAD_BUCKETS, MAX_K, CellKey, CellStats, TuningView, load_bucket,
)
from cluster.policy.choice import (
    Candidate, beta_upper, choose_auto, exploration_rate, explorable_ks, score_pool,
)
from cluster.policy.cost import (
    best_k, cost_per_k, joining_step_rel, measured_overheads, prior_cost_per_k, prior_step_cost, score, score_at,
    score_tokens, step_cost, step_overheads, step_time_rel,
)
from cluster.policy.model import (
    alpha_posterior, class_model, class_runs, draft_rate, expected_tokens, expected_tokens_per_step, prior_alpha,
    run_tokens_per_step,
)
from cluster.policy.params import (
    DEFAULT_PARAMS, PRIOR_ALPHA_BY_MODE, PRIOR_ALPHA_NGRAM, PRIOR_DRAFT_COST, PRIOR_DRAFT_STEP_COST, PolicyParams,
)
from cluster.policy.rows import tuning_rows

__all__ = [
    "BUCKET_BATCH", "BUCKET_NAMES", "DEFAULT_PARAMS", "LOAD_BUCKETS", "MAX_K", "PRIOR_ALPHA_BY_MODE",
    "PRIOR_ALPHA_NGRAM", "PRIOR_DRAFT_COST", "PRIOR_DRAFT_STEP_COST", "Candidate", "CellKey", "CellStats",
    "PolicyParams", "TuningView", "alpha_posterior", "best_k", "beta_upper", "choose_auto", "class_model",
    "class_runs", "cost_per_k", "draft_rate", "expected_tokens", "expected_tokens_per_step",
    "exploration_rate", "explorable_ks", "joining_step_rel",
    "load_bucket", "measured_overheads", "prior_alpha", "prior_cost_per_k", "prior_step_cost", "run_tokens_per_step",
    "score", "score_at", "score_pool", "score_tokens", "step_cost", "step_overheads", "step_time_rel", "tuning_rows",
]
