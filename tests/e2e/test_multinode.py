"""A multi-node Ray cluster on this machine (cluster/configs/local-multinode.yaml): the head and three
worker nodes, each its own `ray start` process tree. Every replica runs on a node its resources
name (as `specserve status` shows), requests go through every pool (the remote_draft target drafts
through the drafter on its own node), a pool that fits no node stops the start-up with a message
naming it, and stopping ends every process the cluster started."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import psutil
import pytest

from tests.e2e.conftest import ROOT, launch_cluster
from tests.e2e.helpers import chat_all, dev_prompts
from tests.paths import CONFIGS

pytestmark = pytest.mark.engine

MULTINODE = CONFIGS / "local-multinode.yaml"


def _status(cluster) -> dict:
    out = subprocess.run([sys.executable, "-m", "cluster.ops.cli", "status", "--url", cluster.http_url,
                          "--config", str(cluster.config_path)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    return json.loads(out.stdout)


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _running(procs: list[psutil.Process]) -> list[str]:
    left = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{p.pid} {' '.join(p.cmdline())[:100]}")
        except psutil.NoSuchProcess:
            pass
    return left


def test_replicas_run_on_their_nodes_serve_through_every_pool_and_stop_whole(tmp_path):
    gen = launch_cluster(tmp_path, "specserve-multinode-test", base=MULTINODE)
    cluster = next(gen)
    try:
        status = _status(cluster)
        nodes = {n["name"]: n for n in status["nodes"]}
        assert sorted(nodes) == ["drafter", "head", "target-1", "target-2"], status.get("nodes")
        assert all(n["alive"] for n in nodes.values())
        deployments = status["applications"]["specserve-multinode-test"]["deployments"]
        on = {d: [r["node"] for r in v["on_nodes"]] for d, v in deployments.items()}
        assert on["router"] == ["head"], on
        assert on["drafter-l4"] == ["drafter"], on
        assert sorted(on["engine-ngram"] + on["engine-remote"]) == ["target-1", "target-2"], on
        for d, v in deployments.items():
            assert v["status"].endswith("HEALTHY"), (d, v)

        prompts = dev_prompts(4)
        plain = asyncio.run(chat_all(cluster.http_url, prompts, {"mode": "none"}, max_tokens=32))
        ngram = asyncio.run(chat_all(cluster.http_url, prompts, {"mode": "ngram", "k": 3}, max_tokens=32))
        remote = asyncio.run(chat_all(cluster.http_url, prompts, {"mode": "remote_draft", "k": 4}, max_tokens=32))
        for a, b, c in zip(plain, ngram, remote):
            assert b["specserve"]["pool"] == "ngram" and c["specserve"]["pool"] == "remote"
            assert a["specserve"]["token_ids"] == b["specserve"]["token_ids"] == c["specserve"]["token_ids"]
        assert sum(r["specserve"]["drafted"] for r in remote) > 0, "no draft came back from the drafter's node"
        started = _descendants(cluster.proc.pid)
        assert sum("raylet" in " ".join(p.cmdline()) for p in started) >= 3, "fewer raylets than worker nodes"
    finally:
        gen.close()  # `specserve up` gets SIGINT and stops Serve, the nodes, Ray and Redis
    deadline = time.monotonic() + 60
    while _running(started) and time.monotonic() < deadline:
        time.sleep(1)
    assert not _running(started), _running(started)


def test_a_pool_that_fits_no_node_stops_the_start_up_naming_it(tmp_path):
    def no_drafter_node(raw: dict) -> None:
        raw["ray"]["nodes"] = [n for n in raw["ray"]["nodes"] if n["name"] != "drafter"]

    with pytest.raises(pytest.fail.Exception) as e:
        next(launch_cluster(tmp_path, "specserve-unplaceable-test", no_drafter_node, base=MULTINODE))
    message = str(e.value)
    assert "specserve up exited with 1" in message, message[-2000:]
    assert "placement: drafter 'l4': a replica needs specserve_drafter 1 on one node" in message, message[-2000:]
