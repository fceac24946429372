"""The HTTP door's routing without Ray: a Router with test-double engines, called as Ray Serve's proxy
calls it (a Starlette request), for each route, a route's path with another method, and no route."""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.requests import Request

from deployments.router_http import ROUTES, match_route
from tests.deployments.test_router import make_router


def call(router, method: str, path: str, body: bytes = b""):
    scope = {"type": "http", "method": method, "path": path, "headers": [(b"content-type", b"application/json")],
             "query_string": b"", "scheme": "http", "server": ("x", 80), "root_path": ""}

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}
    return asyncio.run(router(Request(scope, receive)))


def request(method: str, path: str) -> Request:
    return Request({"type": "http", "method": method, "path": path, "headers": [], "query_string": b"",
                    "root_path": ""})


@pytest.mark.parametrize("method,path,route", [
    ("GET", "/v1/models", "/v1/models"),
    ("GET", "/v1/models/", "/v1/models"),  # a trailing slash is the same route
    ("HEAD", "/v1/specserve/status", "/v1/specserve/status"),
    ("POST", "/v1/completions", "/v1/completions"),
    ("POST", "/v1/chat/completions/", "/v1/chat/completions"),
    ("POST", "/v1/specserve/forget_outputs", "/v1/specserve/forget_outputs"),
])
def test_each_route_matches_its_path_and_methods(method, path, route):
    found, allowed = match_route(request(method, path))
    assert found is not None and found.path == route and allowed == []


@pytest.mark.parametrize("method,path,allowed", [
    ("POST", "/v1/models", ["GET", "HEAD"]),
    ("GET", "/v1/completions", ["POST"]),
    ("DELETE", "/v1/specserve/status", ["GET", "HEAD"]),
    ("GET", "/v1/specserve/forget_outputs", ["POST"]),
    ("GET", "/v1/nope", []),
    ("POST", "/v1/chat/completions/extra", []),
    ("POST", "/v1/COMPLETIONS", []),
    ("GET", "/", []),
])
def test_no_route_says_which_methods_the_path_takes(method, path, allowed):
    assert match_route(request(method, path)) == (None, allowed)


def test_every_route_has_a_door_method():
    assert sorted(r.path for r in ROUTES) == ["/detokenize", "/health", "/metrics", "/tokenize", "/v1/chat/completions",
                                              "/v1/completions", "/v1/models", "/v1/specserve/forget_outputs",
                                              "/v1/specserve/status", "/version"]
    assert all(callable(r.endpoint) for r in ROUTES)


def test_a_route_with_another_method_is_405_with_allow_naming_the_path():
    router, _ = make_router(lambda: None)
    r = call(router, "GET", "/v1/chat/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    err = json.loads(r.body)["error"]
    assert err["param"] == "path" and err["code"] == "method_not_allowed" and "POST" in err["message"], err


def test_no_route_is_404_naming_the_path():
    router, _ = make_router(lambda: None)
    r = call(router, "POST", "/v2/completions", b"{}")
    assert r.status_code == 404 and "allow" not in r.headers
    assert json.loads(r.body)["error"]["param"] == "path"


def test_models_answers_through_its_route():
    router, _ = make_router(lambda: None)
    r = call(router, "GET", "/v1/models/")
    assert r.status_code == 200 and json.loads(r.body)["object"] == "list"


def test_a_bad_body_on_a_generate_route_is_400_naming_the_body():
    router, _ = make_router(lambda: None)
    r = call(router, "POST", "/v1/completions", b"{not json")
    assert r.status_code == 400 and json.loads(r.body)["error"]["param"] == "body"
