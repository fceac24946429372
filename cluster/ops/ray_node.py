"""One worker node of a local multi-node Ray cluster, as a process: `python -m cluster.ops.ray_node
--gcs ADDRESS --name NAME ...` starts a raylet, object store and agents joined to the head's GCS,
and stops them on SIGTERM or SIGINT (`cluster/ops/local_nodes.py` starts one per configured node).

Why not `ray start --address`: its CLI refuses to join a cluster when Ray's loopback switch is set
(`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`), and without the switch it rewrites 127.0.0.1 to this
machine's routable address and every Ray process listens on 0.0.0.0. Ray's own multi-node tests
start nodes on one host the way this does (`ray.cluster_utils.Cluster.add_node`: a
`ray._private.node.Node` with head=False, private API of the pinned Ray), which keeps each node on
loopback.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import sys
import threading


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cluster.ops.ray_node")
    p.add_argument("--gcs", required=True, help="the head's GCS address (host:port)")
    p.add_argument("--name", required=True)
    p.add_argument("--num-cpus", type=int, default=1)
    p.add_argument("--resources", default="{}", help="custom resources, JSON")
    p.add_argument("--object-store-mb", type=int, default=128)
    p.add_argument("--node-ip", default="127.0.0.1")
    p.add_argument("--min-worker-port", type=int, default=0)
    p.add_argument("--max-worker-port", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _args(sys.argv[1:] if argv is None else argv)
    import ray._private.node
    import ray._private.parameter

    params = ray._private.parameter.RayParams(
        gcs_address=args.gcs, node_ip_address=args.node_ip, node_name=args.name, num_cpus=args.num_cpus,
        num_gpus=0, resources=json.loads(args.resources), object_store_memory=args.object_store_mb << 20,
        min_worker_port=args.min_worker_port, max_worker_port=args.max_worker_port,
        include_log_monitor=False,  # the head's log monitor reads this machine's session directory
        node_manager_port=0,
        # Nodes of one machine share the session directory, where Ray would number its sockets by
        # looking for free names: nodes started together took the same one. One pair per node.
        plasma_store_socket_name=os.path.join(tempfile.gettempdir(), f"ray-node-{os.getpid()}-plasma"),
        raylet_socket_name=os.path.join(tempfile.gettempdir(), f"ray-node-{os.getpid()}-raylet"))
    params.dashboard_agent_listen_port = None  # any free port (the head's agent holds the default)
    for path in (params.plasma_store_socket_name, params.raylet_socket_name):
        _unlink(path)  # left by a killed node whose pid this process now has: the raylet could not bind
    # A signal before the node is up ends this process at once (its group is killed after it).
    node = ray._private.node.Node(params, head=False, shutdown_at_exit=False, spawn_reaper=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"[ray-node {args.name}] joined {args.gcs} as {node.node_id}", flush=True)
    try:
        while not stop.wait(1.0):
            if not node.remaining_processes_alive():
                print(f"[ray-node {args.name}] a process of the node died: stopping", flush=True)
                return 1
        return 0
    finally:
        node.kill_all_processes(check_alive=False, allow_graceful=True)
        for path in (params.plasma_store_socket_name, params.raylet_socket_name):
            _unlink(path)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


if __name__ == "__main__":
    sys.exit(main())
