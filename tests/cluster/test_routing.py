from tests.paths import LOCAL_CPU
from dataclasses import replace

import pytest

from cluster.api.types import ApiError, ErrorCode
from cluster.config import RouterConfig
from cluster.routing.route import PoolView, resolve_model, route
from cluster.speculation import SpecMode
from tests.paths import LOCAL_CPU

NGRAM = PoolView("ngram", "m", SpecMode.NGRAM, 6)
DRAFT = PoolView("draft", "m", SpecMode.DRAFT_MODEL, 4)
PLAIN = PoolView("plain", "m", SpecMode.NONE, 0)
ROUTER = RouterConfig(default_mode="auto")


def test_override_mode_and_k():
    d = route([NGRAM, DRAFT], ROUTER, "code", "ngram", 5)
    assert (d.pool, d.mode, d.k, d.decided_by) == ("ngram", SpecMode.NGRAM, 5, "request")
    d = route([NGRAM, DRAFT], ROUTER, "code", "draft_model", None)
    assert (d.pool, d.k) == ("draft", ROUTER.default_k["draft_model"])


def test_override_k_zero_is_plain_decoding():
    d = route([NGRAM, DRAFT], ROUTER, "chat", "ngram", 0)
    assert d.mode == SpecMode.NONE and d.k == 0 and d.pool == "ngram"


def test_none_prefers_the_cheapest_proposer():
    assert route([NGRAM, PLAIN], ROUTER, "chat", "none", None).pool == "plain"
    busy_ngram = PoolView("ngram", "m", SpecMode.NGRAM, 6, running=30)
    d = route([busy_ngram, DRAFT], ROUTER, "chat", "none", None)
    assert d.pool == "ngram" and d.k == 0


@pytest.mark.parametrize("mode, k, field", [("eagle", None, "speculative.mode"), ("ngram", 7, "speculative.k"),
                                            ("none", 2, "speculative.k")])
def test_invalid_overrides_name_the_field(mode, k, field):
    with pytest.raises(ApiError) as e:
        route([NGRAM, DRAFT], ROUTER, "chat", mode, k)
    assert e.value.code == ErrorCode.INVALID_ARGUMENT and e.value.field == field


def test_least_loaded_pool_of_a_mode():
    busy = PoolView("ngram-a", "m", SpecMode.NGRAM, 6, running=10)
    idle = PoolView("ngram-b", "m", SpecMode.NGRAM, 6, running=1)
    assert route([busy, idle], ROUTER, "chat", "ngram", 2).pool == "ngram-b"


def test_k_beyond_some_pools_goes_to_a_pool_that_has_it():
    small = PoolView("small", "m", SpecMode.NGRAM, 2)
    big = PoolView("big", "m", SpecMode.NGRAM, 8, running=50)
    assert route([small, big], ROUTER, "chat", "ngram", 6).pool == "big"


def test_configured_default_mode():
    d = route([NGRAM, DRAFT], RouterConfig(default_mode="draft_model"), "chat")
    assert (d.pool, d.mode, d.decided_by) == ("draft", SpecMode.DRAFT_MODEL, "default")


def test_auto_returns_a_valid_decision():
    d = route([NGRAM, DRAFT], ROUTER, "summarization")
    assert d.decided_by == "policy" and d.pool in ("ngram", "draft")
    pool = {"ngram": NGRAM, "draft": DRAFT}[d.pool]
    assert 0 <= d.k <= pool.max_k and (d.k == 0) == (d.mode == SpecMode.NONE)


def test_no_pools_and_models():
    with pytest.raises(ApiError) as e:
        route([], ROUTER, "chat")
    assert e.value.code == ErrorCode.UNAVAILABLE
    assert resolve_model(None, ["m"]) == "m"
    with pytest.raises(ApiError) as e:
        resolve_model("x", ["m"])
    assert e.value.code == ErrorCode.NOT_FOUND and e.value.field == "model"
    with pytest.raises(ApiError) as e:
        resolve_model(None, ["a", "b"])
    assert e.value.code == ErrorCode.INVALID_ARGUMENT


# -- explain_choices (`specserve tuning --explain`) ------------------------------------------------

def test_explain_choices_rows_follow_load_and_never_explore():
    import random

    from cluster.policy import TuningView
    from cluster.routing.route import explain_choices

    ngram = PoolView(name="ngram", model="m", method=SpecMode.NGRAM, max_k=6, hardware_group="hw",
                     prior_alpha=(("qa", 0.05), ("translation", 0.9)))
    plain = PoolView(name="plain", model="m", method=SpecMode.NONE, max_k=0, hardware_group="hw")
    # an RNG that explores on every draw (random() < ε) must not be used: explain is exploitation only
    always = random.Random(0)
    always.random = lambda: 0.0
    view = TuningView(model="m", rng=always)
    rows = explain_choices([ngram, plain], ROUTER, view, ("translation", "qa"), (1, 32))
    assert [(r["batch"], r["workload_class"]) for r in rows] == [(1, "translation"), (1, "qa"), (32, "translation"), (32, "qa")]
    by = {(r["batch"], r["workload_class"]): r for r in rows}
    # idle: translation (α 0.9) drafts deep; QA (α 0.05) does not pay for a draft
    assert by[(1, "translation")]["mode"] == "ngram" and by[(1, "translation")]["k"] >= 4
    assert by[(1, "qa")]["k"] == 0 and by[(1, "qa")]["mode"] == "none"
    # both pools share the hardware: the batch is the group's, so batch 32 lands in the 16+ bucket
    assert by[(32, "translation")]["load_bucket"] == "16+" and by[(1, "translation")]["load_bucket"] == "1"
    assert by[(32, "translation")]["k_best"] < by[(1, "translation")]["k_best"]
    assert by[(32, "translation")]["k"] == by[(1, "translation")]["k"] == 6  # the engine's ceiling at any load
    # same as the policy itself on the same loaded views with exploration off
    again = explain_choices([ngram, plain], ROUTER, TuningView(model="m"), ("translation", "qa"), (1, 32))
    assert [(r["pool"], r["k"], r["score"]) for r in again] == [(r["pool"], r["k"], r["score"]) for r in rows]


def test_explain_choices_show_the_engines_ceiling_beside_the_k_the_pool_was_scored_at():
    # One drafting pool: every class is sent to its method with the pool's max_k as the ceiling of
    # the engine's per-step K, whatever the policy's best K for the class at that load.
    from cluster.routing.route import explain_choices

    ngram = PoolView(name="ngram", model="m", method=SpecMode.NGRAM, max_k=6,
                     prior_alpha=(("*", 0.05), ("structured", 0.95)))
    rows = explain_choices([ngram], ROUTER, None, ("structured", "qa"), (1, 16, 32))
    by = {(r["batch"], r["workload_class"]): r for r in rows}
    assert by[(1, "structured")]["k_best"] == 6 and by[(1, "qa")]["k_best"] < 6
    for r in rows:
        assert (r["pool"], r["mode"], r["k"]) == ("ngram", "ngram", 6) and 0 <= r["k_best"] <= 6


def test_explain_choices_cold_start_without_a_view():
    from cluster.routing.route import explain_choices

    ngram = PoolView(name="ngram", model="m", method=SpecMode.NGRAM, max_k=4, prior_alpha=(("*", 0.7),))
    rows = explain_choices([ngram], ROUTER, None, ("chat",), (1,))
    assert len(rows) == 1 and rows[0]["pool"] == "ngram" and 1 <= rows[0]["k"] <= 4
    assert rows[0]["alpha"] == 0.7


def test_tuning_explain_command_prints_cold_start_choices_when_redis_is_unreachable(tmp_path, capsys):
    """`specserve tuning --explain` on the shipped local config with nothing listening at its Redis
    URL: it says so and prints the cold-start choice per class and batch (one TSV table)."""
    import socket
    from pathlib import Path

    import yaml

    from cluster.ops.cli import main

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    raw = yaml.safe_load(LOCAL_CPU.read_text())
    raw["redis"] = {**raw["redis"], "url": f"redis://127.0.0.1:{port}/0", "start_local": False}
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    assert main(["tuning", "--config", str(cfg), "--explain", "--batches", "1,16"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "NOT reachable" in lines[0]
    header = lines[1].split("\t")
    rows = [dict(zip(header, line.split("\t"))) for line in lines[2:]]
    assert len(rows) == 2 * 11 and {r["batch"] for r in rows} == {"1", "16"}
    assert all(r["mode"] in ("suffix", "none") for r in rows)  # suffix.auto_ngram: false; no EAGLE head
    assert all("ngram:suffix=" in r["scores"] and "ngram=" not in r["scores"] and "draft=" not in r["scores"]
               for r in rows)  # draft: auto: false; the n-gram pool's engine is scored for suffix only
    assert float(next(r for r in rows if r["workload_class"] == "translation" and r["batch"] == "1")["k"]) >= 4
    assert main(["tuning", "--config", str(cfg), "--explain", "--batches", "1,x"]) == 2
    assert "--batches" in capsys.readouterr().err


# -- K growth within a request --------------------------------------------------------------------

def _pool(**kw):
    from cluster.config_pool import PoolConfig

    return PoolConfig(**{"model": "m", "method": "ngram", "max_k": 6, **kw})


@pytest.mark.parametrize("kw, message", [
    ({"method": "ngram", "max_k": 4, "k_grow_step": 2}, "k_grow_step"),
    ({"method": "ngram", "max_k": 4, "step_k": False}, "step_k"),
])
def test_a_config_that_sets_k_by_another_rule_is_refused_naming_the_field(kw, message):
    """The engine chooses K per step for the policy's requests, a caller's K is fixed: a pool
    config that asks for K growth or for the policy's K at admission names a field nothing reads."""
    from pydantic import ValidationError

    from cluster.config_pool import PoolConfig

    with pytest.raises(ValidationError, match=message):
        PoolConfig(model="m", **kw)


def test_auto_never_chooses_a_pool_that_serves_only_its_mode():
    import random

    from cluster.policy import TuningView

    # a draft pool the priors score far above n-gram, and an exploring RNG: still never chosen by auto
    draft = PoolView("draft", "m", SpecMode.DRAFT_MODEL, 4, prior_alpha=(("*", 0.95),), auto=False)
    ngram = PoolView("ngram", "m", SpecMode.NGRAM, 6, prior_alpha=(("*", 0.05),))
    tuning = TuningView(model="m", rng=random.Random(0))
    assert {route([draft, ngram], ROUTER, "chat", tuning=tuning).pool for _ in range(200)} == {"ngram"}
    assert route([draft, ngram], ROUTER, "chat").pool == "ngram"
    assert route([replace(draft, auto=True), ngram], ROUTER, "chat").pool == "draft"
    # asked for by mode, it serves
    assert route([draft, ngram], ROUTER, "chat", "draft_model", 2).pool == "draft"


def test_a_model_without_an_auto_pool_is_refused_naming_the_field():
    from pydantic import ValidationError

    from cluster.config import ClusterConfig

    with pytest.raises(ValidationError, match="no pool of model 'm' has auto: true"):
        ClusterConfig(models={"m": {"source": "hf:x/y"}},
                      pools={"p": {"model": "m", "method": "ngram", "max_k": 2, "auto": False}})
