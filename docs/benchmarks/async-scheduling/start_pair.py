"""Start two stock vLLM servers without speculation, as `specserve bench` starts its anchors (the
n-gram pool's model, dtype, engine arguments, environment and core binding): `stock-none` as vLLM
runs it (asynchronous scheduling on, vLLM's default without speculation) and `stock-none-sync`
with `--no-async-scheduling` (what every speculative engine here runs: vLLM 0.32 turns it off for
n-gram and suffix drafting, and specserve's per-request-K scheduler needs it off). Prints their
URLs and waits; Ctrl-C or SIGTERM (`kill %1`) stops both.

    .venv/bin/python docs/benchmarks/async-scheduling/start_pair.py &
    specserve bench --baseline-url stock-none=URL1 --baseline-url stock-none-sync=URL2 ...
"""
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
from cluster.bench import anchors as A  # noqa: E402
from cluster.config import load_config  # noqa: E402
from cluster.ops.models import resolve_model  # noqa: E402


def main() -> None:
    config = load_config(str(ROOT / "cluster" / "configs" / "local-cpu.yaml"))
    pool_name, pool = A.choose_pool(config, None)
    baselines = [A.Baseline("stock-none"), A.Baseline("stock-none-sync")]
    servers = A.plan_servers(baselines, pool, resolve_model(pool.model, config), pool.model,
                             config.models[pool.model].dtype, Path("/tmp/async_pair"))
    servers[1].argv.append("--no-async-scheduling")
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})  # for sigwait, from any shell
    for s in servers:
        s.start()
    try:
        for s in servers:
            s.wait_ready(900)
            print(f"{s.name}={s.url}", flush=True)
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    finally:
        for s in servers:
            s.stop()


if __name__ == "__main__":
    main()
