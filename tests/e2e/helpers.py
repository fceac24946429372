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
