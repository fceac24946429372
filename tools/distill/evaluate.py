"""Offline acceptance of a drafter against its target, by greedy verification in PyTorch.

Contract: on the target's greedy continuations of held-out prompts, every round start t in the
continuation is scored as vLLM's greedy rule would score it (accept while d_j == argmax L_{t+j});
the result is the acceptance rate per position and the acceptance length for K = 1..K_max, over
all rounds, per Spec-Bench task (`by_task`) and over the chat-like tasks (`chat_like`, the group
the acceptance target is stated for). Teacher forcing is exact here: while drafts match, the drafter's inputs are the text's tokens.
"""

from __future__ import annotations

import torch

from tools.distill.data import features

# The tasks the "acceptance length on chat-like categories" target is read on: MT-bench's chat
# categories (task `mt_bench`: writing, roleplay, reasoning, math, coding, extraction, stem,
# humanities) plus open question answering (`qa`). Summarization, translation, RAG and
# math_reasoning are document- or problem-bound transformations, not chat, and are reported apart.
CHAT_LIKE_TASKS = ("mt_bench", "qa")


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


def group_summaries(accepted: list[torch.Tensor], tasks: list[str] | None, k_max: int) -> dict:
    """accepted: one [N_i] per sequence, tasks: the sequence's task (aligned) -> the overall summary,
    `by_task` (task -> summary over its sequences) and `chat_like` (over CHAT_LIKE_TASKS' sequences;
    None when there are none). Without tasks only the overall summary, by_task = {}."""
    if tasks is not None and len(tasks) != len(accepted):
        raise ValueError(f"{len(tasks)} tasks for {len(accepted)} sequences")

    def over(idx: list[int]) -> dict:
        acc = [accepted[i] for i in idx]
        return {"sequences": len(acc), **summarize(torch.cat(acc) if acc else torch.zeros(0), k_max)}

    tasks = tasks or []
    by_task = {t: over([i for i, u in enumerate(tasks) if u == t]) for t in sorted(set(tasks))}
    chat = [i for i, u in enumerate(tasks) if u in CHAT_LIKE_TASKS]
    return {**over(list(range(len(accepted)))), "by_task": by_task,
            "chat_like": {"tasks": list(CHAT_LIKE_TASKS), **over(chat)} if chat else None}


def evaluate(kind: str, drafter, target, samples: list[dict], k_max: int = 6,
             tasks: list[str] | None = None) -> dict:
    """Score every round of every sample; tasks (aligned with samples) adds by_task and chat_like."""
    match_fn = eagle_match if kind == "eagle" else draft_model_match
    was = drafter.training
    drafter.eval()
    acc = [accepted_counts(match_fn(drafter, target, s["ids"], s["prompt_len"], k_max)) for s in samples]
    drafter.train(was)
    return {"kind": kind, **group_summaries(acc, tasks, k_max)}


def _line(label: str, r: dict) -> str:
    alpha = " ".join(f"{a:.3f}" for a in r["alpha"])
    al = " ".join(f"K{k}={v:.3f}" for k, v in r["acceptance_length"].items())
    return f"{label} {r['sequences']} seqs, {r['rounds']} rounds | alpha_j: {alpha} | acceptance length: {al}"


def format_report(r: dict) -> str:
    """The overall line, one line per task, and the chat-like line."""
    lines = [_line(f"eval[{r['kind']}]", r)]
    width = max((len(t) for t in r.get("by_task", {})), default=0)
    lines += [_line(f"  {t:<{width}}", s) for t, s in r.get("by_task", {}).items()]
    if r.get("chat_like"):
        lines.append(_line(f"  chat_like ({'+'.join(r['chat_like']['tasks'])})", r["chat_like"]))
    elif r.get("by_task"):
        lines.append(f"  chat_like ({'+'.join(CHAT_LIKE_TASKS)}): no held-out sequences")
    return "\n".join(lines)
