"""The goodput autoscaler on a real cluster: under load the ngram pool scales up for the reason the
policy states, the router counts the decided replica, and without load the pool scales back down.

Slow tier (`chaos` marker, own cluster, `scripts/test --chaos`): a second vLLM replica takes minutes
to start on 2 cores, and the scale-down waits for it, so this does not fit the < 4 min engine tier.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.e2e.conftest import launch_cluster

pytestmark = [pytest.mark.chaos, pytest.mark.engine]

UP_TIMEOUT_S = 240
DOWN_TIMEOUT_S = 480


def _autoscale_overrides(raw: dict) -> None:
    draft = raw["pools"].pop("draft")
    raw["models"].pop(draft["drafter"], None)
    ngram = raw["pools"]["ngram"]
    ngram.pop("replicas", None)
    ngram.pop("hardware_group", None)  # replicas count as capacity (on 2 cores they are not really)
    ngram["autoscaling"] = dict(min_replicas=1, max_replicas=2, target_ongoing_requests=2, upscale_delay_s=0,
                                downscale_delay_s=20, slo_tpot_s=5.0, look_back_period_s=4, min_samples=2)


@pytest.fixture(scope="module")
def as_cluster(tmp_path_factory):
    yield from launch_cluster(tmp_path_factory.mktemp("autoscale"), "specserve-autoscale-e2e", _autoscale_overrides)


def _record(cluster) -> dict:
    from cluster.autoscale.ray_policy import AutoscaleRecords

    reader = AutoscaleRecords({"url": cluster.redis_url}, ["ngram"], start=False)
    try:
        return reader.fetch().get("ngram") or {}
    finally:
        reader.close()


async def _load(url: str, streams: int, stop: asyncio.Event) -> int:
    from cluster.client import AsyncSpecServeClient

    sent = 0
    async with AsyncSpecServeClient(url, timeout_s=300) as client:
        async def one_stream(i: int) -> None:
            nonlocal sent
            while not stop.is_set():
                await client.generate(messages=[{"role": "user", "content": f"[{i}-{sent}] Count from 1 to 40."}],
                                      max_tokens=48)
                sent += 1

        await asyncio.gather(*(one_stream(i) for i in range(streams)))
    return sent


def test_pool_scales_up_under_load_and_back_down(as_cluster):
    async def scenario():
        stop = asyncio.Event()
        load = asyncio.create_task(_load(as_cluster.http_url, 8, stop))
        deadline, up = time.monotonic() + UP_TIMEOUT_S, None
        while time.monotonic() < deadline and up is None:
            rec = await asyncio.to_thread(_record, as_cluster)
            if (rec.get("last_change") or {}).get("action") == "up":
                up = rec
            await asyncio.sleep(2)
        assert up is not None, f"no scale-up within {UP_TIMEOUT_S} s; last record {rec}"
        assert up["target"] == 2 and "carried per replica without speculation" in up["last_change"]["reason"]
        status = httpx.get(f"{as_cluster.http_url}/v1/specserve/status", timeout=30).json()
        assert status["autoscale"]["ngram"]["target"] == 2  # what the router counts on for its load bucket
        stop.set()
        assert await load > 0
        deadline, down = time.monotonic() + DOWN_TIMEOUT_S, None
        while time.monotonic() < deadline and down is None:
            rec = await asyncio.to_thread(_record, as_cluster)
            if (rec.get("last_change") or {}).get("action") == "down":
                down = rec
            await asyncio.sleep(2)
        assert down is not None, f"no scale-down within {DOWN_TIMEOUT_S} s; last record {rec}"
        assert down["target"] == 1 and "fits 1" in down["last_change"]["reason"]

    asyncio.run(scenario())
