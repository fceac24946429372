"""The router verdict (issue 4's three targets) over hand-built summaries."""

import pytest

from cluster.bench.report import _router_lines, router_verdict


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
