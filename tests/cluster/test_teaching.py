"""What traffic teaches the tuner (`cluster.policy.teaching`): the rule, client identity and the budget."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from cluster.api.types import GenerateRequest
from cluster.config import RouterConfig
from cluster.policy.decision import Decision
from cluster.speculation import WORKLOAD_CLASSES, SpecMode
from cluster.policy.teaching import (EXCLUSION_REASONS, MAX_CLIENTS, OTHERS, ClientBudget, Lesson, Teacher, client_id,
                                     teaches_tuner)

OK = Lesson(decided_by="policy", k=3, classified="code", class_hint=None, temperature=0.0, ignore_eos=False)


# -- the rule ------------------------------------------------------------------------------------------

def test_router_decided_greedy_unhinted_traffic_teaches():
    for decided_by, t in itertools.product(("policy", "default"), (0.0, 0.3, 0.7, 1.0)):
        assert teaches_tuner(replace(OK, decided_by=decided_by, temperature=t), 1.0) is None


@pytest.mark.parametrize("k", [1, 2, 3, 6, 16])
def test_a_k_the_caller_chose_teaches_nothing(k):
    assert teaches_tuner(replace(OK, decided_by="request", k=k), 1.0) == "caller_mode"


def test_a_callers_plain_decoding_teaches_it_drafts_nothing():
    assert teaches_tuner(replace(OK, decided_by="request", k=0), 1.0) is None
    # ... but not past the other rules
    assert teaches_tuner(replace(OK, decided_by="request", k=0, ignore_eos=True), 1.0) == "ignore_eos"


def test_a_trusted_client_is_exempt_from_the_caller_rules_only():
    named = replace(OK, decided_by="request", k=6, class_hint="translation")
    assert teaches_tuner(named, 1.0, trusted=True) is None
    assert teaches_tuner(replace(named, ignore_eos=True), 1.0, trusted=True) == "ignore_eos"
    assert teaches_tuner(replace(named, temperature=1.5), 1.0, trusted=True) == "temperature"


@pytest.mark.parametrize("hint", WORKLOAD_CLASSES)
def test_a_class_hint_teaches_only_when_the_classifier_agrees(hint):
    got = teaches_tuner(replace(OK, class_hint=hint), 1.0)
    assert got == (None if hint == OK.classified else "caller_class")


@pytest.mark.parametrize("t,limit,excluded", [(1.0, 1.0, False), (1.01, 1.0, True), (2.0, 1.0, True),
                                              (0.5, 0.5, False), (0.6, 0.5, True), (0.0, 0.0, False),
                                              (0.1, 0.0, True), (float("nan"), 1.0, True)])
def test_temperature_above_the_limit_teaches_nothing(t, limit, excluded):
    assert teaches_tuner(replace(OK, temperature=t), limit) == ("temperature" if excluded else None)


def test_ignore_eos_teaches_nothing():
    assert teaches_tuner(replace(OK, ignore_eos=True), 1.0) == "ignore_eos"


def test_the_first_reason_in_order_is_reported():
    worst = Lesson("request", 6, "code", "translation", 2.0, True)
    assert teaches_tuner(worst, 1.0) == "caller_mode"
    assert teaches_tuner(replace(worst, decided_by="policy"), 1.0) == "caller_class"
    assert teaches_tuner(replace(worst, decided_by="policy", class_hint=None), 1.0) == "ignore_eos"
    assert teaches_tuner(replace(worst, decided_by="policy", class_hint=None, ignore_eos=False), 1.0) == "temperature"


def test_every_reason_is_named_in_exclusion_reasons():
    seen = set()
    for decided_by, hint, t, eos in itertools.product(("policy", "request"), (None, "code", "qa"), (0.0, 2.0),
                                                      (False, True)):
        why = teaches_tuner(Lesson(decided_by, 3, "code", hint, t, eos), 1.0)
        if why is not None:
            seen.add(why)
    assert seen | {"client_budget"} == set(EXCLUSION_REASONS)


def test_lesson_of_a_request_and_its_decision():
    req = GenerateRequest(prompt="x", workload_class="qa", temperature=0.7, ignore_eos=True)
    d = Decision("ngram", SpecMode.NGRAM, 3, "policy", "qa", detail={"classified": "chat"})
    assert Lesson.of(req, d) == Lesson("policy", 3, "chat", "qa", 0.7, True)
    # A decision without the classifier's class (built elsewhere) falls back to its own class.
    assert Lesson.of(GenerateRequest(prompt="x"), Decision("ngram", SpecMode.NONE, 0, "request", "rag")).classified == "rag"


# -- who the client is ------------------------------------------------------------------------------------

@pytest.mark.parametrize("label,peer,want", [
    ("team-a", "ipv4:10.0.0.7:51234", "key:team-a"),
    ("keys.txt:3", None, "key:keys.txt:3"),
    (None, "ipv4:10.0.0.7:51234", "peer:10.0.0.7"),
    (None, "ipv4:10.0.0.7", "peer:10.0.0.7"),
    (None, "ipv6:[2001:db8::1]:443", "peer:2001:db8::1"),
    (None, "unix:/tmp/sock", "peer:unix:/tmp/sock"),
    (None, ("192.168.1.2", 55555), "peer:192.168.1.2"),
    (None, ["192.168.1.2", 1], "peer:192.168.1.2"),
    (None, None, "unknown"),
    (None, "", "unknown"),
    (None, (), "unknown"),
    ("", "ipv4:1.2.3.4:5", "peer:1.2.3.4"),
])
def test_client_id(label, peer, want):
    assert client_id(label, peer) == want


def test_client_ids_are_bounded_and_ports_do_not_make_new_clients():
    assert len(client_id(None, "x" * 10_000)) <= 96
    assert len(client_id("l" * 64, None)) <= 96
    assert len({client_id(None, f"ipv4:10.0.0.7:{port}") for port in range(1000, 2000)}) == 1


# -- the budget ----------------------------------------------------------------------------------------------

def test_a_client_teaches_its_burst_then_at_its_rate():
    b = ClientBudget(rate_per_s=2.0, burst=10)
    assert sum(b.take("a", now=0.0) for _ in range(100)) == 10
    assert sum(b.take("a", now=0.0 + 5.0) for _ in range(100)) == 10  # refilled to the burst, not beyond
    # Steady: over 60 s at one request every 10 ms, 2 a second teach (plus the burst left).
    n = sum(b.take("a", now=10.0 + i * 0.01) for i in range(6000))
    assert 120 <= n <= 120 + 10 + 1


def test_clients_do_not_share_budgets():
    b = ClientBudget(rate_per_s=1.0, burst=3)
    assert [sum(b.take(c, now=0.0) for _ in range(5)) for c in ("a", "b", "c")] == [3, 3, 3]


def test_rate_zero_bounds_nothing():
    b = ClientBudget(rate_per_s=0.0, burst=1)
    assert all(b.take("a", now=0.0) for _ in range(1000)) and len(b) == 0


def test_many_fresh_identities_share_one_bucket_and_memory_stays_bounded():
    b = ClientBudget(rate_per_s=1.0, burst=5, max_clients=100)
    for i in range(100):  # 100 clients, each in use (one token spent)
        assert b.take(f"c{i}", now=0.0)
    taught = sum(b.take(f"new{i}", now=0.0) for i in range(100_000))
    assert taught == 5  # the shared bucket's burst, whatever the number of new names
    assert len(b) <= 101
    assert OTHERS in b._buckets


def test_refilled_buckets_are_forgotten_for_new_clients():
    b = ClientBudget(rate_per_s=1.0, burst=2, max_clients=3)
    for c in ("a", "b", "c"):
        b.take(c, now=0.0)
    assert b.take("d", now=10.0) and "a" not in b._buckets and "d" in b._buckets  # "a" had refilled
    assert len(b) == 3


def test_default_bucket_table_is_bounded():
    assert 0 < MAX_CLIENTS <= 100_000


# -- the teacher ---------------------------------------------------------------------------------------------

def test_teacher_applies_the_rule_then_the_budget_and_counts_why():
    t = Teacher(max_temperature=1.0, client_rate_per_s=1.0, client_burst=2)
    hostile = [replace(OK, decided_by="request"), replace(OK, class_hint="translation"),
               replace(OK, ignore_eos=True), replace(OK, temperature=2.0)]
    for lesson in hostile * 10:
        assert t.exclusion(lesson, "key:x", now=0.0) is not None
    # Excluded requests spend no budget: the client's two tokens are still there.
    assert [t.exclusion(OK, "key:x", now=0.0) for _ in range(3)] == [None, None, "client_budget"]
    assert t.excluded == {"caller_mode": 10, "caller_class": 10, "ignore_eos": 10, "temperature": 10,
                          "client_budget": 1}


def test_teacher_from_the_router_config():
    cfg = RouterConfig(teaching={"max_temperature": 0.5, "client_rate_per_s": 0, "client_burst": 1})
    t = Teacher.from_config(cfg.teaching)
    assert t.exclusion(replace(OK, temperature=0.7), "c", 0.0) == "temperature"
    assert all(t.exclusion(OK, "c", 0.0) is None for _ in range(50))  # rate 0: no budget


def test_trusted_clients_teach_their_named_k_unbudgeted():
    cfg = RouterConfig(teaching={"client_rate_per_s": 1, "client_burst": 1, "trusted_clients": ["key:bench"]})
    t = Teacher.from_config(cfg.teaching)
    named = replace(OK, decided_by="request", k=6)
    assert all(t.exclusion(named, "key:bench", 0.0) is None for _ in range(20))
    assert t.exclusion(named, "key:other", 0.0) == "caller_mode"
    assert [t.exclusion(OK, "key:other", 0.0) for _ in range(2)] == [None, "client_budget"]


def test_router_config_defaults_and_bad_values_name_the_field():
    from pydantic import ValidationError

    d = RouterConfig().teaching
    assert (d.max_temperature, d.client_rate_per_s, d.client_burst) == (1.0, 4.0, 240)
    assert d.trusted_clients == []
    for bad in ({"max_temperature": -0.1}, {"client_rate_per_s": -1}, {"client_burst": 0}, {"nope": 1},
                {"trusted_clients": ["127.0.0.1"]}, {"trusted_clients": ["key:"]}):
        with pytest.raises(ValidationError) as e:
            RouterConfig(teaching=bad)
        assert next(iter(bad)) in str(e.value)
