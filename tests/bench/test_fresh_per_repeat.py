"""`--fresh-per-repeat`: every repeat of the comparisons draws its own prompts (`select_per_repeat`), inside
the chosen half, the same for every configuration; the default (one draw for every repeat) is unchanged."""

import argparse
from collections import Counter
from pathlib import Path

import pytest

from .fake_openai import FakeServer
from tools.bench import cli
from tools.bench.phases import PhaseRun
from tools.bench.report import load_samples
from tools.bench.split import UNTOUCHED, keep, split_half
from tools.bench.workload import load_prompts, select, select_per_repeat

REPEATED = Path(cli.__file__).resolve().parents[2] / "cluster" / "data" / "repeated-structure.jsonl"
CATEGORIES = ("agent_loop", "code_edit", "form_chat", "templated_extraction")


def ids(prompts):
    return [p.question_id for p in prompts]


def test_draws_are_disjoint_per_task_seeded_and_stable_under_file_order():
    prompts = load_prompts(REPEATED)
    draws = select_per_repeat(prompts, 4, 3, seed=5)
    assert len(draws) == 3
    for draw in draws:
        assert Counter(p.task for p in draw) == {c: 4 for c in CATEGORIES}
        assert [p.task for p in draw] == sorted(p.task for p in draw)  # grouped by task, like `select`
    assert len({q for d in draws for q in ids(d)}) == 3 * 4 * 4  # no prompt in two repeats
    assert draws == select_per_repeat(list(reversed(prompts)), 4, 3, seed=5)
    assert draws != select_per_repeat(prompts, 4, 3, seed=6)
    assert select_per_repeat(prompts, 4, 1, seed=5) == [select(prompts, 4, seed=5)]  # one repeat: `select`'s draw


def test_draws_keep_the_filters_and_the_half():
    half = keep(load_prompts(REPEATED), UNTOUCHED)  # the bench applies --split before drawing
    draws = select_per_repeat(half, 5, 6, seed=0, tasks=["agent_loop", "form_chat"], max_prompt_chars=2000)
    assert all(split_half(p.question_id) == UNTOUCHED and p.task in ("agent_loop", "form_chat")
               for d in draws for p in d)
    assert len({q for d in draws for q in ids(d)}) == 6 * 5 * 2  # 30 of each category's 30 in the half


def test_too_few_prompts_names_the_options():
    half = keep(load_prompts(REPEATED), UNTOUCHED)  # 30 per task
    with pytest.raises(ValueError, match=r"--fresh-per-repeat: task \w+ has 30 prompts .* 4 repeats x "
                                         r"--prompts-per-task 8 need 32"):
        select_per_repeat(half, 8, 4)
    # A task the filters remove entirely is no task (as in `select`); the bench then finds no prompt left.
    assert select_per_repeat(load_prompts(REPEATED), 1, 2, max_prompt_chars=10) == [[], []]


def test_comparison_repeats_cover_greedy_and_sampled():
    ns = argparse.Namespace(repeats=3, sampled_repeats=2)
    assert cli._comparison_repeats(ns, [0.0]) == 3 and cli._comparison_repeats(ns, [0.7]) == 2
    assert cli._comparison_repeats(ns, [0.0, 0.7]) == 3 and cli._comparison_repeats(ns, []) == 1


def test_phase_run_sends_each_repeat_its_draw():
    a, b = select_per_repeat(load_prompts(REPEATED), 1, 2, seed=0)
    run = PhaseRun(args=None, model="m", configs=[], sweep_spec="", prompts=a, sweep_prompts=[], temperatures=[0.0],
                   levels=[1], max_k={}, shape=None, repeat_prompts=[a, b])
    assert run.compared(0) == a and run.compared(1) == b and run.all_compared == a + b
    default = PhaseRun(args=None, model="m", configs=[], sweep_spec="", prompts=a, sweep_prompts=[],
                       temperatures=[0.0], levels=[1], max_k={}, shape=None)
    assert default.compared(0) == default.compared(5) == default.all_compared == a


def run_cli(argv):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return cli.run(parser.parse_args(argv))


SMALL = ["--quick", "--max-tokens", "4", "--prompts", str(REPEATED), "--tasks", "agent_loop,form_chat",
         "--prompts-per-task", "1", "--repeats", "2", "--temperatures", "0", "--concurrency", "1",
         "--configs", "none,ngram:2", "--settle-s", "0", "--no-plots", "--split", "tune"]


def test_bench_end_to_end_fresh_prompts_per_repeat(tmp_path):
    with FakeServer(prefill_s=0.001, step_s=0.001) as fake:
        assert run_cli(["--url", fake.url, "--results-dir", str(tmp_path / "fresh"), *SMALL, "--fresh-per-repeat"]) == 0
        assert run_cli(["--url", fake.url, "--results-dir", str(tmp_path / "same"), *SMALL]) == 0
        # 2 repeats x 1 per task need 2 per task; the tune half has 30.
        assert run_cli(["--url", fake.url, "--dry-run", *SMALL, "--fresh-per-repeat", "--prompts-per-task", "16"]) == 2
    (fresh,), (same,) = (list((tmp_path / d).iterdir()) for d in ("fresh", "same"))
    meta, samples = load_samples(fresh / "samples.json")
    compare = [s for s in samples if s.phase == "compare"]
    per = {(r, c): sorted(s.prompt_id for s in compare if (s.repeat, s.config) == (r, c))
           for r in (0, 1) for c in ("none", "ngram:2")}
    assert per[0, "none"] == per[0, "ngram:2"] and per[1, "none"] == per[1, "ngram:2"]  # same draw per repeat
    assert not set(per[0, "none"]) & set(per[1, "none"]) and len(per[0, "none"]) == 2
    assert all(split_half(q) == "tune" for q in per[0, "none"] + per[1, "none"])
    # The reference (greedy, the losslessness check's) covers every prompt of every repeat.
    assert sorted(s.prompt_id for s in samples if s.phase == "reference") == sorted(per[0, "none"] + per[1, "none"])
    assert [sorted(x) for x in meta["repeat_prompts"]] == [per[0, "none"], per[1, "none"]]
    # Default: the same prompts in every repeat, and no per-repeat record.
    meta, samples = load_samples(same / "samples.json")
    compare = [s for s in samples if s.phase == "compare" and s.config == "none"]
    assert sorted(s.prompt_id for s in compare if s.repeat == 0) == sorted(s.prompt_id for s in compare if s.repeat == 1)
    assert "repeat_prompts" not in meta
