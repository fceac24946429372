"""`cluster.ops.cpu_pinning` against real processes: a tree like a local cluster's (a model worker bound
to one core, Ray's daemons and replicas floating) is moved off the worker's core, and what must not
move (the worker, the raylet, a replica whose worker has not started) stays where it was."""

from __future__ import annotations

import os
import subprocess
import time

import psutil
import pytest

from cluster.ops.cpu_pinning import pin_serving_processes

ALL = frozenset(os.sched_getaffinity(0))
pytestmark = pytest.mark.skipif(len(ALL) < 2, reason="needs two cores to keep one free")

# A shell whose children carry the process titles of a local cluster (`exec -a` sets argv[0]; the
# raylet's is its executable's path, as Ray starts it). The worker is bound to the lowest core, as
# vLLM's auto-binding does; everything else floats.
RAYLET = "/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet"
TREE = f"""
(exec -a VLLM::Worker sleep 60) &
(exec -a {RAYLET} bash -c '(exec -a /venv/bin/python3.11 sleep 60) & wait') &
(exec -a ray::ProxyActor sleep 60) &
(exec -a ray::ServeReplica:app:engine-waiting bash -c '(exec -a /venv/bin/python3 sleep 60) & wait') &
(exec -a ray::ServeReplica:app:engine-ngram bash -c '(exec -a VLLM::Worker sleep 60) & wait') &
wait
"""


def _titles(root: psutil.Process) -> dict[str, list[psutil.Process]]:
    out: dict[str, list[psutil.Process]] = {}
    for p in root.children(recursive=True):
        cmd = p.cmdline()
        if cmd:
            out.setdefault(cmd[0], []).append(p)
    return out


def test_serving_processes_leave_the_workers_core_and_the_rest_stays():
    shell = subprocess.Popen(["bash", "-c", TREE])
    try:
        root = psutil.Process(shell.pid)
        deadline = time.monotonic() + 10
        while (len(_titles(root).get("VLLM::Worker", [])) < 2
               or not {"/venv/bin/python3.11", "/venv/bin/python3"} <= _titles(root).keys()) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        titles = _titles(root)
        worker_core = min(ALL)
        for w in titles["VLLM::Worker"]:
            w.cpu_affinity([worker_core])
        free = sorted(ALL - {worker_core})

        assert pin_serving_processes(ALL, root_pid=shell.pid) >= 2
        assert titles["ray::ProxyActor"][0].cpu_affinity() == free
        assert titles["ray::ServeReplica:app:engine-ngram"][0].cpu_affinity() == free  # its worker runs
        assert root.cpu_affinity() == free
        for w in titles["VLLM::Worker"]:
            assert w.cpu_affinity() == [worker_core]
        assert titles[RAYLET][0].cpu_affinity() == sorted(ALL)  # starts replicas: they inherit its cores
        assert titles["/venv/bin/python3.11"][0].cpu_affinity() == sorted(ALL)  # a Ray worker starting
        assert titles["ray::ServeReplica:app:engine-waiting"][0].cpu_affinity() == sorted(ALL)
        assert titles["/venv/bin/python3"][0].cpu_affinity() == sorted(ALL)  # its engine core, starting
        assert pin_serving_processes(ALL, root_pid=shell.pid) == 0  # nothing new to move
    finally:
        for p in psutil.Process(shell.pid).children(recursive=True):
            p.kill()
        shell.kill()
        shell.wait()


def test_without_a_bound_worker_nothing_moves():
    shell = subprocess.Popen(["bash", "-c", "(exec -a ray::ProxyActor sleep 60) & wait"])
    try:
        time.sleep(0.3)
        assert pin_serving_processes(ALL, root_pid=shell.pid) == 0
        assert psutil.Process(shell.pid).cpu_affinity() == sorted(ALL)
    finally:
        for p in psutil.Process(shell.pid).children(recursive=True):
            p.kill()
        shell.kill()
        shell.wait()


def test_an_engine_starts_on_every_core_of_the_node_even_from_a_pinned_thread():
    """`restore_node_cpus` (called before vLLM starts its engine core): a replica process the pinning
    moved before its engine started gets the node's cores back for the thread that starts it."""
    import threading

    from cluster.ops.cpu_pinning import node_cpus_env, restore_node_cpus

    seen = {}

    def start():
        os.sched_setaffinity(0, {min(ALL)})  # as if moved onto one core
        seen["restored"] = restore_node_cpus(node_cpus_env(ALL))
        seen["now"] = os.sched_getaffinity(0)
        seen["unset"] = restore_node_cpus({})

    t = threading.Thread(target=start)
    t.start()
    t.join()
    assert seen == {"restored": ALL, "now": set(ALL), "unset": None}
