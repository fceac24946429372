"""Offline acceptance of a drafter against its target, by greedy verification in PyTorch.

Contract: on the target's greedy continuations of held-out prompts, every round start t in the
continuation is scored as vLLM's greedy rule would score it (accept while d_j == argmax L_{t+j});
the result is the acceptance rate per position and the acceptance length for K = 1..K_max.
Teacher forcing is exact here: while drafts match, the drafter's inputs are the text's tokens.
"""

from __future__ import annotations

import torch

from cluster.distill.data import features


def accepted_counts(match: torch.Tensor) -> torch.Tensor:
    """match: [N, K] bool (draft j of round n equals the target's argmax) -> accepted [N]."""
    return torch.cumprod(match.long(), dim=-1).sum(-1)


def summarize(accepted: torch.Tensor, k_max: int) -> dict:
    """accepted: [N] at K = k_max -> alpha_j (j = 1..k_max) and acceptance length per K."""
    a = accepted.float()
    n = max(len(a), 1)
    return {
        "rounds": len(a),
        "alpha": [round(float((a >= j).sum()) / n, 4) for j in range(1, k_max + 1)],
        "acceptance_length": {k: round(float(a.clamp(max=k).sum()) / n + 1, 4) for k in range(1, k_max + 1)},
    }


def _starts(T: int, prompt_len: int, k: int) -> torch.Tensor:
    """Round starts whose bonus x_{t+1} is generated and whose K drafts lie inside the text."""
    return torch.arange(max(prompt_len - 1, 0), max(T - k, prompt_len - 1, 0))


@torch.no_grad()
def eagle_match(head, target, ids: torch.Tensor, prompt_len: int, k: int) -> torch.Tensor:
    """ids: [T] -> match [N, k] for an EAGLE head."""
    f = features(target, ids)  # [T, H]
    best = target.lm_head(f).argmax(-1)  # [T]: argmax L_t
    outs = head.unroll(target.model.embed_tokens, ids[None], f[None], k)  # k x [1, T, H]
    drafts = torch.stack([target.lm_head(o[0]).argmax(-1) for o in outs], -1)  # [T, k]: d_j at start t
    t = _starts(len(ids), prompt_len, k)  # [N]
    j = torch.arange(1, k + 1)  # [k]
    return drafts[t] == best[t[:, None] + j[None, :]]  # [N, k]


@torch.no_grad()
def draft_model_match(draft, target, ids: torch.Tensor, prompt_len: int, k: int) -> torch.Tensor:
    """ids: [T] -> match [N, k] for a draft model: d_j of round t is the drafter's argmax at t+j."""
    best = target(input_ids=ids[None], use_cache=False).logits[0].argmax(-1)  # [T]
    same = draft(input_ids=ids[None], use_cache=False).logits[0].argmax(-1) == best  # [T]
    t = _starts(len(ids), prompt_len, k)
    return same[t[:, None] + torch.arange(1, k + 1)[None, :]]  # [N, k]


def evaluate(kind: str, drafter, target, samples: list[dict], k_max: int = 6) -> dict:
    match_fn = eagle_match if kind == "eagle" else draft_model_match
    was = drafter.training
    drafter.eval()
    acc = [accepted_counts(match_fn(drafter, target, s["ids"], s["prompt_len"], k_max)) for s in samples]
    drafter.train(was)
    return {"kind": kind, "sequences": len(samples), **summarize(torch.cat(acc) if acc else torch.zeros(0), k_max)}


def format_report(r: dict) -> str:
    alpha = " ".join(f"{a:.3f}" for a in r["alpha"])
    al = " ".join(f"K{k}={v:.3f}" for k, v in r["acceptance_length"].items())
    return f"eval[{r['kind']}] {r['sequences']} seqs, {r['rounds']} rounds | alpha_j: {alpha} | acceptance length: {al}"
