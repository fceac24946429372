"""One real local cluster per test session: `specserve up` in a subprocess (the README's path),
on free ports, with its own Redis; every engine test shares it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from cluster.state.redis_server import free_port
from tests.paths import LOCAL_CPU

ROOT = Path(__file__).resolve().parents[2]
LOCAL_CONFIG = LOCAL_CPU
START_TIMEOUT_S = 600


# Ports drawn outside the kernel's ephemeral range, never twice (`cluster.state.redis_server.free_port`).
_free_port = free_port


class Cluster:
    def __init__(self, config_path: Path, raw: dict, proc: subprocess.Popen, log_path: Path):
        self.config_path = config_path
        self.raw = raw
        self.proc = proc
        self.log_path = log_path
        self.http_url = f"http://127.0.0.1:{raw['api']['http_port']}"
        self.grpc_target = f"127.0.0.1:{raw['api']['grpc_port']}"
        self.redis_url = raw["redis"]["url"]
        self.cleanups: list = []  # callables run at teardown (e.g. a Redis a test restarted)

    def log_tail(self, n: int = 60) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])


def launch_cluster(tmp: Path, name: str, mutate=None, base: Path = LOCAL_CONFIG):
    """Start `specserve up` (the README's path) on free ports with its own Redis; yield a Cluster;
    stop it (SIGINT, then kill) afterwards. `mutate(raw)` adjusts the config (`base`) first."""
    raw = yaml.safe_load(base.read_text())
    raw["api"]["http_port"] = _free_port()
    raw["api"]["grpc_port"] = _free_port()
    raw["redis"]["url"] = f"redis://127.0.0.1:{_free_port()}/0"
    raw["ray"]["metrics_export_port"] = _free_port()
    raw["name"] = name
    if mutate is not None:
        mutate(raw)
    config_path = tmp / "cluster.yaml"
    config_path.write_text(yaml.safe_dump(raw))
    log_path = tmp / "up.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "cluster.ops.cli", "up", "--config", str(config_path),
                                 "--verbose"],  # engine logs in up.log, for a failing test's report
                                stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                start_new_session=True)
    c = Cluster(config_path, raw, proc, log_path)
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"specserve up exited with {proc.returncode}:\n{c.log_tail()}")
            if "[specserve] serving in" in log_path.read_text(errors="replace"):
                break
            if time.monotonic() > deadline:
                pytest.fail(f"cluster not serving after {START_TIMEOUT_S} s:\n{c.log_tail()}")
            time.sleep(2)
        if not raw["api"].get("tls") and not raw.get("auth", {}).get("enabled"):
            httpx.get(f"{c.http_url}/v1/models", timeout=30).raise_for_status()
        yield c
    finally:
        for fn in c.cleanups:
            fn()
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # `specserve up` shuts Serve, Ray and Redis down
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)


def _session_overrides(raw: dict) -> None:
    # Bounded admission small enough that the overload test can exceed it (and large enough for the
    # lossless test's 7 x 16 concurrent requests on the ngram pool and 4 x 16 on the draft pool).
    raw["pools"]["ngram"].update(max_ongoing_requests=32, max_queued_requests=112)
    raw["pools"]["draft"].update(max_ongoing_requests=32, max_queued_requests=64)
    # The slow-body probe waits the body deadline out: shorter than the default 30 s.
    raw["api"].setdefault("limits", {})["body_read_timeout_s"] = 10


@pytest.fixture(scope="session")
def cluster(tmp_path_factory) -> Cluster:
    attach = os.environ.get("SPECSERVE_TEST_ATTACH")  # dev loop: a config of a cluster already up
    if attach:
        yield Cluster(Path(attach), yaml.safe_load(Path(attach).read_text()), None, Path(os.devnull))
        return
    yield from launch_cluster(tmp_path_factory.mktemp("cluster"), "specserve-test", _session_overrides)
