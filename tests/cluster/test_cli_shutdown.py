"""`cluster.cli.bounded`: a shutdown step that hangs or raises does not stop the rest of the
shutdown (Ray's `serve.shutdown()` once waited forever on a killed controller in CI)."""

from __future__ import annotations

import threading
import time

from cluster.cli import bounded


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
