"""The router verdict's selection-unbiased comparison: the best static chosen on the other repeats
(cross-validation) and a paired per-prompt bootstrap interval, next to the plain max-over-configs one."""

import json
from pathlib import Path

import pytest

from tools.bench.metrics import Sample
from tools.bench.report import _router_lines, build_summary, load_samples, render_markdown, write_results
from tools.bench.router_verdict import cross_validated_best, paired_bootstrap_ci, router_verdict

A, B = "ngram:2", "ngram:4"


def _s(cfg, pid, task, repeat, latency, tokens=12):
    return Sample(phase="compare", config=cfg, prompt_id=pid, category=task, task=task, temperature=0.0,
                  concurrency=1, repeat=repeat, start_s=0.0, end_s=latency, ttft_s=0.1, latency_s=latency,
                  token_ids=list(range(tokens)))


# Latency (s) of each 12-token request: {config: {repeat: (p1 = qa, p2 = translation)}}.
#   qa tokens/s:          none 6 / 6, A 12 / 8,  B 8 / 12.5, auto 9.6 / 9.6
#   translation tokens/s: none 6 / 6, A 12 / 10, B 6 / 8,    auto 12 / 8
LATENCY = {
    "none": {0: (2.0, 2.0), 1: (2.0, 2.0)},
    A: {0: (1.0, 1.0), 1: (1.5, 1.2)},
    B: {0: (1.5, 2.0), 1: (0.96, 1.5)},
    "auto": {0: (1.25, 1.0), 1: (1.25, 1.5)},
}


def samples(repeats=(0, 1)):
    out = []
    for r in repeats:  # configurations interleaved per prompt, as the runner does
        for pid, task, i in (("p1", "qa", 0), ("p2", "translation", 1)):
            out += [_s(cfg, pid, task, r, LATENCY[cfg][r][i]) for cfg in LATENCY]
    return out


def test_two_repeats_each_won_by_another_config_by_hand():
    s = build_summary(samples())
    one = s["router"]["one_stream"]
    # Per repeat (24 tokens over the two latencies): A 12 / 8.889, B 6.857 / 9.756, auto 10.667 / 8.727.
    # Plain: best = A (median 10.444 > B's 8.306), auto's median 9.697: ratio 0.928, not ok (unchanged).
    assert one["best_static"] == A and one["ratio"] == pytest.approx(((24 / 2.25 + 24 / 2.75) / 2)
                                                                     / ((12 + 24 / 2.7) / 2))
    assert one["ok"] is False
    # Repeat 0 is judged with the best of repeat 1 (B, 9.756 > A's 8.889), repeat 1 with the best of
    # repeat 0 (A, 12): B on repeat 0 is 6.857, A on repeat 1 is 8.889.
    assert one["cv_best_static"] == [B, A]
    assert one["cv_ratio"] == pytest.approx((24 / 2.25 + 24 / 2.75) / (24 / 3.5 + 24 / 2.7))
    assert one["cv_ratio"] == pytest.approx(1.2317, abs=1e-4) and one["cv_ok"] is True
    assert [(x["round"], x["best_static"]) for x in one["cv_rounds"]] == [(0, B), (1, A)]
    assert one["cv_rounds"][0]["best_static_tokens_per_s"] == pytest.approx(24 / 3.5)
    # Bootstrap over the two prompts (latency summed over the repeats, 24 tokens each): auto 2.5 / 2.5,
    # A 2.5 / 2.2. Resamples: {p1, p1} -> 1.0, {p1, p2} -> 0.94, {p2, p2} -> 2.2 / 2.5 = 0.88; each
    # extreme comes up about a quarter of the time, so the 2.5% and 97.5% quantiles are exactly those.
    assert one["bootstrap_prompts"] == 2
    assert one["ratio_ci95"] == pytest.approx([0.88, 1.0])


def test_per_task_cross_validation_by_hand():
    tasks = build_summary(samples())["router"]["by_task"]
    qa, tr = tasks["qa"], tasks["translation"]
    # qa: plain best B (median 10.25 > A's 10), auto 9.6: 0.937, not ok; cv: repeat 0 judged with B
    # (12.5 on repeat 1), repeat 1 with A (12 on repeat 0): (9.6 + 9.6) / (8 + 8) = 1.2.
    assert qa["best_static"] == B and qa["ratio"] == pytest.approx(9.6 / 10.25) and qa["ok"] is False
    assert qa["cv_best_static"] == [B, A] and qa["cv_ratio"] == pytest.approx(1.2) and qa["cv_ok"] is True
    # translation: A wins both repeats, so cv = plain = (12 + 8) / (12 + 10) = 0.909 < 0.95.
    assert tr["best_static"] == A and tr["ratio"] == pytest.approx(10 / 11) and tr["ok"] is False
    assert tr["cv_best_static"] == [A, A] and tr["cv_ratio"] == pytest.approx(20 / 22) and tr["cv_ok"] is False


def test_verdicts_and_markdown():
    s = build_summary(samples())
    v = s["router"]
    assert v["all_ok"] is False and v["all_ok_cv"] is False  # translation fails either way
    text = render_markdown(s, {})
    assert ("Selection-unbiased (best static chosen on the other repeats, measured on this one; prompts resampled "
            "2000 times): auto / cv best = 1.232 (ngram:4, ngram:2; target >= 1: yes); paired bootstrap 95% CI of "
            "auto / ngram:2 over 2 prompts: 0.880-1.000.") in text
    assert "| task | auto speedup | best static | its speedup | ratio | >= 0.95 | cv ratio, >= 0.95 |" in text
    assert "| qa | 1.60 | ngram:4 | 1.71 | 0.937 | **no** | 1.200 yes |" in text
    assert "| translation | 1.67 | ngram:2 | 1.83 | 0.909 | **no** | 0.909 **no** |" in text
    assert ("All router targets met: **no**. With the selection-unbiased one-stream and per-task verdicts: "
            "**no**.") in text
    # the line comes right after the plain one-stream verdict
    lines = [x for x in text.splitlines() if x]
    i = next(k for k, x in enumerate(lines) if x.startswith("One stream, greedy:"))
    assert lines[i + 1].startswith("Selection-unbiased")


def test_one_repeat_has_no_cross_validation_but_a_bootstrap():
    s = build_summary(samples(repeats=(0,)))
    v = s["router"]
    one = v["one_stream"]
    assert one["cv_best_static"] is None and one["cv_ratio"] is None and one["cv_ok"] is None
    assert one["cv_rounds"] is None
    assert all(t["cv_ratio"] is None and t["cv_ok"] is None for t in v["by_task"].values())
    assert v["all_ok_cv"] is None
    # repeat 0 alone: auto p1 1.25 / p2 1.0 s, best A 1.0 / 1.0 s -> {p1,p1} 0.8, {p2,p2} 1.0
    assert one["best_static"] == A and one["ratio_ci95"] == pytest.approx([0.8, 1.0])
    text = render_markdown(s, {})
    assert "auto / cv best" not in text and "With the selection-unbiased" not in text
    assert ("Selection-unbiased (best static chosen on the other repeats, measured on this one; prompts resampled "
            "2000 times): paired bootstrap 95% CI of auto / ngram:2 over 2 prompts: 0.800-1.000.") in text
    assert "| qa | 1.60 | ngram:2 | 2.00 | 0.800 | **no** | - |" in text


def _rounds(*rates):
    return [{"round": r, "tokens_per_s": x} for r, x in enumerate(rates)]


def test_three_repeats_choose_on_the_median_of_the_others():
    # repeat 0: others A (15, 9) -> 12 > B (11, 12) -> 11.5: A, 10; repeat 1: A 9.5 < B 12: B, 11;
    # repeat 2: A 12.5 > B 11.5: A, 9. auto 11 every repeat: 33 / 30.
    cv = cross_validated_best(_rounds(11, 11, 11), {A: _rounds(10, 15, 9), B: _rounds(12, 11, 12)})
    assert cv["cv_best_static"] == [A, B, A] and cv["cv_ratio"] == pytest.approx(1.1)
    # a configuration missing a repeat is not a candidate for it; nothing to choose from -> None
    cv = cross_validated_best(_rounds(11, 11), {A: _rounds(10), B: _rounds(12, 9)})
    assert cv["cv_best_static"] == [B, B] and cv["cv_ratio"] == pytest.approx(22 / 21)
    assert cross_validated_best(_rounds(11, 11), {A: _rounds(10)})["cv_ratio"] is None
    assert cross_validated_best(None, {A: _rounds(10, 12)})["cv_ratio"] is None


def test_hand_built_summary_all_ok_cv_can_pass_where_all_ok_fails():
    def row(med, rounds, tasks):
        return {"repeat_tokens_per_s": {"median": med}, "rounds": _rounds(*rounds),
                "by_task": {t: {"speedup": sp, "rounds": _rounds(*rr)} for t, (sp, rr) in tasks.items()}}

    s = {"comparison": {"0": {
        "none": row(8.0, (8, 8), {"qa": (1.0, (8, 8))}),
        A: row(11.0, (12, 10), {"qa": (1.375, (12, 10))}),
        B: row(11.5, (10, 13), {"qa": (1.4375, (10, 13))}),
        "auto": row(11.0, (11, 11), {"qa": (1.375, (11, 11))}),
    }}, "load": {}, "poisson": {}}
    v = router_verdict(s)
    assert v["one_stream"]["best_static"] == B and v["one_stream"]["ok"] is False  # 11 / 11.5
    # repeat 0 judged with B (13 on repeat 1): 10; repeat 1 with A (12 on repeat 0): 10 -> 22 / 20
    assert v["one_stream"]["cv_best_static"] == [B, A] and v["one_stream"]["cv_ratio"] == pytest.approx(1.1)
    assert v["by_task"]["qa"]["ratio"] == pytest.approx(11 / 11.5) and v["by_task"]["qa"]["cv_ok"] is True
    assert v["one_stream"]["ratio_ci95"] is None and v["one_stream"]["bootstrap_prompts"] == 0  # no per-prompt rows
    assert v["all_ok"] is False and v["all_ok_cv"] is True
    text = "\n".join(_router_lines(v))
    assert "auto / cv best = 1.100 (ngram:4, ngram:2; target >= 1: yes)." in text
    # (per repeat auto / B reads 1.1 and 0.846: the plain verdict is within the noise)
    assert ("All router targets met: **no**. Within the run's noise: one_stream. With the selection-unbiased "
            "one-stream and per-task verdicts: yes.") in text
    # a failing load level fails both
    s["load"] = {"none": {"4": {"throughput_tokens_per_s": 30.0, "request_tokens_per_s": None}},
                 "auto": {"4": {"throughput_tokens_per_s": 20.0, "request_tokens_per_s": None}}}
    assert router_verdict(s)["all_ok_cv"] is False


def test_bootstrap_is_paired_and_seeded():
    auto = {"p1": [10, 1.0], "p2": [10, 2.0], "p3": [10, 4.0]}
    # the same latencies scaled by 1.25: every resample reads exactly 0.8
    assert paired_bootstrap_ci(auto, {p: [t, lat / 1.25] for p, (t, lat) in auto.items()}) == pytest.approx([0.8, 0.8])
    other = {"p1": [10, 1.1], "p2": [10, 1.5], "p3": [10, 4.2], "p4": [10, 1.0]}  # p4 not in auto: left out
    ci = paired_bootstrap_ci(auto, other)
    assert ci == paired_bootstrap_ci(auto, other) and ci[0] < 30 / 7.0 / (30 / 6.8) < ci[1]
    many = {f"p{i}": [10 + i, 1.0 + 0.37 * i] for i in range(12)}
    scaled = {p: [t, lat * (1.0 + 0.05 * (i % 5))] for i, (p, (t, lat)) in enumerate(many.items())}
    assert paired_bootstrap_ci(many, scaled) != paired_bootstrap_ci(many, scaled, seed=1)  # the seed matters
    assert paired_bootstrap_ci(auto, {"p1": [10, 1.0]}) is None and paired_bootstrap_ci(None, other) is None


def test_round_trip_through_files_and_json(tmp_path):
    s = build_summary(samples())
    files = write_results(tmp_path, samples(), {"started": "now"}, s, plots=False)
    _, back = load_samples(files["samples"])
    rebuilt = build_summary(back)
    stored = json.loads(files["summary"].read_text())
    again = router_verdict(stored)
    assert again["one_stream"]["cv_best_static"] == [B, A] == rebuilt["router"]["one_stream"]["cv_best_static"]
    assert again["one_stream"]["cv_ratio"] == pytest.approx(s["router"]["one_stream"]["cv_ratio"])
    assert again["one_stream"]["ratio_ci95"] == pytest.approx([0.88, 1.0])
    assert again["by_task"]["qa"]["cv_ratio"] == pytest.approx(1.2)
    assert stored["comparison"]["0"]["auto"]["per_prompt"] == {"p1": [24, 2.5], "p2": [24, 2.5]}
    assert "auto / cv best = 1.232" in files["report"].read_text()


def test_summaries_of_older_runs_still_render():
    # a fresh summary stripped of what older runs did not store
    s = build_summary(samples())
    for row in s["comparison"]["0"].values():
        row.pop("per_prompt")
        row.pop("rounds")
        for t in row["by_task"].values():
            t.pop("rounds")
    v = router_verdict(s)
    assert v["one_stream"]["cv_ratio"] is None and v["one_stream"]["ratio_ci95"] is None
    assert v["by_task"]["qa"]["cv_ok"] is None and v["all_ok_cv"] is None
    s["router"] = v
    text = render_markdown(s, {})
    assert "Selection-unbiased" not in text and "| qa | 1.60 | ngram:4 | 1.71 | 0.937 | **no** | - |" in text


def test_a_summary_recorded_before_intervals_still_renders():
    # A real run's summary.json from before the report carried intervals (no ratio_ci95, no cv).
    s = json.loads((Path(__file__).parent / "data" / "summary-without-intervals.json").read_text())
    v = router_verdict(s)
    assert v["one_stream"]["best_static"] == "ngram:4" and v["one_stream"]["ratio"] == pytest.approx(0.9449, abs=1e-4)
    assert v["one_stream"]["cv_ratio"] is None and v["one_stream"]["ratio_ci95"] is None and v["all_ok_cv"] is None
    s["router"] = v
    assert "ratio 0.945 (target >= 1: **no**)" in render_markdown(s, {})
