"""`specserve bench` end to end against two fakes: one as the cluster, one as a stock vLLM server (a
--baseline-url anchor that ignores the specserve extension): comparison, a closed-loop level and a
trace replay with the baseline, warm-ups, losslessness, verdicts, dry run."""

import argparse
import asyncio
import json
import time

import pytest

from .fake_openai import FakeServer
from tools.bench import cli
from tools.bench import plan as P
from tools.bench.report import load_samples
from tools.bench.runner import Job, Runner
from tools.bench.workload import Prompt
from cluster.client import AsyncSpecServeClient


def run_cli(argv):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return cli.run(parser.parse_args(argv))


def content(body):
    return body["messages"][-1]["content"]


def test_baseline_in_every_phase_with_a_trace(tmp_path, capsys):
    with FakeServer(prefill_s=0.005, step_s=0.002) as cluster, \
            FakeServer(prefill_s=0.005, step_s=0.003, stock=True) as stock:
        code = run_cli(["--url", cluster.url, "--results-dir", str(tmp_path), "--quick", "--max-tokens", "6",
                        "--prompts-per-task", "1", "--tasks", "qa,rag", "--concurrency", "1,2,3",
                        "--configs", "none,ngram:2,auto", "--baseline-url", f"stock-none={stock.url}",
                        "--trace", "10:0.6,0:0.3,10:0.6", "--trace-rounds", "2", "--seed", "3", "--no-plots",
                        "--slo-latency-s", "5"])
    assert code == 0
    (folder,) = list(tmp_path.iterdir())
    meta, samples = load_samples(folder / "samples.json")
    assert meta["configs"] == ["none", "ngram:2", "auto", "stock-none"]
    assert meta["baselines"] == {"stock-none": {"speculative_config": None, "url": stock.url}}
    measured = [s for s in samples if s.phase in ("compare", "sweep", "trace")]
    assert all(s.ok for s in samples)

    # The stock server got plain OpenAI requests asking for usage and token ids, in every phase.
    assert stock.requests and all("specserve" not in b for b in stock.requests)
    assert all(b["return_token_ids"] is True and b["stream_options"] == {"include_usage": True}
               and b["model"] == "fake-model" for b in stock.requests)
    # The cluster got the same OpenAI body, plus its own extension (both answer with vLLM's serving layer).
    assert all(b["return_token_ids"] is True and b["stream_options"] == {"include_usage": True} and "specserve" in b
               for b in cluster.requests)
    stock_samples = [s for s in measured if s.config == "stock-none"]
    assert {s.phase for s in stock_samples} == {"compare", "sweep", "trace"}
    assert all(s.spec == {} and len(s.token_ids) == 6 and s.chunk_tokens == [1] * 6 for s in stock_samples)
    # Greedy outputs token by token: the stock server's equal the cluster's reference.
    reference = {s.prompt_id: s.token_ids for s in samples if s.phase == "reference"}
    assert all(s.token_ids == reference[s.prompt_id] for s in stock_samples if s.phase == "compare")

    # Warm-up: every prompt a measured request used had gone through that server with max_tokens 1
    # before (the cluster: through both pools), and no measured request carries a nonce.
    for server, modes in ((stock, [None]), (cluster, ["ngram", "draft_model"])):
        warmed: set = set()
        for b in server.requests:
            if b["max_tokens"] == 1:
                warmed.add((content(b), ((b.get("specserve") or {}).get("speculative") or {}).get("mode")))
            elif not b.get("logprobs") and b["max_tokens"] != 8:  # not the reference / per-config warm-up
                assert all((content(b), m) in warmed for m in modes), content(b)[:40]
                assert not content(b).startswith("[")

    # The closed-loop levels: the sweep's default configurations plus the baseline, in rounds.
    sweep = [s for s in measured if s.phase == "sweep"]
    assert {s.config for s in sweep} == {"none", "ngram:2", "auto", "stock-none"}
    assert {s.concurrency for s in sweep} == {2, 3}
    for c, r in ((2, 0), (2, 1), (3, 0), (3, 1)):
        prompts = {cfg: sorted(s.prompt_id for s in sweep if (s.concurrency, s.repeat, s.config) == (c, r, cfg))
                   for cfg in meta["configs"]}
        assert len({tuple(p) for p in prompts.values()}) == 1  # the same prompts for every configuration

    # The trace: the same schedule (arrival, prompt, max_tokens) for every configuration of a round,
    # sent at the schedule's offsets, configurations in rotated and reversed order from round to round;
    # each round the next prompts (none resent: a stock suffix server would draft them from memory).
    trace = [s for s in measured if s.phase == "trace"]
    schedule = {(c, r): [(s.arrival, s.prompt_id, s.output_tokens) for s in sorted(trace, key=lambda s: s.arrival)
                         if s.config == c and s.repeat == r] for c in meta["configs"] for r in (0, 1)}
    for r in (0, 1):
        first = schedule[("auto", r)]
        assert len(first) >= 4 and all(v == first for (_, r2), v in schedule.items() if r2 == r)
        assert [a for a, _, _ in first] == list(range(len(first)))
    assert not {p for _, p, _ in schedule[("auto", 0)]} & {p for _, p, _ in schedule[("auto", 1)]}
    # Nor does any load phase (a level's round, a trace round) resend a prompt the comparisons or
    # another phase sent: the stock server cannot forget answers as the cluster's trees do.
    compared = {s.prompt_id for s in measured if s.phase == "compare"}
    phases: dict = {}
    for s in measured:
        if s.phase in ("sweep", "trace") and s.config == "stock-none":
            phases.setdefault((s.phase, s.concurrency, s.repeat), set()).add(s.prompt_id)
    assert len(phases) == 2 * 2 + 2 and not compared & set().union(*phases.values())
    assert sum(map(len, phases.values())) == len(set().union(*phases.values()))
    summary = json.loads((folder / "summary.json").read_text())
    order = summary["trace"]["order"]
    assert sorted(order[0]) == sorted(meta["configs"]) and order[1] == order[0][::-1]
    offsets = {s.arrival: s.start_s for s in trace if (s.config, s.repeat) == ("none", 1)}
    gaps = [offsets[i] - offsets[0] for i in sorted(offsets)]
    assert gaps == sorted(gaps) and max(gaps) < 1.6  # the idle middle segment: no arrival sent in it early
    assert meta["trace"]["arrivals"] == len(first)

    # Summary: losslessness includes the stock samples; verdicts against the anchor; trace table.
    assert summary["anchors"] == ["stock-none"]
    assert summary["lossless"]["by_config"]["stock-none"]["compared"] == 2
    assert summary["lossless"]["by_config"]["stock-none"]["mismatches"] == 0
    v = summary["anchor_verdicts"]
    assert v["one_stream"]["vs_best_anchor"]["config"] == "stock-none"
    assert v["load"]["2"]["vs_best_anchor"]["config"] == "stock-none"
    assert v["load"]["2"]["vs_best_anchor"]["units"] == len([s for s in sweep if (s.config, s.concurrency) == ("auto", 2)])
    assert set(summary["trace"]["configs"]) == set(meta["configs"])
    t = summary["trace"]["configs"]["stock-none"]
    assert t["requests"] == 2 * len(first) and t["failures"] == 0 and t["good_requests"] == t["requests"]
    assert summary["trace"]["verdict"]["vs_best_anchor"]["config"] == "stock-none"
    assert summary["trace"]["schedule"]["source"].startswith("Poisson segments 10:0.6,0:0.3,10:0.6")
    # The router's verdict keeps judging against the cluster's own static configurations.
    assert "stock-none" not in json.dumps(summary["router"])
    report = (folder / "report.md").read_text()
    assert "Against the best anchor:" in report and "## Trace replay" in report and "| stock-none |" in report


def test_a_large_gap_on_the_stock_server_fails_the_run(tmp_path):
    with FakeServer(prefill_s=0.002, step_s=0.001) as cluster, \
            FakeServer(prefill_s=0.002, step_s=0.001, stock=True, diverge={"stock": 2}) as stock:
        code = run_cli(["--url", cluster.url, "--results-dir", str(tmp_path), "--quick", "--max-tokens", "5",
                        "--prompts-per-task", "1", "--tasks", "qa", "--concurrency", "1", "--configs", "none,auto",
                        "--baseline-url", f"mine={stock.url}", "--no-plots"])
    assert code == 1
    summary = json.loads(next(tmp_path.iterdir()).joinpath("summary.json").read_text())
    assert summary["lossless"]["by_config"]["mine"]["large_gap"] == 1


def test_dry_run_prints_baselines_and_trace(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("models: {fake-model: {source: /nowhere, dtype: float32}}\n"
                      "pools: {ng: {model: fake-model, method: ngram, max_k: 2, ngram_min: 1, ngram_max: 4,"
                      " env: {VLLM_CPU_KVCACHE_SPACE: '1'}}}\n")
    with FakeServer() as fake:
        assert run_cli(["--url", fake.url, "--dry-run", "--quick", "--config", str(config), "--baselines", "default",
                        "--baseline", 'ng5={"method":"ngram","num_speculative_tokens":5}', "--trace", "0.5:20,2:10",
                        "--concurrency", "1,4"]) == 0
        err = capsys.readouterr().err
        assert "configs: none, ngram:3, draft_model:2, auto, stock-none, stock-ngram:1, stock-ngram:2, stock-table, ng5" in err
        assert 'stock-ngram:2 = {"method":"ngram","num_speculative_tokens":2,"prompt_lookup_min":1,"prompt_lookup_max":4}' in err
        assert "started like pool ng's engine" in err and "sweep none,best,auto,stock in" in err
        assert "bench: trace Poisson segments 0.5:20,2:10 (seed 0):" in err and "replayed in 3 rounds" in err
        # 3 trace rounds leave the last order unpaired (the plan says so); the quick sweep's 2 do not.
        assert "bench: --trace-rounds 3: the last round's order has no reversed twin" in err
        assert "--sweep-rounds 2:" not in err
        assert "stock_start 5.0" in err and "trace " in err
        assert not list(tmp_path.glob("2*")) and not fake.requests
        # errors: exit 2 with the flag named
        for argv, message in ((["--baseline", "x={bad"], "--baseline 'x={bad': SPEC is not valid JSON"),
                              (["--baselines", "eagle:2"], "unknown item"),
                              (["--baseline-url", "none=http://h:1"], "bad baseline name 'none'"),
                              (["--baselines", "none", "--baseline-url", "stock-none=http://h:1"], "used twice"),
                              (["--trace", "1"], "--trace: expected RATE:SECONDS"),
                              (["--trace-file", str(tmp_path / "missing.csv")], "missing.csv"),
                              (["--trace", "1:5", "--trace-rounds", "0"], "--trace-rounds")):
            assert run_cli(["--url", fake.url, "--dry-run", "--quick", "--config", str(config), *argv]) == 2, argv
            assert message in capsys.readouterr().err
        other = tmp_path / "o.yaml"
        other.write_text(config.read_text().replace("fake-model", "other-model"))
        assert run_cli(["--url", fake.url, "--dry-run", "--config", str(other), "--baselines", "none"]) == 2
        assert "its model is 'other-model'" in capsys.readouterr().err
        # a --baseline-url that serves another model is refused before anything is measured
        with FakeServer(stock=True) as stock:
            stock_url = stock.url
        assert run_cli(["--url", fake.url, "--quick", "--results-dir", str(tmp_path / "r"),
                        "--baseline-url", f"gone={stock_url}"]) == 2
        assert "baseline gone: cannot list models" in capsys.readouterr().err


def test_runner_timeout_and_schedule():
    async def go():
        with FakeServer(prefill_s=0.01, step_s=0.3) as slow:
            async with AsyncSpecServeClient(slow.url) as client:
                got = []
                runner = Runner(client, model=None, max_tokens=4, request_timeout_s=0.2, on_done=got.append)
                prompt = Prompt("1", "qa", "qa", "hello")
                cfg = P.parse_config("none")[0]
                t0 = time.perf_counter()
                samples = await runner.run_schedule([Job("trace", cfg, prompt, arrival=i) for i in range(3)],
                                                    [0.0, 0.15, 0.3])
                return samples, got, time.perf_counter() - t0

    samples, got, wall = asyncio.run(go())
    assert [s.arrival for s in samples] == [0, 1, 2] and got == samples
    assert all(not s.ok and "request timeout (0.2 s)" in s.error for s in samples)
    assert [s.start_s - samples[0].start_s for s in samples] == pytest.approx([0.0, 0.15, 0.3], abs=0.08)
    assert all(s.latency_s == pytest.approx(0.2, abs=0.1) for s in samples) and wall < 1.0


def test_a_stock_suffix_anchor_is_refused_where_the_load_phases_resend_prompts(capsys):
    # a stock suffix server keeps its answers: resent prompts would be drafted whole from them
    with FakeServer() as fake:
        argv = ["--url", fake.url, "--dry-run", "--quick", "--prompts-per-task", "1", "--concurrency", "1",
                "--baseline-url", f"stock-suffix={fake.url}", "--trace", "20:30", "--trace-rounds", "3"]
        assert run_cli(argv) == 2
        err = capsys.readouterr().err
        assert "stock-suffix would draft those from its own earlier answers" in err and "--trace-rounds" in err
        assert run_cli(argv + ["--allow-repeated-prompts"]) == 0
        assert "some come round again" in capsys.readouterr().err
        # enough fresh prompts for every round, or no stateful anchor: no refusal
        assert run_cli(argv[:-4] + ["--trace", "1:5", "--trace-rounds", "3"]) == 0
        assert run_cli([a.replace("stock-suffix=", "stock-none=") for a in argv]) == 0
