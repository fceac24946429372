import pytest

from cluster.api import ApiError, ErrorCode
from cluster.config import RouterConfig
from cluster.routing import PoolView, resolve_model, route
from cluster.speculation import SpecMode

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
