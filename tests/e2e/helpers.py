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


async def open_connections(calls) -> None:
    """Run `calls` (coroutines of one client, e.g. its /v1/models) at once, so that its pool holds that
    many open connections before a timed phase. On a loaded CI machine a request that needed a new
    connection reached the proxy seconds after one that reused a pooled connection (the proxy and
    router handled both in milliseconds), so batches meant to run together did not."""
    await asyncio.gather(*calls)


async def wait_for_batch(client: httpx.AsyncClient, url: str, pool: str, fillers: list[asyncio.Future],
                         at_least: int, timeout_s: float = 120.0) -> int:
    """Wait until `pool`'s engine runs at least `at_least` requests, with `fillers` (the requests meant
    to hold the batch) in flight. A filler that ends first (an error, or it finished) fails at once
    with what it returned, not after the timeout; the timeout's message gives the counts seen."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    seen: list[int] = []
    while True:
        for f in fillers:
            if f.done():
                f.result()  # re-raises the filler's own error
                raise AssertionError(f"a filler finished before the batch reached {at_least}: seen {seen[-20:]}")
        status = (await client.get(f"{url}/v1/specserve/status", timeout=30)).json()
        entry = status["pools"][pool]
        assert "engine" in entry, f"the status has no engine report for {pool}: {entry}"
        n = int(entry["engine"]["unfinished"])
        if n >= at_least:
            return n
        if not seen or seen[-1] != n:
            seen.append(n)
        assert loop.time() < deadline, (
            f"{pool}'s engine never ran {at_least} requests in {timeout_s:g} s: counts seen {seen[-20:]}, "
            f"last report {entry}")
        await asyncio.sleep(0.05)
