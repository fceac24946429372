"""`specserve up`'s lifecycle: start Redis, Ray, the Serve application (bounded by a wait), serve until a
signal, and stop everything it started, even when start-up fails or is interrupted (the stopping and the
signals: cluster/ops/shutdown.py)."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from cluster.config import ConfigError, load_config
from cluster.engine.draft_wire import SECRET_ENV, new_secret
from cluster.ops import ray_tls, reaper
from cluster.ops.cpu_pinning import node_cpus_env, pin_serving_processes
from cluster.ops.local_nodes import LocalNodes
from cluster.ops.models import prepare_all
from cluster.ops.placement import (
    app_builder,
    GRPC_SERVICER_FUNCTIONS, grpc_message_options, grpc_reflection, placement_problems, used_drafters,
)
from cluster.ops.ray_driver import driver_log_levels, local_ray_env, ray_address_file, ray_address_record, ray_init_kwargs
from cluster.ops.shutdown import STOP_SIGNALS, hold_signals_while_stopping, interrupt_on_signals, stop_cluster
from cluster.routing.deadline import proxy_timeout_s
from cluster.state.redis_server import ensure_local_redis
from cluster.tls import GrpcTlsForwarder, TlsConfigError, grpc_server_credentials, http_tls_options

log = logging.getLogger(__name__)

RAY_WORKER_NICENESS_ENV = "RAY_worker_niceness"  # Ray's own setting (ray_constants.RAY_WORKER_NICENESS)


def start_cluster(config_path: str, wait_s: float = 900.0, verbose: bool = False):
    """Start Redis (if local), Ray and the Serve application; return (config, redis handle).
    `verbose`: the workers' output (engines, Serve) in this terminal too, not only in the log directory."""
    config = load_config(config_path)  # 1. fail fast on a bad config
    if not config.ray.address:
        # Before `import ray`, which reads the loopback switch among these (ray_driver.RAY_LOOPBACK_ENV).
        # Read by the workers the raylet starts too: the gRPC proxy's message-size bound (a joined
        # cluster's nodes must have it in their own environment, as the rendered manifests do).
        os.environ.update(local_ray_env(config))
        if config.ray.pin_serving_cpus:  # read before any pinning: an engine replica starts its engine on them
            os.environ.update(node_cpus_env(frozenset(os.sched_getaffinity(0))))
        if config.ray.tls.enabled:  # Ray's mutual TLS: every Ray process inherits the node certificate
            os.environ.update(ray_tls.local_pki([config.ray.node_ip_address or ray_tls.routable_address()],
                                                config.ray.tls.ca_cert, config.ray.tls.ca_key).env())
    import ray
    from ray import serve
    from ray.serve import api as serve_api
    from ray.serve.config import gRPCOptions, HTTPOptions

    build_app = app_builder()

    for name, level in driver_log_levels(verbose).items():  # after `from ray import serve`: importing it sets ray.serve's
        logging.getLogger(name).setLevel(level)
    print(f"[specserve] config {config_path}: {len(config.pools)} pools, models {config.served_models()}")
    t0 = time.monotonic()
    paths = prepare_all(config)  # 2. model files, once (cached)
    print(f"[specserve] models ready in {time.monotonic() - t0:.1f} s: {paths}")
    redis_handle = _start_redis(config)  # 3. tuning state
    forwarder = nodes = None
    try:
        # 4. Ray: join a cluster or start a local one
        local = not config.ray.address
        if local:
            # Ray starts its workers at nice 15, and Serve replicas are workers: the vLLM engine of a
            # replica then yields its core to any ordinary process (a client, a neighbour's server),
            # stalled past its health check while a stock vLLM server started beside it, and ran at
            # ~60% of a stock server's speed side by side (BENCHMARKS.md, serving path). The engine
            # is the workload here, so workers run at the normal priority (read by the raylet).
            os.environ.setdefault(RAY_WORKER_NICENESS_ENV, "0")
            os.environ.update(local_drafter_secret(config, os.environ))
        elif used_drafters(config) and SECRET_ENV not in os.environ:
            print(f"[specserve] note: drafters and engines read {SECRET_ENV} from their node's environment "
                  "(a joined cluster's nodes must have it; drafters refuse to start without it)", file=sys.stderr)
        # A local Ray binds to loopback (ray.node_ip_address): its processes take unauthenticated calls.
        ctx = init_ray(ray.init, ray.shutdown, ray_init_kwargs(
            config, pythonpath=str(Path(__file__).resolve().parents[2]), log_to_driver=verbose), retry=local)
        interrupt_on_signals()  # ray.init replaced the SIGTERM handler with its own (sys.exit)
        print(logs_line((getattr(ctx, "address_info", None) or {}).get("session_dir"), verbose,
                        joined=not local))
        if local:
            _record_ray_address(config, (getattr(ctx, "address_info", None) or {}).get("gcs_address"))
            nodes = _start_local_nodes(config, ctx)  # 4b. worker nodes of a local multi-node cluster
            _check_placement(config)
        tls = config.api.tls
        http_tls = {}
        if tls.enabled:
            http_tls = http_tls_options(tls.certfile, tls.keyfile)  # fails here on a bad certificate or key
            if tls.client_ca_file:
                grpc_server_credentials(tls.certfile, tls.keyfile, tls.client_ca_file)  # and on a bad CA file
        grpc = None
        timeout_s = proxy_timeout_s(config.router.request_timeout_s)  # the proxies' backstop to the router's deadline
        if config.api.grpc_port and config.api.door == "ray_proxy":
            grpc = gRPCOptions(port=config.api.grpc_port, grpc_servicer_functions=GRPC_SERVICER_FUNCTIONS,
                               enable_reflection=grpc_reflection(config), request_timeout_s=timeout_s)
        if config.api.door == "router":  # the router replicas listen themselves (deployments/router_door.py)
            serve.start(proxy_location="Disabled")
        else:
            # One machine: the proxies of every node would bind the same ports, so a local cluster runs
            # them on the head only (a joined cluster keeps Serve's default, a proxy per node with replicas).
            serve.start(proxy_location="HeadOnly" if local else None,
                        http_options=HTTPOptions(host=config.api.host, port=config.api.http_port,
                                                 request_timeout_s=timeout_s, **http_tls), grpc_options=grpc)
        if grpc is not None and tls.enabled:  # Ray's gRPC proxy has no TLS: a TLS listener in front of it
            forwarder = GrpcTlsForwarder(f"{config.api.host}:{tls.grpc_tls_port}", f"127.0.0.1:{config.api.grpc_port}",
                                         grpc_server_credentials(tls.certfile, tls.keyfile, tls.client_ca_file),
                                         options=grpc_message_options(config)).start()
        print("[specserve] deploying (engine start-up takes about a minute per engine on a small CPU)...")
        t0 = time.monotonic()
        # serve.run waits for the application without a bound; its non-waiting form returns once
        # the deployments are submitted, and _wait_ready bounds start-up by --wait-s (a start-up
        # that overruns is stopped below, engines included). Private in Ray 2.60 (pinned).
        serve_api._run(build_app({"config_path": config_path}), _blocking=False, name=config.name, route_prefix="/")
        _wait_ready(config, wait_s)
        scheme = "https" if tls.enabled else "http"
        grpc_at = f"{config.api.host}:{tls.grpc_tls_port if forwarder else config.api.grpc_port}"
        grpc_at += " (TLS)" if tls.enabled else ""
        print(f"[specserve] serving in {time.monotonic() - t0:.0f} s: HTTP {scheme}://{config.api.host}:{config.api.http_port}"
              + (f"  gRPC {grpc_at}" if config.api.grpc_port else ""))
    except BaseException:  # a failed or interrupted start-up stops what it started
        hold_signals_while_stopping()
        print("[specserve] start-up did not finish: stopping what was started", file=sys.stderr)
        stop_cluster(redis_handle, forwarder, nodes)
        forget_ray_address(config)
        raise
    return config, redis_handle, forwarder, nodes


# Ray's "node timed out during startup": its raylet did not register within Ray's 30 s, seen when
# `up` ran right after a cluster was stopped and the old session's raylet was still exiting.
NODE_TIMEOUT_MESSAGE = "timed out during startup"
NODE_RETRY_PAUSE_S = 10.0


def init_ray(init, shutdown, kwargs: dict, retry: bool, pause_s: float = NODE_RETRY_PAUSE_S, sleep=time.sleep):
    """`init(**kwargs)` (ray.init); a local node that timed out during startup is started once more,
    after `shutdown()` and `pause_s`. Any other failure, or a second timeout, is raised as it is."""
    try:
        return init(**kwargs)
    except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception for this one
        if not retry or NODE_TIMEOUT_MESSAGE not in str(e):
            raise
        print(f"[specserve] Ray's node timed out during startup (a stopped cluster's processes may still be "
              f"exiting); starting it once more in {pause_s:.0f} s", file=sys.stderr)
        shutdown()
        sleep(pause_s)
        return init(**kwargs)


def _record_ray_address(config, gcs_address) -> None:
    """Write the local Ray's GCS address where `specserve status --config` finds it (ray_driver.ray_address_file)."""
    if not gcs_address:
        return
    path = ray_address_file(config)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(ray_address_record(gcs_address, os.environ) + "\n")  # after ray.init: its auth mode
    except OSError as e:  # status falls back to Ray's "auto"
        log.warning("could not record the Ray address in %s: %s", path, e)


def forget_ray_address(config) -> None:
    """Remove the record `_record_ray_address` wrote, once its Ray is stopped: `specserve status
    --config` then attaches to no stale address, and records of stopped clusters do not pile up."""
    try:
        ray_address_file(config).unlink(missing_ok=True)
    except OSError as e:
        log.warning("could not remove the Ray address record: %s", e)


def _start_local_nodes(config, ctx):
    """Start the config's local worker nodes (`ray.nodes`) and wait until Ray has them; None if none."""
    if not config.ray.nodes:
        return None
    import ray

    info = getattr(ctx, "address_info", None) or {}
    session = Path(info.get("session_dir") or "/tmp/ray/session_latest")
    t0 = time.monotonic()
    nodes = LocalNodes.start(config.ray.nodes, info["gcs_address"], config.ray.node_ip_address, session / "logs")
    try:
        nodes.wait_joined(lambda: [n.get("NodeName") for n in ray.nodes() if n.get("Alive")])
    except BaseException:
        nodes.stop()
        raise
    print(f"[specserve] ray nodes {[n.name for n in nodes.nodes]} joined the head ({info['gcs_address']}) "
          f"in {time.monotonic() - t0:.0f} s")
    return nodes


def _check_placement(config) -> None:
    """Fail the start-up, naming the pool and the resource, when a replica fits no node of the local
    cluster (Serve would otherwise wait for it forever)."""
    import ray

    problems = placement_problems(config, [n.get("Resources") or {} for n in ray.nodes() if n.get("Alive")])
    if problems:
        raise RuntimeError("placement: " + "; ".join(problems))


def logs_line(session_dir: Optional[str], verbose: bool, joined: bool) -> str:
    """The one line that says where the workers' logs are: Ray writes each worker's stdout and stderr
    to `logs/worker-*.out|err` and Serve its components' logs to `logs/serve/` in the session
    directory of the node the worker runs on (`session_dir`: this node's; None in Ray Client mode).

    >>> print(logs_line("/tmp/ray/session_1", verbose=False, joined=False))
    [specserve] logs: /tmp/ray/session_1/logs (engines, Ray workers, Serve; `specserve up --verbose` shows them here)
    >>> print(logs_line("/tmp/ray/session_1", verbose=True, joined=True))
    [specserve] logs: /tmp/ray/session_1/logs (engines, Ray workers, Serve; each Ray node keeps its own workers' logs)
    """
    notes = ["engines, Ray workers, Serve"]
    if joined:
        notes.append("each Ray node keeps its own workers' logs")
    if not verbose:
        notes.append("`specserve up --verbose` shows them here")
    where = f"{session_dir}/logs" if session_dir else "/tmp/ray/session_latest/logs"
    return f"[specserve] logs: {where} ({'; '.join(notes)})"


def local_drafter_secret(config, environ) -> dict[str, str]:
    """The drafter wire's shared secret for a local Ray (`cluster.engine.draft_wire`): a new random one per
    start when the config has drafters and `environ` has none. Set in this process before Ray starts,
    it reaches drafters and engines through the raylet's environment, not Ray's GCS."""
    if not used_drafters(config) or environ.get(SECRET_ENV):
        return {}
    return {SECRET_ENV: new_secret()}


def _start_redis(config):
    if not config.redis.start_local:
        return None
    handle = ensure_local_redis(config.redis.url)
    print(f"[specserve] redis at {config.redis.url}")
    return handle


def failure_summary(app_message: str, deployments: dict[str, tuple[str, str]]) -> str:
    """Serve's application message and, for each deployment that failed, the last line of its
    message (a failed constructor's exception, e.g. an engine start past its startup_timeout_s).

    >>> failure_summary("Failed to update the deployments ['engine-ngram'].", {
    ...     "engine-ngram": ("DEPLOY_FAILED", "Traceback ...\\n  File x\\nEngineStartTimeout: pools.ngram.startup_timeout_s: ..."),
    ...     "router": ("HEALTHY", "")})
    "Failed to update the deployments ['engine-ngram']. engine-ngram: EngineStartTimeout: pools.ngram.startup_timeout_s: ..."
    """
    parts = [app_message.strip()]
    for name, (status, message) in sorted(deployments.items()):
        lines = [ln.strip() for ln in (message or "").splitlines() if ln.strip()]
        if "HEALTHY" != status.rsplit(".", 1)[-1] and lines:
            parts.append(f"{name}: {lines[-1][:300]}")
    return " ".join(parts)


def _wait_ready(config, wait_s: float) -> None:
    from ray import serve

    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        app = serve.status().applications.get(config.name)
        state = getattr(app, "status", None)
        if state == "RUNNING":
            return
        if state in ("DEPLOY_FAILED", "UNHEALTHY"):
            causes = {n: (str(d.status), d.message) for n, d in (app.deployments or {}).items()}
            raise RuntimeError(f"application {config.name} failed: {failure_summary(app.message, causes)}")
        time.sleep(2)
    raise TimeoutError(f"application {config.name} not running after {wait_s:.0f} s")


def _pinner(config, every_s: float = 5.0):
    """The serving loop's CPU pinning (`ray.pin_serving_cpus`, cluster/ops/cpu_pinning.py): a call
    that, every `every_s`, moves the local cluster's serving processes started since off the cores
    vLLM's workers are bound to. A no-op when off or when this process joined a cluster."""
    if not config.ray.pin_serving_cpus or config.ray.address:
        return lambda: None

    all_cpus = frozenset(os.sched_getaffinity(0))  # read before this process is itself moved
    next_at = [0.0]

    def pin() -> None:
        if time.monotonic() < next_at[0]:
            return
        next_at[0] = time.monotonic() + every_s
        try:
            pin_serving_processes(all_cpus)
        except Exception:  # noqa: BLE001 - pinning is an optimisation: serving goes on without it
            log.exception("pinning the serving processes failed")

    return pin


def cmd_up(args) -> int:
    interrupt_on_signals()
    reaper.become_subreaper()  # an engine its Ray worker orphans is re-parented here, not to init
    try:
        try:
            config, redis_handle, forwarder, nodes = start_cluster(args.config, wait_s=args.wait_s,
                                                            verbose=getattr(args, "verbose", False))
        except (ConfigError, TlsConfigError) as e:
            print(f"specserve up: {e}", file=sys.stderr)
            return 2
        except (RuntimeError, TimeoutError) as e:
            print(f"specserve up: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt as e:
            print(f"specserve up: interrupted during start-up ({e or 'SIGINT'})", file=sys.stderr)
            return 130
        stop = threading.Event()
        try:
            for sig in STOP_SIGNALS:  # serving: a signal asks the loop below to stop
                signal.signal(sig, lambda *_: stop.set())
            print("[specserve] press Ctrl-C to stop")
            pin = _pinner(config)
            while not stop.wait(1.0):
                pin()
        except KeyboardInterrupt:
            pass  # a signal in the instant before these handlers replaced the start-up's: stop all the same
        print("[specserve] stopping")
        hold_signals_while_stopping()
        stop_cluster(redis_handle, forwarder, nodes)
        forget_ray_address(config)
        return 0
    finally:
        left = reaper.reap_descendants()
        if left:
            print(f"[specserve] stopped {len(left)} processes the shutdown left behind: {reaper.describe(left)}",
                  file=sys.stderr)
