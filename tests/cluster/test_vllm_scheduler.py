import pytest

from cluster.speculation import EXTRA_ARGS_K
from cluster.engine.draft_gate import DraftGate
from cluster.engine.vllm_scheduler import requested_k


@pytest.mark.parametrize(
    "extra, k_max, want",
    [(None, 6, 6), ({}, 6, 6), ({EXTRA_ARGS_K: 2}, 6, 2), ({EXTRA_ARGS_K: 0}, 6, 0),
     ({EXTRA_ARGS_K: 9}, 6, 6), ({EXTRA_ARGS_K: -3}, 6, 0), ({EXTRA_ARGS_K: "x"}, 6, 0),
     ({EXTRA_ARGS_K: "3"}, 6, 3)],
)
def test_requested_k(extra, k_max, want):
    assert requested_k(extra, k_max) == want


def test_scheduler_class_resolves_for_vllm():
    from vllm.v1.core.sched.scheduler import Scheduler

    from cluster.engine import vllm_scheduler

    assert issubclass(vllm_scheduler.PerRequestKScheduler, Scheduler)


# -- the scheduler's wiring ---------------------------------------------------------------------------

class _Req:
    def __init__(self, extra):
        from types import SimpleNamespace

        self.sampling_params = SimpleNamespace(extra_args=extra)


def _scheduler(monkeypatch, requests: dict):
    """The engine's scheduler over `requests` (all running, K_max 6) with vLLM's own scheduling and
    bookkeeping stubbed out: what is left is specserve's wiring around them."""
    from types import SimpleNamespace

    from vllm.v1.core.sched.scheduler import Scheduler

    from cluster.engine import vllm_scheduler

    monkeypatch.setattr(Scheduler, "update_draft_token_ids", lambda self, d: None)
    monkeypatch.setattr(Scheduler, "update_from_output", lambda self, so, mo: {})
    monkeypatch.setattr(Scheduler, "schedule", lambda self, *a, **kw: SimpleNamespace(
        num_spec_tokens_to_schedule=6, num_scheduled_tokens={}, scheduled_spec_decode_tokens={}))
    cls = vllm_scheduler.PerRequestKScheduler
    sched = cls.__new__(cls)
    sched.requests, sched.running, sched.num_spec_tokens = requests, list(requests.values()), 6
    sched.start_state({})  # no batch bound, the gate not learning
    return sched


def _step(sched, accepted: dict[str, int], offered_n: int = 6) -> dict[str, int]:
    """One engine step over every request of `sched`: schedule, the proposer offers `offered_n`
    drafts to each, the scheduler trims them, then the step is judged with `accepted` drafts each.
    Returns the K each request was given."""
    from types import SimpleNamespace

    sched.schedule()
    ids = list(sched.requests)
    offered = SimpleNamespace(req_ids=ids, draft_token_ids=[list(range(offered_n)) for _ in ids])
    sched.update_draft_token_ids(offered)
    kept = dict(zip(ids, offered.draft_token_ids))
    sched.update_from_output(SimpleNamespace(scheduled_spec_decode_tokens=kept),
                             SimpleNamespace(req_id_to_index={r: i for i, r in enumerate(ids)},
                                             sampled_token_ids=[[0] * (min(accepted[r], len(kept[r])) + 1) for r in ids]))
    return {r: len(kept[r]) for r in ids}


def test_per_step_k_follows_each_requests_acceptance(monkeypatch):
    """A per-step-K request drafts deep while its drafts are accepted and shallow once they are
    not; a fixed-K request beside it keeps its K whatever happens."""
    sched = _scheduler(monkeypatch, {"copy": _Req({"specserve_k": 6, "specserve_k_step": 0.5}),
                                     "fixed": _Req({"specserve_k": 2})})
    first = _step(sched, {"copy": 6, "fixed": 0})
    assert first["fixed"] == 2 and 1 <= first["copy"] <= 6
    for _ in range(4):
        ks = _step(sched, {"copy": 6, "fixed": 0})
    assert ks == {"copy": 6, "fixed": 2}  # every draft accepted: the whole ceiling
    for _ in range(6):
        ks = _step(sched, {"copy": 0, "fixed": 2})
    assert ks["fixed"] == 2 and ks["copy"] < first["copy"]  # every draft rejected: fewer drafts


def test_a_fixed_k_is_kept_at_every_step_whatever_the_batch_and_the_acceptance(monkeypatch):
    """A caller's K is the whole rule for its request: the same K in a batch of 16 under a cost
    where drafts do not pay, after every draft was rejected, bounded only by the drafts found."""
    reqs = {f"r{i}": _Req({"specserve_k": 3}) for i in range(16)}
    sched = _scheduler(monkeypatch, reqs)
    for b in (1, 4, 16):
        for d in (0, 4, 16):
            for _ in range(30):
                sched.step_cost.observe(b, d, 0.05 + 0.01 * b + 0.01 * d + (0.005 if d else 0.0))
    for _ in range(5):
        assert set(_step(sched, {r: 0 for r in reqs}).values()) == {3}
    assert set(_step(sched, {r: 0 for r in reqs}, offered_n=2).values()) == {2}


def test_per_step_k_never_exceeds_the_ceiling_or_the_drafts_found(monkeypatch):
    sched = _scheduler(monkeypatch, {"r": _Req({"specserve_k": 3, "specserve_k_step": 1.0})})
    assert _step(sched, {"r": 6})["r"] == 3
    assert _step(sched, {"r": 6}, offered_n=1)["r"] == 1


def test_per_step_k_drops_drafts_when_the_step_cost_says_the_batch_pays_for_them(monkeypatch):
    """With a measured cost where a draft token costs as much as a whole request (a saturated
    CPU), 16 requests at a middling acceptance verify no drafts; the same request alone, where the
    step's fixed cost dominates, does."""
    reqs = {f"r{i}": _Req({"specserve_k": 6, "specserve_k_step": 0.5}) for i in range(16)}
    sched = _scheduler(monkeypatch, reqs)
    for b in (1, 4, 16):
        for d in (0, 4, 16):
            for _ in range(30):
                sched.step_cost.observe(b, d, 0.05 + 0.01 * b + 0.01 * d + (0.005 if d else 0.0))
    assert set(_step(sched, {r: 0 for r in reqs}).values()) == {0}
    alone = _scheduler(monkeypatch, {"r": _Req({"specserve_k": 6, "specserve_k_step": 0.5})})
    alone.step_cost = sched.step_cost
    assert _step(alone, {"r": 0})["r"] >= 1


def test_decode_steps_feed_the_step_cost_and_prefill_steps_do_not(monkeypatch):
    from types import SimpleNamespace

    from vllm.v1.core.sched.scheduler import Scheduler

    sched = _scheduler(monkeypatch, {"r": _Req({"specserve_k": 6, "specserve_k_step": 0.5})})
    shapes = iter([({"r": 300}, {}), ({"r": 3}, {"r": [1, 2]}), ({"r": 1}, {})])

    def schedule(self, *a, **kw):
        n, spec = next(shapes)
        return SimpleNamespace(num_spec_tokens_to_schedule=6, num_scheduled_tokens=n, scheduled_spec_decode_tokens=spec)

    monkeypatch.setattr(Scheduler, "schedule", schedule)
    empty = (SimpleNamespace(scheduled_spec_decode_tokens={}), SimpleNamespace(req_id_to_index={}, sampled_token_ids=[]))
    for _ in range(3):
        sched.schedule()
        sched.update_from_output(*empty)
    assert sched.step_cost.steps == 2  # the prefill step was not a decode step


def test_above_the_pools_batch_bound_per_step_k_requests_neither_draft_nor_ask_the_proposer(monkeypatch):
    """`step_k_max_batch`: in a larger batch the per-step-K requests verify nothing and, with no
    fixed-K request beside them, the proposer is asked for no drafts (the engine decodes plainly);
    a caller's fixed K is kept; at or below the bound the per-step choice decides again."""
    reqs = {f"r{i}": _Req({"specserve_k": 6, "specserve_k_step": 0.9}) for i in range(5)}
    sched = _scheduler(monkeypatch, reqs)
    sched.gate = DraftGate(prior_max_batch=4, explore=0.0)
    assert sched.schedule().num_spec_tokens_to_schedule == 0
    assert set(_step(sched, {r: 6 for r in reqs}).values()) == {0}
    sched.running = sched.running[:4]
    assert sched.schedule().num_spec_tokens_to_schedule == 6
    assert max(_step(sched, {r: 6 for r in reqs}).values()) >= 1
    mixed = _scheduler(monkeypatch, {**reqs, "fixed": _Req({"specserve_k": 2})})
    mixed.gate = DraftGate(prior_max_batch=4, explore=0.0)
    assert mixed.schedule().num_spec_tokens_to_schedule == 2
    ks = _step(mixed, {r: 2 for r in mixed.requests})
    assert ks["fixed"] == 2 and all(ks[r] == 0 for r in reqs)


def test_suffix_requests_keep_the_drafts_their_tree_found_up_to_the_ceiling_and_the_batch_bound(monkeypatch):
    """A suffix-mode request's drafts stop where its tree's match does (self-limiting), so the
    per-step choice keeps them whole even at a low class α, where an n-gram request beside it with
    the same α and drafts is cut; above `step_k_max_batch` it drafts nothing, as every per-step-K
    request."""
    reqs = {"suffix": _Req({"specserve_k": 16, "specserve_k_step": 0.3, "specserve_mode": "suffix"}),
            "ngram": _Req({"specserve_k": 16, "specserve_k_step": 0.3, "specserve_mode": "ngram"})}
    sched = _scheduler(monkeypatch, reqs)
    sched.num_spec_tokens = 16
    ks = _step(sched, {"suffix": 0, "ngram": 0}, offered_n=12)
    assert ks["suffix"] == 12 and ks["ngram"] < 12
    ks = _step(sched, {"suffix": 0, "ngram": 0}, offered_n=12)  # rejected last step: still whole
    assert ks["suffix"] == 12
    capped = _scheduler(monkeypatch, {"suffix": _Req({"specserve_k": 4, "specserve_k_step": 0.3, "specserve_mode": "suffix"})})
    assert _step(capped, {"suffix": 4}, offered_n=12)["suffix"] == 4  # the router's K stays a ceiling
    sched.gate = DraftGate(prior_max_batch=1, explore=0.0)
    assert set(_step(sched, {"suffix": 0, "ngram": 0}, offered_n=12).values()) == {0}


def _decode_step(monkeypatch, sched, scheduled: dict[str, int], spec: dict[str, list], sampled: dict[str, int]):
    """One step as the engine core runs it, with `scheduled` tokens per request (1 + drafts) and
    `sampled` tokens per request; returns the `schedule` output."""
    from types import SimpleNamespace

    from vllm.v1.core.sched.scheduler import Scheduler

    monkeypatch.setattr(Scheduler, "schedule", lambda self, *a, **kw: SimpleNamespace(
        num_spec_tokens_to_schedule=6, num_scheduled_tokens=scheduled, scheduled_spec_decode_tokens=spec))
    out = sched.schedule()
    ids = list(scheduled)
    sched.update_from_output(SimpleNamespace(scheduled_spec_decode_tokens=spec),
                             SimpleNamespace(req_id_to_index={r: i for i, r in enumerate(ids)},
                                             sampled_token_ids=[[0] * sampled[r] for r in ids]))
    return out


def test_the_gate_learns_from_each_decode_step_under_the_arm_that_governed_it(monkeypatch):
    """A decode step is measured for the arm the gate chose when its drafts were trimmed (the
    schedule before it), with the tokens it sampled; prefill steps, steps with a caller's drafts and
    steps with no request the gate governs teach it nothing."""
    reqs = {"a": _Req({"specserve_k": 6, "specserve_k_step": 0.5}), "b": _Req({"specserve_k": 6, "specserve_k_step": 0.5}),
            "fixed": _Req({"specserve_k": 2})}
    sched = _scheduler(monkeypatch, reqs)
    sched.gate = DraftGate(prior_max_batch=2, explore=0.0)  # 3 running: plain from the first schedule on
    assert sched._draft_next is True
    _decode_step(monkeypatch, sched, {"a": 3, "b": 1}, {"a": [7, 8]}, {"a": 3, "b": 1})  # verified under the draft arm
    _decode_step(monkeypatch, sched, {"a": 1, "b": 1}, {}, {"a": 1, "b": 1})  # under the plain arm the last schedule chose
    _decode_step(monkeypatch, sched, {"a": 300, "b": 1}, {}, {"a": 1, "b": 1})  # a prefill
    _decode_step(monkeypatch, sched, {"a": 1, "fixed": 3}, {"fixed": [1, 2]}, {"a": 1, "fixed": 3})  # a caller's drafts
    _decode_step(monkeypatch, sched, {"fixed": 1}, {}, {"fixed": 1})  # nothing the gate governs
    (row,) = sched.gate.table()
    assert row["batch"] == "2-3"
    assert row["draft"]["steps"] == 1 and row["plain"]["steps"] == 1  # (the other arm's evidence fades a little)
    assert round(sched.gate.arms[(1, True)].tokens) == 4 and round(sched.gate.arms[(1, False)].tokens) == 2


def test_where_the_gate_measured_drafting_faster_a_batch_above_the_bound_drafts(monkeypatch):
    """Above the pool's bound, once drafting measured faster there, the per-step-K requests verify
    drafts again and the proposer is asked for them; where plain decoding measured faster, they
    do not."""
    reqs = {f"r{i}": _Req({"specserve_k": 6, "specserve_k_step": 0.95}) for i in range(5)}
    for faster, drafts in ((True, True), (False, False)):
        sched = _scheduler(monkeypatch, reqs)
        sched.gate = DraftGate(prior_max_batch=4, explore=0.2)
        for _ in range(300):
            sched.gate.observe(5, True, 12 if faster else 4, 0.1)
            sched.gate.observe(5, False, 5, 0.1)
        asked = [sched.schedule().num_spec_tokens_to_schedule for _ in range(20)]
        ks = _step(sched, {r: 6 for r in reqs})
        assert (min(asked) == 6) if drafts else (max(asked) == 0), (faster, asked)
        assert (max(ks.values()) >= 1) if drafts else (set(ks.values()) == {0}), (faster, ks)
