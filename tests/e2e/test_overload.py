"""Overload: far more concurrent streams than a pool admits. Excess requests get 429 with a retry
hint quickly, admitted ones complete, and the cluster's memory stays bounded."""

from __future__ import annotations

import asyncio
import math
import subprocess
import time

import httpx
import pytest
import yaml

pytestmark = pytest.mark.engine


def _rss_mb() -> float:
    """Resident memory of every Ray worker and raylet process on this machine (MiB)."""
    out = subprocess.run(["ps", "-eo", "rss,args"], capture_output=True, text=True).stdout
    return sum(int(line.split(None, 1)[0]) for line in out.splitlines()[1:]
               if "ray::" in line or "raylet" in line or "EngineCore" in line) / 1024


def test_overload_gets_429_and_admitted_requests_complete(cluster):
    raw = yaml.safe_load(cluster.config_path.read_text())
    pool = raw["pools"]["ngram"]
    capacity = pool["max_ongoing_requests"] + pool["max_queued_requests"]
    n = capacity * 2 + 40
    # Admitted requests run for a while (96 tokens: the queue drains in several engine batches, most of
    # a minute on two cores), so "turned away at once" is told apart from "turned away after the queue
    # drained"; getting the burst in through the proxy and router took up to 10 s in CI.
    body = {"messages": [{"role": "user", "content": "Count to five."}], "max_tokens": 96, "ignore_eos": True,
            "specserve": {"speculative": {"mode": "none"}}}
    rss_before = _rss_mb()

    async def run():
        limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=n + 10)
        async with httpx.AsyncClient(limits=limits, timeout=600) as client:
            async def one():
                t0 = time.monotonic()
                r = await client.post(f"{cluster.http_url}/v1/chat/completions", json=body)
                return r, time.monotonic() - t0
            return await asyncio.gather(*[one() for _ in range(n)])

    results = asyncio.run(run())
    rss_after = _rss_mb()
    codes = [r.status_code for r, _ in results]
    rejected = [(r, dt) for r, dt in results if r.status_code == 429]
    ok = [(r, dt) for r, dt in results if r.status_code == 200]
    others = sorted({c for c in codes if c not in (200, 429)})
    median = sorted(dt for _, dt in rejected)[len(rejected) // 2] if rejected else math.nan
    drained = max((dt for _, dt in ok), default=math.nan)
    print(f"overload: sent {n}, capacity {capacity}: 200={len(ok)} 429={len(rejected)} other={others}; "
          f"429 median {median:.1f} s, last 200 at {drained:.1f} s; rss {rss_before:.0f} -> {rss_after:.0f} MiB")
    assert not others, f"unexpected statuses {others}"
    assert len(rejected) >= n - capacity - 40, "too few requests were turned away"
    assert len(ok) >= capacity // 2, "admitted requests did not complete"
    for r, _ in rejected:
        assert r.headers.get("retry-after"), "429 without a Retry-After hint"
        assert r.json()["error"]["code"] == "resource_exhausted"
    # Rejections are quick: the median well before the admitted requests drain.
    assert median < drained / 2, (median, drained)
    assert all(r.json()["choices"][0]["message"]["content"] is not None for r, _ in ok)
    assert rss_after < rss_before + 1024, "memory grew by more than 1 GiB under overload"
    # Still serving afterwards.
    r = httpx.post(f"{cluster.http_url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200
