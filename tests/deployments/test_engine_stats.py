from tests.paths import LOCAL_CPU
from types import SimpleNamespace

from cluster.config import load_config
from deployments.engine import engine_kwargs, speculative_config, stats_from_output
from pathlib import Path
from tests.paths import LOCAL_CPU

CFG = load_config(LOCAL_CPU)


def metrics(hist, drafted, per_step_drafted=()):
    return SimpleNamespace(histogram=hist, num_draft_tokens=drafted, per_step_drafted=list(per_step_drafted))


def test_no_speculation():
    s = stats_from_output("none", 0, 10, None)
    assert (s.steps, s.spec_steps, s.drafted, s.accepted) == (9, 0, 0, 0)
    assert s.acceptance_length == 1.0


def test_histogram_to_counts():
    # 5 spec steps: accepted 0,1,2,2,3 of K=3 -> accepted 8; 20 tokens -> 19 after the first.
    m = metrics([1, 1, 2, 1], 15, [3, 3, 3, 3, 3])
    s = stats_from_output("ngram", 3, 20, m)
    assert s.spec_steps == 5 and s.accepted == 8 and s.drafted == 15
    assert s.steps == 19 - 8
    assert s.accepted_per_position == [4, 3, 1]
    assert s.drafted_per_position == [5, 5, 5]
    assert abs(s.acceptance_length - (1 + 8 / 11)) < 1e-9


def test_stop_inside_accepted_run_caps_accepted():
    # 3 steps each accepting 4 of K=4 would give 15 tokens after the first; EOS cut it to 13.
    s = stats_from_output("ngram", 4, 14, metrics([0, 0, 0, 0, 3], 12, [4, 4, 4]))
    assert s.accepted == 13 - 3 and s.steps == 3
    assert abs(s.acceptance_length - (1 + 10 / 3)) < 1e-9


def test_short_drafts_per_position():
    s = stats_from_output("ngram", 4, 10, metrics([1, 1, 0, 0, 0], 3, [2, 1]))
    assert s.drafted_per_position == [2, 1, 0, 0]


def test_accepted_runs_from_the_ordered_steps():
    # K = 4: a copy of 12 (full, full, 2), a rejection at once, then 1 accepted of 4.
    m = metrics([1, 1, 1, 0, 2], 20, [4, 4, 4, 4, 4])
    m.per_step_accepted = [4, 4, 2, 0, 1]
    s = stats_from_output("ngram", 4, 20, m)
    assert s.run_lengths == [1, 1] + [0] * 10 + [1]
    m.per_step_accepted = [4, 4]  # lists that do not pair up step by step are not trusted
    assert stats_from_output("ngram", 4, 20, m).run_lengths == []
    assert stats_from_output("ngram", 4, 20, metrics([1, 1, 1, 0, 2], 20, [4] * 5)).run_lengths == []


def test_accepted_runs_edges():
    from cluster.speculation import RUN_CAP, accepted_runs
    assert accepted_runs([], []) == [] and accepted_runs([0, 0], [3, 3]) == [2]
    assert accepted_runs([3], [3]) == [0, 0, 0, 1]  # a run cut by the request's end: no bonus counted
    assert accepted_runs([3, 0], [3, 0]) == [0, 0, 0, 1]  # ... or by a step that drafts nothing
    assert accepted_runs([2, 9], [2, 3]) == [0, 0, 0, 0, 0, 0, 1]  # accepted beyond drafted is clamped
    assert accepted_runs([6] * 10, [6] * 10) == [0] * RUN_CAP + [1]  # longer than the cap: counted at it


def test_speculative_config_per_method():
    plain_ngram = CFG.pools["ngram"].model_copy(update={"suffix": None})
    assert speculative_config(plain_ngram, None) == {
        "method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 1, "prompt_lookup_max": 5}
    assert speculative_config(CFG.pools["ngram"], None) == {  # with suffix: both, in specserve's proposer
        "method": "custom_class", "num_speculative_tokens": 16, "model": "cluster.engine.lookup_proposer.LookupProposer"}
    assert speculative_config(CFG.pools["draft"], "/d") == {"method": "eagle", "num_speculative_tokens": 3,
                                                            "model": "/d"}


def test_engine_kwargs_pool_overrides_win():
    kw = engine_kwargs(CFG.pools["ngram"], "/m", None, "smollm2-135m", "float32")
    assert kw["scheduler_cls"] == "cluster.engine.vllm_scheduler.PerRequestKScheduler"
    assert kw["async_scheduling"] is False and kw["enforce_eager"] is True and kw["max_num_seqs"] == 64
    assert kw["dtype"] == "float32"
    assert kw["trust_remote_code"] is False  # only the model's own setting turns it on
    assert engine_kwargs(CFG.pools["ngram"], "/m", None, "m", trust_remote_code=True)["trust_remote_code"] is True


def test_engine_kwargs_platform_cpu_build_has_no_chunked_prefill():
    """The CPU build: no chunked prefill (a split seeded prompt kills the engine core), a budget that
    holds a whole max_model_len prompt plus draft slots; the GPU build: vLLM's defaults; a pool's
    own engine_kwargs still win (and max_model_len is read after them)."""
    pool = CFG.pools["ngram"]
    cpu = engine_kwargs(pool, "/m", None, "m", cpu_build=True)
    assert cpu["enable_chunked_prefill"] is False and cpu["max_num_batched_tokens"] > pool.max_model_len
    gpu = engine_kwargs(pool, "/m", None, "m", cpu_build=False)
    assert "enable_chunked_prefill" not in gpu and "max_num_batched_tokens" not in gpu
    own = pool.model_copy(update={"engine_kwargs": {**pool.engine_kwargs, "max_model_len": 4096,
                                                    "enable_chunked_prefill": True}})
    kw = engine_kwargs(own, "/m", None, "m", cpu_build=True)
    assert kw["enable_chunked_prefill"] is True and kw["max_num_batched_tokens"] > 4096
