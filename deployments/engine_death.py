"""An engine replica whose vLLM engine core died: what counts as that death, the error the replica
answers with from then on, and how it retires so that Ray Serve replaces it.

vLLM 0.32's AsyncLLM runs its engine core in a child process (`VLLM::EngineCore`). When that
process exits (killed, crashed, out of memory), a monitor thread in AsyncLLM marks the engine dead
at once, every waiting `generate()` raises `EngineDeadError`, and so does every later `generate()`
and `check_health()`: the AsyncLLM never serves again. A replica left running would fail each
request at once and, looking idle, draw more of them, until Ray Serve gave up on it after three
failed health checks (about 30 s). So the replica fails its calls with `EngineDead` (the router
retries a call that sent no output on the pool, and ends one that did with UNAVAILABLE) and ends
its own process after a short grace: Serve's handles stop routing to the dead actor when they next
try it, and the controller starts a replacement at its next health check (`health_check_period_s`).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Callable

log = logging.getLogger("specserve.engine")

# Between the engine's death and the end of the replica's process: long enough for the failing
# calls' replies (EngineDead) and the log lines to leave, short enough that few new calls land here.
RETIRE_GRACE_S = 0.5
RETIRE_EXIT_CODE = 70  # EX_SOFTWARE: the replica ended itself because its engine died


class EngineDead(RuntimeError):
    """The replica's vLLM engine core is dead; the replica is retiring. A call that got no output may
    be retried on another replica of the pool."""


def engine_died(e: BaseException, errored: bool) -> bool:
    """Whether `e`, raised by vLLM's AsyncLLM, means its engine core is gone: `EngineDeadError`, or
    any error while the engine reports itself errored (AsyncLLM wraps an error of its output loop
    that raced the death in `EngineGenerateError`). `errored`: the AsyncLLM's `errored` property."""
    from vllm.v1.engine.exceptions import EngineDeadError

    return isinstance(e, EngineDeadError) or errored


def retire_process(grace_s: float = RETIRE_GRACE_S, exit_fn: Callable[[int], None] = os._exit) -> threading.Timer:
    """End this process `grace_s` from now, from a daemon timer (a busy event loop cannot hold it
    up). Ray sees the replica's actor die: the Serve controller marks it unhealthy and replaces it,
    and Serve's handles route around it. `exit_fn`: for tests."""
    def _exit() -> None:
        log.error("engine replica retiring: its vLLM engine core is dead (exit code %d)", RETIRE_EXIT_CODE)
        for handler in [*logging.getLogger().handlers, *logging.getLogger("specserve").handlers, *log.handlers]:
            try:
                handler.flush()
            except Exception:  # noqa: BLE001 - exiting anyway
                pass
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - exiting anyway
                pass
        exit_fn(RETIRE_EXIT_CODE)

    timer = threading.Timer(grace_s, _exit)
    timer.daemon = True
    timer.start()
    return timer
