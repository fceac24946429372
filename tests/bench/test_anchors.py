"""Stock-vLLM anchors without vLLM: baseline parsing, the default set, the server's command line and
environment built from a pool, the memory estimate, and a stand-in server's start / stop."""
import json
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tools.bench import anchors as A
from tools.bench import plan as P
from cluster.config import load_config
from cluster.ops.placement import cpu_engine_env
from tests.paths import LOCAL_CPU



@pytest.fixture(scope="module")
def ngram_pool():
    config = load_config(LOCAL_CPU)
    name, pool = A.choose_pool(config, None)
    assert name == "ngram"
    return pool


def test_baseline_parsing():
    b = A.parse_baseline('ng3={"method":"ngram","num_speculative_tokens":3,"prompt_lookup_min":1,"prompt_lookup_max":5}')
    assert (b.name, b.speculative_config["num_speculative_tokens"], b.url) == ("ng3", 3, None)
    assert A.parse_baseline("plain=none").speculative_config is None
    assert b.config() == P.BenchConfig("ng3", None, None, baseline=True) and b.config().speculative() is None
    assert not b.config().is_speculative
    assert A.parse_baseline_url("mine=http://127.0.0.1:8101/").url == "http://127.0.0.1:8101"
    assert "ng3 = {\"method\":\"ngram\"" in b.describe()


@pytest.mark.parametrize("text, message", [
    ('ng={"method": "ngram",', r"--baseline 'ng=\{\"method\": \"ngram\",': SPEC is not valid JSON"),
    ("ng", "expected NAME=SPEC"),
    ("ng=", "expected NAME=SPEC"),
    ("ng=[1, 2]", "must be a JSON object"),
    ('ng={"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be an integer >= 1"),
    ("auto=none", "bad baseline name 'auto'"),
    ("a,b=none", "bad baseline name"),
    ('t={"method":"ngram","num_speculative_tokens":3,"num_speculative_tokens_per_batch_size":[[2,4,3]]}',
     "num_speculative_tokens_per_batch_size must be"),
    ('t={"method":"ngram","num_speculative_tokens":3,"num_speculative_tokens_per_batch_size":[[1,4,3],[3,8,1]]}',
     "not overlapping"),
    ('t={"method":"ngram","num_speculative_tokens":4,"num_speculative_tokens_per_batch_size":[[1,4,3]]}',
     r"largest K \(3\) must equal num_speculative_tokens \(4\)"),
])
def test_baseline_errors_name_the_flag_and_the_value(text, message):
    with pytest.raises(ValueError, match=message) as e:
        A.parse_baseline(text)
    assert str(e.value).startswith("--baseline")


def test_baseline_url_errors():
    for bad in ("x", "x=localhost:8000", "none=http://h:1"):
        with pytest.raises(ValueError, match="--baseline-url"):
            A.parse_baseline_url(bad)


def test_default_set_from_the_ngram_pool(ngram_pool):
    got = A.default_baselines(ngram_pool)
    assert [b.name for b in got] == (["stock-none"] + [f"stock-ngram:{k}" for k in range(1, 7)]
                                     + ["stock-table", "stock-suffix"])  # the pool drafts by suffix tree too
    assert got[-1].speculative_config == {"method": "suffix"}
    assert got[0].speculative_config is None
    assert got[3].speculative_config == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                         "prompt_lookup_max": 5}
    table = got[-2].speculative_config
    assert table["num_speculative_tokens"] == 3 and table["prompt_lookup_min"] == 1
    assert table["num_speculative_tokens_per_batch_size"] == [[1, 4, 3], [5, 11, 1], [12, 64, 0]]
    A.check_k_table(table)  # what vLLM accepts, top K = num_speculative_tokens


def test_shorthand(ngram_pool):
    names = lambda text: [b.name for b in A.parse_baselines(text, ngram_pool, "ngram")]  # noqa: E731
    assert names("none,ngram:3,table") == ["stock-none", "stock-ngram:3", "stock-table"]
    assert names("ngram:*") == [f"stock-ngram:{k}" for k in range(1, 7)]
    assert names("default,none,ngram:2") == names("default")  # duplicates dropped
    with pytest.raises(ValueError, match="unknown item 'eagle:3'"):
        A.parse_baselines("eagle:3", ngram_pool)
    draft = load_config(LOCAL_CPU).pools["draft"]
    with pytest.raises(ValueError, match="needs an n-gram pool; --baseline-pool draft has method eagle"):
        A.parse_baselines("ngram:3", draft, "draft")
    assert [b.name for b in A.parse_baselines("none", draft, "draft")] == ["stock-none"]


def test_pool_choice_and_name_clashes():
    config = load_config(LOCAL_CPU)
    assert A.choose_pool(config, "draft")[0] == "draft"
    with pytest.raises(ValueError, match="--baseline-pool: no pool 'x'"):
        A.choose_pool(config, "x")
    ok = A.merge_baselines([[A.Baseline("stock-none")], [A.Baseline("mine", url="http://h:1")]], {"none", "auto"})
    assert [b.name for b in ok] == ["stock-none", "mine"]
    with pytest.raises(ValueError, match="'ngram:3' is used twice"):
        A.merge_baselines([[A.Baseline("ngram:3")]], {"ngram:3"})
    with pytest.raises(ValueError, match="'x' is used twice"):
        A.merge_baselines([[A.Baseline("x")], [A.Baseline("x")]], set())


def test_command_line_and_environment_copy_the_pool_engine(ngram_pool):
    args = A.stock_engine_args(ngram_pool, "/models/smol", "smollm2-135m", "float32", cpu_build=True)
    spec = A.table_baseline(ngram_pool).speculative_config
    argv = A.stock_argv(args, spec, 8123, python="/venv/bin/python")
    assert argv[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    flags = " ".join(argv)
    for piece in ("--model /models/smol", "--served-model-name smollm2-135m", "--host 127.0.0.1", "--port 8123",
                  "--dtype float32", "--max-model-len 2048", "--enforce-eager", "--max-num-seqs 64",
                  "--no-enable-chunked-prefill", "--max-num-batched-tokens 2112", "--generation-config vllm"):
        assert piece in flags, piece
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == spec
    for own in ("scheduler", "additional-config", "per-request", "async-scheduling", "log-requests"):
        assert own not in flags  # specserve's own engine arguments stay out
    assert "--speculative-config" not in A.stock_argv(args, None, 8123)
    # The GPU build: no platform arguments, so chunked prefill stays vLLM's default.
    gpu = A.stock_argv(A.stock_engine_args(ngram_pool, "/m", "s", "auto", cpu_build=False), None, 1)
    assert "--no-enable-chunked-prefill" not in gpu and "--max-num-batched-tokens" not in gpu

    env = A.stock_env(ngram_pool, base={"PATH": "/bin"}, platform_env={"LD_PRELOAD": "/venv/lib/libiomp5.so"})
    assert env == {"PATH": "/bin", "LD_PRELOAD": "/venv/lib/libiomp5.so", "VLLM_CPU_KVCACHE_SPACE": "2"}
    real = A.stock_env(ngram_pool, base={})  # the platform environment the cluster's engines get
    assert real["VLLM_CPU_KVCACHE_SPACE"] == "2" and real.items() >= cpu_engine_env().items()
    if cpu_engine_env():
        assert real["LD_PRELOAD"].endswith("libiomp5.so")


def test_memory_estimate():
    assert A.memory_needed_gib({"VLLM_CPU_KVCACHE_SPACE": "2"}, 8) == pytest.approx(8 * (2 + A.STOCK_OVERHEAD_GIB))
    with pytest.raises(ValueError, match="sets no VLLM_CPU_KVCACHE_SPACE"):
        A.memory_needed_gib({}, 1)
    free = A.mem_available_gib()
    assert free is None or free > 0


def test_plan_servers_skips_running_ones(ngram_pool, tmp_path):
    ports = iter([9001, 9002])
    servers = A.plan_servers([A.Baseline("stock-ngram:2", A.ngram_spec(ngram_pool, 2)), A.Baseline("x", url="http://h:1")],
                             ngram_pool, "/m", "smollm2-135m", "float32", tmp_path, python="py", port=lambda: next(ports))
    (s,) = servers
    assert s.url == "http://127.0.0.1:9001" and s.log_path == tmp_path / "stock-stock-ngram_2.log"
    assert "--port" in s.argv and s.env["VLLM_CPU_KVCACHE_SPACE"] == "2"


# A stand-in for the stock server: answers /v1/models after `delay` s and keeps a child process, so
# stopping must take the whole process group.
FAKE_SERVER = textwrap.dedent("""
    import http.server, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(sys.argv[2], "w").write(str(child.pid))
    time.sleep(float(sys.argv[3]))
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.send_header("Content-Length", "2"); self.end_headers(); self.wfile.write(b"{}")
        def log_message(self, *a): pass
    print("serving", flush=True)
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def _server(tmp_path, name, delay=0.0, code=None):
    port = A.free_port()
    argv = [sys.executable, "-c", f"import sys; sys.exit({code})" if code is not None else FAKE_SERVER,
            str(port), str(tmp_path / f"{name}.child"), str(delay)]
    return A.StockServer(name, argv, dict(os.environ), tmp_path / f"stock-{name}.log", f"http://127.0.0.1:{port}")


def test_fleet_starts_waits_and_stops_the_process_tree(tmp_path):
    a, b = _server(tmp_path, "a"), _server(tmp_path, "b", delay=0.5)
    with A.StockFleet([a, b], timeout_s=30, external={"ext": "http://h:1"}, log=lambda m: None, grace_s=5) as urls:
        assert urls == {"ext": "http://h:1", "a": a.url, "b": b.url}
        assert a.ready() and b.ready()
        pids = [a.proc.pid, b.proc.pid] + [int((tmp_path / f"{n}.child").read_text()) for n in "ab"]
        assert all(_alive(p) for p in pids)
        # Each its own process group (stopped as one), in the bench's session: a session of its own
        # is a scheduler autogroup of its own, which an idle cluster engine's probe starved.
        assert [os.getpgid(s.proc.pid) for s in (a, b)] == [a.proc.pid, b.proc.pid]
        assert {os.getsid(p) for p in pids} == {os.getsid(0)}
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)
    assert "serving" in a.log_tail() and a.log_tail().startswith("$ ")


def test_fleet_errors_name_the_baseline_and_stop_what_started(tmp_path):
    good, dead = _server(tmp_path, "good"), _server(tmp_path, "dead", code=3)
    with pytest.raises(A.StockServerError, match=r"baseline dead: the stock server exited with code 3") as e:
        with A.StockFleet([good, dead], timeout_s=30, log=lambda m: None, grace_s=5):
            pass
    assert "stock-dead.log ends:" in str(e.value)
    assert good.proc.poll() is not None  # the one already up was stopped
    slow = _server(tmp_path, "slow", delay=30)
    with pytest.raises(A.StockServerError, match=r"baseline slow: no answer at .* within 1 s"):
        with A.StockFleet([slow], timeout_s=1, log=lambda m: None, grace_s=5):
            pass
    assert slow.proc.poll() is not None
