"""The K replay: exact tokens per step of a K policy from a greedy output, priced with a run's own step times;
the suffix cache replay (`tools.bench.prior_alpha.SuffixReplay`)."""

from __future__ import annotations

import numpy as np
import pytest

from tools.bench.k_replay import (
    Case, GrowOnFullAccept, StaticK, analyse, auto_choices, grow_policies, ngram_proposer, replay, step_cost_by_k,
    step_time_by_drafts,
)
from tools.bench.metrics import Sample

# A prompt holding a 12-token span the output copies whole after 3 tokens of its own.
SPAN = list(range(100, 112))
PROMPT = [1, 2, 3] + SPAN + [4, 5]
OUTPUT = [7, 8, 100, 101] + SPAN[2:] + [9, 10, 11]


def test_the_vllm_matcher_drafts_the_copied_span():
    propose = ngram_proposer(2, 5)
    assert list(propose(np.array(PROMPT + [7, 100, 101]), 4)) == [102, 103, 104, 105]
    assert len(propose(np.array([1, 2, 3, 4]), 4)) == 0  # nothing repeats: no draft


@pytest.mark.parametrize("k", [1, 2, 3, 4, 6])
def test_static_replay_emits_the_output_exactly_once(k):
    steps = replay(PROMPT, OUTPUT, StaticK(k), ngram_proposer(2, 5))
    emitted = sum(s.accepted + 1 for s in steps)
    assert 0 <= emitted - (len(OUTPUT) - 1) <= 1  # the first token is the prefill's; the last step may stop early
    assert all(s.k == k and s.accepted <= s.drafted <= k for s in steps)


def test_a_longer_k_takes_fewer_steps_through_a_copy_run():
    propose = ngram_proposer(2, 5)
    n = {k: len(replay(PROMPT, OUTPUT, StaticK(k), propose)) for k in (0, 2, 4, 6)}
    assert n[0] == len(OUTPUT) - 1 and n[0] > n[2] > n[4] > n[6]


def test_growing_k_follows_the_run_and_resets_after_a_rejection():
    table = lambda ctx, k: np.array([5] * k, dtype=np.int32)  # noqa: E731 - always proposes 5s
    out = [0] + [5] * 9 + [6, 5]
    steps = replay([1], out, GrowOnFullAccept(1, 4), table)
    assert [s.k for s in steps] == [1, 2, 3, 4, 1, 2][:len(steps)]
    assert steps[3].accepted < steps[3].drafted  # the fourth step ran into the 6


def _sample(config, pid, task, repeat, steps, decode_s, k=None, mode=None):
    spec = {"steps": steps, **({"k": k, "mode": mode} if mode else {})}
    return Sample(phase="compare", config=config, prompt_id=pid, category=task, task=task, temperature=0.0,
                  concurrency=1, repeat=repeat, token_ids=[1] * 9, latency_s=decode_s + 0.1, ttft_s=0.1, spec=spec)


def test_step_cost_pairs_each_config_with_plain_decoding_of_the_same_prompt_and_repeat():
    samples = [_sample("none", "a", "qa", 0, 8, 0.8), _sample("none", "a", "qa", 1, 8, 1.6),  # repeat 1 is slower
               _sample("ngram:2", "a", "qa", 0, 4, 0.44), _sample("ngram:2", "a", "qa", 1, 4, 0.88),
               _sample("ngram:3", "b", "qa", 0, 4, 0.5)]  # no plain run of "b": not priced
    assert step_cost_by_k(samples, [2, 3]) == {0: 1.0, 2: pytest.approx(1.1)}


def test_hindsight_ceilings_bound_every_policy_and_auto_at_the_best_static_reads_one():
    cases = [Case("a", "qa", tuple(PROMPT), tuple(OUTPUT)), Case("b", "chat", (1, 2, 3, 4), (9, 8, 7, 6, 5, 4))]
    costs = {0: 1.0, 1: 1.05, 2: 1.0, 3: 1.02, 4: 1.03}
    r = analyse(cases, costs, ngram_proposer(2, 5), [GrowOnFullAccept(2, 4)])
    best = r["best_static"]
    ceil = r["ceilings"]
    assert ceil["per-prompt best K (hindsight)"] >= ceil["per-task best K (hindsight)"] >= 1.0
    assert 0.5 < ceil["grow 2..4 +1"] < 1.5
    again = analyse(cases, costs, ngram_proposer(2, 5), chosen={"a": [best, best], "b": [best]})
    assert again["ceilings"]["auto's chosen K, replayed"] == pytest.approx(1.0)
    worse = analyse(cases, costs, ngram_proposer(2, 5), chosen={"a": [0], "b": [0]})
    assert worse["ceilings"]["auto's chosen K, replayed"] < 1.0


def test_auto_choices_reads_the_mode_and_k_auto_ran():
    samples = [_sample("auto", "a", "qa", 0, 4, 0.4, k=4, mode="ngram"), _sample("auto", "a", "qa", 1, 8, 0.8, k=0, mode="none"),
               _sample("auto", "b", "qa", 0, 4, 0.4, k=2, mode="eagle"), _sample("ngram:4", "a", "qa", 0, 4, 0.4)]
    assert auto_choices(samples) == {"a": [4, 0]}


def test_step_time_by_drafts_recovers_a_cost_per_draft_count_that_is_not_linear_in_k():
    """Every step of `ngram:K` drafts K here (the proposer always offers K tokens), so each K's decode
    time fixes one draft count's step time; configs that are not none / ngram:K are left out."""
    table = lambda ctx, k: np.array([5] * k, dtype=np.int32)  # noqa: E731
    out = [0] + [5, 5, 6] * 8  # every third token rejects the drafts
    case = Case("a", "qa", (1,), tuple(out))
    true = {0: 1.0, 1: 1.2, 2: 1.0, 3: 1.02, 6: 1.3}  # K = 1 and 6 dear, as measured here
    samples = []
    for k, c in true.items():
        steps = replay(case.prompt_ids, case.output_ids, StaticK(k), table)
        assert all(s.drafted == k for s in steps)
        samples.append(_sample("none" if k == 0 else f"ngram:{k}", "a", "qa", 0, len(steps), 0.07 * c * len(steps)))
    samples.append(_sample("auto", "a", "qa", 0, 3, 9.0, k=2, mode="ngram"))
    got = step_time_by_drafts(samples, [case], table)
    assert got == {d: pytest.approx(c) for d, c in true.items()}
    assert step_time_by_drafts([], [case], table) == {}


def test_growing_k_policies_are_built_only_where_every_k_was_priced():
    assert [p.name for p in grow_policies({0: 1, 2: 1, 3: 1, 4: 1})] == [
        "grow 2..4 +1", "grow 2..4 +2", "grow 3..4 +1", "grow 3..4 +2"]
    assert grow_policies({0: 1, 1: 1, 3: 1}) == []  # no K = 2: nothing grows from 2; 3 is the top


def test_a_growing_policy_is_replayed_and_priced_by_drafts_on_request():
    """The copy run of case "a" takes fewer steps when K = 1 grows by 2 up to 4; pricing by drafts,
    where a 3- or 4-draft step costs double, takes part of that back."""
    cases = [Case("a", "qa", tuple(PROMPT), tuple(OUTPUT))]
    costs = {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0}
    grow = GrowOnFullAccept(1, 4, 2)
    flat = analyse(cases, costs, ngram_proposer(2, 5), [grow])["ceilings"][grow.name]
    dear = analyse(cases, costs, ngram_proposer(2, 5), [grow],
                   by_drafts={0: 1.0, 1: 1.0, 2: 1.0, 3: 2.0, 4: 2.0})["ceilings"][grow.name]
    assert dear < flat


def _suffix_replay(offset: float = 0.0):
    from types import SimpleNamespace

    from tools.bench.prior_alpha import SuffixReplay

    knobs = SimpleNamespace(max_tree_depth=24, max_cached_requests=100, max_spec_factor=1.0,
                            max_spec_offset=offset, min_token_prob=0.1)
    return SuffixReplay(knobs)


def test_the_suffix_replay_drafts_a_second_request_from_the_first_ones_answer():
    rng = np.random.default_rng(0)
    prompt, answer = list(rng.integers(500, 900, 20)), list(rng.integers(1000, 1400, 40))  # nothing repeats
    suffix = _suffix_replay()
    first, second = suffix.steps(prompt, answer, 16), suffix.steps(prompt, answer, 16)
    for steps in (first, second):
        assert 0 <= sum(s.accepted + 1 for s in steps) - (len(answer) - 1) <= 1
    assert sum(s.accepted for s in first) == 0  # a fresh cache holds no answer to draft from
    assert len(second) <= len(first) // 4  # the global tree drafts the remembered answer in long runs


def test_the_suffix_replay_passes_max_spec_offset_on():
    # The answer copies the prompt from its third token: after a one-token match a draft is capped
    # at max_spec_factor x 1 + max_spec_offset tokens.
    prompt, answer = [1, 2, 3, 4, 5, 6, 7, 8, 9], [3, 4, 5, 6, 7, 8, 9, 1]
    plain, offset = _suffix_replay(0.0).steps(prompt, answer, 16), _suffix_replay(4.0).steps(prompt, answer, 16)
    assert (plain[0].drafted, offset[0].drafted) == (1, 5)


def test_replay_cut_counts_every_token_and_a_stricter_cut_drafts_no_more():
    from tools.bench.prior_alpha import replay_cut

    rng = np.random.default_rng(1)
    common = list(rng.integers(1000, 1400, 30))
    rows = [(f"p{i}", list(rng.integers(500, 900, 12)), common + list(rng.integers(1400, 1800, 10)))
            for i in range(4)]  # answers share a head, so later requests draft from earlier ones
    loose, strict = replay_cut(rows, 0.1), replay_cut(rows, 0.99)
    assert loose[0] > 1.2 and 0 < loose[2] <= 1  # drafts from remembered answers pay
    assert strict[1] <= loose[1]
    # one fresh request has nothing to draft from: prefill gives the first token, a step each of the other 39
    assert replay_cut(rows[:1], 0.1, seeds=(0,)) == (40 / 39, 0.0, 0.0)
