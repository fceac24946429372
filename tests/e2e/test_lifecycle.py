"""`specserve up` leaves nothing running when its start-up fails or is interrupted: Ray, Redis and
every vLLM engine process it started are gone once it exits (an interrupted
start-up once left `VLLM::EngineCore` processes re-parented to init, holding their models' memory).

Each test starts its own `specserve up` with a tag in its environment; Ray workers and the engine
processes they start inherit it, so after the exit a scan of /proc finds anything it left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
import yaml

from cluster.state.redis_server import parse_redis_url, ping
from tests.e2e.conftest import LOCAL_CONFIG, ROOT, _free_port

pytestmark = pytest.mark.engine

EXIT_TIMEOUT_S = 180


def _tagged(tag: str) -> list[str]:
    """`pid cmdline` of every live process whose environment carries the tag."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if tag.encode() not in (d / "environ").read_bytes():
                continue
            if (d / "stat").read_text().split(")")[-1].split()[0] == "Z":
                continue  # exited, not yet waited for
            cmdline = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{d.name} {cmdline[:120]}")
        except OSError:
            continue
    return found


def _start(tmp: Path, wait_s: float, sigint_ignored: bool = False, **pool_overrides,
           ) -> tuple[subprocess.Popen, Path, str, dict]:
    """Start `specserve up`; with `sigint_ignored`, the way a shell script's background job
    (`specserve up &` without job control) starts it: SIGINT inherited ignored (`trap '' INT`).
    CI runs the tests that way, and there an interrupt during start-up once did nothing."""
    raw = yaml.safe_load(LOCAL_CONFIG.read_text())
    raw["api"]["http_port"] = _free_port()
    raw["api"]["grpc_port"] = _free_port()
    raw["redis"]["url"] = f"redis://127.0.0.1:{_free_port()}/0"
    raw["ray"]["metrics_export_port"] = _free_port()
    raw["name"] = "specserve-lifecycle"
    raw["pools"] = {"ngram": {**raw["pools"]["ngram"], **pool_overrides}}  # one engine is enough
    config_path = tmp / "cluster.yaml"
    config_path.write_text(yaml.safe_dump(raw))
    tag = f"SPECSERVE_LIFECYCLE_TAG={uuid.uuid4().hex}"
    key, value = tag.split("=")
    log_path = tmp / "up.log"
    with open(log_path, "w") as log:
        cmd = [sys.executable, "-m", "cluster.ops.cli", "up", "--config", str(config_path), "--wait-s", str(wait_s)]
        if sigint_ignored:
            cmd = ["sh", "-c", 'trap "" INT; exec "$@"', "sh", *cmd]  # exec: the pid stays that of `up`
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", key: value}, start_new_session=True)
    return proc, log_path, tag, raw


def _wait_for(log_path: Path, text: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in log_path.read_text(errors="replace"):
        assert proc.poll() is None, f"exited early:\n{log_path.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {text!r} after {timeout_s} s:\n{log_path.read_text()[-3000:]}"
        time.sleep(0.5)


def _finish(proc: subprocess.Popen, log_path: Path, tag: str) -> tuple[int, str, list[str]]:
    try:
        rc = proc.wait(timeout=EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # stop it the documented way, then by force
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        _kill(_tagged(tag))
        pytest.fail(f"specserve up still running {EXIT_TIMEOUT_S} s after the stop:\n{log_path.read_text()[-3000:]}")
    time.sleep(1.0)
    left = _tagged(tag)
    _kill(left)  # do not leak into the rest of the session even when the test fails
    return rc, log_path.read_text(errors="replace"), left


def _kill(lines: list[str]) -> None:
    for line in lines:
        try:
            os.kill(int(line.split()[0]), signal.SIGKILL)
        except OSError:
            pass


def _redis_left(raw: dict) -> bool:
    """True when the cluster's Redis still answers; it is then stopped (redis-server rewrites its
    process title over its environment, so the tag scan cannot see it)."""
    host, port, _ = parse_redis_url(raw["redis"]["url"])
    if not ping(host, port):
        return False
    for p in psutil.process_iter(["name"]):
        try:
            if "redis" in (p.info["name"] or "") and any(c.laddr.port == port for c in p.net_connections()):
                p.kill()
        except psutil.Error:
            pass
    return True


def _engine_started(tag: str) -> bool:
    return any("VLLM" in line or "EngineCore" in line for line in _tagged(tag))


def test_an_interrupted_start_up_leaves_no_process_behind(tmp_path):
    proc, log_path, tag, raw = _start(tmp_path, wait_s=600, sigint_ignored=True)
    _wait_for(log_path, "[specserve] deploying", proc, 300)
    deadline = time.monotonic() + 240  # interrupt while the engine is starting (the leak's window)
    while not _engine_started(tag) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.5)
    assert _engine_started(tag), f"no engine process seen:\n{log_path.read_text()[-3000:]}"
    assert "[specserve] serving in" not in log_path.read_text()  # still starting: the case under test
    proc.send_signal(signal.SIGINT)
    rc, log, left = _finish(proc, log_path, tag)
    assert left == [], f"left running after `specserve up` exited: {left}\n{log[-3000:]}"
    assert not _redis_left(raw), "the cluster's Redis is still up"
    assert rc != 0, log[-3000:]
    assert "start-up did not finish" in log, log[-3000:]


def test_a_start_up_that_times_out_stops_what_it_started(tmp_path):
    proc, log_path, tag, raw = _start(tmp_path, wait_s=10)
    rc, log, left = _finish(proc, log_path, tag)
    assert left == [], f"left running after `specserve up` exited: {left}\n{log[-3000:]}"
    assert not _redis_left(raw), "the cluster's Redis is still up"
    assert rc == 1, log[-3000:]
    assert "not running after 10 s" in log, log[-3000:]


def test_an_engine_that_does_not_start_in_time_stops_the_start_up_naming_the_field(tmp_path):
    """The replica gives up at the pool's startup_timeout_s (vLLM's own wait for its engine core has
    no bound until the model is loaded); Serve stops it, and with it the engine it was starting."""
    proc, log_path, tag, raw = _start(tmp_path, wait_s=600, startup_timeout_s=3)
    rc, log, left = _finish(proc, log_path, tag)
    assert left == [], f"left running after `specserve up` exited: {left}\n{log[-3000:]}"
    assert rc == 1, log[-3000:]
    assert "engine-ngram: deployments.engine_start.EngineStartTimeout: pools.ngram.startup_timeout_s: " \
           "the engine did not start within 3 s" in log, log[-3000:]


def _pids(tag: str, needle: str) -> list[int]:
    return [int(line.split()[0]) for line in _tagged(tag) if needle in line]


def test_an_engine_whose_replica_is_killed_stops_instead_of_leaking(tmp_path):
    """A Serve replica killed outright (SIGKILL: an OOM kill, a crash) does not leak its
    `VLLM::EngineCore` and the model's memory: the engine stops within 60 s. (Written expecting a
    leak; it passes with no watcher of ours in the engine, so none was added. It guards the
    behaviour against a vLLM or Ray upgrade.)"""
    proc, log_path, tag, raw = _start(tmp_path, wait_s=600)
    try:
        _wait_for(log_path, "[specserve] serving in", proc, 600)
        # Quiet by default: what a newcomer sees until "serving" fits on one screen (engine and
        # Ray output stays in the log directory unless --verbose).
        before = log_path.read_text(errors="replace").split("[specserve] serving in")[0].splitlines()
        assert len(before) <= 25, "start-up printed more than a screen:\n" + "\n".join(before[:60])
        replicas = _pids(tag, "ServeReplica:specserve-lifecycle:engine-ngram")
        engines = _pids(tag, "VLLM::EngineCore")
        assert len(replicas) == 1 and len(engines) == 1, _tagged(tag)
        assert psutil.Process(engines[0]).ppid() == replicas[0]
        os.kill(replicas[0], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and psutil.pid_exists(engines[0]) \
                and psutil.Process(engines[0]).status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.5)
        engine_gone = not psutil.pid_exists(engines[0]) or psutil.Process(engines[0]).status() == psutil.STATUS_ZOMBIE
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        rc, log, left = _finish(proc, log_path, tag)
    assert engine_gone, f"the killed replica's engine {engines[0]} still runs 60 s later"
    assert left == [], f"left running after `specserve up` exited: {left}\n{log[-3000:]}"
    assert not _redis_left(raw), "the cluster's Redis is still up"
