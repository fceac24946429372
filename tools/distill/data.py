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

import contextlib
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from tools.bench.workload import task_of
from tools.distill import vllm_gen

log = logging.getLogger(__name__)

SPECBENCH = Path(__file__).resolve().parents[2] / "cluster" / "data" / "specbench-dev.jsonl"

# Templated training requests (`synthetic_instructions`): 48 templates in the styles of Spec-Bench's
# first turns (MT-bench's writing, roleplay, reasoning, math, coding, extraction, STEM and humanities;
# natural questions; summaries) over 120 topics: with 10 templates over 30 topics (270 distinct
# single-topic requests) a corpus of 1,000+ requests repeats each many times.
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
    "What is {}?",
    "How does {} work?",
    "Why is {} important?",
    "Who first studied {}, and what did they find?",
    "Write a persuasive paragraph arguing that everyone should care about {}.",
    "Pretend you are a tour guide and describe {} to a group of visitors.",
    "Write a limerick about {}.",
    "Describe {} in exactly three sentences.",
    "What are common misconceptions about {}?",
    "Write a blog post introduction about {}.",
    "Imagine you are a scientist in the year 2100. What has changed about {}?",
    "Give me a quiz of three questions about {}, with answers.",
    "Write a dialogue between two students discussing {}.",
    "What would happen if {} disappeared tomorrow?",
    "Explain the relationship between {} and {}.",
    "Write a product description for a book about {}.",
    "Outline a five-minute presentation on {}.",
    "What skills does someone need to work with {}?",
    "Write a short poem that mentions both {} and {}.",
    "Give three tips for beginners interested in {}.",
    "Describe a typical day for someone whose job involves {}.",
    "Write a news headline and a short article about a discovery related to {}.",
    "What are the main challenges related to {} today?",
    "Answer briefly: what is the most interesting thing about {}?",
    "Write a thank-you note to a teacher who taught you about {}.",
    "Explain {} using an analogy.",
    "Create a study plan for one week to learn about {}.",
    "Write a short speech for a school event about {}.",
    "Classify the following topics into science or culture: {}, {}.",
    "Rewrite this sentence to be more formal: I really like learning about {}.",
    "Translate into simple English: the phenomenon of {} is multifaceted.",
    "Solve this: a class of 24 students studies {}; a third of them write a report. How many reports are written?",
    "Write a SQL query that finds all books about {} published after 2000, and explain it.",
    "If you could interview an expert on {}, what five questions would you ask?",
    "Summarize in one paragraph how {} affects everyday life.",
    "Write a recipe-style guide to understanding {}.",
    "What are the ethical questions raised by {}?",
    "Tell me a fun fact about {} and explain why it is true.",
]
_TOPICS = [
    "the moon", "volcanoes", "photosynthesis", "the internet", "coffee", "bicycles", "the ocean",
    "machine learning", "ancient Rome", "chess", "gardening", "electric cars", "music theory",
    "the human heart", "recycling", "mountains", "bread baking", "the solar system", "rain",
    "friendship", "libraries", "trains", "honey bees", "sorting a list", "prime numbers",
    "climate change", "football", "the printing press", "sleep", "smartphones",
    "black holes", "the French Revolution", "vaccines", "earthquakes", "jazz", "democracy",
    "the stock market", "dinosaurs", "the Great Wall of China", "renewable energy", "DNA",
    "social media", "Shakespeare", "the water cycle", "penguins", "the Renaissance", "cryptography",
    "the Olympic Games", "tea", "rainforests", "the immune system", "robots", "ancient Egypt",
    "inflation", "the piano", "meditation", "airplanes", "coral reefs", "the Industrial Revolution",
    "video games", "mathematics", "plate tectonics", "the Amazon river", "public transport",
    "antibiotics", "chocolate", "the Cold War", "space exploration", "wolves", "poetry",
    "nuclear power", "the human brain", "the Silk Road", "cloud computing", "origami", "deserts",
    "the Beatles", "gravity", "the printing of money", "marathons", "photography", "languages",
    "the Moon landing", "bees and flowers", "cybersecurity", "architecture", "Mount Everest",
    "the periodic table", "healthy eating", "the Roman Empire", "solar panels", "volunteering",
    "the Eiffel Tower", "tsunamis", "bacteria", "the internet of things", "ballet", "glaciers",
    "world war two", "the camera", "electricity", "the Pythagorean theorem", "recycling plastic",
    "hurricanes", "the Mona Lisa", "quantum computing", "taxes", "elephants", "the violin",
    "urban gardening", "the blockchain", "fossils", "the Arctic", "job interviews", "time zones",
    "the Nile", "programming languages", "mushrooms", "the human eye", "birds' migration",
    "remote work", "the speed of light",
]


def load_specbench(path: Path = SPECBENCH) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@dataclass(frozen=True)
class HeldOut:
    """A held-out evaluation prompt and the Spec-Bench reporting group it belongs to."""

    text: str  # the first turn
    task: str  # `tools.bench.workload.task_of(category)`
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
    """n distinct templated requests, seeded (a repeated request would only repeat its greedy
    continuation); at most as many as the templates and topics can make."""
    gen = torch.Generator().manual_seed(seed)
    out: list[str] = []
    seen: set[str] = set()
    for _ in range(50 * n):
        if len(out) == n:
            break
        t = _TEMPLATES[int(torch.randint(len(_TEMPLATES), (1,), generator=gen))]
        a, b = (_TOPICS[int(i)] for i in torch.randint(len(_TOPICS), (2,), generator=gen))
        text = t.format(a, b)
        if text not in seen:
            seen.add(text)
            out.append(text)
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
def features_shared_prompt(target, prompt: list[int], conts: list[list[int]]) -> list[torch.Tensor]:
    """Features of prompt + each continuation, the prompt run once: its states and KV cache are
    computed alone, then every continuation runs as one right-padded batch against that cache
    (repeated per row). The same as `features` of each whole sequence (causal attention: a
    position sees only what precedes it); the prompt, often longer than its continuations, is
    paid once instead of once per continuation."""
    out = target.model(input_ids=torch.tensor([prompt]), use_cache=True)
    hp = out.last_hidden_state[0]  # [P, H]
    P, n, L = len(prompt), len(conts), max((len(c) for c in conts), default=0)
    if L == 0:
        return [hp.clone() for _ in conts]
    cache = out.past_key_values
    cache.batch_repeat_interleave(n)
    ids = torch.zeros(n, L, dtype=torch.long)  # [n, L]
    mask = torch.zeros(n, P + L, dtype=torch.long)  # [n, P+L]: the prompt, then each row's own tokens
    mask[:, :P] = 1
    for i, c in enumerate(conts):
        ids[i, :len(c)] = torch.tensor(c, dtype=torch.long)
        mask[i, P:P + len(c)] = 1
    pos = torch.arange(P, P + L)[None].expand(n, L)  # [n, L]
    h = target.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                     use_cache=False).last_hidden_state  # [n, L, H]
    return [torch.cat([hp, h[i, :len(c)]]) for i, c in enumerate(conts)]


@dataclass(frozen=True)
class CorpusSpec:
    """One corpus: every prompt continued by the target with these settings."""

    prompts: tuple[str, ...]
    max_new_tokens: int
    temperature: float
    seed: int
    # The target in bfloat16 for this corpus (vLLM dtype and the features' autocast): ~1.5x faster
    # generation and ~2.7x faster features on a CPU with AVX512-BF16 (BENCHMARKS 9.2). Its features
    # are ~0.7% off fp32 ones, well inside the training's own feature noise; for training text, not
    # for the held-out corpus, which stays what a float32 engine serves.
    bf16: bool = False


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

    engine "vllm": every missing continuation of every spec comes from ONE child vLLM engine per
    dtype (`tools.distill.vllm_gen`; a `bf16` spec gets a bfloat16 engine), its jobs prompt-major
    so a prompt's continuations share its prefill; "transformers": batched `generate` here. Then
    features are computed and saved shard by shard, the shards of specs with the same prompts
    together, each prompt run once (`features_shared_prompt`). An interrupted run keeps the saved
    shards (the continuations of unsaved ones are generated again). The engine and `bf16` are part
    of the cache key.
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
               spec.temperature, spec.seed] + ([engine] if engine != "transformers" else []) + (["bf16"] if spec.bf16 else [])
        root = Path(cache_dir) / f"corpus-{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]}"
        root.mkdir(parents=True, exist_ok=True)
        shards = []
        for s in range((len(spec.prompts) + shard_size - 1) // shard_size):
            chunk = [chat_ids(tokenizer, p) for p in spec.prompts[s * shard_size:(s + 1) * shard_size]]
            shards.append((s, root / f"shard-{s:04d}.pt", chunk))
        plans.append((root, shards))
    # 1. continuations of the missing shards: one vLLM call for all of them (prompt-major, so a
    #    prompt's continuations across specs run together and share its prefill in the prefix cache)
    conts: dict[tuple[int, int], list[list[int]]] = {}
    missing = [(si, s, chunk) for si, (_, shards) in enumerate(plans) for s, path, chunk in shards if not path.exists()]
    if engine == "vllm":
        jobs, where = [], []
        for si, s, chunk in missing:
            spec = specs[si]
            for i, ids in enumerate(chunk):
                jobs.append({"prompt_ids": ids, "max_new_tokens": spec.max_new_tokens,
                             "temperature": spec.temperature, "seed": job_seed(spec.seed, s * shard_size + i)})
                where.append((si, s, i))
        if jobs:
            got: list = [None] * len(jobs)
            for bf16 in sorted({specs[si].bf16 for si, _, _ in where}):  # one engine per dtype
                mine = [k for k in range(len(jobs)) if specs[where[k][0]].bf16 == bf16]
                order = sorted(mine, key=lambda k: (jobs[k]["prompt_ids"], k))
                made = vllm_gen.generate_vllm(model_path, [jobs[k] for k in order], max_model_len, log_fn=log_fn,
                                              **({"dtype": "bfloat16"} if bf16 else {}))
                for k, c in zip(order, made):
                    got[k] = c
            for (si, s, i), c in zip(where, got):
                conts.setdefault((si, s), []).append(c)
    else:
        for si, s, chunk in missing:
            spec = specs[si]
            gen = torch.Generator().manual_seed(spec.seed * 100003 + s)  # per shard: a resumed run is identical
            order = sorted(range(len(chunk)), key=lambda i: len(chunk[i]))  # similar lengths: less padding
            new = [None] * len(chunk)
            for b in range(0, len(order), batch_size):
                rows = order[b:b + batch_size]
                for i, c in zip(rows, generate(target, [chunk[i] for i in rows], spec.max_new_tokens,
                                               spec.temperature, gen, eos, pad)):
                    new[i] = c
            conts[(si, s)] = new
    # 2. features of the missing shards: shards of the same prompts (a greedy corpus and its sampled
    #    twins) together, each prompt run once for all its continuations (`features_shared_prompt`)
    groups: dict[tuple, list[tuple[int, int]]] = {}
    built: dict[Path, list[dict]] = {}  # the shards made here, returned without reading them back
    for si, s, chunk in missing:
        groups.setdefault((specs[si].bf16, tuple(map(tuple, chunk))), []).append((si, s))
    for (bf16, chunk_key), members in groups.items():
        feats = {m: [] for m in members}
        amp = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        for i, prompt in enumerate(chunk_key):
            with amp:
                fs = features_shared_prompt(target, list(prompt), [conts[m][i] for m in members])
            for m, f in zip(members, fs):
                feats[m].append(f)
        for si, s in members:
            path = plans[si][1][s][1]
            shard = [{"ids": torch.tensor(list(p) + c, dtype=torch.long), "prompt_len": len(p), "feats": f.half()}
                     for p, c, f in zip(chunk_key, conts[(si, s)], feats[(si, s)])]
            tmp = path.with_suffix(".tmp")
            torch.save(shard, tmp)
            os.replace(tmp, path)
            built[path] = shard
            log_fn(f"data: shard {s + 1}/{len(plans[si][1])} (T={specs[si].temperature}, {engine}) -> {path}")
    return [[x for _, path, _ in shards for x in (built[path] if path in built else torch.load(path))]
            for _, shards in plans]


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
