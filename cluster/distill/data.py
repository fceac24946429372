"""Self-distillation data: prompts in, the frozen target's own continuations and features out.

Contract: `corpora(...)` / `corpus(...)` return samples ``{"ids": [T] long, "prompt_len": int, "feats": [T, H]
half}`` where ids = chat-templated prompt + the target's continuation (greedy or sampled with an
explicit seeded generator) and feats are the target's final-norm hidden states on them. Results are
cached on disk in shards keyed by everything that determines them, so an interrupted run resumes.
Samples come back in prompt order, so a list aligned with the prompts (e.g. their tasks) stays
aligned with the samples. Prompts: the first turns of Spec-Bench (`cluster/data/specbench-dev.jsonl`,
a seeded split stratified by Spec-Bench task holds some of every task out for evaluation) plus
simple synthetic instructions.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from cluster.bench.workload import task_of

log = logging.getLogger(__name__)

SPECBENCH = Path(__file__).resolve().parents[1] / "data" / "specbench-dev.jsonl"

_TEMPLATES = [
    "Explain {} to a ten-year-old.",
    "Write a short story about {}.",
    "List five facts about {}.",
    "What are the pros and cons of {}?",
    "Write a haiku about {}.",
    "Give step-by-step instructions for learning about {}.",
    "Summarize the history of {} in three sentences.",
    "Write a short email to a friend about {}.",
    "Compare {} and {} in a short paragraph.",
    "Write a Python function related to {} and explain it.",
]
_TOPICS = [
    "the moon", "volcanoes", "photosynthesis", "the internet", "coffee", "bicycles", "the ocean",
    "machine learning", "ancient Rome", "chess", "gardening", "electric cars", "music theory",
    "the human heart", "recycling", "mountains", "bread baking", "the solar system", "rain",
    "friendship", "libraries", "trains", "honey bees", "sorting a list", "prime numbers",
    "climate change", "football", "the printing press", "sleep", "smartphones",
]


def load_specbench(path: Path = SPECBENCH) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@dataclass(frozen=True)
class HeldOut:
    """A held-out evaluation prompt and the Spec-Bench reporting group it belongs to."""

    text: str  # the first turn
    task: str  # `cluster.bench.workload.task_of(category)`
    category: str  # the file's category


def split_prompts(records: list[dict], n_eval_per_task: int, seed: int) -> tuple[list[str], list[HeldOut]]:
    """Records -> (train first turns, held-out prompts): a seeded split stratified by task.

    Every task holds out `n_eval_per_task` records, drawn round-robin over its categories (so the
    eight MT-bench categories of `mt_bench` each contribute); everything else is training, in a
    seeded random order. The same records and seed give the same split; the two parts are disjoint.
    """
    gen = torch.Generator().manual_seed(seed)
    shuffled = [records[i] for i in torch.randperm(len(records), generator=gen).tolist()]
    by_task: dict[str, dict[str, list[int]]] = {}  # task -> category -> indices into shuffled
    for i, r in enumerate(shuffled):
        by_task.setdefault(task_of(r["category"]), {}).setdefault(r["category"], []).append(i)
    held: list[int] = []
    for task in sorted(by_task):
        cats = list(by_task[task].values())  # in order of first appearance in the shuffle: seeded
        if n_eval_per_task > sum(map(len, cats)):
            raise ValueError(f"task {task!r} has {sum(map(len, cats))} records, "
                             f"fewer than --eval-per-task {n_eval_per_task}")
        robin = [c[j] for j in range(max(map(len, cats))) for c in cats if j < len(c)]
        held += robin[:n_eval_per_task]
    out = set(held)
    train = [r["turns"][0] for i, r in enumerate(shuffled) if i not in out]
    return train, [HeldOut(shuffled[i]["turns"][0], task_of(shuffled[i]["category"]), shuffled[i]["category"])
                   for i in held]


def write_heldout(path: Path, held: list[HeldOut]) -> Path:
    """The held-out prompts as a Spec-Bench-format JSONL (`specserve bench --prompts` reads it), so a
    speed run can use exactly the prompts the drafter never trained on."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"question_id": f"heldout-{i}", "category": h.category, "turns": [h.text]}) + "\n"
                            for i, h in enumerate(held)))
    return path


def synthetic_instructions(n: int, seed: int) -> list[str]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        t = _TEMPLATES[int(torch.randint(len(_TEMPLATES), (1,), generator=gen))]
        a, b = (_TOPICS[int(i)] for i in torch.randint(len(_TOPICS), (2,), generator=gen))
        out.append(t.format(a, b))
    return out


def chat_ids(tokenizer, text: str) -> list[int]:
    s = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return tokenizer(s, add_special_tokens=False)["input_ids"]


@torch.no_grad()
def generate(
    target, prompts: list[list[int]], max_new_tokens: int, temperature: float,
    gen: torch.Generator, eos_id: int, pad_id: int,
) -> list[list[int]]:
    """Batched continuation of left-padded prompts with a KV cache; temperature 0 is greedy."""
    B, L = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((B, L), pad_id, dtype=torch.long)  # [B, L]
    mask = torch.zeros(B, L, dtype=torch.long)  # [B, L]
    for i, p in enumerate(prompts):
        ids[i, L - len(p):] = torch.tensor(p)
        mask[i, L - len(p):] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, L]
    out = target(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
    new: list[list[int]] = [[] for _ in range(B)]
    done = torch.zeros(B, dtype=torch.bool)
    pos = pos[:, -1:]
    for _ in range(max_new_tokens):
        logits = out.logits[:, -1].float()  # [B, V]
        if temperature == 0:
            nxt = logits.argmax(-1)  # [B]
        else:
            nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen).squeeze(1)
        for i in range(B):
            if not done[i]:
                new[i].append(int(nxt[i]))
                done[i] = int(nxt[i]) == eos_id
        if bool(done.all()):
            break
        mask = torch.cat([mask, torch.ones(B, 1, dtype=torch.long)], 1)
        pos = pos + 1
        out = target(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos,
                     past_key_values=out.past_key_values, use_cache=True)
    return new


@torch.no_grad()
def features(target, ids: torch.Tensor) -> torch.Tensor:
    """ids: [T] -> the target's final-norm hidden states [T, H] (fp32)."""
    return target.model(input_ids=ids[None]).last_hidden_state[0]


@torch.no_grad()
def features_batched(target, seqs: list[torch.Tensor], batch_size: int = 8) -> list[torch.Tensor]:
    """Features of many sequences, right-padded in batches of similar length (causal attention:
    padding after a sequence leaves its positions' states unchanged)."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    out: list[Optional[torch.Tensor]] = [None] * len(seqs)
    for b in range(0, len(order), batch_size):
        rows = order[b:b + batch_size]
        L = max(len(seqs[i]) for i in rows)
        ids = torch.zeros(len(rows), L, dtype=torch.long)  # [B, L]
        mask = torch.zeros(len(rows), L, dtype=torch.long)  # [B, L]
        for r, i in enumerate(rows):
            ids[r, :len(seqs[i])] = seqs[i]
            mask[r, :len(seqs[i])] = 1
        h = target.model(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, L, H]
        for r, i in enumerate(rows):
            out[i] = h[r, :len(seqs[i])].clone()
    return out  # type: ignore[return-value]


@dataclass(frozen=True)
class CorpusSpec:
    """One corpus: every prompt continued by the target with these settings."""

    prompts: tuple[str, ...]
    max_new_tokens: int
    temperature: float
    seed: int


def target_key(target) -> list:
    """What identifies the frozen target in a cache key: its vocabulary size and a weight checksum."""
    return [target.config.to_dict().get("vocab_size"), float(target.model.norm.weight.sum())]


def job_seed(seed: int, index: int) -> int:
    return (seed * 100003 + index) % (2**31 - 1)


def corpora(
    target, tokenizer, specs: list[CorpusSpec], cache_dir: Path, *, engine: str = "transformers",
    model_path: Optional[str] = None, max_model_len: int = 4096, batch_size: int = 8, shard_size: int = 32,
    log_fn=print,
) -> list[list[dict]]:
    """The target's continuations of every spec's prompts, with features (cached in shards).

    engine "vllm": every missing continuation of every spec comes from ONE child vLLM engine
    (`cluster.distill.vllm_gen`, started once), then features are computed shard by shard;
    "transformers": batched `generate` here, shard by shard. The engine is part of the cache key.
    """
    if engine not in ("vllm", "transformers"):
        raise ValueError(f"engine must be 'vllm' or 'transformers', got {engine!r}")
    if engine == "vllm" and not model_path:
        raise ValueError("engine 'vllm' needs model_path (the target's HF directory)")
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    plans = []  # per spec: (root, [(shard index, shard path, [prompt ids])])
    for spec in specs:
        key = [*target_key(target), list(spec.prompts), spec.max_new_tokens,
               spec.temperature, spec.seed] + ([engine] if engine != "transformers" else [])
        root = Path(cache_dir) / f"corpus-{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]}"
        root.mkdir(parents=True, exist_ok=True)
        shards = []
        for s in range((len(spec.prompts) + shard_size - 1) // shard_size):
            chunk = [chat_ids(tokenizer, p) for p in spec.prompts[s * shard_size:(s + 1) * shard_size]]
            shards.append((s, root / f"shard-{s:04d}.pt", chunk))
        plans.append((root, shards))
    # 1. continuations of the missing shards: one vLLM call for all of them
    conts: dict[tuple[int, int], list[list[int]]] = {}
    if engine == "vllm":
        jobs, where = [], []
        for si, (spec, (_, shards)) in enumerate(zip(specs, plans)):
            for s, path, chunk in shards:
                if not path.exists():
                    for i, ids in enumerate(chunk):
                        jobs.append({"prompt_ids": ids, "max_new_tokens": spec.max_new_tokens,
                                     "temperature": spec.temperature, "seed": job_seed(spec.seed, s * shard_size + i)})
                        where.append((si, s))
        if jobs:
            from cluster.distill.vllm_gen import generate_vllm

            for (si, s), c in zip(where, generate_vllm(model_path, jobs, max_model_len, log_fn=log_fn)):
                conts.setdefault((si, s), []).append(c)
    # 2. per shard: (generate here,) features, save
    out: list[list[dict]] = []
    for si, (spec, (root, shards)) in enumerate(zip(specs, plans)):
        samples: list[dict] = []
        for s, path, chunk in shards:
            if path.exists():
                samples += torch.load(path)
                continue
            if engine == "vllm":
                new = conts[(si, s)]
            else:
                gen = torch.Generator().manual_seed(spec.seed * 100003 + s)  # per shard: a resumed run is identical
                order = sorted(range(len(chunk)), key=lambda i: len(chunk[i]))  # similar lengths: less padding
                new = [None] * len(chunk)
                for b in range(0, len(order), batch_size):
                    rows = order[b:b + batch_size]
                    for i, c in zip(rows, generate(target, [chunk[i] for i in rows], spec.max_new_tokens,
                                                   spec.temperature, gen, eos, pad)):
                        new[i] = c
            seqs = [torch.tensor(p + c, dtype=torch.long) for p, c in zip(chunk, new)]
            feats = features_batched(target, seqs, batch_size)
            shard = [{"ids": ids, "prompt_len": len(p), "feats": f.half()} for ids, p, f in zip(seqs, chunk, feats)]
            tmp = path.with_suffix(".tmp")
            torch.save(shard, tmp)
            os.replace(tmp, path)
            samples += shard
            log_fn(f"data: shard {s + 1}/{len(shards)} ({len(samples)} sequences, T={spec.temperature}, "
                   f"{engine}) -> {path}")
        out.append(samples)
    return out


def corpus(
    target, tokenizer, prompts: list[str], cache_dir: Path, *, max_new_tokens: int, temperature: float,
    seed: int, batch_size: int = 8, shard_size: int = 32, log_fn=print, engine: str = "transformers",
    model_path: Optional[str] = None,
) -> list[dict]:
    """Continuations of every prompt by the target (cached; resumes shard by shard)."""
    return corpora(target, tokenizer, [CorpusSpec(tuple(prompts), max_new_tokens, temperature, seed)], cache_dir,
                   engine=engine, model_path=model_path, batch_size=batch_size, shard_size=shard_size,
                   log_fn=log_fn)[0]


def hold_back(parts: list[list[dict]], n: int) -> tuple[list[dict], list[dict]]:
    """Training corpora (aligned: part j's i-th sample continues prompt i) -> (train, val): every
    len/n-th prompt's greedy sample (parts[0]) is held back for validation, and that prompt's
    samples in every other part leave training too, so no continuation of a validation prompt is
    trained on. n = 0: nothing held back."""
    if n <= 0 or not parts or not parts[0]:
        return [s for part in parts for s in part], []
    stride = max(1, len(parts[0]) // n)
    held = set(list(range(0, len(parts[0]), stride))[:n])
    train = [s for part in parts for i, s in enumerate(part) if i not in held]
    return train, [parts[0][i] for i in sorted(held)]


def cap_prompts(tokenizer, prompts: list[str], max_tokens: Optional[int]) -> tuple[list[str], int]:
    """Prompts whose chat-templated length is at most max_tokens (None: all) and how many were dropped."""
    if max_tokens is None:
        return list(prompts), 0
    kept = [p for p in prompts if len(chat_ids(tokenizer, p)) <= max_tokens]
    return kept, len(prompts) - len(kept)
