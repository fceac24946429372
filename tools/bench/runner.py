"""Drives a running cluster (and stock-vLLM baselines) through their public HTTP APIs and records one
`Sample` per request.

Every request is streamed (`AsyncSpecServeClient.generate_stream`), so TTFT and inter-chunk times
are measured at the client. Four ways to send a list of `Job`s: in order, one at a time
(`run_sequential`); with N closed-loop streams (`run_closed_loop`); open loop with Poisson
arrivals at a rate, bounded in time and count (`run_poisson`); and open loop at given arrival
offsets (`run_schedule`, the trace replay). A failed request (an error answer, or no end within the
per-request timeout) becomes a sample with `ok=False`; it is never retried (it counts against goodput).

A job whose configuration is a baseline goes to that baseline's server as a plain OpenAI request (no
`specserve` extension), asking for usage and per-chunk token ids (`return_token_ids`, vLLM), so its
greedy output can be compared token by token with the cluster's; its samples have no spec stats.
"""

from __future__ import annotations

import asyncio
import re
import random
import time
from dataclasses import dataclass
from typing import Callable, Optional

from tools.bench.metrics import Sample
from tools.bench.plan import BenchConfig
from tools.bench.workload import Prompt
from cluster.client import AsyncSpecServeClient
from cluster.client_wire import ClientError, collect_stream


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
    # Prefixed to the prompt so that the server's prefix cache cannot serve it (open-loop Poisson phase).
    nonce: Optional[str] = None
    arrival: Optional[int] = None  # trace replay: index in the schedule

    def messages(self) -> list[dict]:
        if not self.nonce:
            return self.prompt.messages
        return [{"role": "user", "content": f"[{self.nonce}] {self.prompt.text}"}]


# Added to every request, the cluster's and the stock servers' alike (both answer with vLLM's serving
# layer): usage in the last event, token ids in every chunk.
STOCK_EXTRA = {"stream_options": {"include_usage": True}, "return_token_ids": True}


# Quiet before each one-stream request of an interleaved comparison. vLLM's shm message-queue readers
# (an engine's worker, its engine core) busy-poll for 1 s after their last read
# (vllm.distributed.device_communicators.shm_broadcast.SpinCondition); where engines share cores, as
# the cluster's and the stock servers' do here, the next configuration's request ran beside that spin,
# and about a third of one-stream requests had a first token 1 s late.
SETTLE_S = 1.2


class Runner:
    """Sends jobs; `t0` (perf_counter) is the run's time origin; `on_done` is called per sample.
    `stock_clients`: baseline name -> client of its server. `request_timeout_s`: a request that has
    not ended after this long is cancelled and recorded as failed (None: only the client's timeouts)."""

    def __init__(self, client: AsyncSpecServeClient, *, model: Optional[str], max_tokens: int,
                 top_p: Optional[float] = None, ignore_eos: bool = False, hint_workload_class: bool = False,
                 on_done: Optional[Callable[[Sample], None]] = None, t0: Optional[float] = None,
                 stock_clients: Optional[dict[str, AsyncSpecServeClient]] = None,
                 request_timeout_s: Optional[float] = None):
        self.client = client
        self.stock_clients = stock_clients or {}
        self.request_timeout_s = request_timeout_s
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

    def _request(self, job: Job) -> tuple[AsyncSpecServeClient, dict]:
        """The client a job goes to and the keyword arguments of its request."""
        kwargs = dict(
            messages=job.messages(), model=self.model, max_tokens=job.max_tokens or self.max_tokens,
            temperature=job.temperature, top_p=self.top_p if job.temperature > 0 else None,
            seed=job.seed, logprobs=job.logprobs,
            extra={**job.prompt.request, **STOCK_EXTRA, **({"ignore_eos": True} if self.ignore_eos else {})},
        )
        if job.config.baseline:
            if job.config.name not in self.stock_clients:
                raise KeyError(f"no server for baseline {job.config.name!r}")
            return self.stock_clients[job.config.name], kwargs
        kwargs.update(speculative=job.config.speculative(), request_id=self._request_id(job),
                      workload_class=job.prompt.workload_class if self.hint_workload_class else None)
        return self.client, kwargs

    async def one(self, job: Job) -> Sample:
        sample = Sample(phase=job.phase, config=job.config.name, prompt_id=job.prompt.question_id,
                        category=job.prompt.category, task=job.prompt.task, temperature=job.temperature,
                        concurrency=job.concurrency, repeat=job.repeat, rate_rps=job.rate_rps, arrival=job.arrival)
        client, kwargs = self._request(job)

        async def stream() -> list:
            return [c async for c in client.generate_stream(**kwargs)]

        start = time.perf_counter()
        sample.start_s = start - self.t0
        try:
            chunks = await asyncio.wait_for(stream(), self.request_timeout_s)
            result = collect_stream(chunks, start)
        except ClientError as e:
            sample.ok, sample.error_status, sample.error = False, e.status, e.message
        except ValueError as e:  # a stream event that is not JSON
            sample.ok, sample.error = False, f"bad stream event: {e}"
        except asyncio.TimeoutError:
            sample.ok, sample.error = False, f"no end within the request timeout ({self.request_timeout_s:g} s)"
        else:
            sample.end_s = sample.start_s + result.latency_s
            sample.ttft_s, sample.latency_s = result.ttft_s, result.latency_s
            sample.chunk_times_s, sample.chunk_tokens = result.chunk_times_s, result.chunk_tokens
            sample.token_ids, sample.finish_reason, sample.text = result.token_ids, result.finish_reason, result.text
            if not job.config.baseline:  # a stock server sends no spec stats
                sample.logprobs = result.spec.logprobs
                spec = result.spec.__dict__.copy()
                spec.pop("token_ids", None)
                spec.pop("logprobs", None)
                sample.spec = spec
        if not sample.ok:
            sample.end_s = time.perf_counter() - self.t0
            sample.latency_s = sample.end_s - sample.start_s
        if self.on_done:
            self.on_done(sample)
        return sample

    async def run_sequential(self, jobs: list[Job], settle_s: float = 0.0) -> list[Sample]:
        """One job at a time; `settle_s` of quiet before each (SETTLE_S says why), the first too: the
        phase before (a warm-up through every engine) leaves other engines busy-polling as well."""
        samples = []
        for job in jobs:
            if settle_s > 0:
                await asyncio.sleep(settle_s)
            samples.append(await self.one(job))
        return samples

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

    async def run_schedule(self, jobs: list[Job], offsets_s: list[float]) -> list[Sample]:
        """Open loop at given arrival times: job i is sent `offsets_s[i]` seconds after the start
        (a late sender catches up at once, never skipping a job). Requests in flight at the end are
        awaited; each is bounded by the per-request timeout."""
        start = time.perf_counter()
        tasks: list[asyncio.Task] = []
        for job, at in zip(jobs, offsets_s):
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(self.one(job)))
        return list(await asyncio.gather(*tasks))
