"""How `specserve up` stops what it started, and the signals around it. `stop_cluster` stops the gRPC
TLS forwarder, Serve, the local worker nodes, Ray, the node certificate and Redis, with Serve's
shutdown bounded (`bounded`) and the rest in a `finally`, so that a step that hangs or fails does not
stop the rest. SIGINT and SIGTERM raise KeyboardInterrupt during start-up, even when the process
inherited SIGINT ignored, and a second one while stopping does not cut the stop short.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from cluster.ops import ray_tls

SERVE_SHUTDOWN_S = 60.0


def bounded(fn, timeout_s: float, what: str) -> bool:
    """Run `fn` in a daemon thread and wait at most `timeout_s` for it: True if it returned, False
    (with a line on stderr) if it raised or is still running, which the caller then goes past.
    Ray 2.60's `serve.shutdown()` can wait forever: once its controller is killed, the controller's
    `graceful_shutdown` task is retried without end ("infinite retries remaining"), seen once in CI
    on an interrupted start-up; `ray.shutdown()` and the reaper stop what it leaves."""
    outcome: list[BaseException] = []

    def run():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - reported, then the caller goes on stopping
            outcome.append(e)

    t = threading.Thread(target=run, daemon=True, name=what)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        print(f"[specserve] {what} did not finish in {timeout_s:.0f} s: going on with the shutdown", file=sys.stderr)
        return False
    if outcome:
        print(f"[specserve] {what} failed: {outcome[0]!r}: going on with the shutdown", file=sys.stderr)
        return False
    return True


def stop_cluster(redis_handle=None, forwarder=None, nodes=None, serve_timeout_s: float = SERVE_SHUTDOWN_S) -> None:
    import ray
    from ray import serve

    try:
        if forwarder is not None:
            forwarder.stop()
        if ray.is_initialized():
            bounded(serve.shutdown, serve_timeout_s, "serve.shutdown")
    finally:
        if nodes is not None:
            nodes.stop()
        ray.shutdown()
        ray_tls.forget_local_pki(os.environ)
        if redis_handle is not None:
            redis_handle.stop()


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


def interrupt_on_signals() -> None:
    """Make SIGINT and SIGTERM raise KeyboardInterrupt in the main thread, whatever their
    disposition was. A process started from a shell script's background job (`specserve up &`
    without job control, as CI runs its tests) inherits SIGINT *ignored*, and Python then leaves it
    ignored: an interrupt during start-up did nothing, the cluster came up anyway (in CI the
    lifecycle test's interrupt was acted on only once `up` had installed its serving-time handler,
    3 minutes later). SIGTERM is handled the same way so a start-up stopped by a process
    manager also stops what it started (its default would kill `up` and leave Redis running)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _raise_interrupt)


def hold_signals_while_stopping() -> None:
    """A second Ctrl-C while stopping must not cut the stop short (and leave Redis or engines
    running): say so and go on."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda *_: print("[specserve] already stopping", file=sys.stderr))
