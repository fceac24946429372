"""The goodput autoscaling policy as a pure function: hand-built snapshots for each rule, the delays,
the router's capacity view, the engine's window, and a replay of snapshots recorded from a real run
(tests/cluster/data/autoscale_snapshots.jsonl, written by tools/bench/autoscale_ramp.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.autoscale.policy import (
    LatencyWindow, PolicyState, PoolSnapshot, ReplicaMetrics, decide, effective_replicas, plain_step_points,
    replica_carry, with_capacity,
)
from cluster.config_pool import AutoscalingConfig
from cluster.routing.route import PoolView
from cluster.speculation import SpecMode

FIXTURE = Path(__file__).parent / "data" / "autoscale_snapshots.jsonl"


def cfg(**kw) -> AutoscalingConfig:
    base = dict(min_replicas=1, max_replicas=4, target_ongoing_requests=4, upscale_delay_s=10, downscale_delay_s=60,
                slo_tpot_s=0.25, slo_ttft_s=3.0, min_samples=4, downscale_headroom=0.6)
    return AutoscalingConfig(**{**base, **kw})


def rep(name="r1", tpot=0.1, ttft=0.5, finished=10, tokens=20.0, k=2.0) -> ReplicaMetrics:
    return ReplicaMetrics(replica=name, finished=finished, tokens_per_s=tokens, accepted_per_s=tokens / 3,
                          tpot_p99_s=tpot, ttft_p99_s=ttft, mean_k=k)


def snap(load, running=1, target=None, replicas=None, now=1000.0, plain=()) -> PoolSnapshot:
    target = running if target is None else target
    return PoolSnapshot(now_s=now, running_replicas=running, target_replicas=target, load=load,
                        replicas=tuple(replicas if replicas is not None else [rep()]), plain_step_s=tuple(plain))


# -- carry ---------------------------------------------------------------------------------------

def test_carry_is_where_the_fitted_plain_step_time_meets_the_slo():
    # step = 0.08 + 0.01 * batch: reaches 0.25 at batch 17
    pts = [(1.0, 0.09), (5.5, 0.135), (11.5, 0.195)]
    carry, source = replica_carry(pts, 0.25, fallback=4, max_carry=64)
    assert source == "measured" and carry == pytest.approx(17.0, abs=1e-6)


def test_carry_from_one_point_uses_the_prior_growth():
    # one point at batch 1 (0.1 s); prior growth 8% per request: 0.1 * (1 + 0.08 (b - 1)) = 0.2 at b = 13.5
    carry, source = replica_carry([(1.0, 0.1)], 0.2, fallback=4, max_carry=64)
    assert source == "prior" and carry == pytest.approx(13.5, abs=1e-6)


@pytest.mark.parametrize("pts,slo,expected", [
    ([], 0.25, (4, "config")),  # nothing measured
    ([(1.0, 0.1)], None, (4, "config")),  # no TPOT objective
    ([(1.0, 0.3), (2.5, 0.4)], 0.25, (1.0, "measured")),  # even batch 1 misses it: at least one request
    ([(1.0, 0.01), (24.0, 0.02)], 0.25, (64.0, "measured")),  # bounded by max_ongoing_requests
    ([(1.0, 0.1), (2.5, 0.1)], 0.25, (64.0, "measured")),  # flat: whatever the replica admits
    # measured only at large batches, all past the SLO (seen live on the loaded CPU): no extrapolation down
    ([(11.5, 1.024), (24.0, 1.548)], 0.25, (4, "config")),
    ([(11.5, 1.024)], 0.25, (4, "config")),
])
def test_carry_edges(pts, slo, expected):
    assert replica_carry(pts, slo, fallback=4, max_carry=64) == expected


def test_plain_step_points_come_from_the_tuning_view_of_plain_decoding():
    from cluster.policy import CellStats, TuningView

    cells = {("none", "chat", "1"): CellStats(requests=10, steps=300, tokens=310, decode_s=30.0),
             ("none", "qa", "4-7"): CellStats(requests=5, steps=150, tokens=155, decode_s=24.0),
             ("none", "qa", "8-15"): CellStats(requests=1, steps=50, tokens=51, decode_s=10.0),  # too few steps
             ("ngram", "chat", "8-15"): CellStats(requests=9, steps=400, tokens=800, decode_s=80.0)}  # not plain
    assert plain_step_points(TuningView(model="m", cells=cells), min_steps=100) == ((1.0, 0.1), (5.5, 0.16))


# -- the rules -----------------------------------------------------------------------------------

def test_slo_slip_scales_up_after_the_delay_and_not_before():
    c = cfg()
    slow = [rep(tpot=0.4)]
    v, st = decide(snap(2.0, replicas=slow, now=1000.0), c)
    assert (v.replicas, v.want, v.action) == (1, 2, "pending-up")
    assert "p99 TPOT 0.400 s > SLO 0.250 s" in v.reason and "wanted for 0 of 10 s" in v.reason
    v, st = decide(snap(2.0, replicas=slow, now=1006.0), c, st)
    assert v.action == "pending-up" and st.since_s == 1000.0
    v, st = decide(snap(2.0, replicas=slow, now=1010.0), c, st)
    assert (v.replicas, v.action) == (2, "up") and st == PolicyState()


def test_ttft_slip_alone_scales_up():
    v, _ = decide(snap(1.0, replicas=[rep(ttft=5.0)]), cfg(upscale_delay_s=0))
    assert (v.replicas, v.action) == (2, "up") and "p99 TTFT 5.00 s > SLO 3.00 s" in v.reason


def test_percentiles_of_replicas_with_too_few_requests_do_not_count():
    v, _ = decide(snap(1.0, replicas=[rep(tpot=9.0, finished=3)]), cfg(upscale_delay_s=0))
    assert v.action == "hold" and v.tpot_p99_s == -1.0


def test_load_beyond_what_replicas_carry_without_speculation_scales_up_to_the_need():
    # carry 4 (config fallback: nothing measured); load 13 needs ceil(13 / 4) = 4 replicas
    v, _ = decide(snap(13.0), cfg(upscale_delay_s=0))
    assert (v.replicas, v.action) == (4, "up") and "load 13.0 > 1 x 4.0 carried per replica" in v.reason


def test_load_within_carry_with_latency_in_slo_holds():
    v, st = decide(snap(3.5), cfg())
    assert (v.replicas, v.action) == (1, "hold") and st == PolicyState()
    assert v.reason.startswith("hold 1: load 3.5 within 1 x 4.0")


def test_measured_carry_replaces_the_config_fallback():
    plain = [(1.0, 0.09), (5.5, 0.135), (11.5, 0.195)]  # carry 17
    v, _ = decide(snap(13.0, plain=plain), cfg(upscale_delay_s=0))
    assert v.action == "hold" and v.carry_source == "measured"
    v, _ = decide(snap(18.0, plain=plain), cfg(upscale_delay_s=0))
    assert (v.replicas, v.action) == (2, "up")


def test_scale_down_needs_headroom_and_the_delay():
    c = cfg()
    # 2 replicas, load 2.0: fits 1 at 60 % of 4 (2.4)
    v, st = decide(snap(2.0, running=2, replicas=[rep("a"), rep("b")], now=0.0), c)
    assert (v.replicas, v.want, v.action) == (2, 1, "pending-down")
    v, st = decide(snap(2.0, running=2, replicas=[rep("a"), rep("b")], now=59.0), c, st)
    assert v.action == "pending-down"
    v, st = decide(snap(2.0, running=2, replicas=[rep("a"), rep("b")], now=60.0), c, st)
    assert (v.replicas, v.action) == (1, "down") and "fits 1 at 60%" in v.reason


def test_no_scale_down_without_headroom_in_load_or_latency():
    c = cfg(downscale_delay_s=0)
    v, _ = decide(snap(3.0, running=2, replicas=[rep("a"), rep("b")]), c)  # 3.0 > 2.4
    assert v.action == "hold"
    v, _ = decide(snap(1.0, running=2, replicas=[rep("a", tpot=0.2), rep("b")]), c)  # 0.2 > 0.6 * 0.25
    assert v.action == "hold"


def test_interrupted_want_resets_the_delay():
    c = cfg()
    _, st = decide(snap(2.0, replicas=[rep(tpot=0.4)], now=0.0), c)
    _, st = decide(snap(2.0, replicas=[rep(tpot=0.1)], now=5.0), c, st)  # recovered: hold, reset
    assert st == PolicyState()
    v, st = decide(snap(2.0, replicas=[rep(tpot=0.4)], now=12.0), c, st)
    assert v.action == "pending-up" and st.since_s == 12.0


def test_a_scale_up_under_way_is_not_stacked_on_by_latency():
    # target 2, 1 running (the new replica is starting): the slow replica does not add a third
    v, _ = decide(snap(5.0, running=1, target=2, replicas=[rep(tpot=0.5)]), cfg(upscale_delay_s=0))
    assert (v.replicas, v.action) == (2, "hold") and "scale-up under way (1 of 2 running)" in v.reason
    # ... but load that needs more than the target still does
    v, _ = decide(snap(11.0, running=1, target=2), cfg(upscale_delay_s=0))
    assert (v.replicas, v.action) == (3, "up")


@pytest.mark.parametrize("load,replicas,expected", [(100.0, 1, 4), (0.0, 3, 1)])
def test_bounds(load, replicas, expected):
    v, _ = decide(snap(load, running=replicas, replicas=[rep(str(i)) for i in range(replicas)]),
                  cfg(upscale_delay_s=0, downscale_delay_s=0))
    assert v.replicas == expected and "bounded to" in v.reason


def test_goodput_and_mean_k_are_summed_and_token_weighted():
    v, _ = decide(snap(1.0, replicas=[rep("a", tokens=30.0, k=4.0), rep("b", tokens=10.0, k=0.0)]), cfg())
    assert v.goodput_tokens_per_s == 40.0 and v.mean_k == pytest.approx(3.0)


def test_state_round_trips_through_rays_policy_state_dict():
    st = PolicyState(want=3, since_s=12.5)
    assert PolicyState.from_dict({**st.to_dict(), "some_ray_key": 1}) == st


# -- the router's side ---------------------------------------------------------------------------

def _view(name="ngram", replicas=1) -> PoolView:
    return PoolView(name=name, model="m", method=SpecMode.NGRAM, max_k=6, replicas=replicas, running=8.0)


def test_router_counts_the_decided_target_including_a_starting_scale_up():
    recs = {"ngram": {"target": 2, "running": 1, "time_unix_s": 100.0}}
    [v] = with_capacity([_view()], recs, now_unix_s=101.0)
    assert v.replicas == 2 and v.batch_per_replica == 4.0  # the load bucket for K sees the coming replica


@pytest.mark.parametrize("rec", [None, {"target": 2, "time_unix_s": 10.0}, {"target": "x", "time_unix_s": 100.0},
                                 {"time_unix_s": 100.0}])
def test_router_falls_back_to_its_static_view_without_a_fresh_record(rec):
    assert effective_replicas(rec, 1, now_unix_s=101.0) == 1


# -- the engine's window -------------------------------------------------------------------------

def test_latency_window_summary():
    w = LatencyWindow(window_s=30.0)
    for i in range(10):  # 10 requests, 11 tokens each, TPOT 0.1 s (and one 0.5 s), TTFT 0.2 s
        w.add(end_s=100.0 + i, ttft_s=0.2, decode_s=(5.0 if i == 9 else 1.0), tokens=11, accepted=4,
              k=(3 if i % 2 else 1))
    s = w.summary(now_s=110.0)
    assert s["finished"] == 10 and s["tpot_p99_s"] == 0.5 and s["ttft_p99_s"] == 0.2
    # rates over the replica's 11.2 s of life so far (first request began at 98.8), not the whole window
    assert s["mean_k"] == 2.0 and s["accepted_per_s"] == pytest.approx(40 / 11.2, abs=1e-3)
    assert w.summary(now_s=135.0)["tokens_per_s"] == pytest.approx(11 * 5 / 30.0, abs=1e-3)  # 5 left, full window
    assert w.summary(now_s=200.0)["finished"] == 0 and w.summary(now_s=200.0)["tpot_p99_s"] == -1.0


# -- replay of a real run ------------------------------------------------------------------------

def _recorded() -> list[dict]:
    return [json.loads(line) for line in FIXTURE.read_text().splitlines() if line.strip()]


def _carry_fixed(row: dict) -> bool:
    """A tick recorded before a320750 whose carry was extrapolated below every measured batch."""
    pts = PoolSnapshot.from_dict(row["snapshot"]).plain_step_s
    c = AutoscalingConfig.model_validate(row["config"])
    return (row["carry"], row["carry_source"]) != replica_carry(pts, c.slo_tpot_s, c.target_ongoing_requests,
                                                               row.get("max_carry", 64.0))


def test_replay_of_recorded_snapshots_gives_the_recorded_decisions():
    """Every tick recorded live (runs of 2026-11-22 08:02 and 08:25, BENCHMARKS.md section 8), decided
    again from its snapshot and incoming state, gives the target, action and reason the live policy published;
    except the ticks whose carry the later fix changed (measured points only above the SLO at large
    batches), which must then be exactly those and now use the config's carry."""
    rows = _recorded()
    assert len(rows) >= 100
    fixed = 0
    for row in rows:
        c = AutoscalingConfig.model_validate(row["config"])
        v, _ = decide(PoolSnapshot.from_dict(row["snapshot"]), c, PolicyState.from_dict(row["state_in"]),
                      max_carry=row.get("max_carry", 64.0))
        if _carry_fixed(row):
            fixed += 1
            pts = row["snapshot"]["plain_step_s"]
            assert row["carry"] == 1.0 and min(b for b, _ in pts) > 1 and all(t > c.slo_tpot_s for _, t in pts)
            assert v.carry_source == "config"
        else:
            assert (v.replicas, v.action, v.reason) == (row["target"], row["action"], row["reason"]), row["time_unix_s"]
    assert 0 < fixed < len(rows)


def test_recorded_runs_scaled_up_and_down_for_stated_reasons_and_held_while_the_replica_started():
    rows = _recorded()  # two runs: 08:02 (up on a TPOT slip) and 08:25 (up on load, then down)
    changes = {r["last_change"]["time_unix_s"]: r["last_change"] for r in rows if r.get("last_change")}
    ups = [c["reason"] for c in changes.values() if c["action"] == "up"]
    downs = [c["reason"] for c in changes.values() if c["action"] == "down"]
    assert any("p99 TPOT" in u and "> SLO" in u for u in ups)
    assert any("carried per replica without speculation" in u for u in ups)
    assert downs and all("fits 1 at 60%" in d for d in downs)
    starting = [r for r in rows if r["running"] < r["target"]]
    assert starting and all(r["action"] == "hold" and "scale-up under way" in r["reason"] for r in starting)
    assert any(r["action"] == "pending-down" for r in rows)  # low load wanted fewer (never for the whole delay)
