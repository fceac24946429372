"""Drives a running cluster through its public HTTP API and records one `Sample` per request.

Every request is streamed (`AsyncSpecServeClient.generate_stream`), so TTFT and inter-chunk times
are measured at the client. Three ways to send a list of `Job`s: in order, one at a time
(`run_sequential`); with N closed-loop streams (`run_closed_loop`); and open loop with Poisson
arrivals at a rate, bounded in time and count (`run_poisson`). A failed request becomes a sample
with `ok=False` and its HTTP status; it is never retried (it counts against goodput).
"""

from __future__ import annotations

import asyncio
import re
import random
import time
from dataclasses import dataclass
from typing import Callable, Optional

from cluster.bench.metrics import Sample
from cluster.bench.plan import BenchConfig
from cluster.bench.workload import Prompt
from cluster.client import AsyncSpecServeClient, ClientError, collect_stream


@dataclass(frozen=True)
class Job:
    phase: str
    config: BenchConfig
    prompt: Prompt
    temperature: float = 0.0
    concurrency: int = 1
    repeat: int = 0
    seed: Optional[int] = None
    logprobs: Optional[int] = None
    max_tokens: Optional[int] = None  # None: the runner's
    rate_rps: Optional[float] = None
    # Prefixed to the prompt so that the server's prefix cache cannot serve it (load phases).
    nonce: Optional[str] = None

    def messages(self) -> list[dict]:
        if not self.nonce:
            return self.prompt.messages
        return [{"role": "user", "content": f"[{self.nonce}] {self.prompt.text}"}]


class Runner:
    """Sends jobs; `t0` (perf_counter) is the run's time origin; `on_done` is called per sample."""

    def __init__(self, client: AsyncSpecServeClient, *, model: Optional[str], max_tokens: int,
                 top_p: Optional[float] = None, ignore_eos: bool = False, hint_workload_class: bool = False,
                 on_done: Optional[Callable[[Sample], None]] = None, t0: Optional[float] = None):
        self.client = client
        self.model = model
        self.max_tokens = max_tokens
        self.top_p = top_p
        self.ignore_eos = ignore_eos
        self.hint_workload_class = hint_workload_class
        self.on_done = on_done
        self.t0 = time.perf_counter() if t0 is None else t0
        self._n = 0

    def _request_id(self, job: Job) -> str:
        self._n += 1
        cfg = re.sub(r"[^A-Za-z0-9._-]", "-", job.config.name)  # request ids allow [A-Za-z0-9._:-] only
        return f"bench-{job.phase}-{cfg}-{job.prompt.question_id}-{self._n}"

    async def one(self, job: Job) -> Sample:
        sample = Sample(phase=job.phase, config=job.config.name, prompt_id=job.prompt.question_id,
                        category=job.prompt.category, task=job.prompt.task, temperature=job.temperature,
                        concurrency=job.concurrency, repeat=job.repeat, rate_rps=job.rate_rps)
        kwargs = dict(
            messages=job.messages(), model=self.model, max_tokens=job.max_tokens or self.max_tokens,
            temperature=job.temperature, top_p=self.top_p if job.temperature > 0 else None,
            seed=job.seed, logprobs=job.logprobs, speculative=job.config.speculative(),
            workload_class=job.prompt.workload_class if self.hint_workload_class else None,
            request_id=self._request_id(job), extra={"ignore_eos": True} if self.ignore_eos else None,
        )
        start = time.perf_counter()
        sample.start_s = start - self.t0
        try:
            chunks = [c async for c in self.client.generate_stream(**kwargs)]
            result = collect_stream(chunks, start)
        except ClientError as e:
            sample.ok, sample.error_status, sample.error = False, e.status, e.message
            sample.end_s = time.perf_counter() - self.t0
            sample.latency_s = sample.end_s - sample.start_s
        except ValueError as e:  # a stream event that is not JSON
            sample.ok, sample.error = False, f"bad stream event: {e}"
            sample.end_s = time.perf_counter() - self.t0
            sample.latency_s = sample.end_s - sample.start_s
        else:
            sample.end_s = sample.start_s + result.latency_s
            sample.ttft_s, sample.latency_s = result.ttft_s, result.latency_s
            sample.chunk_times_s, sample.chunk_tokens = result.chunk_times_s, result.chunk_tokens
            sample.token_ids, sample.finish_reason, sample.text = result.token_ids, result.finish_reason, result.text
            sample.logprobs = result.spec.logprobs
            spec = result.spec.__dict__.copy()
            spec.pop("token_ids", None)
            spec.pop("logprobs", None)
            sample.spec = spec
        if self.on_done:
            self.on_done(sample)
        return sample

    async def run_sequential(self, jobs: list[Job]) -> list[Sample]:
        return [await self.one(job) for job in jobs]

    async def run_closed_loop(self, jobs: list[Job], concurrency: int) -> list[Sample]:
        """`concurrency` streams, each sending its next job as soon as its previous one ended."""
        queue = list(reversed(jobs))
        samples: list[Sample] = []

        async def stream() -> None:
            while queue:
                samples.append(await self.one(queue.pop()))

        await asyncio.gather(*(stream() for _ in range(max(1, concurrency))))
        return samples

    async def run_poisson(self, jobs: list[Job], rate_rps: float, duration_s: float, max_requests: int,
                          seed: int = 0) -> list[Sample]:
        """Open loop: job i is sent at the i-th arrival of a Poisson process of `rate_rps` (seeded),
        while fewer than `max_requests` were sent and less than `duration_s` has passed; jobs are
        cycled. Requests in flight at the bound are awaited."""
        if rate_rps <= 0 or not jobs:
            return []
        rng = random.Random(seed)
        start = time.perf_counter()
        tasks: list[asyncio.Task] = []
        next_at = rng.expovariate(rate_rps)
        while len(tasks) < max_requests and next_at < duration_s:
            delay = start + next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(self.one(jobs[len(tasks) % len(jobs)])))
            next_at += rng.expovariate(rate_rps)
        return list(await asyncio.gather(*tasks))
