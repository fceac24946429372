import pytest

from cluster.speculation import EXTRA_ARGS_K
from cluster.engine.draft_gate import DraftGate
from cluster.engine.vllm_scheduler import effective_k, k_cap_for_batch, requested_k

TABLE = [(1, 6), (4, 3), (16, 0)]


@pytest.mark.parametrize("batch, cap", [(1, 6), (3, 6), (4, 3), (15, 3), (16, 0), (500, 0)])
def test_cap_table_lookup(batch, cap):
    assert k_cap_for_batch(batch, TABLE) == cap


def test_cap_table_absent_or_starting_late():
    assert k_cap_for_batch(3, None) is None
    assert k_cap_for_batch(3, []) is None
    assert k_cap_for_batch(1, [(2, 1)]) is None


@pytest.mark.parametrize(
    "extra, k_max, want",
    [(None, 6, 6), ({}, 6, 6), ({EXTRA_ARGS_K: 2}, 6, 2), ({EXTRA_ARGS_K: 0}, 6, 0),
     ({EXTRA_ARGS_K: 9}, 6, 6), ({EXTRA_ARGS_K: -3}, 6, 0), ({EXTRA_ARGS_K: "x"}, 6, 0),
     ({EXTRA_ARGS_K: "3"}, 6, 3)],
)
def test_requested_k(extra, k_max, want):
    assert requested_k(extra, k_max) == want


@pytest.mark.parametrize(
    "k, k_max, batch, table, want",
    [(4, 6, 1, None, 4), (4, 6, 8, TABLE, 3), (4, 6, 20, TABLE, 0), (9, 6, 1, None, 6), (2, 6, 8, TABLE, 2),
     (0, 6, 1, TABLE, 0), (5, 6, 2, [(1, -1)], 0)],
)
def test_effective_k(k, k_max, batch, table, want):
    assert effective_k(k, k_max, batch, table) == want


def test_scheduler_class_resolves_for_vllm():
    from vllm.v1.core.sched.scheduler import Scheduler

    from cluster.engine import vllm_scheduler

    assert issubclass(vllm_scheduler.PerRequestKScheduler, Scheduler)


@pytest.mark.parametrize(
    "extra, want",
    [(None, None), ({}, None), ({"specserve_k_cap": [[1, 4], [8, 1]]}, [(1, 4), (8, 1)]),
     ({"specserve_k_cap": [[8, 1], [1, 4]]}, [(1, 4), (8, 1)]), ({"specserve_k_cap": "x"}, None),
     ({"specserve_k_cap": [[0, 4]]}, None), ({"specserve_k_cap": [[1, -2]]}, None),
     ({"specserve_k_cap": [["a", 1]]}, None), ({"specserve_k_cap": [[1, 1]] * 65}, None)],
)
def test_cap_table_from_request(extra, want):
    from cluster.engine.vllm_scheduler import cap_table_from

    assert cap_table_from(extra) == want


# -- K growing within a request ---------------------------------------------------------------------

@pytest.mark.parametrize(
    "extra, want",
    [(None, None), ({}, None), ({"specserve_k_grow": [2, 5]}, (2, 5)), ({"specserve_k_grow": (1, 6)}, (1, 6)),
     ({"specserve_k_grow": [0, 5]}, None), ({"specserve_k_grow": [2, 0]}, None), ({"specserve_k_grow": [2]}, None),
     ({"specserve_k_grow": "2,5"}, None), ({"specserve_k_grow": [2, "x"]}, None), ({"specserve_k_grow": [-1, 5]}, None)],
)
def test_growth_from_request(extra, want):
    from cluster.engine.vllm_scheduler import growth_from

    assert growth_from(extra) == want


@pytest.mark.parametrize(
    "k_state, k_base, batch, table, want",
    [(5, 3, 1, [(1, 3)], 5),  # the first entry caps admissions, not growth
     (5, 3, 1, [(1, 3), (4, 2)], 5), (5, 3, 4, [(1, 3), (4, 2)], 2),  # a load cap binds a grown K too
     (3, 3, 1, [(1, 2)], 2),  # not grown: the whole table, as before
     (9, 3, 1, None, 6),  # K_max bounds it
     (5, 3, 16, [(1, 6), (16, 0)], 0)],
)
def test_grown_effective_k(k_state, k_base, batch, table, want):
    from cluster.engine.vllm_scheduler import grown_effective_k

    assert grown_effective_k(k_state, k_base, 6, batch, table) == want


def test_next_k_follows_the_replays_growing_policy():
    """The engine's rule is the one `tools.bench.k_replay` priced (GrowOnFullAccept): over random
    step outcomes, the two give the same K sequence."""
    import random

    from tools.bench.k_replay import GrowOnFullAccept, Step
    from cluster.engine.vllm_scheduler import next_k

    rng = random.Random(7)
    for base, up, top in [(1, 2, 5), (3, 2, 5), (2, 1, 6), (4, 2, 6)]:
        pol, state, k = GrowOnFullAccept(base, top, up), GrowOnFullAccept(base, top, up).start(), base
        for _ in range(300):
            drafted = rng.choice([0, k, k, k, max(k - 1, 0)])
            accepted = rng.choice([drafted, drafted, rng.randint(0, drafted)])
            state = pol.update(state, Step(k, drafted, accepted))
            k = next_k(k, k, base, (up, top), drafted, accepted)
            assert k == state


def test_next_k_edges():
    from cluster.engine.vllm_scheduler import next_k

    assert next_k(0, 0, 0, (2, 5), 0, 0) == 0  # K = 0 drafts nothing and stays
    assert next_k(2, 2, 3, (2, 5), 2, 2) == 4  # a load cap had cut it to 2: grow from what ran
    assert next_k(2, 2, 3, (2, 5), 2, 1) == 3  # ... and a rejection resets to the admitted K
    assert next_k(5, 5, 3, (2, 5), 5, 9) == 5  # accepted beyond drafted (never from vLLM): full


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
    sched.start_state({})  # no cap table, no batch bound, the gate not learning
    return sched


def test_scheduler_trims_to_the_grown_k_step_by_step(monkeypatch):
    """The wiring: drafts are trimmed to the request's current K, and the K state follows what vLLM
    scheduled and sampled in each step (vLLM's own bookkeeping is stubbed out here; the real engine
    runs it in tests/e2e/test_foundation.py)."""
    from types import SimpleNamespace

    sched = _scheduler(monkeypatch, {"g": _Req({"specserve_k": 2, "specserve_k_grow": [2, 5]}),
                                     "f": _Req({"specserve_k": 2})})

    def step(accepted_g, accepted_f):
        # As in vLLM: schedule, run (the proposer drafts what schedule asked for, for the next
        # step), judge the step, then hand the drafts over to be trimmed and verified next step.
        n = sched.schedule().num_spec_tokens_to_schedule
        offered = SimpleNamespace(req_ids=["g", "f"], draft_token_ids=[list(range(n)), list(range(n))])
        sched.update_draft_token_ids(offered)
        kept = dict(zip(offered.req_ids, offered.draft_token_ids))
        so = SimpleNamespace(scheduled_spec_decode_tokens=kept)
        mo = SimpleNamespace(req_id_to_index={"g": 0, "f": 1},
                             sampled_token_ids=[[0] * (accepted_g + 1), [0] * (accepted_f + 1)])
        sched.update_from_output(so, mo)
        return len(kept["g"]), len(kept["f"])

    assert step(2, 2) == (2, 2)  # both accept their full K = 2; only "g" grows
    assert sched.schedule().num_spec_tokens_to_schedule == 5  # "g" may be at 4 + 2 -> top 5 next
    assert step(4, 2) == (4, 2)
    assert step(1, 2) == (5, 2)  # 4 + 2 capped at the top 5; "g" rejects at its 2nd draft
    assert step(0, 0) == (2, 2)  # back to the admitted K
    assert sched.schedule().num_spec_tokens_to_schedule == 4  # drafts for "g" at 2 + 2


def test_the_proposer_drafts_for_the_k_a_growing_request_may_have_next(monkeypatch):
    """The order of a vLLM step: drafts proposed during step t (as many as `schedule` asked for at
    t) are verified at t + 1, after t's outcome moved the K. Drafting only for the K before that
    outcome gave every grown step the old K's drafts, read as a short match: nothing grew (the
    first A/B). Here the proposer drafts exactly `num_spec_tokens_to_schedule` and K still grows."""
    from types import SimpleNamespace

    sched = _scheduler(monkeypatch, {"g": _Req({"specserve_k": 1, "specserve_k_grow": [2, 5]})})
    verified, pending = [], None
    for _ in range(5):  # a long copy: every draft is accepted
        n = sched.schedule().num_spec_tokens_to_schedule
        if pending is not None:  # step t verifies the drafts kept after t - 1
            verified.append(len(pending))
            sched.update_from_output(SimpleNamespace(scheduled_spec_decode_tokens={"g": pending}),
                                     SimpleNamespace(req_id_to_index={"g": 0}, sampled_token_ids=[[0] * (len(pending) + 1)]))
        offered = SimpleNamespace(req_ids=["g"], draft_token_ids=[list(range(n))])
        sched.update_draft_token_ids(offered)
        pending = offered.draft_token_ids[0]
    assert verified == [1, 3, 5, 5]


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
