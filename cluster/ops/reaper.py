"""Leave no process behind: `specserve up` adopts what its children orphan and stops it on exit.

A local cluster is a tree under `specserve up`: Redis, Ray's GCS and raylet, Ray workers (Serve
replicas), and each replica's vLLM engine-core process. Ray stops its workers on `ray.shutdown()`,
but a worker killed while its engine was still starting (an interrupted or failed start-up) leaves
the `VLLM::EngineCore` process running, re-parented to init, holding its model's memory. On Linux
`specserve up` makes itself a child subreaper, so such orphans are re-parented to it instead, and
after a shutdown it stops whatever is left under it (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal

import psutil

log = logging.getLogger(__name__)

_PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>


def become_subreaper() -> bool:
    """Ask Linux to re-parent this process's orphaned descendants to it (not to init). False where
    that is not available (not Linux); the reaper then sees only descendants still attached."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def describe(found: list[tuple[int, str]]) -> str:
    """`pid name, ...`: the message saying what was stopped."""
    return ", ".join(f"{pid} {name}" for pid, name in found)


def reap_descendants(grace_s: float = 10.0, pid: int | None = None) -> list[tuple[int, str]]:
    """Stop every process still under `pid` (default: this one): SIGTERM, `grace_s` to exit, then
    SIGKILL. Returns (pid, name) of the processes found (empty when the shutdown left nothing)."""
    try:
        procs = psutil.Process(pid or os.getpid()).children(recursive=True)
    except psutil.Error:
        return []
    found, live = [], []
    for p in procs:
        try:
            if p.status() == psutil.STATUS_ZOMBIE:  # exited, not yet waited for: collect it quietly
                _collect(p)
                continue
            found.append((p.pid, " ".join(p.cmdline())[:80] or p.name()))
            live.append(p)
        except psutil.Error:
            _collect(p)
    procs = live
    if not procs:
        return []
    for p in procs:
        _signal(p, signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        _signal(p, signal.SIGKILL)
    psutil.wait_procs(alive, timeout=5)
    return found


def _collect(p: psutil.Process) -> None:
    try:
        p.wait(timeout=0)  # reaps it if it is our child (an orphan re-parented to us included)
    except (psutil.Error, ChildProcessError):
        pass


def _signal(p: psutil.Process, sig: int) -> None:
    try:
        p.send_signal(sig)
    except psutil.Error:
        pass

