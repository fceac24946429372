"""Configuration discovery and parsing, interleaved order, the estimate, and prompt loading."""

import json
from collections import Counter

import pytest

from tools.bench import plan as P
from tools.bench.workload import (DEFAULT_PROMPTS_PATH, WorkloadError, interleave_tasks, load_prompts, parse_lines,
                                    select, task_of)

POOLS = [{"name": "ngram", "method": "ngram", "max_k": 6, "modes": ["ngram", "none"]},
         {"name": "draft", "method": "draft_model", "max_k": 4, "modes": ["draft_model"]}]


def names(cfgs):
    return [c.name for c in cfgs]


def test_discover_configs_local_cpu_pools():
    assert P.mode_max_k(POOLS) == {"ngram": 6, "none": 0, "draft_model": 4}
    got = names(P.discover_configs(POOLS))
    assert got == ["none"] + [f"ngram:{k}" for k in range(1, 7)] + [f"draft_model:{k}" for k in range(1, 5)] + ["auto"]
    assert names(P.quick_configs(POOLS)) == ["none", "ngram:3", "draft_model:2", "auto"]


def test_mode_max_k_by_mode_lets_suffix_k_past_the_pool_max_k_but_keeps_the_default_lists():
    pools = [{"name": "ngram", "method": "ngram", "max_k": 6, "modes": ["ngram", "suffix", "none"],
              "max_k_by_mode": {"ngram": 6, "suffix": 16, "none": 0}}]
    assert P.mode_max_k(pools) == {"ngram": 6, "suffix": 6, "none": 0}
    served = P.mode_max_k(pools, by_mode=True)
    assert served == {"ngram": 6, "suffix": 16, "none": 0}
    assert names(P.parse_configs("suffix:16", served)) == ["suffix:16"]
    with pytest.raises(ValueError):
        P.parse_configs("suffix:17", served)
    with pytest.raises(ValueError):
        P.parse_configs("ngram:7", served)
    assert names(P.discover_configs(pools))[-2] == "suffix:6"
    assert P.mode_max_k(POOLS, by_mode=True) == P.mode_max_k(POOLS)  # pools that list no max_k_by_mode


def test_parse_configs_and_overrides():
    max_k = P.mode_max_k(POOLS)
    cfgs = P.parse_configs("none,ngram:2,ngram:4,draft_model:2,auto,ngram:2", max_k)
    assert names(cfgs) == ["none", "ngram:2", "ngram:4", "draft_model:2", "auto"]
    assert [c.speculative() for c in cfgs] == [{"mode": "none"}, {"mode": "ngram", "k": 2}, {"mode": "ngram", "k": 4},
                                               {"mode": "draft_model", "k": 2}, None]
    assert [c.is_speculative for c in cfgs] == [False, True, True, True, False]
    assert names(P.parse_configs("draft_model:*", max_k)) == [f"draft_model:{k}" for k in range(1, 5)]
    assert P.parse_configs("ngram", max_k)[0].speculative() == {"mode": "ngram"}
    assert names(P.parse_configs("ngram:0")) == ["none"]
    assert names(P.parse_configs("eagle:3")) == ["eagle:3"]  # nothing to check against without pools
    for bad in ("ngram:7", "eagle:1", "ngram:x", ",", "ngram:*x"):
        with pytest.raises(ValueError):
            P.parse_configs(bad, max_k)
    with pytest.raises(ValueError):
        P.parse_configs("ngram:*")  # needs the pools
    with pytest.raises(ValueError):
        P.parse_configs("ngram:3+2", max_k)  # K growth is not served


def test_interleaved_order_balances_positions():
    order = P.interleaved_order(3, 6, 2)
    assert len(order) == 36 and len(set(order)) == 36
    # Each prompt of each repeat runs all three configurations back to back.
    for i in range(0, 36, 3):
        block = order[i:i + 3]
        assert len({(r, p) for r, p, _ in block}) == 1 and sorted(c for _, _, c in block) == [0, 1, 2]
    # Every configuration is first (and last) equally often.
    firsts = Counter(order[i][2] for i in range(0, 36, 3))
    assert firsts == {0: 4, 1: 4, 2: 4}
    assert P.interleaved_order(2, 1, 2) == [(0, 0, 0), (0, 0, 1), (1, 0, 1), (1, 0, 0)]
    # Every other prompt runs the cycle backwards: each configuration follows both neighbours.
    preceded = Counter((order[i - 1][2], order[i][2]) for i in range(36) if i % 3)
    assert set(preceded) == {(a, b) for a in range(3) for b in range(3) if a != b}
    assert P.interleaved_order(4, 2, 1) == [(0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 0, 3),
                                            (0, 1, 1), (0, 1, 0), (0, 1, 3), (0, 1, 2)]


def test_sweep_round_orders_rotate_and_reverse():
    assert P.sweep_round_orders(3, 3) == [[0, 1, 2], [2, 1, 0], [1, 2, 0]]  # ABC, CBA, BCA
    # Three configurations over six rounds run all six orders, each first and last twice.
    six = P.sweep_round_orders(3, 6)
    assert sorted(map(tuple, six)) == sorted({(0, 1, 2), (0, 2, 1), (1, 0, 2), (1, 2, 0), (2, 0, 1), (2, 1, 0)})
    assert Counter(o[0] for o in six) == Counter(o[-1] for o in six) == {0: 2, 1: 2, 2: 2}
    for n in (2, 3, 4, 5):
        orders = P.sweep_round_orders(n, 2 * n)
        assert all(sorted(o) == list(range(n)) for o in orders)
        # In every pair of rounds each configuration's positions add up to n - 1: a linear drift cancels.
        for a, b in zip(orders[::2], orders[1::2]):
            assert {a.index(c) + b.index(c) for c in range(n)} == {n - 1}
        assert Counter(o[0] for o in orders) == {c: 2 for c in range(n)}  # nobody always first
    # The level's shift starts each level with another configuration.
    assert P.sweep_round_orders(3, 2, shift=1) == [[1, 2, 0], [0, 2, 1]]
    assert P.sweep_round_orders(3, 1) == [[0, 1, 2]] and P.sweep_round_orders(0, 2) == [[], []]


def test_order_drift_is_zero_only_for_an_even_number_of_rounds():
    for n in (2, 3, 4, 5):
        for shift in (0, 1, 2):
            for rounds in (2, 4, 6):
                assert P.order_drift(n, rounds, shift) == [0.0] * n
            for rounds in (1, 3, 5):  # the last round has no reversed twin
                drift = P.order_drift(n, rounds, shift)
                assert any(drift) and abs(sum(drift)) < 1e-6, (n, rounds, shift, drift)
    # Four configurations over three rounds (the capacity traces): the first runs first, last, last.
    assert P.order_drift(4, 3)[0] == 0.5
    assert P.order_drift(1, 3) == [0.0] and P.order_drift(0, 3) == [] and P.order_drift(3, 0) == [0.0] * 3


def test_sweep_sizes_and_estimate():
    assert P.sweep_requests(1, 12) == 12 and P.sweep_requests(32, 12) == 64
    assert P.aggregate_tokens_per_s(1, 10.0) == 10.0
    assert P.aggregate_tokens_per_s(16, 10.0) == pytest.approx(160 / 3.25)
    shape = P.PlanShape(n_compare_configs=2, n_prompts=3, max_tokens=40, greedy_repeats=2, sampled_temperatures=1,
                        sampled_repeats=1, n_sweep_configs=1, concurrency_levels=(1, 4), n_sweep_prompts=3,
                        poisson_duration_s=10.0, n_warmup_modes=1)
    est = P.estimate_s(shape, 10.0, per_request_overhead_s=0.0)
    assert est["compare_greedy"] == pytest.approx(2 * 3 * 2 * 4.0)  # 12 requests x 4 s
    assert est["compare_sampled"] == pytest.approx(6 * 4.0)
    assert est["sweep"] == pytest.approx(8 * 40 / (10 * 4 / 1.45))  # 8 requests at 4 streams
    assert est["poisson"] == pytest.approx(14.0)
    assert est["warmup"] == pytest.approx(3 * 4.0 + 2 * 0.8)
    assert est["total"] == pytest.approx(sum(v for k, v in est.items() if k != "total"))
    # Per-phase size (at least 2 per stream) and rounds multiply the sweep only.
    assert P.sweep_requests(4, 12, per_phase=30) == 30 and P.sweep_requests(32, 12, per_phase=30) == 64
    from dataclasses import replace
    est3 = P.estimate_s(replace(shape, sweep_rounds=3, sweep_requests_per_phase=16), 10.0, per_request_overhead_s=0.0)
    assert est3["sweep"] == pytest.approx(3 * 16 * 40 / (10 * 4 / 1.45))
    assert est3["compare_greedy"] == est["compare_greedy"] and est3["poisson"] == est["poisson"]


def test_full_and_quick_presets_fit_their_budgets_at_12_tokens_per_s():
    from tools.bench.cli import PRESETS

    # quick: a few minutes; full: about an hour, 27 min of it the sweep's three rounds
    for name, budget_s, configs in (("quick", 7 * 60, P.quick_configs(POOLS)), ("full", 65 * 60, P.discover_configs(POOLS))):
        pre = PRESETS[name]
        levels = tuple(int(x) for x in pre["concurrency"].split(","))
        n_modes = 2
        shape = P.PlanShape(n_compare_configs=len(configs), n_prompts=6 * pre["prompts_per_task"],
                            max_tokens=pre["max_tokens"], greedy_repeats=pre["repeats"],
                            sampled_temperatures=len([t for t in pre["temperatures"].split(",") if float(t) > 0]),
                            sampled_repeats=pre["sampled_repeats"], n_sweep_configs=2 + n_modes,
                            concurrency_levels=levels, n_sweep_prompts=6 * pre["prompts_per_task"],
                            poisson_duration_s=pre["duration_s"] if pre["rate"] else 0.0, n_warmup_modes=n_modes,
                            sweep_rounds=pre["sweep_rounds"])
        est = P.estimate_s(shape, 12.0)
        # sampled runs use none, best (one per mode), auto
        total = est["total"] - est["compare_sampled"] * (1 - (2 + n_modes) / len(configs))
        assert total < budget_s, (name, total / 60)


def test_default_prompt_file_ships_and_groups_into_six_tasks():
    prompts = load_prompts()
    assert DEFAULT_PROMPTS_PATH.name == "specbench-dev.jsonl"
    assert "Apache License" in (DEFAULT_PROMPTS_PATH.parent / "SPEC-BENCH-LICENSE").read_text()
    assert len(prompts) == 240
    tasks = Counter(p.task for p in prompts)
    assert tasks == {"mt_bench": 40, "translation": 40, "summarization": 40, "qa": 40, "math_reasoning": 40, "rag": 40}
    assert task_of("coding") == "mt_bench" and task_of("rag") == "rag"


def test_select_is_seeded_per_task_and_filters():
    prompts = load_prompts()
    a = select(prompts, 2, seed=0)
    assert len(a) == 12 and Counter(p.task for p in a) == {t: 2 for t in
                                                          ("mt_bench", "translation", "summarization", "qa",
                                                           "math_reasoning", "rag")}
    assert a == select(list(reversed(prompts)), 2, seed=0)  # independent of file order
    assert a != select(prompts, 2, seed=1)
    short = select(prompts, 50, tasks=["summarization"], max_prompt_chars=2000)
    assert short and all(p.task == "summarization" and len(p.text) <= 2000 for p in short)
    assert {p.category for p in select(prompts, 3, tasks=["coding"])} == {"coding"}
    assert a[0].messages == [{"role": "user", "content": a[0].text}]


def test_interleave_tasks_round_robin():
    prompts = select(load_prompts(), 11, seed=1)  # grouped by task, as select returns them
    mixed = interleave_tasks(prompts)
    assert sorted(p.question_id for p in mixed) == sorted(p.question_id for p in prompts)
    # Every window of 6 consecutive prompts holds all six tasks (grouped, the first 18 held two tasks).
    assert all(len({p.task for p in mixed[i:i + 6]}) == 6 for i in range(0, 60))
    assert len({p.task for p in prompts[:18]}) == 2 and Counter(p.task for p in mixed[:18]) == {
        t: 3 for t in ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")}
    # Order inside a task is kept; unequal groups run out one by one.
    a = [x for x in mixed if x.task == "qa"]
    assert a == [x for x in prompts if x.task == "qa"]
    uneven = select(load_prompts(), 2, seed=0, tasks=["qa"]) + select(load_prompts(), 1, seed=0, tasks=["rag"])
    assert [p.task for p in interleave_tasks(uneven)] == ["qa", "rag", "qa"] and interleave_tasks([]) == []


def test_parse_lines_first_turn_and_errors():
    lines = [json.dumps({"question_id": 7, "category": "rag", "turns": ["first", "second"]}), ""]
    (p,) = parse_lines(lines)
    assert (p.question_id, p.category, p.task, p.text, p.workload_class) == ("7", "rag", "rag", "first", "rag")
    for bad in ('{"question_id": 1, "category": "x"}', '{"question_id": 1, "category": "x", "turns": []}', "not json"):
        with pytest.raises(WorkloadError, match=":1:"):
            parse_lines([bad], "f.jsonl")
    with pytest.raises(WorkloadError):
        parse_lines([])


def test_every_config_name_makes_a_request_id_the_api_accepts():
    """A config name such as `ngram:3` goes into the request id, `:` and all: every one must be an id
    the API accepts, or that config's rows are lost."""
    from cluster.api.types import GenerateRequest
    from tools.bench.runner import Job, Runner
    from tools.bench.workload import Prompt

    runner = Runner(None, model=None, max_tokens=4)
    prompt = Prompt("heldout-1", "qa", "qa", "hi")
    for cfg in P.parse_configs("none,ngram:3,ngram:*,draft_model:2,auto", P.mode_max_k(POOLS)):
        rid = runner._request_id(Job("compare", cfg, prompt))
        assert GenerateRequest(prompt="x", request_id=rid).request_id == rid


def test_sequential_requests_are_apart_by_the_settle_pause():
    """The pause keeps one configuration's request out of another engine's busy-poll second."""
    import asyncio
    import time

    from tools.bench.runner import Job, Runner
    from tools.bench.workload import Prompt

    runner = Runner(None, model=None, max_tokens=4)
    starts = []

    async def one(job):
        starts.append(time.perf_counter())
        return job.repeat

    runner.one = one
    cfg = P.parse_configs("none", P.mode_max_k(POOLS))[0]
    jobs = [Job("compare", cfg, Prompt("p", "qa", "qa", "hi"), repeat=r) for r in range(3)]
    called = time.perf_counter()
    assert asyncio.run(runner.run_sequential(jobs, settle_s=0.1)) == [0, 1, 2]
    gaps = [b - a for a, b in zip([called] + starts, starts)]  # the first request waits too: the
    assert all(g >= 0.1 for g in gaps), gaps  # phase before it leaves other engines busy-polling
    starts.clear()
    asyncio.run(runner.run_sequential(jobs))
    assert all(b - a < 0.05 for a, b in zip(starts, starts[1:]))
