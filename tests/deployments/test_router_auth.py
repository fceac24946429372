"""Router + API keys without Ray: HTTP 401 / gRPC UNAUTHENTICATED for no, wrong and revoked keys;
a valid key works; health stays open only when configured."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from specserve.v1 import specserve_pb2 as pb
from starlette.requests import Request

from cluster.api.auth import ApiKeyStore
from cluster.config import load_config
from deployments.router import Router
from tests.paths import LOCAL_CPU

KEY = "sk-test-0123456789abcdef"
CONFIG = LOCAL_CPU


class Ctx:
    def __init__(self, md=()):
        self.md, self.code, self.details = list(md), None, None

    def invocation_metadata(self):
        return self.md

    def set_code(self, c):
        self.code = c

    def set_details(self, d):
        self.details = d

    def set_trailing_metadata(self, md):
        pass


def http(router, path="/v1/models", auth=None):
    headers = [(b"authorization", auth.encode("latin-1"))] if auth is not None else []
    scope = {"type": "http", "method": "GET", "path": path, "headers": headers, "query_string": b"",
             "scheme": "http", "server": ("x", 80), "root_path": ""}
    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}
    return asyncio.run(router(Request(scope, receive)))


@pytest.fixture
def setup(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"t:{KEY}\n")
    cfg = load_config(CONFIG)
    cfg.auth.enabled, cfg.auth.api_keys_file = True, str(keys)
    store = ApiKeyStore.from_config({**cfg.auth.model_dump(), "reload_interval_s": 0.0})
    return Router(cfg, engines={"x": object()}, auth=store), keys, cfg


def test_http(setup):
    router, keys, _ = setup
    for bad in (None, "", "Bearer nope-nope-nope-nope", f"Basic {KEY}", f"Bearer {KEY}x"):
        r = http(router, auth=bad)
        assert r.status_code == 401 and json.loads(r.body)["error"]["message"] == "missing or invalid API key"
        assert r.headers["www-authenticate"].startswith("Bearer")
    assert http(router, "/nope", auth=None).status_code == 401  # routes are not revealed
    assert http(router, auth=f"bearer {KEY}").status_code == 200
    keys.write_text("# all revoked\n")
    assert http(router, auth=f"Bearer {KEY}").status_code == 401


def test_grpc(setup):
    router, _, cfg = setup
    for md in ([], [("authorization", "Bearer wrong-wrong-wrong-wrong")]):
        ctx = Ctx(md)
        with pytest.raises(Exception):
            asyncio.run(router.ListModels(pb.ListModelsRequest(), grpc_context=ctx))
        assert ctx.code == grpc.StatusCode.UNAUTHENTICATED and ctx.details == "missing or invalid API key"
    ctx = Ctx([("authorization", f"Bearer {KEY}")])
    assert asyncio.run(router.ListModels(pb.ListModelsRequest(), grpc_context=ctx)).models
    assert asyncio.run(router.Check(health_pb2.HealthCheckRequest(), grpc_context=Ctx())).status == 1
    router.health_open = False
    ctx = Ctx()
    with pytest.raises(Exception):
        asyncio.run(router.Check(health_pb2.HealthCheckRequest(), grpc_context=ctx))
    assert ctx.code == grpc.StatusCode.UNAUTHENTICATED
