"""Worker nodes of a local multi-node Ray cluster (`ray.nodes` in the config): each node is a
separate process tree on this machine (`cluster.ops.ray_node`: its own raylet, object store, agents
and workers), joined to the head that `specserve up` starts, as Ray's own scheduling tests run
several nodes on one host. Nodes advertise the custom resources the config names, so the placement code
that sends engines to GPU node groups is the code that runs here.

Each node gets its own process group: stopping a node (or killing it, to test node loss) signals
the group, which holds every process of that node (the node process, the raylet, its workers and
the vLLM engine cores they start). Not its own session: Linux schedules each session as one
autogroup, and engines in different autogroups sharing a core starved one another (a model worker
that busy-polls its queue between steps, as vLLM's do for a second, kept another node's worker from
running for a minute); in the head's session they share the core as the engines of one node do.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from cluster.config_sections import LocalNodeConfig

# Worker ports of node i: WORKER_PORT_BASE + i * WORKER_PORTS_PER_NODE onwards (the head keeps
# Ray's default range, 10002-19999, below), so nodes on one machine never hand out the same port.
WORKER_PORT_BASE = 20000
WORKER_PORTS_PER_NODE = 400


def node_command(python: str, gcs_address: str, node: LocalNodeConfig, index: int, node_ip: Optional[str]) -> list[str]:
    """The command line of worker node `index` (0-based): `cluster.ops.ray_node` with its resources.

    >>> node = LocalNodeConfig(name="target", num_cpus=1, resources={"specserve_target": 1})
    >>> cmd = node_command("python", "127.0.0.1:6379", node, 1, "127.0.0.1")
    >>> cmd[:6], cmd[cmd.index("--resources") + 1], cmd[cmd.index("--min-worker-port") + 1]
    (['python', '-m', 'cluster.ops.ray_node', '--gcs', '127.0.0.1:6379', '--name'], '{"specserve_target": 1.0}', '20400')
    """
    lo = WORKER_PORT_BASE + index * WORKER_PORTS_PER_NODE
    cmd = [python, "-m", "cluster.ops.ray_node", "--gcs", gcs_address, "--name", node.name,
           "--num-cpus", str(node.num_cpus), "--resources", json.dumps(node.resources),
           "--object-store-mb", str(node.object_store_mb),
           "--min-worker-port", str(lo), "--max-worker-port", str(lo + WORKER_PORTS_PER_NODE - 1)]
    if node_ip:
        cmd += ["--node-ip", node_ip]
    return cmd


@dataclass
class LocalNode:
    config: LocalNodeConfig
    proc: subprocess.Popen
    log_path: Path

    @property
    def name(self) -> str:
        return self.config.name


@dataclass
class LocalNodes:
    """The worker nodes `specserve up` started (see module doc)."""

    nodes: list[LocalNode] = field(default_factory=list)

    @classmethod
    def start(cls, configs: list[LocalNodeConfig], gcs_address: str, node_ip: Optional[str], log_dir: Path,
              environ: Optional[dict] = None, python: Optional[str] = None) -> "LocalNodes":
        """Start one node process per node (each in its own process group, output to `log_dir`);
        `python`: the interpreter that runs `cluster.ops.ray_node` (default: this one)."""
        python = python or sys.executable
        log_dir.mkdir(parents=True, exist_ok=True)
        started = cls()
        try:
            for i, node in enumerate(configs):
                log_path = log_dir / f"node-{node.name}.log"
                with open(log_path, "ab") as log:
                    proc = subprocess.Popen(node_command(python, gcs_address, node, i, node_ip),
                                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=dict(environ if environ is not None else os.environ),
                                            process_group=0)  # see module doc: not a new session
                started.nodes.append(LocalNode(node, proc, log_path))
        except BaseException:
            started.stop()
            raise
        return started

    def wait_joined(self, alive_names, timeout_s: float = 120.0, poll_s: float = 0.5) -> None:
        """Wait until every node is alive in the cluster: `alive_names()` returns the names Ray
        reports alive. Raises RuntimeError naming a node whose process ended or that did not join."""
        deadline = time.monotonic() + timeout_s
        while True:
            for n in self.nodes:
                if n.proc.poll() is not None:
                    raise RuntimeError(f"ray node {n.name!r} exited with {n.proc.returncode} before joining "
                                       f"(its log: {n.log_path})")
            missing = sorted({n.name for n in self.nodes} - set(alive_names()))
            if not missing:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"ray nodes {missing} did not join within {timeout_s:g} s (logs in "
                                   f"{self.nodes[0].log_path.parent})")
            time.sleep(poll_s)

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM each node process (it stops its raylet, agents and workers), then SIGKILL its whole
        process group after `grace_s`."""
        for n in self.nodes:
            if n.proc.poll() is None:
                n.proc.terminate()
        deadline = time.monotonic() + grace_s
        for n in self.nodes:
            try:
                n.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _signal_group(n.proc, signal.SIGKILL)  # whatever the node left (a worker, an engine core)
            try:
                n.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self.nodes = []


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
