"""Training prompts written by the target itself (self-instruct), in the style of Spec-Bench's.

Why: the held-out evaluation uses Spec-Bench prompts, and the drafter memorises a small corpus
(BENCHMARKS.md section 9): the templated synthetic instructions (`data.synthetic_instructions`, ten
templates over thirty topics) add sequences but little variety. Here the frozen target is shown a
few of the *training* split's prompts (never a held-out one) and asked, at a high temperature, for a
new one; each seed gives a different request. The target then continues those requests like any
other prompt (`data.corpora`), so everything the drafter trains on is still the target's own text.

Contract: `self_instruct(...)` -> up to n distinct requests, none equal to a pool prompt; cached in
``cache_dir/instruct-<key>.json`` keyed by everything that determines them. The pure parts
(`instruct_message`, `parse_request`, `pick_requests`) are unit-tested.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from pathlib import Path
from typing import Callable, Optional

from tools.distill import vllm_gen

ASK = ("Here are examples of requests that users send to an AI assistant:\n\n{examples}\n\n"
       "Write one new request of the same kind about a different subject. Reply with the request only.")
_LEAD = re.compile(r"^\s*(?:(?:new\s+)?request\s*\d*\s*[:.)-]|\d+\s*[.)]|[-*•]|#+)\s*", re.IGNORECASE)
_QUOTES = "\"'“”‘’`"
# A lead-in the target often writes before (or instead of) the request: "Here's a new request: ...".
_INTRO = re.compile(r"^[^\n]{0,80}?\b(?:new|another|one)\s+(?:request|example)\s*:\s*", re.IGNORECASE)
# Echoes of the instruction itself (first words of each of ASK's sentences), lower-cased.
_ECHOES = ("here are examples of requests", "write one new request of the same kind", "reply with the request only")
# Bump when parse_request changes what it keeps: the cached picks depend on it.
PARSE_VERSION = 2


def instruct_message(examples: list[str], max_example_chars: int = 300) -> str:
    """The user message showing `examples` (each cut to `max_example_chars`, on a word boundary)."""
    def cut(s: str) -> str:
        s = " ".join(s.split())
        if len(s) <= max_example_chars:
            return s
        return s[:max_example_chars].rsplit(" ", 1)[0] + " ..."
    return ASK.format(examples="\n".join(f"{i + 1}. {cut(e)}" for i, e in enumerate(examples)))


def parse_request(text: str, min_chars: int = 15, max_chars: int = 600) -> Optional[str]:
    """The request in the target's reply, or None when there is none usable.

    Takes the first paragraph (the next one when the first is a lead-in ending in ":"), strips a
    lead-in such as "Here's a new request:", a leading "Request:", a list number or bullet and
    wrapping quotes; refuses an echo of the instruction, and what is shorter than `min_chars`,
    longer than `max_chars`, or has no letter.
    """
    paras = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text.strip()) if p.strip()] or [""]
    para = paras[0]
    if para.endswith(":"):
        para = paras[1] if len(paras) > 1 else ""
    para = _INTRO.sub("", para, count=1).strip()
    for _ in range(3):  # e.g. '1. Request: "..."'
        stripped = _LEAD.sub("", para, count=1).strip()
        if stripped == para:
            break
        para = stripped
    if len(para) >= 2 and para[0] in _QUOTES and para[-1] in _QUOTES:
        para = para[1:-1].strip()
    if not (min_chars <= len(para) <= max_chars) or not re.search(r"[A-Za-z]", para):
        return None
    if any(e in para.lower() for e in _ECHOES):
        return None
    return para


def pick_requests(replies: list[str], n: int, exclude: list[str]) -> list[str]:
    """The first n distinct parsable requests among `replies`, none equal (case and spacing aside)
    to an `exclude` prompt or to an earlier pick."""
    def norm(s: str) -> str:
        return " ".join(s.lower().split())
    seen = {norm(e) for e in exclude}
    out = []
    for r in replies:
        q = parse_request(r)
        if q is None or norm(q) in seen:
            continue
        seen.add(norm(q))
        out.append(q)
        if len(out) == n:
            break
    return out


def instruct_jobs(tokenizer, pool: list[str], n: int, seed: int, *, shots: int = 3, max_new_tokens: int = 96,
                  temperature: float = 1.0) -> list[dict]:
    """n generation jobs (`tools.distill.vllm_gen` format), each showing `shots` pool prompts drawn
    with a seeded generator and sampling with its own seed."""
    from tools.distill.data import chat_ids, job_seed

    if not pool:
        raise ValueError("self-instruct needs at least one pool prompt")
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        examples = rng.sample(pool, min(shots, len(pool)))
        jobs.append({"prompt_ids": chat_ids(tokenizer, instruct_message(examples)), "max_new_tokens": max_new_tokens,
                     "temperature": temperature, "seed": job_seed(seed, i)})
    return jobs


def self_instruct(tokenizer, model_path: str, pool: list[str], n: int, seed: int, cache_dir: Path, *,
                  target_key: list, oversample: float = 1.5, log_fn: Callable = print,
                  generate: Optional[Callable] = None) -> list[str]:
    """Up to n new requests written by the target (one child vLLM engine; cached)."""
    if n <= 0:
        return []
    key = [target_key, sorted(pool), n, seed, oversample, ASK, PARSE_VERSION]
    path = Path(cache_dir) / f"instruct-{hashlib.sha256(json.dumps(key).encode()).hexdigest()[:12]}.json"
    if path.exists():
        out = json.loads(path.read_text())
        log_fn(f"data: {len(out)} self-instructed prompts from {path}")
        return out
    if generate is None:
        generate = vllm_gen.generate_vllm
    jobs = instruct_jobs(tokenizer, pool, int(n * oversample) + 1, seed)
    conts = generate(model_path, jobs, 4096, log_fn=log_fn)
    replies = [tokenizer.decode(c, skip_special_tokens=True) for c in conts]
    out = pick_requests(replies, n, pool)
    log_fn(f"data: self-instruct kept {len(out)} of {len(replies)} replies")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=1))
    tmp.replace(path)
    return out
