"""Small HTTP helpers for the end-to-end tests (the product's client is tested separately)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from pathlib import Path

import grpc
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
    try:
        r = await client.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    except (httpx.ReadError, httpx.RemoteProtocolError) as e:
        # The connection closed under the request with no response. On the loaded 2-core CI machine
        # this happens rarely mid-burst, seen from both ends at once (the proxy logs the client gone,
        # the router cancels the request in vLLM): the socket went, not the request. These requests
        # are greedy and idempotent: one resend on a new connection; a second failure fails the test.
        print(f"[e2e] {type(e).__name__} on {url}, resending once", file=sys.stderr)
        async with httpx.AsyncClient() as fresh:
            r = await fresh.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


async def chat_all(url: str, prompts: list[dict], spec: dict | None, max_tokens: int = 32, concurrency: int = 16,
                   sem: asyncio.Semaphore | None = None, **extra) -> list[dict]:
    """`chat` for every prompt (dev_prompts' dicts), at most `concurrency` in flight (or as many as
    `sem`, shared between calls, lets through), in prompt order."""
    sem = sem or asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient() as client:
        async def one(p):
            async with sem:
                return await chat(client, url, p["text"], max_tokens, spec, **extra)
        return await asyncio.gather(*[one(p) for p in prompts])


@contextlib.asynccontextmanager
async def held_batch(url: str, pool: str, n: int, spec: dict, timeout_s: float = 120.0, max_tokens: int = 1500):
    """Hold `pool`'s engine batch at `n` or more: `n` plain streamed requests (`max_tokens`, ignore_eos)
    that each have a token before the body runs, so all run in the engine together. The body gets
    their tasks; one that is done has ended early (check `held_batch_intact`). On exit the streams
    hang up, which aborts them in vLLM, and the engine is back to no requests.

    Long streams, not requests of a set length: on a loaded CI machine some requests reached the Ray
    proxy seconds after others sent with them, so fillers of a few seconds' work were done before
    the last one started, and the batch the test meant to build was not built."""
    body = {"messages": [{"role": "user", "content": "Write a long story about the sea."}],
            "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "specserve": {"speculative": spec}}
    started = [asyncio.Event() for _ in range(n)]

    async def one(client: httpx.AsyncClient, first: asyncio.Event) -> None:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
            assert r.status_code == 200, (await r.aread()).decode()
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"token_ids":[]' not in line:
                    first.set()

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=n + 4)) as client:
        tasks = [asyncio.ensure_future(one(client, ev)) for ev in started]
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout_s
            while not all(ev.is_set() for ev in started):
                for t in tasks:
                    if t.done():
                        t.result()  # re-raises the filler's own error
                        raise AssertionError("a filler stream ended before every filler had a token")
                assert loop.time() < deadline, (
                    f"only {sum(ev.is_set() for ev in started)} of {n} filler streams had a token in {timeout_s:g} s")
                await asyncio.sleep(0.05)
            yield tasks
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    await engine_idle(url, pool)


def held_batch_intact(tasks: list[asyncio.Future]) -> bool:
    """Whether every filler of `held_batch` still runs."""
    return not any(t.done() for t in tasks)


async def engine_idle(url: str, pool: str, timeout_s: float = 60.0) -> None:
    """Wait until `pool`'s engine runs no request (hung-up streams are aborted in vLLM)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with httpx.AsyncClient() as client:
        while True:
            entry = (await client.get(f"{url}/v1/specserve/status", timeout=30)).json()["pools"][pool]
            # No "engine" entry: its load call waited behind a full pool's requests and timed out.
            if "engine" in entry and int(entry["engine"]["unfinished"]) == 0:
                return
            assert loop.time() < deadline, f"{pool}'s engine still runs requests: {entry}"
            await asyncio.sleep(0.25)


@contextlib.contextmanager
def specserve_stub(target: str):
    """A `specserve.v1.SpecServe` stub on a plaintext channel to `target`, ready, closed after."""
    from specserve.v1 import specserve_pb2_grpc as pb_grpc

    channel = grpc.insecure_channel(target)
    try:
        grpc.channel_ready_future(channel).result(timeout=30)
        yield pb_grpc.SpecServeStub(channel)
    finally:
        channel.close()
