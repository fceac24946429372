"""The lookup proposer: n-gram lookup and SuffixDecoding per request in one engine.

Built with the real pieces it wraps (vLLM's n-gram kernel, arctic-inference's suffix tree) and a
stand-in for vLLM's model runner (request ids, token buffer, sampling parameters)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from cluster.config import ConfigError, parse_config
from cluster.engine.lookup_proposer import LookupProposer, plan_drafts
from deployments.vllm_args import engine_kwargs, speculative_config
from cluster.speculation import EXTRA_ARGS_K, EXTRA_ARGS_MODE, SpecMode

MAX_LEN = 64


def vllm_config(k_max=4, ngram=True, suffix=None):
    return SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=k_max),
        model_config=SimpleNamespace(max_model_len=MAX_LEN),
        scheduler_config=SimpleNamespace(max_num_seqs=8),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        additional_config={"specserve": {"lookup": {"method": "ngram" if ngram else "suffix", "ngram": ngram,
                                                    "ngram_min": 1, "ngram_max": 3, "suffix": suffix or {}}}},
    )


class Runner:
    """What the proposer reads of vLLM's GPU/CPU model runner."""

    def __init__(self, seqs: dict[str, tuple[list[int], list[int]]], extra: dict[str, dict]):
        self.tokens = np.zeros((8, MAX_LEN), dtype=np.int32)
        self.set(seqs)
        self.requests = {r: SimpleNamespace(sampling_params=SimpleNamespace(extra_args=e)) for r, e in extra.items()}

    def set(self, seqs):
        ids = list(seqs)
        self.input_batch = SimpleNamespace(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                           token_ids_cpu=self.tokens, num_prompt_tokens=np.zeros(8, dtype=np.int32))
        self.lengths = np.zeros(8, dtype=np.int32)
        for i, (prompt, out) in enumerate(seqs.values()):
            seq = prompt + out
            self.tokens[i, :len(seq)] = seq
            self.lengths[i] = len(seq)
            self.input_batch.num_prompt_tokens[i] = len(prompt)


def step(proposer, runner, sampled):
    return proposer.propose(sampled, runner.lengths, runner.tokens)


def test_each_request_drafts_by_its_own_method_up_to_its_own_k():
    prompt = [5, 6, 7, 8, 9, 10, 11, 5, 6, 7]
    seqs = {"a": (prompt, [8]), "b": (prompt, [8]), "c": (prompt, [8])}
    extra = {"a": {EXTRA_ARGS_MODE: "ngram", EXTRA_ARGS_K: 2}, "b": {EXTRA_ARGS_MODE: "suffix", EXTRA_ARGS_K: 4},
             "c": {EXTRA_ARGS_MODE: "none", EXTRA_ARGS_K: 0}}
    p = LookupProposer(vllm_config())
    runner = Runner(seqs, extra)
    p.attach(runner)
    drafts = step(p, runner, [[8], [8], [8]])
    assert drafts[0] == [9, 10]  # prompt lookup: "7 8" continues "9 10 ..."
    assert drafts[1][:3] == [9, 10, 11] and len(drafts[1]) <= 4  # the prompt's suffix tree
    assert drafts[2] == []  # K = 0 drafts nothing
    assert p.status()["active_requests"] == 3  # every decoding request feeds the trees


def _second_request_after_first(p: LookupProposer, out: list[int]) -> Runner:
    """A first request decodes `out` token by token and leaves; a second one (mode suffix, K 6) has a
    new prompt and `out[:3]` so far."""
    runner = Runner({"first": ([1, 2, 3], [])}, {"first": {EXTRA_ARGS_MODE: "ngram", EXTRA_ARGS_K: 6}})
    p.attach(runner)
    for n in range(1, len(out) + 1):
        runner.set({"first": ([1, 2, 3], out[:n])})
        step(p, runner, [[out[n - 1]]])
    second = {EXTRA_ARGS_MODE: "suffix", EXTRA_ARGS_K: 6}
    runner.requests = {"second": SimpleNamespace(sampling_params=SimpleNamespace(extra_args=second))}
    runner.set({"second": ([9, 8, 7], out[:3])})  # the first left the batch: its output is cached
    return runner


def test_suffix_drafts_from_an_earlier_requests_output_that_ngram_cannot_see():
    """The global tree: a second request with a new prompt gets the first one's output as drafts."""
    p = LookupProposer(vllm_config(k_max=6))
    out = [40, 41, 42, 43, 44, 45, 46, 47]
    runner = _second_request_after_first(p, out)
    # A draft is at most max_spec_factor (1.0) x the matched length (3) long.
    assert step(p, runner, [[42]])[0] == [43, 44, 45]
    runner.requests["second"].sampling_params.extra_args = {EXTRA_ARGS_MODE: "ngram", EXTRA_ARGS_K: 6}
    assert step(p, runner, [[42]])[0] == []  # its own context has no earlier "42"


@pytest.mark.parametrize("offset,expected", [(2.0, [43, 44, 45, 46, 47]), (9.0, [43, 44, 45, 46, 47])])
def test_max_spec_offset_lengthens_suffix_drafts_past_the_match_up_to_the_output_it_knows(offset, expected):
    """The pool's `max_spec_offset` reaches the tree: match 3 + offset 2 drafts 5 tokens; a larger
    offset stops where the cached output ends (47), below the request's K of 6."""
    p = LookupProposer(vllm_config(k_max=6, suffix={"max_spec_offset": offset}))
    runner = _second_request_after_first(p, [40, 41, 42, 43, 44, 45, 46, 47])
    assert step(p, runner, [[42]])[0] == expected


def test_solo_knobs_apply_to_a_step_with_one_request_and_the_pools_knobs_to_a_shared_step():
    """`suffix.solo` drafts 2 past the match when the request is alone in the batch; with a batchmate
    the same request drafts by the pool's knobs (the match's length, 3)."""
    p = LookupProposer(vllm_config(k_max=6, suffix={"solo": {"max_spec_offset": 2.0, "min_token_prob": 0.1}}))
    runner = _second_request_after_first(p, [40, 41, 42, 43, 44, 45, 46, 47])
    assert step(p, runner, [[42]])[0] == [43, 44, 45, 46, 47]
    extra = {EXTRA_ARGS_MODE: "suffix", EXTRA_ARGS_K: 6}
    runner.requests["mate"] = SimpleNamespace(sampling_params=SimpleNamespace(extra_args=extra))
    runner.set({"second": ([9, 8, 7], [40, 41, 42]), "mate": ([3, 3, 3], [3])})
    assert step(p, runner, [[42], [3]])[0] == [43, 44, 45]


def test_forget_drops_finished_outputs_and_keeps_requests_in_flight():
    """After `forget` a new request no longer drafts from an earlier one's output; a request still
    decoding keeps its own tree."""
    p = LookupProposer(vllm_config(k_max=6))
    out = [40, 41, 42, 43, 44, 45]
    extra = {EXTRA_ARGS_MODE: "suffix", EXTRA_ARGS_K: 6}
    runner = Runner({"first": ([1, 2, 3], [])}, {"first": extra})
    p.attach(runner)
    for n in range(1, len(out) + 1):
        runner.set({"first": ([1, 2, 3], out[:n])})
        step(p, runner, [[out[n - 1]]])
    runner.requests = {"live": SimpleNamespace(sampling_params=SimpleNamespace(extra_args=extra))}
    runner.set({"live": ([40, 41, 42, 43, 40, 41], [42])})  # "first" left: its output is cached
    assert step(p, runner, [[42]])[0][:1] == [43]
    assert p.forget() == 1 and p.status()["cached_requests"] == 1  # only "live" is left
    runner.requests["new"] = runner.requests.pop("live")
    runner.set({"new": ([9, 8, 7], [40, 41, 42])})  # "live" left the batch, no step has run since
    assert p.forget() == 1 and p.status()["cached_requests"] == 0  # it goes too
    assert step(p, runner, [[42]])[0] == []  # no earlier output is left to draft from


def test_mid_prefill_and_the_context_end_draft_nothing_and_before_attach_ngram_drafts_for_all():
    assert plan_drafts(["suffix", "ngram"], [4, 4], [False, True], [10, MAX_LEN - 1], MAX_LEN).ks == (0, 0)
    p = LookupProposer(vllm_config())
    runner = Runner({"a": ([5, 6, 7, 5, 6], [])}, {})
    assert step(p, runner, [[6]]) == [[7, 5, 6]]  # n-gram, K_max = 4, the match runs 3 more tokens


def test_a_suffix_only_pool_drafts_every_request_from_the_tree():
    p = LookupProposer(vllm_config(ngram=False))
    runner = Runner({"a": ([5, 6, 7, 8, 5], [6])}, {"a": {EXTRA_ARGS_MODE: "ngram", EXTRA_ARGS_K: 2}})
    p.attach(runner)
    assert p.ngram is None and step(p, runner, [[6]]) == [[7, 8]]


def test_a_failing_lookup_costs_drafts_not_the_engine():
    p = LookupProposer(vllm_config())
    p.attach(SimpleNamespace())  # a runner without a batch
    assert step(p, Runner({"a": ([1, 2], [])}, {}), [[2]]) == [[]] and p.errors == 1


CONFIG = {"models": {"m": {"source": "hf:x/y"}}, "pools": {"ngram": {"model": "m", "method": "ngram", "max_k": 6, "suffix": {}}}}


def test_an_ngram_pool_with_suffix_serves_three_modes_in_one_engine_with_the_lookup_proposer():
    pool = parse_config(CONFIG).pools["ngram"]
    assert [m.value for m in pool.modes] == ["ngram", "suffix", "none"]
    assert speculative_config(pool, None) == {"method": "custom_class", "num_speculative_tokens": 16,
                                              "model": "cluster.engine.lookup_proposer.LookupProposer"}
    kw = engine_kwargs(pool, "/m", None, "m", cpu_build=True)
    assert kw["worker_extension_cls"] == "cluster.engine.lookup_proposer.LookupWorkerExtension"
    assert kw["additional_config"]["specserve"]["lookup"]["suffix"] == {
        "max_tree_depth": 24, "max_k": 16, "max_spec_factor": 1.0, "max_spec_offset": 0.0, "min_token_prob": 0.1,
        "max_cached_requests": 10000, "solo": None}
    plain = parse_config({**CONFIG, "pools": {"ngram": {"model": "m", "method": "ngram", "max_k": 6}}}).pools["ngram"]
    assert speculative_config(plain, None)["method"] == "ngram" and SpecMode.SUFFIX not in plain.modes


@pytest.mark.parametrize("pool,field", [
    ({"method": "eagle", "drafter": "m", "suffix": {}}, "suffix"),
    ({"method": "ngram", "suffix": {"min_token_prob": 2}}, "min_token_prob"),
    ({"method": "ngram", "suffix": {"max_spec_offset": -1}}, "max_spec_offset"),
    ({"method": "ngram", "suffix": {"solo": {"min_token_prob": 1.5}}}, "min_token_prob"),
    ({"method": "ngram", "suffix": {"solo": {"offset": 2}}}, "offset"),
    ({"method": "ngram", "suffix": {"prior_alpha": {"poetry": 0.5}}}, "poetry"),
    ({"method": "ngram", "suffix": {"tree_depth": 3}}, "tree_depth"),
    ({"method": "ngram", "suffix": {"prior_draft_rate": {"code": 1.5}}}, "prior_draft_rate"),
    ({"method": "ngram", "prior_draft_rate": {"poetry": 0.5}}, "poetry"),
])
def test_bad_suffix_settings_name_the_field(pool, field):
    with pytest.raises(ConfigError, match=field):
        parse_config({**CONFIG, "pools": {"p": {"model": "m", "max_k": 3, **pool}}})


def test_a_step_the_scheduler_allows_no_drafts_does_no_lookup():
    """The scheduler's bound on the step's drafts (vLLM passes it to its own proposers only) reaches
    this one through the runner's propose call: 0 above the pool's batch bound, so no lookup."""
    p = LookupProposer(vllm_config())
    runner = Runner({"a": ([5, 6, 7, 5], [6])}, {"a": {EXTRA_ARGS_MODE: "ngram", EXTRA_ARGS_K: 4}})
    runner.propose_draft_token_ids = lambda scheduler_output, *a: step(p, runner, [[6]])
    p.attach(runner)
    assert runner.propose_draft_token_ids(SimpleNamespace(num_spec_tokens_to_schedule=2)) == [[7, 5]]
    assert runner.propose_draft_token_ids(SimpleNamespace(num_spec_tokens_to_schedule=0)) == [[]]
    p.attach(runner)  # attaching again does not wrap twice
    assert runner.propose_draft_token_ids(SimpleNamespace(num_spec_tokens_to_schedule=4)) == [[7, 5, 6]]


def test_the_ngram_kernel_is_compiled_at_start_for_the_runners_argument_types():
    """vLLM's own start-up call drafts for no request, so numba would compile the lookup kernel on the
    first real lookup (about 1.2 s, stalling that step). In a fresh process (numba's compiled kernels
    are per process): one signature after construction, and a lookup with the runner's types adds none."""
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    here = Path(__file__)
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(here.parent)!r})
        from test_lookup_proposer import LookupProposer, Runner, step, vllm_config
        from vllm.v1.spec_decode.ngram_proposer import batch_propose_numba
        assert not batch_propose_numba.signatures, "compiled before the proposer was built"
        proposer = LookupProposer(vllm_config())
        assert len(batch_propose_numba.signatures) == 1, batch_propose_numba.signatures
        runner = Runner({{"a": ([5, 6, 7, 5, 6], [])}}, {{"a": None}})
        assert step(proposer, runner, [[6]]) == [[7, 5, 6]]
        assert len(batch_propose_numba.signatures) == 1, batch_propose_numba.signatures
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=str(here.parents[2]))
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
