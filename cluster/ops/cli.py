"""`specserve` command line: up (start a cluster; its lifecycle is `cluster.ops.up`), generate (a client), status,
and the tools.

Each subcommand is a small function; the work is done by the modules it calls.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from cluster.autoscale.ray_policy import AutoscaleRecords
from cluster.client_wire import ClientError
from cluster.config import ConfigError, load_config
from cluster.k8s.render import main as render_main
from cluster.ops.models import prepare_all
from cluster.ops.placement import node_summary, replica_nodes
from cluster.ops.ray_driver import driver_log_levels, gcs_listening, ray_attach_env, ray_attach_kwargs, read_ray_address
from cluster.ops.up import cmd_up
from cluster.routing.route import explain_choices, pool_views
from cluster.speculation import WORKLOAD_CLASSES

DEFAULT_CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "local-cpu.yaml")
DEFAULT_URL = os.environ.get("SPECSERVE_URL", "http://127.0.0.1:8000")


# -- generate / status ----------------------------------------------------------------------------

def cmd_generate(args) -> int:
    from cluster.client import SpecServeClient

    client = SpecServeClient(args.url)
    spec = None
    if args.mode:
        spec = {"mode": args.mode, **({"k": args.k} if args.k is not None else {})}
    kwargs = dict(model=args.model, max_tokens=args.max_tokens, temperature=args.temperature,
                  speculative=spec, workload_class=args.workload_class)
    messages = None if args.raw else [{"role": "user", "content": args.prompt}]
    prompt = args.prompt if args.raw else None
    try:
        if args.stream:
            final = None
            for chunk in client.generate_stream(prompt=prompt, messages=messages, **kwargs):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                final = chunk
            print()
            spec = final.spec if final is not None else None
        else:
            result = client.generate(prompt=prompt, messages=messages, **kwargs)
            print(result.text)
            spec = result.spec
    except ClientError as e:
        print(f"specserve generate: {e}", file=sys.stderr)
        return 1
    stats = dataclasses.asdict(spec) if spec is not None else {}
    print(json.dumps({k: v for k, v in stats.items() if k not in ("token_ids", "logprobs")}), file=sys.stderr)
    return 0


def cmd_status(args) -> int:
    import httpx

    out: dict = {"url": args.url}
    records, rows, cfg = {}, [], None
    if args.config:
        out["redis"] = _redis_reachability(args.config)
        cfg, records, rows = _autoscale_and_tuning(args.config)
    try:
        r = httpx.get(f"{args.url}/v1/specserve/status", timeout=5)
        out["router"] = r.json()
        out["healthy"] = r.status_code == 200
    except httpx.HTTPError as e:
        out["healthy"] = False
        out["error"] = f"router not reachable: {e}"
    out.update(_serve_applications(args.config or DEFAULT_CONFIG, timeout_s=args.ray_timeout))
    records = records or (out.get("router") or {}).get("autoscale") or {}
    out["pools"] = pool_status(cfg, out.get("router") or {}, records, rows, time.time())
    print(json.dumps(out, indent=2))
    return 0 if out.get("healthy") else 1


def _serve_applications(config_path: str, timeout_s: float) -> dict:
    """{"applications": Serve's status per application and deployment, with the node of each replica;
    "nodes": Ray's nodes and the custom resources they advertise} from the running cluster's Ray,
    or {"ray": why not}, within `timeout_s` (Ray's own attach retries for minutes)."""
    config = load_config(config_path)
    record = read_ray_address(config)
    if record and not gcs_listening(record["gcs"]):
        record = None  # left by a cluster that was killed outright: Ray's "auto" instead
    os.environ.update(ray_attach_env(config, os.environ, record))  # before `import ray`
    answer: list[dict] = []  # the attach thread's one result, appended whole

    def attach() -> None:
        try:
            import ray
            from ray import serve

            from ray._private import state as ray_state

            for name, level in driver_log_levels(verbose=False).items():  # the JSON is the whole output
                logging.getLogger(name).setLevel(level)
            ray.init(**ray_attach_kwargs())
            st = serve.status()
            nodes = ray.nodes()
            actors = ray_state.actors(actor_state_name="ALIVE")  # the GCS's table (the cluster runs no dashboard)
            apps = {}
            for name, app in st.applications.items():
                where = replica_nodes(actors, nodes, name)
                apps[name] = {"status": str(app.status),
                              "deployments": {d: {"status": str(ds.status),
                                                  "replicas": {str(k): v for k, v in ds.replica_states.items()},
                                                  "on_nodes": where.get(d, [])}
                                              for d, ds in app.deployments.items()}}
            answer.append({"applications": apps, "nodes": node_summary(nodes)})
        except Exception as e:  # noqa: BLE001 - status is best effort; report what failed
            answer.append({"ray": f"not reachable: {type(e).__name__}: {e}"})

    t = threading.Thread(target=attach, name="ray-attach", daemon=True)
    t.start()
    t.join(timeout_s)
    return answer[0] if answer else {"ray": f"not reachable within {timeout_s:g} s"}


def pool_status(cfg, router: dict, records: dict, tuning_rows: list[dict], now_unix_s: float) -> dict:
    """Per pool: replicas (running / target), load, the mean K per step its requests ran at and the
    autoscaler's last decision and why, from the router's status, the autoscaler's records and the
    tuning rows."""
    names = list(cfg.pools) if cfg is not None else list((router.get("pools") or {}))
    out = {}
    for name in names:
        rp = (router.get("pools") or {}).get(name, {})
        rec = records.get(name) or {}
        mode = cfg.pools[name].method.value if cfg is not None else rp.get("method")
        rows = [r for r in tuning_rows if r.get("mode") == mode and r.get("steps")]
        steps = sum(int(r["steps"]) for r in rows)  # the mean K per step over the pool's cells, by steps
        mean_k = round(sum(float(r.get("mean_k") or 0.0) * int(r["steps"]) for r in rows) / steps, 3) if steps else None
        entry = {"replicas": {"running": rec.get("running"), "target": rec.get("target")},
                 "load": {"router_inflight": rp.get("inflight"), "autoscaler_load": rec.get("load"),
                          "engine_unfinished": (rp.get("engine") or {}).get("unfinished")},
                 "k": {"mean_per_step": mean_k, "live_mean_k": rec.get("mean_k")}}
        if rec:
            entry["autoscaler"] = {
                "decision": rec.get("action"), "reason": rec.get("reason"),
                "age_s": round(now_unix_s - float(rec.get("time_unix_s", now_unix_s)), 1),
                "carry": rec.get("carry"), "carry_source": rec.get("carry_source"),
                "tpot_p99_s": rec.get("tpot_p99_s"), "ttft_p99_s": rec.get("ttft_p99_s"),
                "goodput_tokens_per_s": rec.get("goodput_tokens_per_s"), "last_change": rec.get("last_change")}
        out[name] = entry
    return out


def _autoscale_and_tuning(config_path: str):
    """(config, autoscaler records by pool, tuning rows) read from the config's Redis (empty if down)."""
    import redis

    from cluster.state.tuning import TuningStore

    cfg = load_config(config_path)
    records, rows = {}, []
    reader = AutoscaleRecords(cfg.redis.model_dump(mode="json"), list(cfg.pools), start=False)
    try:
        records = reader.fetch()
    except (redis.RedisError, OSError):
        pass
    finally:
        reader.close()
    store = TuningStore(cfg.redis, models=tuple(cfg.served_models()), start=False)
    try:
        rows = [row for m in cfg.served_models() for row in store.table(m)]
    finally:
        store.close(flush=False)
    return cfg, records, rows


def _redis_reachability(config_path: str) -> dict:
    import redis

    from cluster.state.redis_client import redis_client_from

    cfg = load_config(config_path)
    client = redis_client_from(cfg.redis, timeout_s=0.5)
    try:
        t0 = time.perf_counter()
        client.ping()
        return {"url": cfg.redis.url, "reachable": True, "ping_ms": round(1000 * (time.perf_counter() - t0), 2)}
    except redis.RedisError as e:
        return {"url": cfg.redis.url, "reachable": False, "error": str(e)[:200]}
    finally:
        client.close()


def cmd_tuning(args) -> int:
    """Print the tuning table (per model, mode, workload class, load bucket) from Redis."""
    from cluster.state.tuning import TuningStore

    cfg = load_config(args.config)
    models = [args.model] if args.model else cfg.served_models()
    store = TuningStore(cfg.redis, models=tuple(models), start=False)
    try:
        reachable = all([store.refresh_now(m) for m in models])
        if args.explain:
            return _print_explain(cfg, store, models, args, reachable)
        rows = [row for m in models for row in store.table(m)]
    finally:
        store.close(flush=False)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    cols = ["model", "mode", "workload_class", "load_bucket", "mean_k", "acceptance_length", "tokens_per_s",
            "samples", "acceptance_per_position", "runs", "mean_run", "step_ms_at_k"]
    print(f"# tuning state at {cfg.redis.url} (redis {'reachable' if reachable else 'NOT reachable'}), "
          f"{len(rows)} cells")
    _print_tsv(cols, rows)
    return 0


def _tsv_cell(v) -> str:
    """One table cell: floats to 3 decimals, lists comma-joined, dicts as `key=value` pairs."""
    if isinstance(v, float):
        return f"{v:.3f}"
    if isinstance(v, list):
        return ",".join(f"{x:.2f}" if isinstance(x, float) else str(x) for x in v)
    if isinstance(v, dict):
        return " ".join(f"{k}={_tsv_cell(x)}" for k, x in v.items())
    return "" if v is None else str(v)


def _print_tsv(cols: list[str], rows: list[dict]) -> None:
    print("\t".join(cols))
    for row in rows:
        print("\t".join(_tsv_cell(row.get(c)) for c in cols))


def _print_explain(cfg, store, models, args, reachable: bool) -> int:
    """`specserve tuning --explain`: the router's choice per class and batch from the state just read."""
    try:
        batches = [int(b) for b in args.batches.split(",") if b.strip()]
    except ValueError:
        print(f"--batches: expected a comma list of integers, got {args.batches!r}", file=sys.stderr)
        return 2
    rows = []
    for m in models:
        view = store.snapshot(m)
        pools = [v for v in pool_views(cfg) if v.model == m]
        rows += [{"model": m, **r} for r in explain_choices(pools, cfg.router, view, WORKLOAD_CLASSES, batches)]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"# auto's choice (no exploration) from the tuning state at {cfg.redis.url} "
          f"(redis {'reachable' if reachable else 'NOT reachable: cold-start priors'})")
    cols = ["model", "batch", "workload_class", "pool", "mode", "k", "k_cap", "k_run", "alpha", "draft_rate", "cost_per_step", "cost_per_k", "step_overhead",
            "expected_tokens_per_step", "score", "scores"]
    _print_tsv(cols, rows)
    return 0


def cmd_prepare(args) -> int:
    print(json.dumps(prepare_all(load_config(args.config)), indent=2))
    return 0


def cmd_check_config(args) -> int:
    try:
        cfg = load_config(args.config)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    print(f"{args.config}: ok ({len(cfg.pools)} pools: {', '.join(cfg.pools)})")
    return 0


def cmd_k8s(args) -> int:
    return render_main(args.render_args)


# The tools' own commands (`tools/`, which import the serving packages, never the other way round).
TOOL_COMMANDS = (
    ("bench", "tools.bench.cli", "compare speculation configurations on a running cluster (side by side)"),
    ("distill", "tools.distill.cli", "train a drafter for a target by self-distillation, evaluate and ship it"),
)


def _tool_cli(module: str):
    """A tool's command module (`add_arguments`, `run`), or None where the tools are not installed."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is not None and e.name.split(".")[0] == "tools":
            return None
        raise


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specserve", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    up = sub.add_parser("up", help="start the cluster from a config and serve until interrupted")
    up.add_argument("--config", default=DEFAULT_CONFIG)
    up.add_argument("--wait-s", type=float, default=900.0, help="bound on start-up")
    up.add_argument("--verbose", "--show-logs", action="store_true",
                    help="also show the engines' and Ray workers' logs here (always in the log directory it prints)")
    up.set_defaults(func=cmd_up)

    g = sub.add_parser("generate", help="send one request")
    g.add_argument("prompt")
    g.add_argument("--url", default=DEFAULT_URL)
    g.add_argument("--model", default=None)
    g.add_argument("--mode", default=None, help="none | ngram | draft_model | ... (default: the router decides)")
    g.add_argument("--k", type=int, default=None)
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--workload-class", default=None)
    g.add_argument("--stream", action="store_true")
    g.add_argument("--raw", action="store_true", help="send as a raw prompt, without the chat template")
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("status", help="pools (replicas, load, mean K, the autoscaler's last decision), Redis")
    s.add_argument("--url", default=DEFAULT_URL)
    s.add_argument("--config", default=None, help="also ping this config's Redis directly "
                   "(and attach to Ray as that config starts it; default: the local default's)")
    s.add_argument("--ray-timeout", type=float, default=30.0, help="seconds to wait for Ray's answer")
    s.set_defaults(func=cmd_status)

    t = sub.add_parser("tuning", help="print the adaptive-K tuning table from Redis")
    t.add_argument("--config", default=DEFAULT_CONFIG)
    t.add_argument("--model", default=None)
    t.add_argument("--json", action="store_true")
    t.add_argument("--explain", action="store_true",
                   help="print what auto would choose per workload class and batch size (no exploration)")
    t.add_argument("--batches", default="1,4,16", help="with --explain: batch sizes a request joins")
    t.set_defaults(func=cmd_tuning)

    pr = sub.add_parser("prepare", help="prepare (convert, cache) the models of a config")
    pr.add_argument("--config", default=DEFAULT_CONFIG)
    pr.set_defaults(func=cmd_prepare)

    cc = sub.add_parser("check-config", help="validate a cluster config")
    cc.add_argument("config")
    cc.set_defaults(func=cmd_check_config)

    for name, module, help_text in TOOL_COMMANDS:
        tp = sub.add_parser(name, help=help_text)
        tool = _tool_cli(module)
        if tool is None:  # the serving images carry cluster/ and deployments/ only
            tp.set_defaults(func=lambda args, name=name: sys.exit(
                f"specserve {name}: the tools are not installed here (the repository's tools/ package: "
                f"pip install -e '.[tools]' from a checkout)"))
            continue
        tool.add_arguments(tp)
        tp.set_defaults(func=tool.run)

    k = sub.add_parser("k8s", help="Kubernetes tools: `specserve k8s render [--overlay NAME] [--check]`")
    k.add_argument("action", choices=["render"])
    k.add_argument("render_args", nargs=argparse.REMAINDER, help="arguments of cluster/k8s/render.py")
    k.set_defaults(func=cmd_k8s)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
