"""Keep a local cluster's serving processes off the cores vLLM's CPU workers compute on.

vLLM's CPU backend binds each model worker (`VLLM::Worker`) to its own cores and leaves the rest
("reserved_cpus" in its start-up log) to the processes around it. A stock vLLM server has few of
those; a local cluster has many (Ray's proxies, the router, each replica's front end, the engine
core's scheduler, Ray's own daemons), and they float over every core, so they preempt the model
worker on its core at every request. With `ray.pin_serving_cpus` on, `specserve up` moves every
thread of those processes onto the cores no worker is bound to, and does it again every few seconds
for processes started since (a replaced replica, an autoscaled one).

What is never moved (`plan`): the model workers, Ray's raylet and the workers it starts until they
are one of the long-lived actors (a new replica is started by the raylet, or is a worker it started
earlier, and inherits its cores; vLLM binds its model worker inside the cores its replica was given,
so a replica started on the reserved cores would compute there), and a replica or engine core whose
worker has not started yet (for the same reason).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import psutil

log = logging.getLogger(__name__)

WORKER = "VLLM::Worker"
NEVER_MOVED = ("raylet", "ray::IDLE")  # they start replicas: a replica inherits their cores
SPAWNS_WORKER = ("ray::ServeReplica", "ray::SERVE_REPLICA", "VLLM::EngineCore")  # move only once their worker runs
# The processes a raylet starts that keep their job for life. Any other (a worker still starting as
# `python .../setup_worker.py`, an idle one, one running a task) may become a replica next: moved, it
# would hand the serving cores to the engine that replica starts.
NODE_CPUS_ENV = "SPECSERVE_NODE_CPUS"  # the node's cores, as `specserve up` read them before any pinning
RAY_ACTORS_MOVED = ("ray::ServeController", "ray::ProxyActor", "ray::DashboardAgent", "ray::RuntimeEnvAgent",
                    "ray::ServeReplica", "ray::SERVE_REPLICA")


def program(name: str) -> str:
    """The program a process title names: a title Ray or vLLM set as it is, less the task a Ray actor
    is running (`ray::ServeReplica:app:router.handle_request` is the router's replica), an executable
    by its file name (the raylet runs as `.../ray/core/src/ray/raylet/raylet`).

    >>> program("/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet"), program("ray::IDLE")
    ('raylet', 'ray::IDLE')
    >>> program("ray::ServeReplica:app:router.handle_request_with_rejection"), program("VLLM::Worker")
    ('ray::ServeReplica:app:router', 'VLLM::Worker')
    >>> program("/venv/bin/redis-server 127.0.0.1:6390")
    'redis-server 127.0.0.1:6390'
    """
    if "::" in name.split(" ", 1)[0]:
        head, _, last = name.rpartition(":")
        return f"{head}:{last.split('.', 1)[0]}" if head else name
    return os.path.basename(name)


@dataclass(frozen=True)
class Proc:
    pid: int
    name: str  # the process title (`ray::ProxyActor`, `VLLM::Worker`) or executable
    cpus: frozenset[int]  # its affinity
    has_worker: bool = False  # a VLLM::Worker is among its descendants
    ray_worker: bool = False  # a raylet started it


def reserved_cpus(procs: list[Proc], all_cpus: frozenset[int]) -> frozenset[int]:
    """The cores no model worker is bound to (empty if there is no worker, or the workers are not
    bound: nothing to keep off then).

    >>> w = Proc(9, "VLLM::Worker", frozenset({0}))
    >>> sorted(reserved_cpus([w, Proc(1, "x", frozenset({0, 1}))], frozenset({0, 1})))
    [1]
    >>> reserved_cpus([Proc(9, "VLLM::Worker", frozenset({0, 1}))], frozenset({0, 1}))
    frozenset()
    >>> reserved_cpus([], frozenset({0, 1}))
    frozenset()
    """
    bound = frozenset().union(*(p.cpus for p in procs if p.name.startswith(WORKER) and p.cpus != all_cpus))
    return all_cpus - bound if bound else frozenset()


def plan(procs: list[Proc], all_cpus: frozenset[int]) -> tuple[frozenset[int], list[int]]:
    """(the reserved cores, the pids to move onto them): every process not yet on the reserved cores,
    except the workers, the processes that start replicas, and a replica or engine core whose worker
    has not started.

    >>> W = lambda pid: Proc(pid, "VLLM::Worker", frozenset({0}))
    >>> free = frozenset({0, 1})
    >>> procs = [W(9), Proc(2, "ray::ProxyActor", free), Proc(3, "raylet", free), Proc(4, "ray::IDLE", free),
    ...          Proc(5, "ray::ServeReplica:app:engine-ngram", free, has_worker=True),
    ...          Proc(6, "ray::ServeReplica:app:engine-draft", free), Proc(7, "VLLM::EngineCore", free, True),
    ...          Proc(8, "ray::ServeReplica:app:router", free), Proc(10, "gcs_server", frozenset({1}))]
    >>> plan(procs, free)  # the router replica starts no engine: it moves at once
    (frozenset({1}), [2, 5, 7, 8])
    >>> plan([W(9), Proc(3, "/venv/ray/core/src/ray/raylet/raylet", free)], free)  # by its path, too
    (frozenset({1}), [])
    >>> plan([W(9), Proc(8, "ray::ServeReplica:app:router.handle_request", free)], free)  # busy, too
    (frozenset({1}), [8])
    >>> plan([Proc(2, "ray::ProxyActor", free)], free)  # no bound worker: nothing to do
    (frozenset(), [])

    What a raylet started moves only once it is one of RAY_ACTORS_MOVED (a replica: with its worker):
    >>> R = lambda pid, name, **kw: Proc(pid, name, free, ray_worker=True, **kw)
    >>> plan([W(9), R(11, "/venv/bin/python3.11"), R(12, "ray::_start_node_task"), R(2, "ray::ProxyActor"),
    ...       R(13, "ray::SERVE_REPLICA::app#engine-ngram#x:ServeReplica:app:engine-ngram.__init__"),
    ...       R(14, "ray::SERVE_REPLICA::app#router#y:ServeReplica:app:router.__init__")], free)
    (frozenset({1}), [2, 14])
    """
    reserved = reserved_cpus(procs, all_cpus)
    if not reserved:
        return reserved, []
    out = []
    for p in procs:
        name = program(p.name)
        if p.cpus <= reserved or name.startswith(WORKER) or name.startswith(NEVER_MOVED):
            continue
        if name.startswith(SPAWNS_WORKER) and not p.has_worker and not name.endswith(":router"):
            continue
        if p.ray_worker and not name.startswith(RAY_ACTORS_MOVED):
            continue
        out.append(p.pid)
    return reserved, out


def _title(p: psutil.Process) -> str:
    cmd = p.cmdline()
    return cmd[0] if cmd else p.name()


def _snapshot(root: psutil.Process) -> list[tuple[psutil.Process, Proc]]:
    """Every process under `root`. A process below a replica whose model worker has not started (the
    engine core and its helpers, still `python ...` before they take their titles) counts as that
    replica does: waiting, not moved (`Proc.has_worker` False, `name` the replica's)."""
    out, waiting = [], set()
    for p in [root] + root.children(recursive=True):
        try:
            title = _title(p)
            has_worker = program(title).startswith(SPAWNS_WORKER) and any(
                _title(c).startswith(WORKER) for c in p.children(recursive=True))
            ray_worker = p.pid != root.pid and program(_title(p.parent())) == "raylet"
            if p.ppid() in waiting:  # children come after their parents in this walk
                waiting.add(p.pid)
                title, has_worker = "ray::SERVE_REPLICA (its engine starting)", False
            elif program(title).startswith(SPAWNS_WORKER) and not has_worker and not program(title).endswith(":router"):
                waiting.add(p.pid)
            out.append((p, Proc(p.pid, title, frozenset(p.cpu_affinity()), has_worker, ray_worker)))
        except psutil.Error:  # exited while we looked
            continue
    return out


def node_cpus_env(all_cpus: frozenset[int]) -> dict[str, str]:
    """NODE_CPUS_ENV for the local cluster's processes.

    >>> node_cpus_env(frozenset({1, 0}))
    {'SPECSERVE_NODE_CPUS': '0,1'}
    """
    return {NODE_CPUS_ENV: ",".join(str(c) for c in sorted(all_cpus))}


def restore_node_cpus(environ=os.environ) -> frozenset[int] | None:
    """Give the calling thread every core of the node again (NODE_CPUS_ENV; unset: nothing), before
    it starts a vLLM engine: its engine core and model worker inherit the thread's cores, and vLLM
    binds the worker within them. A replica the pinning moved before its engine started (a Ray worker
    reused, a pass that raced its start) would otherwise put its worker on the serving cores."""
    spec = environ.get(NODE_CPUS_ENV)
    if not spec:
        return None
    cpus = frozenset(int(c) for c in spec.split(",") if c.strip()) & frozenset(range(os.cpu_count() or 1))
    if cpus:
        os.sched_setaffinity(0, cpus)
    return cpus or None


def pin_serving_processes(all_cpus: frozenset[int], root_pid: int | None = None) -> int:
    """Move the serving processes under `root_pid` (default: this process) onto the cores of
    `all_cpus` (the cluster's cores, read before any pinning) that no worker is bound to, every thread
    of each; return how many processes moved. Errors (a process gone, a thread that exited) are
    skipped: the next call tries again."""
    procs = _snapshot(psutil.Process(root_pid or os.getpid()))
    reserved, pids = plan([p for _, p in procs], all_cpus)
    moved = 0
    for p, info in procs:
        if info.pid not in pids:
            continue
        try:
            for t in p.threads():
                try:
                    os.sched_setaffinity(t.id, reserved)
                except OSError:  # the thread exited
                    pass
            moved += 1
            log.debug("pinned %s (pid %d) to cpus %s", info.name[:60], info.pid, sorted(reserved))
        except psutil.Error:
            continue
    if moved:  # one line per pass, not one per process: the start-up output stays on one screen
        log.info("pinned %d serving processes to cpus %s", moved, sorted(reserved))
    return moved

