"""`specserve bench` end to end against the fake HTTP server: phases, files, losslessness verdicts."""

import argparse
import json

import pytest

from .fake_openai import FakeServer
from tools.bench import cli
from tools.bench.report import load_samples


def run_cli(argv):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return cli.run(parser.parse_args(argv))


SMALL = ["--quick", "--max-tokens", "8", "--prompts-per-task", "1", "--tasks", "qa,translation,coding",
         "--concurrency", "1,3", "--no-plots"]


def test_quick_run_writes_results_and_flags_a_large_gap(tmp_path, capsys):
    # Positions 0..7 are generated; position 3 is a near-tie in the reference.
    fake = FakeServer(prefill_s=0.005, step_s=0.002, diverge={"draft_model:2": 3, "ngram:3": 5},
                      tie_positions=frozenset({3}))
    with fake:
        code = run_cli(["--url", fake.url, "--results-dir", str(tmp_path), *SMALL, "--temperatures", "0,0.8",
                        "--rate", "20", "--duration-s", "0.5", "--max-requests", "4", "--slo-ttft-s", "5"])
    assert code == 1  # ngram:3 diverged where the reference was sure: a bug
    (folder,) = list(tmp_path.iterdir())
    assert {p.name for p in folder.iterdir()} == {"samples.json", "summary.json", "report.md"}
    meta, samples = load_samples(folder / "samples.json")
    assert meta["configs"] == ["none", "ngram:3", "draft_model:2", "auto"] and meta["model"] == "fake-model"
    phases = {s.phase for s in samples}
    assert phases == {"reference", "warmup", "compare", "sweep", "poisson"}
    assert all(s.ok for s in samples)
    compare = [s for s in samples if s.phase == "compare" and s.temperature == 0]
    assert len(compare) == 4 * 3  # configs x prompts x 1 repeat
    sampled = {s.config for s in samples if s.phase == "compare" and s.temperature == 0.8}
    # none, best (each mode's fastest K: here the only K of each mode), auto
    assert sampled == {"none", "ngram:3", "draft_model:2", "auto"}
    sweep = [s for s in samples if s.phase == "sweep"]
    # quick: 2 rounds x 4 configs x max(3 prompts, 2 x 3) requests per phase
    assert {s.concurrency for s in sweep} == {3} and len(sweep) == 2 * 4 * 6
    assert {(s.repeat, s.config): sum(1 for x in sweep if (x.repeat, x.config) == (s.repeat, s.config))
            for s in sweep} == {(r, c): 6 for r in (0, 1) for c in ("none", "ngram:3", "draft_model:2", "auto")}
    # Round 1 runs round 0's order reversed; phases of one round do not overlap.
    order = [[c for c, _ in sorted({s.config: min(x.start_s for x in sweep if (x.repeat, x.config) == (r, s.config))
                                    for s in sweep if s.repeat == r}.items(), key=lambda kv: kv[1])] for r in (0, 1)]
    assert order[1] == order[0][::-1]
    # Within a round every configuration got the same prompts; the second round the next ones.
    prompts_of = lambda r, c: [s.prompt_id for s in sorted(sweep, key=lambda s: s.start_s)  # noqa: E731
                               if (s.repeat, s.config) == (r, c)]
    assert sorted(prompts_of(0, "none")) == sorted(prompts_of(0, "auto"))
    poisson = [s for s in samples if s.phase == "poisson"]
    assert 4 <= len(poisson) <= 16 and {s.rate_rps for s in poisson} == {20.0}

    # The requests the server saw: the reference asked for top-2 logprobs; the sweep sends the prompts as
    # they are (no nonce), each round's prompts warmed first in both pools (1 token); Poisson carries a nonce.
    ref_bodies = [b for b in fake.requests if b.get("logprobs")]
    assert len(ref_bodies) == 3 and all(b["top_logprobs"] == 2 and b["specserve"]["speculative"] == {"mode": "none"}
                                        for b in ref_bodies)
    assert not any(b["messages"][0]["content"].startswith("[s") for b in fake.requests)
    assert sum(1 for b in fake.requests if b["messages"][0]["content"].startswith("[p-")) == len(poisson)
    warm = [b for b in fake.requests if b["max_tokens"] == 1]
    # the 3 comparison prompts and each round's distinct sweep prompts, each through the ngram and draft pools
    assert sorted({tuple(sorted(b["specserve"]["speculative"].items())) for b in warm}) == [
        (("mode", "draft_model"),), (("mode", "ngram"),)]
    per_round = [len({s.prompt_id for s in sweep if s.repeat == r}) for r in (0, 1)]
    assert len(warm) == 2 * (3 + sum(per_round))
    assert all(b["stream"] is True for b in fake.requests)

    summary = json.loads((folder / "summary.json").read_text())
    ll = summary["lossless"]["by_config"]
    assert ll["none"]["mismatches"] == 0 and ll["auto"]["mismatches"] == 0
    assert ll["draft_model:2"] == {"compared": 3, "mismatches": 3, "near_tie": 3, "large_gap": 0, "unknown_gap": 0}
    assert ll["ngram:3"]["large_gap"] == 3
    greedy = summary["comparison"]["0"]
    # fake: K=3 accepts 1 per step -> 8 tokens in 4 steps: acceptance length 2; none: 1.0
    assert greedy["ngram:3"]["acceptance_length"] == pytest.approx(2.0)
    assert greedy["none"]["acceptance_length"] == 1.0 and greedy["none"]["speedup"] == pytest.approx(1.0)
    assert greedy["auto"]["k_distribution"] == {"ngram:3": 3}
    assert set(greedy["none"]["by_task"]) == {"qa", "translation", "mt_bench"}
    assert set(summary["load"]) == {"none", "ngram:3", "draft_model:2", "auto"}
    assert set(summary["load"]["none"]) == {"1", "3"} and summary["poisson"]["auto"]["good_requests"] >= 1
    assert summary["sweep_order"] == {"3": order}
    lvl = summary["load"]["none"]["3"]
    assert [r["round"] for r in lvl["rounds"]] == [0, 1] and lvl["requests"] == 12
    # pooled over the two phases, not over the wall span from the first round to the last
    assert lvl["span_s"] == pytest.approx(sum(r["time_s"] for r in lvl["rounds"]))
    assert lvl["throughput_tokens_per_s"] == pytest.approx(lvl["output_tokens"] / lvl["span_s"])
    assert len(summary["router"]["load"]["3"]["round_ratios"]) == 2

    report = (folder / "report.md").read_text()
    assert "## Losslessness" in report and "large-gap" in report and "near-tie" in report
    assert "## Load" in report and "## Open loop" in report
    assert "Phase order per round: 3 streams: [" + ", ".join(order[0]) + "] [" in report
    assert "per round min / median / max" in report
    assert "| ngram:3 |" in capsys.readouterr().out


def test_lossless_run_exits_zero_and_plots(tmp_path):
    with FakeServer(prefill_s=0.02, step_s=0.04) as fake:  # K=2: 3 steps of 2 tokens; K=4: 2 steps of 3
        code = run_cli(["--url", fake.url, "--results-dir", str(tmp_path), "--quick", "--max-tokens", "6",
                        "--prompts-per-task", "1", "--tasks", "qa,rag", "--concurrency", "1,2",
                        "--configs", "none,ngram:2,ngram:4,auto", "--sweep-configs", "none,best"])
    assert code == 0
    (folder,) = list(tmp_path.iterdir())
    names = {p.name for p in folder.iterdir()}
    assert {"speedup_by_task.png", "load_throughput.png", "load_p99_latency.png", "report.md"} <= names
    summary = json.loads((folder / "summary.json").read_text())
    # 'best' sweeps the ngram K that measured fastest in the greedy comparison.
    greedy = summary["comparison"]["0"]
    fastest = max(("ngram:2", "ngram:4"), key=lambda c: greedy[c]["repeat_tokens_per_s"]["median"])
    assert set(summary["load"]) == {"none", fastest}
    assert all(c["mismatches"] == 0 for c in summary["lossless"]["by_config"].values())


def test_dry_run_and_argument_errors(tmp_path, capsys):
    with FakeServer() as fake:
        assert run_cli(["--url", fake.url, "--dry-run", "--results-dir", str(tmp_path)]) == 0
        err = capsys.readouterr().err
        assert "estimate" in err and "ngram:6" in err and "draft_model:4" in err  # full: every K discovered
        assert not list(tmp_path.iterdir()) and not fake.requests
        assert run_cli(["--url", fake.url, "--dry-run", "--configs", "ngram:9"]) == 2
        assert run_cli(["--url", fake.url, "--dry-run", "--concurrency", "0"]) == 2
        assert run_cli(["--url", fake.url, "--dry-run", "--sweep-rounds", "0"]) == 2
        assert run_cli(["--url", fake.url, "--dry-run", "--sweep-requests", "0"]) == 2
        capsys.readouterr()
        assert run_cli(["--url", fake.url, "--dry-run", "--prompts-per-task", "3", "--concurrency", "1,4,16,32",
                        "--sweep-rounds", "4", "--sweep-requests", "24"]) == 0
        assert "in 4 rounds of 24, 32, 64 requests per phase" in capsys.readouterr().err
        assert run_cli(["--url", fake.url, "--dry-run", "--model", "other"]) == 2
    with FakeServer(pools=[]) as fake:  # a server that does not list its pools
        assert run_cli(["--url", fake.url, "--dry-run"]) == 2
        assert run_cli(["--url", fake.url, "--dry-run", "--configs", "none,ngram:2,auto"]) == 0
    assert run_cli(["--url", "http://127.0.0.1:9", "--dry-run"]) == 2
