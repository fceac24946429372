"""The ramp harness's bookkeeping (timeline bins and per-phase summary) on hand-made samples."""

from tools.bench.autoscale_ramp import parse_phases, summarize, timeline, tpot_s
from tools.bench.metrics import Sample


def _s(start, latency, ttft, tokens, k, ok=True):
    s = Sample(phase="poisson", config="auto", prompt_id="p", category="c", task="t", temperature=0.0,
               concurrency=0, ok=ok, start_s=start, end_s=start + latency, ttft_s=ttft, latency_s=latency)
    s.token_ids = list(range(tokens))
    s.spec = {"k": k}
    return s


def test_phases_and_tpot():
    assert parse_phases("0.1:90,1.5:240") == [(0.1, 90.0), (1.5, 240.0)]
    assert tpot_s(_s(0, 2.0, 1.0, 11, 3)) == 0.1
    assert tpot_s(_s(0, 2.0, 1.0, 1, 3)) is None and tpot_s(_s(0, 2.0, 1.0, 11, 3, ok=False)) is None


def test_timeline_bins_rates_k_and_replicas():
    samples = [_s(1, 2.0, 0.5, 16, 4), _s(2, 2.0, 0.5, 16, 2), _s(12, 4.0, 1.0, 31, 0)]
    t0 = 1000.0
    records = [{"time_unix_s": t0 + 5, "running": 1, "target": 1, "action": "hold", "reason": "hold",
                "load": 1.0, "carry": 4.0},
               {"time_unix_s": t0 + 15, "running": 1, "target": 2, "action": "hold", "reason": "hold 2",
                "load": 9.0, "carry": 4.0,  # the up tick itself fell between samples
                "last_change": {"action": "up", "reason": "up 1->2: load", "time_unix_s": t0 + 14.5}}]
    rows = timeline(samples, records, t0, bin_s=10.0)
    assert [r["rate_rps"] for r in rows] == [0.2, 0.1]
    assert rows[0]["mean_k"] == 3.0 and rows[1]["mean_k"] == 0.0
    assert (rows[0]["target"], rows[1]["target"]) == (1, 2) and rows[1]["action"] == "hold"
    assert rows[1]["p99_tpot_s"] == 0.1  # both earlier requests (0.1 s/token) and the third (0.1) in the window
    summary = summarize(samples, records, [(0.2, 10.0), (0.1, 10.0)], t0)
    assert [p["sent"] for p in summary["phases"]] == [2, 1]
    assert summary["phases"][0]["k_counts"] == {"2": 1, "4": 1}
    assert summary["changes"] == [{"t_s": 14.5, "action": "up", "reason": "up 1->2: load"}]
