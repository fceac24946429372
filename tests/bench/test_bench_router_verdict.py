"""The router verdict (its three targets) over hand-built summaries."""

import pytest

from tools.bench.report import _router_lines
from tools.bench.router_verdict import router_verdict


def _row(tok_s, tasks):
    return {"repeat_tokens_per_s": {"median": tok_s}, "by_task": {t: {"speedup": s} for t, s in tasks.items()}}


def _lvl(tput, request_tput=None):
    return {"throughput_tokens_per_s": tput, "request_tokens_per_s": request_tput}


def summary(auto_one=12.0, auto_tasks=None, auto_load=None):
    tasks = auto_tasks or {"qa": 1.10, "translation": 2.30}
    load = auto_load or {"1": _lvl(None, 12.0), "4": _lvl(27.0), "16": _lvl(48.0)}
    return {
        "comparison": {"0": {
            "none": _row(8.0, {"qa": 1.0, "translation": 1.0}),
            "ngram:3": _row(11.6, {"qa": 1.03, "translation": 1.94}),
            "ngram:6": _row(11.3, {"qa": 1.01, "translation": 2.32}),
            "ngram:1": _row(10.2, {"qa": 1.15, "translation": 1.42}),
            "auto": _row(auto_one, tasks),
        }},
        "load": {
            "none": {"1": _lvl(None, 8.0), "4": _lvl(23.75), "16": _lvl(48.82)},
            "ngram:3": {"1": _lvl(None, 11.6), "4": _lvl(27.70), "16": _lvl(45.17)},
            "auto": load,
        },
        "poisson": {},
    }


def test_all_targets_met():
    v = router_verdict(summary())
    assert v["one_stream"]["best_static"] == "ngram:3" and v["one_stream"]["ratio"] == pytest.approx(12.0 / 11.6)
    # per task the best static differs: ngram:1 on qa (1.15), ngram:6 on translation (2.32)
    assert v["by_task"]["qa"]["best_static"] == "ngram:1"
    assert v["by_task"]["qa"]["ratio"] == pytest.approx(1.10 / 1.15) and v["by_task"]["qa"]["ok"]  # 0.957
    assert v["by_task"]["translation"]["best_static"] == "ngram:6"
    # under load the reference is the better of none and the best static speculation
    assert v["load"]["4"]["ratio"] == pytest.approx(27.0 / 27.70)  # ngram:3 better at 4
    assert v["load"]["16"]["ratio"] == pytest.approx(48.0 / 48.82)  # none better at 16
    assert v["load"]["1"]["ratio"] == pytest.approx(12.0 / 11.6)  # level 1: per-request rates
    assert v["all_ok"]
    text = "\n".join(_router_lines(v))
    assert "ratio 1.034 (target >= 1: yes)" in text and "All router targets met: yes." in text


@pytest.mark.parametrize("kwargs,failing", [
    (dict(auto_one=11.5), "one_stream"),  # below ngram:3's 11.6
    (dict(auto_tasks={"qa": 1.09, "translation": 2.30}), "qa"),  # 1.09 / 1.15 = 0.948 < 0.95
    (dict(auto_load={"1": _lvl(None, 12.0), "4": _lvl(26.8), "16": _lvl(48.0)}), "4"),  # 26.8 / 27.7 = 0.9675
])
def test_each_target_can_fail(kwargs, failing):
    v = router_verdict(summary(**kwargs))
    assert not v["all_ok"]
    failed = ([k for k in ("one_stream",) if not v["one_stream"]["ok"]]
              + [t for t, r in v["by_task"].items() if not r["ok"]]
              + [c for c, r in v["load"].items() if not r["ok"]])
    assert failed == [failing]


# -- rounds: pooled numbers and the per-round spread -------------------------------------------------


def _rounds(*rates):
    return [{"round": r, "tokens_per_s": x} for r, x in enumerate(rates)]


def _lvl_rounds(pooled, rates):
    return {"throughput_tokens_per_s": pooled, "request_tokens_per_s": None, "rounds": _rounds(*rates)}


def load_summary(auto_rates, auto_pooled=35.0):
    s = summary()
    s["load"]["none"]["4"] = _lvl_rounds(34.0, (35.0, 33.0, 34.0))
    # ngram:3 is faster than none in round 1, but none is the better by the pooled numbers
    s["load"]["ngram:3"]["4"] = _lvl_rounds(33.0, (31.0, 36.0, 32.0))
    s["load"]["auto"]["4"] = _lvl_rounds(auto_pooled, auto_rates)
    return s


def test_load_spread_pairs_auto_with_the_pooled_reference_round_by_round():
    v = router_verdict(load_summary((34.0, 36.0, 35.0)))["load"]["4"]
    assert v["reference"] == "none" and v["ratio"] == pytest.approx(35.0 / 34.0) and v["ok"]
    # paired with none in every round, never with the faster of the round (which would bias it down)
    assert v["round_ratios"] == pytest.approx([34 / 35, 36 / 33, 35 / 34])
    assert v["round_ratio"]["min"] == pytest.approx(34 / 35) and v["round_ratio"]["median"] == pytest.approx(35 / 34)
    assert v["round_ratio"]["below_target"] == 0 and v["round_ratio"]["within_noise"] is False


def test_a_pooled_pass_inside_the_noise_is_flagged():
    # pooled 0.995 passes, but round 0 reads 31 / 35 = 0.886 (rounds 1, 2: 36 / 33, 38 / 34): they straddle 0.97
    v = router_verdict(load_summary((31.0, 36.0, 38.0), auto_pooled=33.83))
    lvl = v["load"]["4"]
    assert lvl["ok"] and lvl["round_ratio"]["below_target"] == 1 and lvl["round_ratio"]["within_noise"] is True
    assert v["within_noise"] == ["load:4"] and v["all_ok"]  # the verdict stays the pooled one
    text = "\n".join(_router_lines(v))
    assert "| 4 | 33.83 | 34.00 | ngram:3 | 33.00 | 0.995 | 0.886 / 1.091 / 1.118 | 1 of 3 | yes (within the noise) |" in text
    assert "All router targets met: yes. Within the run's noise: load:4." in text


def test_a_fail_in_every_round_is_not_noise_and_old_summaries_have_no_spread():
    v = router_verdict(load_summary((30.0, 31.0, 30.0), auto_pooled=30.3))
    assert not v["load"]["4"]["ok"] and v["load"]["4"]["round_ratio"]["below_target"] == 3
    assert v["load"]["4"]["round_ratio"]["within_noise"] is False and v["within_noise"] == []
    old = router_verdict(summary())  # a summary written before rounds: no `rounds` anywhere
    assert old["load"]["16"]["round_ratios"] == [] and old["load"]["16"]["round_ratio"]["n"] == 0
    assert "| 16 | 48.00 | 48.82 | ngram:3 | 45.17 | 0.983 | - | - | yes |" in "\n".join(_router_lines(old))


def test_one_stream_spread_over_repeats():
    s = summary()
    s["comparison"]["0"]["auto"]["rounds"] = _rounds(12.5, 11.0)
    s["comparison"]["0"]["ngram:3"]["rounds"] = _rounds(11.8, 11.4)
    one = router_verdict(s)["one_stream"]
    assert one["round_ratios"] == pytest.approx([12.5 / 11.8, 11.0 / 11.4]) and one["round_ratio"]["within_noise"]
    assert "Per repeat: 0.965 / 1.012 / 1.059 over 2 repeats, 1 below 1, so within the noise." in "\n".join(
        _router_lines(router_verdict(s)))


def test_build_summary_pools_sweep_rounds_not_the_wall_span():
    from tools.bench.metrics import Sample
    from tools.bench.report import build_summary, render_markdown

    def sweep(cfg, r, start, lat, tokens=12):
        return Sample(phase="sweep", config=cfg, prompt_id="p", category="qa", task="qa", temperature=0.0,
                      concurrency=4, repeat=r, start_s=start, end_s=start + lat, ttft_s=0.1, latency_s=lat,
                      token_ids=list(range(tokens)))

    # Round 0 order none, auto; round 1 auto, none. Each phase: two requests side by side.
    samples = [sweep("none", 0, 0.0, 2.0), sweep("none", 0, 0.0, 2.0), sweep("auto", 0, 2.0, 1.5),
               sweep("auto", 0, 2.0, 1.5), sweep("auto", 1, 10.0, 2.0), sweep("auto", 1, 10.0, 2.0),
               sweep("none", 1, 12.0, 3.0), sweep("none", 1, 12.0, 3.0)]
    s = build_summary(samples)
    none, auto = s["load"]["none"]["4"], s["load"]["auto"]["4"]
    assert s["sweep_order"] == {"4": [["none", "auto"], ["auto", "none"]]}
    assert none["span_s"] == pytest.approx(5.0) and none["throughput_tokens_per_s"] == pytest.approx(48 / 5.0)
    assert auto["span_s"] == pytest.approx(3.5) and auto["throughput_tokens_per_s"] == pytest.approx(48 / 3.5)
    assert [r["tokens_per_s"] for r in none["rounds"]] == pytest.approx([12.0, 8.0])
    assert none["goodput_tokens_per_s"] == pytest.approx(48 / 5.0) and none["requests"] == 4
    v = s["router"]["load"]["4"]
    assert v["ratio"] == pytest.approx(5.0 / 3.5) and v["round_ratios"] == pytest.approx([16 / 12, 12 / 8])
    assert "Phase order per round: 4 streams: [none, auto] [auto, none]" in render_markdown(s, {})


def test_a_growing_k_is_not_a_static_configuration():
    """`MODE:K+S` rows are reported but the verdict compares auto with fixed K only (the issue's bar)."""
    s = summary()
    s["comparison"]["0"]["ngram:3+2"] = _row(13.0, {"qa": 1.20, "translation": 2.50})
    s["load"]["ngram:3+2"] = {"1": _lvl(None, 13.0), "4": _lvl(30.0), "16": _lvl(50.0)}
    v = router_verdict(s)
    assert v["one_stream"]["best_static"] == "ngram:3" and v["by_task"]["qa"]["best_static"] == "ngram:1"
    assert v["load"]["4"]["ratio"] == pytest.approx(27.0 / 27.70) and v["all_ok"]


def test_without_none_there_is_no_per_task_verdict_and_no_plain_reference():
    """Speedups are over `none`: a run without it (`--configs auto,suffix:16` beside stock anchors)
    has no per-task verdict, and its load reference is the best static configuration alone. Neither
    may read as a failed target."""
    s = summary()
    del s["comparison"]["0"]["none"], s["load"]["none"]
    for row in s["comparison"]["0"].values():
        row["by_task"] = {t: {"speedup": None} for t in row["by_task"]}
    v = router_verdict(s)
    assert "by_task" not in v
    assert v["load"]["16"]["none_tokens_per_s"] is None and v["load"]["16"]["reference"] == "ngram:3"
    assert v["load"]["16"]["ratio"] == pytest.approx(48.0 / 45.17) and v["all_ok"]
    text = "\n".join(_router_lines(v))
    assert "| 16 | 48.00 | - | ngram:3 |" in text and "All router targets met: yes." in text
    s["load"]["auto"]["16"] = _lvl(43.0)  # 43 / 45.17 = 0.952: the load target still fails
    assert not router_verdict(s)["all_ok"]
