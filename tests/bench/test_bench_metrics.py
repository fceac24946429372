"""Metric math against values computed by hand (the numbers in the comments)."""

import math

import pytest

from tools.bench.metrics import (Sample, Slo, best_k_per_mode, check_lossless, distribution, first_divergence,
                                   itl_s, logit_gap, meets_slo, paired_ratios, pooled_rate, ratio_spread,
                                   repeat_spread, round_rates, speedup, summarize, tpot_s)


def mk(config="c", ttft=0.5, lat=2.5, tokens=5, start=0.0, repeat=0, ok=True, spec=None, chunks=None, task="qa",
       pid="1", temp=0.0, logprobs=None, token_ids=None):
    return Sample(phase="compare", config=config, prompt_id=pid, category=task, task=task, temperature=temp,
                  concurrency=1, repeat=repeat, ok=ok, start_s=start, end_s=start + lat, ttft_s=ttft, latency_s=lat,
                  chunk_times_s=chunks or [], token_ids=token_ids if token_ids is not None else list(range(tokens)),
                  spec=spec or {}, logprobs=logprobs)


def test_distribution_skips_missing():
    d = distribution([1.0, None, 3.0, float("nan")])
    assert d["n"] == 2 and d["mean"] == 2.0 and d["p50"] == 2.0 and d["min"] == 1.0 and d["max"] == 3.0
    assert distribution([])["n"] == 0


def test_tpot_and_itl():
    s = mk(ttft=0.5, lat=2.5, tokens=5, chunks=[0.5, 1.0, 1.75, 2.5])
    assert tpot_s(s) == pytest.approx(0.5)  # (2.5 - 0.5) / (5 - 1)
    assert itl_s(s) == pytest.approx([0.5, 0.75, 0.75])
    assert tpot_s(mk(tokens=1)) is None and tpot_s(mk(ok=False)) is None


def test_slo():
    s = mk(ttft=0.5, lat=2.5, tokens=5)  # TPOT 0.5
    assert meets_slo(s, Slo())
    assert meets_slo(s, Slo(ttft_s=0.5, tpot_s=0.5, latency_s=2.5))  # limits are inclusive
    assert not meets_slo(s, Slo(ttft_s=0.4))
    assert not meets_slo(s, Slo(tpot_s=0.49))
    assert not meets_slo(s, Slo(latency_s=2.4))
    assert meets_slo(mk(tokens=1), Slo(tpot_s=0.01))  # one token: no TPOT to miss
    assert not meets_slo(mk(ok=False), Slo())


def test_summarize_hand_computed():
    a = mk(ttft=0.5, lat=2.5, tokens=5, start=0.0, spec={"mode": "ngram", "k": 2, "steps": 3, "drafted": 6, "accepted": 2,
                                                         "explored": True, "decision": {"load_bucket": "16+"}})
    b = mk(ttft=1.0, lat=3.0, tokens=3, start=1.0, spec={"mode": "ngram", "k": 2, "steps": 2, "drafted": 4, "accepted": 1,
                                                         "decision": {"load_bucket": "8-15"}})
    c = mk(ttft=0.2, lat=0.7, tokens=2, start=3.5, spec={"mode": "none", "k": 0, "steps": 2})
    bad = mk(ok=False, start=2.0, lat=0.1, tokens=0)
    r = summarize([a, b, c, bad], Slo(tpot_s=0.6))
    assert r["requests"] == 4 and r["errors"] == 1 and r["output_tokens"] == 10
    assert r["request_tokens_per_s"] == pytest.approx(10 / 6.2)  # 10 tokens over 2.5 + 3.0 + 0.7 s
    assert r["span_s"] == pytest.approx(4.2)  # first start 0.0, last end 3.5 + 0.7
    assert r["throughput_tokens_per_s"] == pytest.approx(10 / 4.2)
    # TPOTs: a 0.5, b 1.0, c 0.5 -> a and c meet 0.6: 7 tokens
    assert r["good_requests"] == 2 and r["goodput_tokens_per_s"] == pytest.approx(7 / 4.2)
    assert r["request_goodput_tokens_per_s"] == pytest.approx(7 / 6.2)
    assert r["tpot_s"]["mean"] == pytest.approx(2.0 / 3)
    assert r["ttft_s"]["p50"] == pytest.approx(0.5) and r["latency_s"]["p90"] == pytest.approx(2.9)
    # steps 7, accepted 3, drafted 10
    assert r["acceptance_length"] == pytest.approx(1 + 3 / 7) and r["acceptance_rate"] == pytest.approx(0.3)
    assert r["k_distribution"] == {"ngram:2": 2, "none:0": 1} and r["explored"] == 1
    assert r["load_buckets"] == {"16+": 1, "8-15": 1}  # c reported no decision


def test_repeat_spread_and_speedup():
    # repeat 0: 10 tokens / 2 s = 5; repeat 1: 12 / 2 = 6; repeat 2: 9 / 1 = 9 -> min 5, median 6
    ss = [mk(tokens=4, lat=1.0, repeat=0), mk(tokens=6, lat=1.0, repeat=0), mk(tokens=12, lat=2.0, repeat=1),
          mk(tokens=9, lat=1.0, repeat=2), mk(ok=False, repeat=2)]
    r = repeat_spread(ss)
    assert r == {"repeats": 3, "min": 5.0, "median": 6.0}
    assert speedup(6.0, 4.0) == 1.5 and math.isnan(speedup(6.0, 0.0))
    assert repeat_spread([])["repeats"] == 0


def test_round_rates_and_pooled_rate():
    # round 0: two requests over wall 0.0 .. 3.0 (10 tokens); round 1 ran later, 100.0 .. 102.0 (8 tokens)
    ss = [mk(tokens=4, start=0.0, lat=2.0, repeat=0), mk(tokens=6, start=1.0, lat=2.0, repeat=0),
          mk(tokens=8, start=100.0, lat=2.0, repeat=1), mk(ok=False, start=101.0, lat=0.5, tokens=0, repeat=1)]
    rounds = round_rates(ss, Slo(ttft_s=0.1))
    assert [r["round"] for r in rounds] == [0, 1] and [r["requests"] for r in rounds] == [2, 2]
    assert [r["time_s"] for r in rounds] == [3.0, 2.0] and [r["output_tokens"] for r in rounds] == [10, 8]
    assert [r["tokens_per_s"] for r in rounds] == pytest.approx([10 / 3, 4.0])
    assert [r["good_tokens"] for r in rounds] == [0, 0]  # every TTFT 0.5 > 0.1
    # pooled: 18 tokens / 5 s of phases (not / 102 s of wall, not the mean 3.67 of the two rates)
    assert pooled_rate(rounds) == pytest.approx(3.6)
    # one stream (wall=False): summed latency, 4 + 2 s
    assert [r["time_s"] for r in round_rates(ss, wall=False)] == [4.0, 2.0]
    assert math.isnan(pooled_rate([])) and round_rates([]) == []


def test_paired_ratios_and_spread():
    auto = [{"round": 0, "tokens_per_s": 30.0}, {"round": 1, "tokens_per_s": 36.0}, {"round": 2, "tokens_per_s": 40.0},
            {"round": 3, "tokens_per_s": 10.0}]
    ref = [{"round": 0, "tokens_per_s": 32.0}, {"round": 1, "tokens_per_s": 36.0}, {"round": 2, "tokens_per_s": 38.0},
           {"round": 3, "tokens_per_s": 0.0}]  # round 3: no reference rate, left out
    ratios = paired_ratios(auto, ref)
    assert ratios == pytest.approx([0.9375, 1.0, 40 / 38])
    sp = ratio_spread(ratios, 0.97)
    assert sp["n"] == 3 and sp["min"] == pytest.approx(0.9375) and sp["median"] == 1.0
    assert sp["max"] == pytest.approx(40 / 38) and sp["below_target"] == 1 and sp["within_noise"] is True
    assert ratio_spread([0.98, 1.01], 0.97)["within_noise"] is False
    assert ratio_spread([0.90, 0.95], 0.97) == {"n": 2, "min": 0.90, "median": pytest.approx(0.925), "max": 0.95,
                                                "below_target": 2, "within_noise": False}
    assert ratio_spread([0.9], 0.97)["within_noise"] is None and ratio_spread([], 0.97)["n"] == 0


def test_best_k_per_mode():
    rows = {"none": 10.0, "ngram:1": 11.0, "ngram:2": 13.0, "ngram:3": 12.0, "draft_model:1": 8.0,
            "draft_model:2": float("nan"), "auto": 20.0}
    names = {"ngram:1": ("ngram", 1), "ngram:2": ("ngram", 2), "ngram:3": ("ngram", 3),
             "draft_model:1": ("draft_model", 1), "draft_model:2": ("draft_model", 2)}
    assert best_k_per_mode(rows, names) == {"ngram": "ngram:2", "draft_model": "draft_model:1"}


def test_first_divergence_and_gap():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2
    assert first_divergence([], [4]) == 0
    assert logit_gap({7: -0.25, 9: -1.5}) == pytest.approx(1.25)
    assert logit_gap({9: -1.5, 7: -0.25, 3: -3.0}) == pytest.approx(1.25)
    assert logit_gap({7: -0.1}) is None and logit_gap(None) is None


def test_check_lossless_classifies_by_reference_gap():
    lps = [{10: -0.1, 11: -2.1}, {20: -0.5, 21: -0.51}, {30: -0.2, 31: -3.2}]
    ref = mk(config="none", pid="p", token_ids=[10, 20, 30], logprobs=lps)
    same = mk(config="none", pid="p", token_ids=[10, 20, 30])
    tie = mk(config="ngram:2", pid="p", token_ids=[10, 21, 30])  # gap 0.01 at position 1
    bug = mk(config="ngram:3", pid="p", token_ids=[10, 20, 31], repeat=1)  # gap 3.0 at position 2
    longer = mk(config="draft_model:1", pid="p", token_ids=[10, 20, 30, 40])  # no reference logprob there
    sampled = mk(config="ngram:3", pid="p", token_ids=[1, 2, 3], temp=0.7)  # not compared
    other = mk(config="ngram:3", pid="q", token_ids=[1])  # no reference: not compared
    counts, mism = check_lossless({"p": ref}, [same, tie, bug, longer, sampled, other], tie_gap=0.05)
    assert counts["none"] == {"compared": 1, "mismatches": 0, "near_tie": 0, "large_gap": 0, "unknown_gap": 0}
    assert counts["ngram:2"]["near_tie"] == 1 and counts["ngram:3"]["large_gap"] == 1
    assert counts["ngram:3"]["compared"] == 1 and counts["draft_model:1"]["unknown_gap"] == 1
    by = {m.config: m for m in mism}
    assert (by["ngram:2"].position, by["ngram:2"].reference_token, by["ngram:2"].token) == (1, 20, 21)
    assert by["ngram:2"].gap == pytest.approx(0.01) and by["ngram:2"].verdict == "near-tie"
    assert by["ngram:3"].gap == pytest.approx(3.0) and by["ngram:3"].verdict == "large-gap" and by["ngram:3"].repeat == 1
    assert by["draft_model:1"].position == 3 and by["draft_model:1"].reference_token is None
    assert by["draft_model:1"].token == 40 and by["draft_model:1"].verdict == "unknown-gap"


def test_sample_json_roundtrip_keeps_int_token_keys():
    s = mk(logprobs=[{5: -0.1, 6: -2.0}])
    d = s.to_dict()
    assert d["logprobs"] == [{"5": -0.1, "6": -2.0}]
    assert Sample.from_dict(d) == s


def test_the_k_column_counts_exploration_draws():
    from tools.bench.report import _kdist

    assert _kdist({"ngram:5": 3, "none:0": 1}, 1) == "ngram:5×3 none:0×1 (explored 1)"
    assert _kdist({"ngram:5": 3}) == "ngram:5×3"
    assert _kdist({"ngram:1": 3}, 1, {"16+": 2, "8-15": 1}) == "ngram:1×3 (explored 1; at 16+×2 8-15×1)"
    assert _kdist({"ngram:5": 3}, buckets={"1": 3}) == "ngram:5×3"  # one stream: no note
