"""A request's time bounds (`cluster.routing.deadline`) and their config: one end-to-end deadline, the
engine's waits inside it, clear errors naming the field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from cluster.api.types import ErrorCode
from cluster.config import RouterConfig
from cluster.routing.deadline import PROXY_MARGIN_S, Bounds, body_expired, engine_wait, expired, proxy_timeout_s

B = Bounds(request_s=120.0, first_token_s=60.0, idle_s=30.0)


@pytest.mark.parametrize("now,started,want", [
    (0.0, False, (60.0, "first_token")),
    (0.0, True, (30.0, "idle")),
    (59.9, False, (60.0, "first_token")),
    (60.0, False, (60.0, "deadline")),  # a tie goes to the deadline: it is the bound that ends the request
    (61.0, False, (59.0, "deadline")),
    (89.0, True, (30.0, "idle")),
    (90.0, True, (30.0, "deadline")),
    (119.5, True, (0.5, "deadline")),
    (120.0, True, (0.0, "deadline")),
    (500.0, False, (0.0, "deadline")),  # past it: no wait at all
])
def test_each_wait_is_its_own_bound_or_what_is_left_of_the_deadline(now, started, want):
    assert engine_wait(B, deadline_s=120.0, now_s=now, started=started) == want


def test_a_wait_never_outlasts_the_deadline():
    for now in [i * 0.7 for i in range(300)]:
        for started in (False, True):
            wait, _ = engine_wait(B, 120.0, now, started)
            assert 0.0 <= wait and now + wait <= max(120.0, now)


def test_the_deadline_counts_from_arrival():
    assert B.deadline(1000.0) == 1120.0
    assert Bounds.from_config(RouterConfig()) == Bounds(120.0, 60.0, 60.0)


def test_errors_name_the_field_and_map_to_both_doors():
    d = expired("deadline", B, "ngram")
    assert (d.code, d.code.grpc_name, d.code.http_status, d.retry_after_s) == (ErrorCode.DEADLINE_EXCEEDED,
                                                                                "DEADLINE_EXCEEDED", 504, None)
    assert "router.request_timeout_s (120 s)" in d.message and "aborted" in d.message
    assert d.to_openai()["error"]["code"] == "deadline_exceeded"
    for what, field in (("first_token", "router.first_token_timeout_s (60 s)"), ("idle", "router.stream_idle_timeout_s (30 s)")):
        e = expired(what, B, "ngram")
        assert e.code is ErrorCode.UNAVAILABLE and e.retry_after_s and field in e.message and "'ngram'" in e.message
    with pytest.raises(ValueError, match="unknown wait"):
        expired("nap", B, "ngram")
    b = body_expired(Bounds(2.5, 1, 1))
    assert (b.code.http_status, b.code.grpc_name, b.field) == (408, "DEADLINE_EXCEEDED", "body")
    assert "router.request_timeout_s (2.5 s)" in b.message and b.to_openai()["error"]["code"] == "request_timeout"


def test_the_proxies_give_up_after_the_router():
    assert proxy_timeout_s(120) == 120 + PROXY_MARGIN_S > 120
    assert proxy_timeout_s(0.5) > 0.5


def test_ray_serve_proxies_take_the_timeout():
    from ray.serve.config import HTTPOptions, gRPCOptions

    t = proxy_timeout_s(RouterConfig().request_timeout_s)
    assert HTTPOptions(request_timeout_s=t).request_timeout_s == t
    assert gRPCOptions(port=9000, request_timeout_s=t).request_timeout_s == t


def test_config_defaults_keep_every_wait_within_the_deadline():
    r = RouterConfig()
    assert r.request_timeout_s == 120.0
    assert r.first_token_timeout_s <= r.request_timeout_s and r.stream_idle_timeout_s <= r.request_timeout_s


@pytest.mark.parametrize("bad,field", [
    ({"first_token_timeout_s": 300}, "router.first_token_timeout_s"),
    ({"stream_idle_timeout_s": 121}, "router.stream_idle_timeout_s"),
    ({"request_timeout_s": 10}, "router.first_token_timeout_s"),  # the 60 s default no longer fits
    ({"request_timeout_s": 0}, "request_timeout_s"),
    ({"request_timeout_s": -1}, "request_timeout_s"),
])
def test_a_wait_past_the_deadline_is_refused_at_load_naming_both_fields(bad, field):
    with pytest.raises(ValidationError) as e:
        RouterConfig(**bad)
    assert field in str(e.value)


def test_a_short_deadline_with_short_waits_loads():
    r = RouterConfig(request_timeout_s=5, first_token_timeout_s=5, stream_idle_timeout_s=2)
    assert Bounds.from_config(r) == Bounds(5, 5, 2)
