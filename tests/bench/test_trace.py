"""The trace's schedule: segments, the CSV (ISO timestamps), time scaling, window and count; the same
schedule for every configuration; round orders."""

import argparse
import statistics
from pathlib import Path

import pytest

from tools.bench import plan as P
from tools.bench import trace as T
from tools.bench.phases import trace_jobs
from tools.bench.workload import Prompt

SAMPLE = Path(__file__).parent / "data" / "azure_trace_sample.csv"  # generated, seeded (40 arrivals)
PROMPTS = [Prompt(str(i), "qa", "qa", f"question {i}") for i in range(7)]


def args(**kw):
    base = dict(trace=None, trace_file=None, trace_rate=None, trace_window_s=None, trace_max_requests=None)
    return argparse.Namespace(**{**base, **kw})


def test_segments_parse_and_errors():
    assert T.parse_segments("0.08:90, 0.6:60 ,0.08:90") == [(0.08, 90.0), (0.6, 60.0), (0.08, 90.0)]
    for bad in ("0.08", "x:90", "0.1:0", "-1:10", "", "0.1:nan"):
        with pytest.raises(ValueError, match="--trace"):
            T.parse_segments(bad)


def test_poisson_segments_follow_their_rates_and_the_seed():
    segments = [(0.5, 200.0), (5.0, 100.0), (0.0, 50.0), (0.5, 200.0)]
    offs = T.poisson_offsets(segments, seed=7)
    assert offs == sorted(offs) and offs == T.poisson_offsets(segments, seed=7) != T.poisson_offsets(segments, 8)
    counts = [sum(lo <= t < hi for t in offs) for lo, hi in ((0, 200), (200, 300), (300, 350), (350, 550))]
    assert 60 <= counts[0] <= 140 and 400 <= counts[1] <= 600 and counts[2] == 0 and 60 <= counts[3] <= 140
    assert max(offs) < 550


def test_timestamps_plain_and_iso():
    assert T.parse_timestamp(" 3.25 ") == 3.25
    a = T.parse_timestamp("2023-11-16 18:15:46.6805900")  # seven fractional digits, as Azure writes them
    b = T.parse_timestamp("2023-11-16T18:15:47.1805900Z")
    assert b - a == pytest.approx(0.5)
    with pytest.raises(ValueError):
        T.parse_timestamp("yesterday")


def test_csv_rows_sorted_with_token_columns():
    rows = T.parse_trace_csv("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                             "2023-11-16 18:15:48.0000000,10,4\n2023-11-16 18:15:46.5000000,20,7\n\n")
    assert [(r.context_tokens, r.generated_tokens) for r in rows] == [(20, 7), (10, 4)]
    assert rows[1].t_s - rows[0].t_s == pytest.approx(1.5)
    plain = T.parse_trace_csv("t,other\n5,x\n2.5,y\n")  # no timestamp column: the first one, seconds
    assert [r.t_s for r in plain] == [2.5, 5.0] and plain[0].generated_tokens is None
    with pytest.raises(ValueError, match="f.csv:3: ValueError"):
        T.parse_trace_csv("TIMESTAMP,GeneratedTokens\n1,2\nbad,3\n", "f.csv")
    with pytest.raises(ValueError, match="no arrival"):
        T.parse_trace_csv("TIMESTAMP\n")


def test_sample_csv_scaled_windowed_and_capped():
    rows = T.load_trace_csv(SAMPLE)
    assert len(rows) == 40
    raw = T.scale_trace(rows)
    assert raw[0][0] == 0.0 and all(g is not None for _, g in raw)
    scaled = T.scale_trace(rows, rate=2.0)
    assert T.mean_rate([t for t, _ in scaled]) == pytest.approx(2.0)
    # the shape is kept: every gap shrinks by the same factor
    factor = scaled[-1][0] / raw[-1][0]
    assert all(s[0] == pytest.approx(r[0] * factor) for s, r in zip(scaled, raw))
    windowed = T.scale_trace(rows, rate=2.0, window_s=5.0)
    assert windowed and all(t < 5.0 for t, _ in windowed) and windowed == scaled[:len(windowed)]
    assert T.scale_trace(rows, rate=2.0, window_s=5.0, max_requests=3) == scaled[:3]
    with pytest.raises(ValueError, match="--trace-rate"):
        T.scale_trace(rows, rate=0)
    with pytest.raises(ValueError, match="two arrivals"):
        T.scale_trace(rows[:1], rate=1.0)


def test_offsets_from_args():
    offs, gen, desc = T.offsets_from_args(args(trace="1:20,0:5"), seed=3)
    assert gen is None and offs and max(offs) < 20 and "seed 3" in desc
    assert T.offsets_from_args(args(trace="1:20", trace_max_requests=4), 3)[0] == offs[:4]
    assert all(t < 5 for t in T.offsets_from_args(args(trace="1:20", trace_window_s=5), 3)[0])
    offs, gen, desc = T.offsets_from_args(args(trace_file=str(SAMPLE), trace_rate=1.0, trace_max_requests=10), 0)
    assert len(offs) == len(gen) == 10 and "at 1 req/s" in desc
    assert T.offsets_from_args(args(), 0) == ([], None, "")
    for bad, match in ((args(trace="1:2", trace_file="f"), "give one"), (args(trace="1:2", trace_rate=1), "--trace-file only"),
                       (args(trace="1:2", trace_window_s=0), "--trace-window"),
                       (args(trace="1:2", trace_max_requests=0), "--trace-max-requests")):
        with pytest.raises(ValueError, match=match):
            T.offsets_from_args(bad, 0)


def test_schedule_is_identical_for_every_configuration():
    offs, gen, _ = T.offsets_from_args(args(trace_file=str(SAMPLE), trace_rate=1.0), 0)
    arrivals = T.build_schedule(offs, PROMPTS, 48, gen)
    assert [a.index for a in arrivals] == list(range(40))
    assert [a.prompt.question_id for a in arrivals[:8]] == ["0", "1", "2", "3", "4", "5", "6", "0"]
    assert all(1 <= a.max_tokens <= 48 for a in arrivals) and any(a.max_tokens < 48 for a in arrivals)
    configs = [P.BenchConfig("none", "none", 0), P.BenchConfig("auto", None, None), P.baseline_config("stock-none")]
    jobs = {c.name: trace_jobs(arrivals, c, 2) for c in configs}
    shape = lambda js: [(j.arrival, j.prompt, j.max_tokens, j.repeat, j.phase, j.nonce) for j in js]  # noqa: E731
    assert shape(jobs["none"]) == shape(jobs["auto"]) == shape(jobs["stock-none"])
    assert {j.config.name for j in jobs["stock-none"]} == {"stock-none"}
    summary = T.schedule_shape(arrivals)
    assert summary["arrivals"] == 40 and summary["mean_rate_rps"] == pytest.approx(1.0) and summary["prompts"] == 7


def test_each_round_sends_the_next_prompts_on_the_same_schedule():
    """A stock suffix server remembers answers across requests: a round that resent an earlier round's
    prompts would meet its own answers as drafts. Rounds keep the times and lengths, not the prompts."""
    many = [Prompt(str(i), "qa", "qa", f"question {i}") for i in range(120)]  # 3 rounds of 40
    offs, gen, _ = T.offsets_from_args(args(trace_file=str(SAMPLE), trace_rate=1.0), 0)
    arrivals = T.build_schedule(offs, many, 48, gen)
    rounds = [T.round_schedule(arrivals, many, r) for r in range(3)]
    assert [a.prompt for a in rounds[0]] == [a.prompt for a in arrivals]
    for r in rounds:
        assert [(a.index, a.offset_s, a.max_tokens) for a in r] == [(a.index, a.offset_s, a.max_tokens) for a in arrivals]
    ids = [{a.prompt.question_id for a in r} for r in rounds]
    assert all(len(i) == 40 for i in ids) and not (ids[0] & ids[1]) and not (ids[1] & ids[2]) and not (ids[0] & ids[2])
    # too few prompts: they cycle, in the same order for every configuration of a round
    few = T.round_schedule(T.build_schedule(offs, PROMPTS, 48, gen), PROMPTS, 1)
    assert [a.prompt.question_id for a in few[:3]] == ["5", "6", "0"]


def test_round_orders_rotate_and_reverse():
    orders = P.sweep_round_orders(3, 6)
    assert orders == [[0, 1, 2], [2, 1, 0], [1, 2, 0], [0, 2, 1], [2, 0, 1], [1, 0, 2]]
    # every configuration's mean position over a pair of rounds is the middle
    for i in range(3):
        assert statistics.mean(o.index(i) for o in orders[:2]) == 1.0
