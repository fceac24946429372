"""How an engine core waits for its model workers' replies: vLLM spins, a pool may have it block.

vLLM's engine core reads each step's result from its workers through a shared-memory queue
(`vllm.distributed.device_communicators.shm_broadcast.MessageQueue`). While it waits it spins on
`sched_yield` for up to a second after its last read (`SpinCondition.wait`); with a step every few
tens of milliseconds it never stops, so it keeps its core busy for the whole forward pass. Where
that core is also the serving path's (the CPU build with `ray.pin_serving_cpus`: the engine core
shares a core with Serve's proxy, the router and the engine replicas, which relay every streamed
chunk), the spin takes that core from them. With the pool's `engine_core_wait: block` the engine
core instead sleeps on the queue's notification socket (the writer notifies after every write) and
wakes when the reply is there; the poll returns at least every `POLL_MS`, so a notification that
the socket drops costs that much, not vLLM's idle recheck of seconds.

`block_on_replies()` replaces `SpinCondition.wait` for the process that calls it: the scheduler
(`cluster.engine.vllm_scheduler`) calls it in the engine core, where the only reader is the one
of the workers' replies; the model workers (other processes) keep vLLM's spin.
"""

from __future__ import annotations

from typing import Any, Optional

import zmq

POLL_MS = 1  # the longest a dropped notification delays the engine core


def blocking_wait(cond: Any, timeout_ms: Optional[int] = None, poll_ms: int = POLL_MS) -> None:
    """`SpinCondition.wait` that sleeps until the writer's notification (or cancel), at most `poll_ms`
    (or `timeout_ms`, if shorter). The caller re-checks the queue's flag either way, as vLLM's does."""
    events = dict(cond.poller.poll(timeout=poll_ms if timeout_ms is None else max(0, min(timeout_ms, poll_ms))))
    if cond.local_notify_socket in events:  # CONFLATE: at most one pending notification
        cond.local_notify_socket.recv(flags=zmq.NOBLOCK, copy=False)


def block_on_replies(poll_ms: int = POLL_MS) -> bool:
    """Make this process's shared-memory queue readers block instead of spinning (see module doc).
    Returns False if it already did."""
    from vllm.distributed.device_communicators import shm_broadcast

    cls = shm_broadcast.SpinCondition
    if getattr(cls.wait, "specserve_blocking", False):
        return False

    def wait(self, timeout_ms: Optional[int] = None) -> None:
        blocking_wait(self, timeout_ms, poll_ms)

    wait.specserve_blocking = True  # type: ignore[attr-defined]
    cls.wait = wait
    return True
