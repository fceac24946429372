"""`cluster.ops.up` and `cluster.ops.shutdown`: a shutdown step that hangs or raises does not stop the rest
of the shutdown (Ray's `serve.shutdown()` once waited forever on a killed controller in CI); start-up is
quiet unless --verbose; signals during start-up stop it."""

from __future__ import annotations

import threading
import time

import pytest

from cluster.ops.shutdown import bounded
from cluster.ops.up import init_ray, local_drafter_secret, logs_line
from tests.paths import LOCAL_CPU


def test_a_hanging_step_is_gone_past_after_its_bound(capsys):
    release = threading.Event()
    t0 = time.monotonic()
    assert bounded(release.wait, 0.5, "serve.shutdown") is False
    waited = time.monotonic() - t0
    release.set()
    assert 0.5 <= waited < 5.0
    assert "serve.shutdown did not finish in" in capsys.readouterr().err


def test_a_raising_step_is_reported_and_gone_past(capsys):
    def boom():
        raise RuntimeError("controller is dead")

    assert bounded(boom, 5.0, "serve.shutdown") is False
    assert "serve.shutdown failed: RuntimeError('controller is dead')" in capsys.readouterr().err


def test_a_step_that_finishes_returns_true_at_once():
    done = []
    t0 = time.monotonic()
    assert bounded(lambda: done.append(1), 30.0, "serve.shutdown") is True
    assert done == [1] and time.monotonic() - t0 < 5.0


class _FlakyInit:
    """ray.init that fails its first `fails` calls with `error`."""

    def __init__(self, fails: int, error: Exception):
        self.fails, self.error, self.calls, self.shutdowns = fails, error, [], 0

    def __call__(self, **kwargs):
        self.calls.append(kwargs)
        if len(self.calls) <= self.fails:
            raise self.error
        return "ctx"

    def shutdown(self):
        self.shutdowns += 1


NODE_TIMEOUT = Exception("The current node timed out during startup. This could happen because some of the "
                         "raylet failed to startup or the GCS has become overloaded.")


def test_a_local_node_that_timed_out_during_startup_is_started_once_more(capsys):
    """`up` right after a stopped cluster: the old raylet was still exiting and Ray's node timed out."""
    init, slept = _FlakyInit(1, NODE_TIMEOUT), []
    assert init_ray(init, init.shutdown, {"num_cpus": 2}, retry=True, sleep=slept.append) == "ctx"
    assert init.calls == [{"num_cpus": 2}] * 2 and init.shutdowns == 1 and slept == [10.0]
    assert "timed out during startup" in capsys.readouterr().err


@pytest.mark.parametrize("fails, error, retry", [
    (2, NODE_TIMEOUT, True),  # a second timeout is not hidden
    (1, NODE_TIMEOUT, False),  # joining a cluster starts no node: nothing to retry
    (1, ValueError("bad runtime_env"), True),  # any other failure is raised at once
])
def test_other_start_up_failures_are_raised_as_they_are(fails, error, retry):
    init, slept = _FlakyInit(fails, error), []
    with pytest.raises(type(error), match=str(error)[:20]):
        init_ray(init, init.shutdown, {}, retry=retry, sleep=slept.append)
    assert len(init.calls) == (2 if fails == 2 else 1)


def test_a_local_cluster_with_drafters_gets_a_new_wire_secret_per_start():
    """`specserve up` of the local default with a remote drafter needs no secret set by hand."""
    from pathlib import Path

    import yaml

    from tools.bench.remote import bench_config
    from cluster.config import parse_config
    from cluster.engine.draft_wire import SECRET_ENV, secret_from_env

    local = yaml.safe_load(LOCAL_CPU.read_text())
    with_drafter = parse_config(bench_config(local, 1, 2, 3, 4, timeout_s=0.5))
    first, second = local_drafter_secret(with_drafter, {}), local_drafter_secret(with_drafter, {})
    assert secret_from_env(first) and first[SECRET_ENV] != second[SECRET_ENV]
    assert local_drafter_secret(with_drafter, {SECRET_ENV: "set-by-the-operator-0123"}) == {}  # kept
    assert local_drafter_secret(parse_config(local), {}) == {}  # no drafters, no secret


# -- quiet by default ------------------------------------------------------------------------------
# A start-up printed some 500 lines of engine and Serve logs forwarded by Ray before "serving"; they
# go to the session's log directory, whose path `up` prints once, and --verbose shows them as well.

def test_up_is_quiet_unless_verbose_and_the_flag_reaches_start_cluster(monkeypatch):
    from cluster.ops import reaper, up
    from cluster.ops.cli import build_parser
    from cluster.config import ConfigError

    seen = []

    def start_cluster(config_path, wait_s, verbose):
        seen.append(verbose)
        raise ConfigError("stop here")  # `up` returns 2 before starting anything

    monkeypatch.setattr(up, "start_cluster", start_cluster)
    monkeypatch.setattr(up, "interrupt_on_signals", lambda: None)  # keep pytest's own signal handlers
    monkeypatch.setattr(reaper, "become_subreaper", lambda: False)
    monkeypatch.setattr(reaper, "reap_descendants", lambda: [])
    for argv, verbose in ((["up"], False), (["up", "--verbose"], True), (["up", "--show-logs"], True)):
        args = build_parser().parse_args(argv)
        assert args.func(args) == 2
        assert seen.pop() is verbose, argv


def test_the_log_directory_is_named_once_with_the_flag_that_shows_the_logs():
    quiet = logs_line("/tmp/ray/session_x", verbose=False, joined=False)
    assert quiet.startswith("[specserve] logs: /tmp/ray/session_x/logs ") and "--verbose" in quiet
    assert "--verbose" not in logs_line("/tmp/ray/session_x", verbose=True, joined=False)
    assert "each Ray node keeps its own" in logs_line("/tmp/ray/session_x", verbose=False, joined=True)
    assert "/tmp/ray/session_latest/logs" in logs_line(None, verbose=False, joined=True)  # Ray Client: no local session


def test_up_docstring_examples_hold():
    import doctest

    import cluster.ops.up

    result = doctest.testmod(cluster.ops.up)
    assert result.attempted > 0 and result.failed == 0


# -- signals during start-up ----------------------------------------------------------------------
# A process started from a script's background job (no job control, as CI runs) inherits SIGINT
# ignored; `specserve up` must still stop on it. Each case runs in a fresh interpreter started with
# SIGINT ignored (`trap '' INT`, what the shell does for such a job).

_PROBE = r"""
import os, signal, sys, time
from cluster.ops.shutdown import hold_signals_while_stopping, interrupt_on_signals
print("inherited", signal.getsignal(signal.SIGINT) is signal.SIG_IGN, flush=True)
{setup}
try:
    os.kill(os.getpid(), signal.{sig})
    time.sleep(2.0)
    print("not interrupted", flush=True)
except KeyboardInterrupt as e:
    print("interrupted", e, flush=True)
"""


def _probe(setup: str, sig: str) -> str:
    import subprocess
    import sys
    from pathlib import Path

    code = _PROBE.replace("{setup}", setup).replace("{sig}", sig)
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(["sh", "-c", 'trap "" INT; exec "$0" -c "$1"', sys.executable, code],
                         cwd=root, capture_output=True, text=True, timeout=120)
    return out.stdout + out.stderr


def test_an_inherited_ignored_sigint_is_ignored_without_the_handlers():
    out = _probe("", "SIGINT")  # the case the handlers exist for: nothing happens
    assert "inherited True" in out and "not interrupted" in out, out


def test_sigint_and_sigterm_interrupt_start_up_even_when_sigint_was_ignored():
    for sig in ("SIGINT", "SIGTERM"):
        out = _probe("interrupt_on_signals()", sig)
        assert "inherited True" in out and f"interrupted {sig}" in out, out


def test_a_signal_while_stopping_does_not_cut_the_stop_short():
    out = _probe("interrupt_on_signals(); hold_signals_while_stopping()", "SIGINT")
    assert "not interrupted" in out and "[specserve] already stopping" in out, out
