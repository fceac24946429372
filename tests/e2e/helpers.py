"""Small HTTP helpers for the end-to-end tests (the product's client is tested separately)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx

DEV_SET = Path("/work/shared/data/specbench-dev.jsonl")
REPO_DEV_SET = Path(__file__).resolve().parents[2] / "cluster" / "data" / "specbench-dev.jsonl"


def dev_prompts(n: int) -> list[dict]:
    """n prompts spread over the dev set's categories (every len/n-th line), first turn only."""
    path = REPO_DEV_SET if REPO_DEV_SET.exists() else DEV_SET
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    step = max(len(rows) // n, 1)
    return [{"id": r["question_id"], "category": r["category"], "text": r["turns"][0]} for r in rows[::step][:n]]


async def chat(client: httpx.AsyncClient, url: str, text: str, max_tokens: int = 32, spec: dict | None = None,
               **extra) -> dict:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0.0, **extra}
    if spec is not None:
        body["specserve"] = {"speculative": spec}
    r = await client.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


async def chat_all(url: str, prompts: list[dict], spec: dict | None, max_tokens: int = 32, concurrency: int = 16,
                   **extra) -> list[dict]:
    """`chat` for every prompt (dev_prompts' dicts), at most `concurrency` in flight, in prompt order."""
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient() as client:
        async def one(p):
            async with sem:
                return await chat(client, url, p["text"], max_tokens, spec, **extra)
        return await asyncio.gather(*[one(p) for p in prompts])


def crowded_share(intervals: list[tuple[float, float]], bound: int) -> list[float]:
    """For each (start, end), the share of it during which more than `bound` of the intervals ran.

    >>> crowded_share([(0, 4), (0, 2), (1, 4)], 2)
    [0.25, 0.5, 0.3333333333333333]
    """
    edges = sorted({t for iv in intervals for t in iv})
    shares = []
    for s, e in intervals:
        crowded = sum(b - a for a, b in zip(edges, edges[1:])
                      if s <= a and b <= e and sum(1 for s2, e2 in intervals if s2 <= a and b <= e2) > bound)
        shares.append(crowded / (e - s) if e > s else 0.0)
    return shares
