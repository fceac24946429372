"""Verdicts against the anchors (win / tie / loss with a paired bootstrap) and the trace's table."""

import json
import math
import random

import pytest

from tools.bench import verdict as V
from tools.bench.metrics import Sample, Slo
from tools.bench.report import build_summary, render_markdown


def sample(config, prompt, tokens, latency, phase="compare", repeat=0, start=0.0, concurrency=1, ok=True,
           ttft=None, arrival=None):
    return Sample(phase=phase, config=config, prompt_id=str(prompt), category="qa", task="qa", temperature=0.0,
                  concurrency=concurrency, repeat=repeat, ok=ok, start_s=start, end_s=start + latency,
                  ttft_s=ttft if ttft is not None else latency / 10, latency_s=latency,
                  token_ids=list(range(tokens)) if ok else [], arrival=arrival)


def one_stream(speed_of: dict, n_prompts=30, repeats=2, seed=0):
    """Greedy comparison samples: a prompt's latency = its length / the config's speed, times a
    factor shared by every config (the prompt's and the moment's), and for auto a +-10% jitter that
    alternates from prompt to prompt (so its ratio has a spread to resample)."""
    rng = random.Random(seed)
    out = []
    for r in range(repeats):
        for p in range(n_prompts):
            tokens, shared = 20 + 3 * p, 1 + rng.uniform(-0.15, 0.15)
            for cfg, speed in speed_of.items():
                jitter = (1.1 if p % 2 else 0.9) if cfg == "auto" else 1.0
                out.append(sample(cfg, p, tokens, tokens / speed * shared * jitter, repeat=r))
    return out


def test_classify():
    assert V.classify(1.04, [1.0, 1.08]) == {"verdict": "win", "target_met": True}
    assert V.classify(1.01, [0.99, 1.03]) == {"verdict": "tie", "target_met": True}
    assert V.classify(0.995, [0.98, 1.01]) == {"verdict": "tie", "target_met": False}  # ratio below 1.00
    assert V.classify(1.02, [0.95, 1.09]) == {"verdict": "tie", "target_met": False}  # lower bound below 0.97
    assert V.classify(0.9, [0.86, 0.94]) == {"verdict": "loss", "target_met": False}
    assert V.classify(0.95, [0.9, 0.98], higher_is_better=False) == {"verdict": "win", "target_met": True}
    assert V.classify(1.1, None) == {"verdict": None, "target_met": None}
    assert V.classify(math.nan, [1, 2])["verdict"] is None


@pytest.mark.parametrize("auto_speed, verdict", [(11.0, "win"), (10.0, "tie"), (9.0, "loss")])
def test_one_stream_verdict_against_the_best_anchor(auto_speed, verdict):
    samples = one_stream({"none": 8.0, "ngram:3": 10.4, "stock-none": 8.1, "stock-ngram:3": 10.0, "auto": auto_speed})
    v = V.anchor_verdicts(samples, ["stock-none", "stock-ngram:3"], resamples=1000)["one_stream"]
    anchor, other = v["vs_best_anchor"], v["vs_best_other"]
    assert anchor["config"] == "stock-ngram:3" and other["config"] == "ngram:3"
    assert anchor["ratio"] == pytest.approx(auto_speed / 10.0, rel=0.01)
    assert anchor["ci95"][0] <= anchor["ratio"] <= anchor["ci95"][1] and anchor["units"] == 30
    assert anchor["verdict"] == verdict and len(anchor["round_ratios"]) == 2
    assert other["ratio"] == pytest.approx(auto_speed / 10.4, rel=0.01)
    # seeded: the same samples give the same interval
    again = V.anchor_verdicts(samples, ["stock-none", "stock-ngram:3"], resamples=1000)["one_stream"]
    assert again["vs_best_anchor"]["ci95"] == anchor["ci95"]


def test_bootstrap_ci_edges():
    assert V.bootstrap_ci(1, lambda idx: 1.0) is None
    lo, hi = V.bootstrap_ci(50, lambda idx: sum(idx) / len(idx), resamples=1000, seed=1)
    assert lo < 24.5 < hi


def closed_loop(speed_of: dict, streams=4, rounds=2, per_phase=8, seed=0, drift=None):
    """A load level: each round every config runs the same prompts (one prompt twice), phases in turn;
    `drift` {(config, round): factor} slows a whole phase (the machine's speed during it)."""
    rng = random.Random(seed)
    out, t = [], 0.0
    for r in range(rounds):
        prompts = [0, 1, 2, 3, 4, 5, 6, 0]  # prompt 0 twice per phase
        for cfg, speed in speed_of.items():
            starts = [t] * streams
            for i, p in enumerate(prompts[:per_phase]):
                k = i % streams
                lat = 30 / speed * (1 + rng.uniform(-0.02, 0.02)) * (drift or {}).get((cfg, r), 1.0)
                out.append(sample(cfg, p, 30, lat, phase="sweep", repeat=r, start=starts[k], concurrency=streams))
                starts[k] += lat
            t = max(starts) + 1.0
    return out


def test_load_level_verdict_pairs_by_round_prompt_and_occurrence():
    samples = closed_loop({"stock-none": 5.0, "none": 5.0, "auto": 6.0})
    keys = V.occurrence_keys([s for s in samples if s.config == "auto"])
    assert sorted(k for k in keys.values() if k[1] == "0") == [(0, "0", 0), (0, "0", 1), (1, "0", 0), (1, "0", 1)]
    v = V.anchor_verdicts(samples, ["stock-none"], resamples=500)["load"]["4"]
    anchor = v["vs_best_anchor"]
    assert anchor["config"] == "stock-none" and anchor["units"] == 16  # 2 rounds x 8 requests
    assert anchor["ratio"] == pytest.approx(1.2, rel=0.03) and anchor["verdict"] == "win"
    assert anchor["wall_ratio"] == pytest.approx(1.2, rel=0.05) and len(anchor["round_ratios"]) == 2
    assert "one_stream" not in V.anchor_verdicts(samples, ["stock-none"])


def test_a_load_level_whose_rounds_disagree_is_a_tie():
    """Requests of one phase share the machine's speed during it: auto 1.1x in two rounds and 0.9x in
    the third is not a win, however tight each round is (pooling the requests would call it one)."""
    drift = {("auto", 1): 1.1 / 0.9}  # auto's second phase ran while the machine was slower
    samples = closed_loop({"stock-none": 5.0, "auto": 5.5}, rounds=3, drift=drift)
    anchor = V.anchor_verdicts(samples, ["stock-none"], resamples=500)["load"]["4"]["vs_best_anchor"]
    assert [round(x, 2) for x in anchor["round_ratios"]] == pytest.approx([1.1, 0.9, 1.1], abs=0.03)
    assert anchor["ci95"][0] < 0.95 and anchor["ci95"][1] > 1.05 and anchor["verdict"] == "tie"
    keys, units = V.paired_units([s for s in samples if s.config == "auto"],
                                 [s for s in samples if s.config == "stock-none"],
                                 lambda s, k=V.occurrence_keys(samples): k[id(s)])
    narrow = V.bootstrap_ci(len(units), lambda idx: V.paired_rate_ratio(units, idx), 500)
    assert narrow[0] > 0.97  # requests pooled over rounds: a spurious near-win
    agreeing = closed_loop({"stock-none": 5.0, "auto": 5.5}, rounds=3)
    assert V.anchor_verdicts(agreeing, ["stock-none"], resamples=500)["load"]["4"]["vs_best_anchor"]["verdict"] == "win"


def trace_samples(latency_of: dict, arrivals=20, rounds=2, fail=(), drift=None):
    out = []
    for r in range(rounds):
        t0 = 1000.0 * r
        for cfg, base in latency_of.items():
            for i in range(arrivals):
                lat = base * (1 + 0.1 * (i % 5)) * (drift or {}).get((cfg, r), 1.0)
                ok = (cfg, r, i) not in fail
                out.append(sample(cfg, i % 7, 10, lat, phase="trace", repeat=r, start=t0 + 2.0 * i, concurrency=0,
                                  ok=ok, ttft=0.1 * base, arrival=i))
    return out


def test_trace_numbers_and_table():
    samples = trace_samples({"auto": 1.0}, arrivals=10, rounds=1, fail={("auto", 0, 3)})
    n = V.trace_numbers(samples, Slo(latency_s=1.25))
    assert n["requests"] == 10 and n["failures"] == 1 and n["output_tokens"] == 90
    lats = sorted(1.0 * (1 + 0.1 * (i % 5)) for i in range(10) if i != 3)
    assert n["latency_mean_s"] == pytest.approx(sum(lats) / 9) and n["latency_p50_s"] == pytest.approx(lats[4])
    assert n["latency_p99_s"] == pytest.approx(lats[-2] + 0.92 * (lats[-1] - lats[-2]))
    assert n["ttft_mean_s"] == pytest.approx(0.1) and n["tpot_mean_s"] > 0
    span = (2.0 * 9 + 1.4) - 0.0  # first start to last end
    assert n["span_s"] == pytest.approx(span) and n["throughput_tokens_per_s"] == pytest.approx(90 / span)
    good = sum(1 for x in lats if x <= 1.25)
    assert n["good_requests"] == good and n["goodput_requests_per_s"] == pytest.approx(good / span)
    table = V.trace_table(trace_samples({"auto": 1.0, "none": 2.0}, arrivals=10, rounds=2))
    assert [r["round"] for r in table["none"]["rounds"]] == [0, 1]
    assert table["none"]["span_s"] == pytest.approx(sum(r["span_s"] for r in table["none"]["rounds"]))


def test_trace_latency_verdict_paired_by_arrival():
    latency_of = {"auto": 1.0, "none": 1.25, "stock-none": 1.3, "stock-ngram:3": 1.1}
    samples = trace_samples(latency_of, fail={("stock-ngram:3", 1, 4)})
    v = V.trace_verdict(samples, ["stock-none", "stock-ngram:3"], resamples=500)
    anchor = v["vs_best_anchor"]
    assert anchor["config"] == "stock-ngram:3" and v["vs_best_other"]["config"] == "stock-ngram:3"
    assert anchor["arrivals"] == 20 and anchor["ratio"] == pytest.approx(1 / 1.1)
    assert anchor["p99_ratio"] == pytest.approx(1 / 1.1) and anchor["verdict"] == "win" and anchor["target_met"]
    assert v["auto"] == pytest.approx(1.2)  # mean of 1.0 x (1, 1.1, ..., 1.4)
    worse = V.trace_verdict(trace_samples({"auto": 1.2, "stock-none": 1.0}), ["stock-none"], resamples=500)
    assert worse["vs_best_anchor"]["verdict"] == "loss" and worse["vs_best_anchor"]["target_met"] is False
    assert V.trace_verdict(trace_samples({"none": 1.0}), []) is None


def test_a_trace_whose_rounds_disagree_is_a_tie():
    steady = trace_samples({"auto": 0.9, "stock-none": 1.0}, rounds=3)
    assert V.trace_verdict(steady, ["stock-none"], resamples=500)["vs_best_anchor"]["verdict"] == "win"
    drifting = trace_samples({"auto": 0.9, "stock-none": 1.0}, rounds=3, drift={("auto", 2): 1.3})
    anchor = V.trace_verdict(drifting, ["stock-none"], resamples=500)["vs_best_anchor"]
    assert anchor["units"] == 60 and anchor["arrivals"] == 20
    assert anchor["ci95"][0] < 1.0 < anchor["ci95"][1] and anchor["verdict"] == "tie"


def test_summary_and_report_carry_the_anchor_sections():
    samples = one_stream({"none": 8.0, "stock-none": 8.0, "auto": 9.0}) + closed_loop(
        {"none": 5.0, "stock-none": 5.0, "auto": 5.5}) + trace_samples({"auto": 1.0, "stock-none": 1.1, "none": 1.2})
    summary = build_summary(samples, Slo(), anchors=("stock-none",))
    assert summary["anchors"] == ["stock-none"]
    assert set(summary["anchor_verdicts"]) == {"one_stream", "load"}
    assert summary["trace"]["order"] == [["auto", "stock-none", "none"]] * 2
    assert summary["trace"]["verdict"]["vs_best_anchor"]["config"] == "stock-none"
    # the router's own verdict still compares with the cluster's static configurations only
    assert summary["router"]["one_stream"]["best_static"] == "none"
    assert summary["router"]["load"]["4"]["best_static"] is None
    report = render_markdown(summary, {})
    assert "## `auto` against the stock-vLLM anchors and every other configuration" in report
    assert "Against the best anchor:" in report and "| trace (mean latency ms) |" in report
    assert "## Trace replay" in report and "| stock-none | 40 | 0 |" in report
    # both rounds send the same 7 prompts: the report says so (a stock suffix server would draft them from memory)
    assert summary["trace"]["resent"] == 20 and "**20 arrivals of later rounds resend a prompt" in report
    fresh = [s for s in trace_samples({"auto": 1.0, "stock-none": 1.1}) if s.repeat == 0]
    assert V.resent_arrivals(fresh) == 0
    assert "resend a prompt" not in render_markdown(build_summary(fresh, Slo(), anchors=("stock-none",)), {})


def test_per_task_each_task_is_judged_against_the_anchor_that_is_best_on_it():
    """Suffix wins one task, n-gram the other: auto is judged per task against each task's winner."""
    import dataclasses

    code = one_stream({"stock-ngram:3": 10.0, "stock-suffix": 14.0, "auto": 14.5})
    qa = one_stream({"stock-ngram:3": 10.0, "stock-suffix": 9.0, "auto": 9.0}, seed=1)
    samples = [dataclasses.replace(s, task="code", prompt_id="c" + s.prompt_id) for s in code] + qa
    v = V.anchor_verdicts(samples, ["stock-ngram:3", "stock-suffix"], resamples=1000)
    by_task = v["one_stream_by_task"]
    assert by_task["code"]["vs_best_anchor"]["config"] == "stock-suffix"
    assert by_task["qa"]["vs_best_anchor"]["config"] == "stock-ngram:3"
    assert by_task["qa"]["vs_best_anchor"]["verdict"] == "loss"
    assert by_task["code"]["vs_best_anchor"]["ratio"] == pytest.approx(14.5 / 14.0, rel=0.01)
    text = "\n".join(V.render_lines({"anchor_verdicts": v, "anchors": ["stock-ngram:3", "stock-suffix"]}))
    assert "One stream per task" in text and "| `qa` |" in text and "`stock-ngram:3`" in text


def test_hindsight_choice_bounds_what_choosing_among_the_anchors_can_gain():
    """Suffix is faster on code, n-gram on qa: serving each prompt on its faster anchor beats the best
    single anchor by what the per-task split allows, and no more; auto that matches the faster anchor
    on each task ties that choice."""
    import dataclasses

    code = one_stream({"stock-ngram:3": 10.0, "stock-suffix": 14.0, "auto": 14.0})
    qa = one_stream({"stock-ngram:3": 10.0, "stock-suffix": 8.0, "auto": 10.0}, seed=1)
    samples = [dataclasses.replace(s, task="code", prompt_id="c" + s.prompt_id) for s in code] + qa
    v = V.anchor_verdicts(samples, ["stock-ngram:3", "stock-suffix"], resamples=1000)["one_stream"]
    h = v["hindsight"]
    assert h["best_anchor"] == v["vs_best_anchor"]["config"] == "stock-suffix"
    assert h["picked"] == {"stock-ngram:3": 30, "stock-suffix": 30} and h["units"] == 60
    suffix_s = sum(x.latency_s for x in samples if x.config == "stock-suffix")
    chosen_s = sum(x.latency_s for x in samples if x.config == ("stock-suffix" if x.prompt_id.startswith("c") else "stock-ngram:3"))
    assert h["ratio"] == pytest.approx(suffix_s / chosen_s) and h["ratio"] > 1.0
    assert h["ci95"][0] <= h["ratio"] <= h["ci95"][1]
    assert h["auto_ci95"][0] <= 1.0 <= h["auto_ci95"][1]  # auto's jitter averages out: a tie with the choice
    text = "\n".join(V.render_lines({"anchor_verdicts": {"one_stream": v}, "anchors": ["stock-ngram:3", "stock-suffix"]}))
    assert "chosen per prompt in hindsight" in text and "`stock-ngram:3` 30" in text
    assert V.hindsight_choice({"auto": samples}, ["stock-suffix"], lambda x: x.prompt_id) is None


def test_a_finished_run_is_rendered_again_from_its_samples(tmp_path):
    from tools.bench.report import rerender, write_results

    samples = one_stream({"stock-ngram:3": 10.0, "stock-suffix": 14.0, "auto": 14.5}, n_prompts=6)
    summary = build_summary(samples, Slo(), anchors=("stock-ngram:3", "stock-suffix"))
    write_results(tmp_path, samples, {"slo": {"ttft_s": None}}, summary, plots=False)
    (tmp_path / "report.md").write_text("stale")
    files = rerender(tmp_path, plots=False)
    assert "`stock-suffix`" in files["report"].read_text()


def test_part_of_a_mixed_run_is_reported_on_its_own(tmp_path):
    import dataclasses

    from tools.bench.report import rerender, write_results

    qa = one_stream({"stock-suffix": 9.0, "auto": 10.0}, n_prompts=6)
    code = [dataclasses.replace(s, task="code", prompt_id="c" + s.prompt_id)
            for s in one_stream({"stock-suffix": 14.0, "auto": 12.0}, n_prompts=6)]
    samples = qa + code
    write_results(tmp_path, samples, {}, build_summary(samples, Slo(), anchors=("stock-suffix",)), plots=False)
    rerender(tmp_path, plots=False, tasks={"qa"}, out=tmp_path / "qa")
    summary = json.loads((tmp_path / "qa" / "summary.json").read_text())
    assert summary["anchor_verdicts"]["one_stream"]["vs_best_anchor"]["ratio"] == pytest.approx(10 / 9, rel=0.02)


def streamed(config, prompt, steps, step_s, stall_at=None, stall_s=1.03):
    """A one-stream sample of `steps` one-token chunks `step_s` apart, with one engine pause before
    chunk `stall_at` (None: no pause)."""
    times, t = [], 0.1
    for i in range(steps):
        if i == stall_at:
            t += stall_s
        times.append(t)
        t += step_s
    s = sample(config, prompt, steps, times[-1] + 0.01, ttft=0.1)
    s.chunk_times_s = times
    return s


def test_stalls_are_counted_and_taken_out_of_the_one_stream_ratio():
    # auto and the anchor are equally fast, but the anchor pauses 1.03 s in every third answer:
    # measured, auto wins; with the pauses taken out it is a tie at 1.00.
    samples = []
    for p in range(30):
        samples.append(streamed("auto", p, 60, 0.03 * (1.1 if p % 2 else 0.9)))
        samples.append(streamed("stock-x", p, 60, 0.03 * (0.9 if p % 2 else 1.1), stall_at=20 if p % 3 == 0 else None))
    v = V.anchor_verdicts(samples, ["stock-x"], resamples=200)["one_stream"]
    assert v["vs_best_anchor"]["verdict"] == "win" and v["vs_best_anchor"]["ratio"] > 1.1
    assert v["stalls"]["stock-x"]["stalled"] == 10 and v["stalls"]["auto"]["stalled"] == 0
    assert v["stalls"]["stock-x"]["lost_s"] == pytest.approx(10 * 1.03, abs=0.01)  # the pause, not the step it held
    calm = v["without_stalls"]["vs_best_anchor"]
    assert calm["verdict"] == "tie" and calm["ratio"] == pytest.approx(1.0, abs=0.01)
    lines = "\n".join(V.render_lines({"anchor_verdicts": {"one_stream": v}, "anchors": ["stock-x"]}))
    assert "`stock-x` 10 of 30 requests" in lines and "stall time taken out" in lines


def test_a_run_without_stalls_reports_no_stall_section():
    samples = [streamed(c, p, 40, 0.03) for p in range(10) for c in ("auto", "stock-x")]
    v = V.anchor_verdicts(samples, ["stock-x"], resamples=50)["one_stream"]
    assert "stalls" not in v and "without_stalls" not in v
    assert "Stalls" not in "\n".join(V.render_lines({"anchor_verdicts": {"one_stream": v}, "anchors": ["stock-x"]}))
