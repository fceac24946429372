"""What traffic teaches the tuner, through the router's real recording path: hostile requests (a
caller's K on prompts that reject, ignore_eos, temperature 2.0, a caller's class) are served but
leave the tuning cells, and so what `auto` picks for a class, unchanged; each exclusion is counted
by reason; a client's weight is bounded by its key (or peer).

The integration test runs a real redis-server and the real TuningStore; engines are test doubles
whose statistics are what a hostile request would make them report."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import pytest
from starlette.requests import Request

from cluster.config import RedisConfig
from cluster.policy import class_model
from cluster.state.redis_server import free_port, start_local_redis
from cluster.routing.route import explain_choices, pool_views
from cluster.policy.teaching import Teacher
from cluster.state.tuning import TuningStore
from deployments.engine import EngineChunk
from tests.deployments.test_router import FakeCall, make_router, vllm_shaped

MODEL = "smollm2-135m"
PROMPTS = {  # what the classifier makes of them
    "translation": "Translate German to English: Der Hund spielt im Garten mit dem Ball.",
    "code": "Write a Python function that reverses a list.",
    "chat": "hello, how are you today?",
}
STEPS = 40


def _final(ereq, accept: float) -> EngineChunk:
    """The last chunk of a request whose drafts were accepted at rate `accept` (0: all rejected)."""
    k, steps = int(ereq.k), STEPS
    drafted = k * steps
    per_pos = [int(steps * accept ** (i + 1)) for i in range(k)]
    accepted = sum(per_pos)
    stats = {"mode": ereq.mode, "k": k, "steps": steps, "spec_steps": steps if k else 0, "drafted": drafted,
             "accepted": accepted, "accepted_per_position": per_pos, "drafted_per_position": [steps] * k}
    return EngineChunk(text="x", token_ids=[1] * (steps + accepted + 1), finish_reason="length", prompt_tokens=10,
                       completion_tokens=steps + accepted + 1, stats=stats, replica="r1")


def _router(store, accept_box):
    # One drafting method per class, so that the α the test reads is the one the requests teach.
    router, handles = make_router(lambda: FakeCall(), suffix=None)
    for h in handles.values():  # the chunk depends on the request: build it in remote()
        def remote(req, h=h):
            h.requests.append(req)
            call = FakeCall(vllm_shaped([_final(req, accept_box["accept"])], req))
            h.calls.append(call)
            return call
        h.remote = remote
    router.tuning = store
    from cluster.routing.classifier import classify
    router.classify = lambda prompt, messages: classify(text=prompt, messages=messages)
    return router


def _post(router, body, client=("10.0.0.9", 5000), headers=()):
    raw = json.dumps(body).encode()
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"", "scheme": "http",
             "server": ("x", 80), "root_path": "", "client": client,
             "headers": [(b"content-type", b"application/json"), *headers]}

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}
    r = asyncio.run(router(Request(scope, receive)))
    assert r.status_code == 200, r.body
    return json.loads(r.body)


def _body(wclass, **extra):
    return {"prompt": PROMPTS[wclass], "max_tokens": 64, **extra}


HOSTILE = [  # (prompt's class, request fields, acceptance the engine reports)
    ("translation", {"specserve": {"speculative": {"mode": "ngram", "k": 6}}}, 0.0),  # caller's K on rejecting text
    ("chat", {"ignore_eos": True}, 1.0),  # a loop past EOS: every draft accepted
    ("translation", {"temperature": 2.0}, 0.0),  # hot sampling: every draft rejected
    ("code", {"specserve": {"workload_class": "translation"}}, 0.0),  # code filed as translation
]


def _auto_picks(router, store):
    """What auto picks (exploiting) for each class at batches 1 and 8 (pool, method, the engine's
    ceiling and the K the pool was scored at), and each class's α (where the engine's K starts)."""
    view = store.snapshot(MODEL)
    rows = explain_choices(pool_views(router.config), router.config.router, view, list(PROMPTS), [1, 8])
    ngram = router.views["ngram"]
    alphas = {c: round(class_model(view, "ngram", c, ngram.prior_alpha)[0], 6) for c in PROMPTS}
    return [(r["batch"], r["workload_class"], r["pool"], r["mode"], r["k"], r["k_best"]) for r in rows], alphas


@pytest.fixture
def redis_url(tmp_path):
    server = start_local_redis(free_port(), data_dir=tmp_path / "redis")
    yield server.url
    server.stop()


def _store(url, prefix):
    return TuningStore(RedisConfig(url=url, key_prefix=prefix, start_local=False), models=(MODEL,), start=False,
                       rng_seed=0)


def _cells(store):
    """The model's cells, counts only (every write refreshes `updated`)."""
    return {key: replace(cell, updated_unix_s=0.0) for key, cell in store.snapshot(MODEL).cells.items()}


def _sync(store):
    assert store.flush_now() and store.refresh_now(MODEL)


def test_a_hostile_burst_changes_neither_the_cells_nor_what_auto_picks(redis_url):
    box = {"accept": 0.5}
    store = _store(redis_url, "specserve:test")
    router = _router(store, box)
    for _ in range(5):  # ordinary traffic: each class has cells
        for wclass in PROMPTS:
            _post(router, _body(wclass))
    _sync(store)
    cells_before = _cells(store)
    picks_before = _auto_picks(router, store)
    assert cells_before and router.teacher.excluded == {}

    for wclass, extra, accept in HOSTILE:
        box["accept"] = accept
        for _ in range(50):
            body = _post(router, _body(wclass, **extra))
            assert body["choices"][0]["text"] == "x"  # served all the same
    _sync(store)
    assert _cells(store) == cells_before
    assert _auto_picks(router, store) == picks_before
    assert router.teacher.excluded == {"caller_mode": 50, "ignore_eos": 50, "temperature": 50, "caller_class": 50}

    # The same burst, recorded as every finished request used to be, moves what auto picks.
    naive = _router(_store(redis_url, "specserve:naive"), box)
    naive.teacher.exclusion = lambda *a: None
    box["accept"] = 0.5
    for _ in range(5):
        for wclass in PROMPTS:
            _post(naive, _body(wclass))
    _sync(naive.tuning)
    assert _auto_picks(naive, naive.tuning) == picks_before  # the same start
    for wclass, extra, accept in HOSTILE:
        box["accept"] = accept
        for _ in range(50):
            _post(naive, _body(wclass, **extra))
    _sync(naive.tuning)
    picks, alphas = _auto_picks(naive, naive.tuning)
    assert alphas["translation"] < picks_before[1]["translation"] - 0.1
    assert alphas["chat"] > picks_before[1]["chat"] + 0.1
    assert picks != picks_before[0]


def test_a_client_past_its_budget_is_served_and_not_learned_from(redis_url):
    box = {"accept": 0.5}
    store = _store(redis_url, "specserve:budget")
    router = _router(store, box)
    router.teacher = Teacher(max_temperature=1.0, client_rate_per_s=0.001, client_burst=3)
    for _ in range(10):
        _post(router, _body("code"), client=("10.0.0.1", 1))
    for port in range(2000, 2005):  # another client (its port changes nothing)
        _post(router, _body("code"), client=("10.0.0.2", port))
    _sync(store)
    requests = sum(c.requests for c in store.snapshot(MODEL).cells.values())
    assert requests == 3 + 3
    assert router.teacher.excluded == {"client_budget": 7 + 2}


def test_the_client_is_the_api_key_label_when_keys_are_on(tmp_path):
    from cluster.api.auth import ApiKeyStore

    keys = tmp_path / "keys"
    keys.write_text("team-a:sk-aaaaaaaaaaaaaaaaaaaaaaaa\nteam-b:sk-bbbbbbbbbbbbbbbbbbbbbbbb\n")
    box = {"accept": 0.5}
    recorded = []

    class Store:
        healthy = True

        def snapshot(self, model):
            from cluster.policy import TuningView
            return TuningView(model=model)

        def record_completion(self, model, d, comp):
            recorded.append(d.workload_class)

    router = _router(Store(), box)
    router.auth = ApiKeyStore(api_keys_file=str(keys), api_keys_env=None)
    router.teacher = Teacher(max_temperature=1.0, client_rate_per_s=0.001, client_burst=2)
    for key in ("sk-aaaaaaaaaaaaaaaaaaaaaaaa", "sk-bbbbbbbbbbbbbbbbbbbbbbbb"):
        for _ in range(4):  # one peer, two keys: two budgets
            _post(router, _body("code"), headers=[(b"authorization", f"Bearer {key}".encode())])
    assert len(recorded) == 4 and router.teacher.excluded == {"client_budget": 4}


def test_grpc_clients_are_told_apart_by_peer():
    from cluster.policy.teaching import client_id

    router, _ = make_router(lambda: FakeCall())

    class Ctx:
        def peer(self):
            return "ipv4:10.1.2.3:40000"

        def invocation_metadata(self):
            return []
    assert router._authenticate_grpc(Ctx()) == client_id(None, "ipv4:10.1.2.3:1") == "peer:10.1.2.3"
    assert router._authenticate_grpc(None) == "unknown"


class _Recorded:
    """A tuning store double that remembers the (mode, K) of what it was asked to record."""

    healthy = True

    def __init__(self):
        self.records = []

    def snapshot(self, model):
        from cluster.policy import TuningView
        return TuningView(model=model)

    def record_completion(self, model, d, comp):
        self.records.append((d.mode.value, d.k))


def test_plain_decoding_the_caller_chose_teaches_and_a_trusted_client_teaches_its_k():
    store = _Recorded()
    router = _router(store, {"accept": 0.5})
    _post(router, _body("code", specserve={"speculative": {"mode": "none"}}))
    _post(router, _body("code", specserve={"speculative": {"mode": "ngram", "k": 4}}))
    assert store.records == [("none", 0)] and router.teacher.excluded == {"caller_mode": 1}
    router.config.router.teaching.trusted_clients = ["peer:10.0.0.9"]
    router.teacher = Teacher.from_config(router.config.router.teaching)
    _post(router, _body("code", specserve={"speculative": {"mode": "ngram", "k": 4}}))
    _post(router, _body("code", specserve={"speculative": {"mode": "ngram", "k": 4}}), client=("10.0.0.10", 1))
    assert store.records == [("none", 0), ("ngram", 4)] and router.teacher.excluded == {"caller_mode": 1}
