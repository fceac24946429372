"""Remote proposer: the breaker, the per-step session against a real DraftServer (tiny random model),
timeouts that never block a step, and per-request K taken from the request's SamplingParams."""

from __future__ import annotations

import socket
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from cluster.engine.draft_client import TcpDraftClient  # noqa: E402
from cluster.engine.remote_proposer import (  # noqa: E402
    CircuitBreaker, RemoteDraftProposer, RemoteDraftSession, SeqWork,
)
from cluster.speculation import EXTRA_ARGS_K  # noqa: E402
from deployments.drafter import DraftModel, Drafter, DraftServer  # noqa: E402
from cluster.engine.draft_wire import SECRET_ENV  # noqa: E402
from tests.drafter_peer import SECRET  # noqa: E402


@pytest.fixture
def server(hf_model):
    s = DraftServer(Drafter(DraftModel(hf_model)), "127.0.0.1", 0, secret=SECRET)
    yield s
    s.close()


@pytest.fixture(autouse=True)
def wire_secret(monkeypatch):
    """The engine process's environment carries the secret (the proposer reads it there)."""
    monkeypatch.setenv(SECRET_ENV, SECRET.decode())


def client(endpoint):
    return TcpDraftClient(endpoint, SECRET)


class Recording:
    """TcpDraftClient that keeps every message sent (what went over the wire)."""

    def __init__(self):
        self.sent: list[dict] = []

    def __call__(self, endpoint):
        outer = self

        class _C(TcpDraftClient):
            def call(self, msg, deadline):
                outer.sent.append(msg)
                return super().call(msg, deadline)

        return _C(endpoint, SECRET)


def test_breaker_opens_after_consecutive_failures_and_probes_periodically():
    b = CircuitBreaker(failures_to_open=2, reprobe_s=1.0)
    assert b.allow(0.0)
    b.failure(0.0)
    assert not b.is_open and b.allow(0.1)
    b.failure(0.1)
    assert b.is_open
    assert not b.allow(0.5)
    assert b.allow(1.2)  # one probe
    assert not b.allow(1.3)
    b.success()
    assert not b.is_open and b.allow(1.4)


def test_session_sends_only_new_tokens_skips_k0_and_evicts_finished(server):
    rec = Recording()
    session = RemoteDraftSession(rec, timeout_s=5.0)
    session.set_endpoint(server.address)
    a, b = [5, 6, 7, 8], [9, 10, 11]
    d = session.step([SeqWork("a", a, 3), SeqWork("b", b, 0)])
    assert len(d[0]) == 3 and d[1] == []
    assert [s[0] for s in rec.sent[-1]["seqs"]] == ["a"]  # K = 0 is not sent
    a2 = a + d[0][:1] + [42]  # one draft accepted + bonus
    session.step([SeqWork("a", np.array(a2), 2), SeqWork("b", b + [1], 0)])
    assert rec.sent[-1]["seqs"] == [["a", 4, [d[0][0], 42], 2]]  # only the new tokens
    session.step([SeqWork("c", [1, 2], 2)])  # "a" finished
    assert rec.sent[-1]["evict"] == ["a"]
    assert server.drafter.stats.sequences == 1


def test_drafts_from_the_session_equal_the_drafters(server, hf_model):
    session = RemoteDraftSession(client, timeout_s=5.0)
    session.set_endpoint(server.address)
    ref = Drafter(DraftModel(hf_model))
    got = session.step([SeqWork("a", [3, 1, 4, 1, 5], 4)])
    assert got == ref.propose("x", [("a", 0, [3, 1, 4, 1, 5], 4)], [])[0]


@pytest.fixture
def silent_endpoint():
    """A TCP server that accepts and never answers (a hung drafter)."""
    sock = socket.create_server(("127.0.0.1", 0))
    conns = []
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            try:
                conns.append(sock.accept()[0])
            except OSError:
                return

    threading.Thread(target=loop, daemon=True).start()
    yield f"127.0.0.1:{sock.getsockname()[1]}"
    stop.set()
    sock.close()
    for c in conns:
        c.close()


def test_a_hung_drafter_costs_one_timeout_then_the_breaker_skips_it_until_a_probe(silent_endpoint, server):
    now = [0.0]
    session = RemoteDraftSession(client, timeout_s=0.05, failures_to_open=2, reprobe_s=5.0,
                                 clock=lambda: now[0])
    session.set_endpoint(silent_endpoint)
    for _ in range(2):
        t0 = time.perf_counter()
        assert session.step([SeqWork("a", [1, 2, 3], 2)]) == [[]]
        assert time.perf_counter() - t0 < 2.0  # bounded by the timeout (generous on a loaded machine)
    assert session.breaker.is_open and session.failures == 2
    t0 = time.perf_counter()
    for _ in range(50):
        assert session.step([SeqWork("a", [1, 2, 3], 2)]) == [[]]
    assert time.perf_counter() - t0 < 0.5  # open: no calls, no timeouts (50 x 0.05 s would be 2.5 s)
    assert session.skipped_open == 50
    # The drafter comes back elsewhere: a new endpoint is tried at once.
    session.set_endpoint(server.address)
    session.timeout_s = 10.0  # the healthy drafter must not miss the deadline on a loaded test machine
    assert len(session.step([SeqWork("a", [1, 2, 3], 2)])[0]) == 2
    assert not session.breaker.is_open


def test_a_restarted_drafter_at_the_same_address_resyncs_lost_sequences(hf_model):
    first = DraftServer(Drafter(DraftModel(hf_model)), "127.0.0.1", 0, secret=SECRET)
    port = first.port
    session = RemoteDraftSession(client, timeout_s=5.0, failures_to_open=1, reprobe_s=0.0)
    session.set_endpoint(first.address)
    toks = [1, 2, 3, 4]
    d = session.step([SeqWork("a", toks, 2)])
    assert len(d[0]) == 2
    first.close()
    time.sleep(0.1)
    toks = toks + [d[0][0], 7]
    assert session.step([SeqWork("a", toks, 2)]) == [[]]  # connection broken: no drafts, no error
    second = DraftServer(Drafter(DraftModel(hf_model)), "127.0.0.1", port, secret=SECRET)
    try:
        toks = toks + [8]
        assert session.step([SeqWork("a", toks, 2)]) == [[]]  # it knows nothing: resync from 0
        assert session.sent["a"] == 0 and session.resyncs == 1
        toks = toks + [9]
        assert len(session.step([SeqWork("a", toks, 2)])[0]) == 2  # resent whole: drafts again
    finally:
        second.close()


def _proposer(k_max=4, max_model_len=64, remote=None):
    cfg = SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=k_max),
        model_config=SimpleNamespace(max_model_len=max_model_len),
        additional_config={"specserve": {"remote_drafter": remote or {"timeout_s": 5.0}}},
    )
    return RemoteDraftProposer(cfg)


def _runner(req_ks: dict):
    requests = {
        rid: SimpleNamespace(sampling_params=SimpleNamespace(extra_args=extra)) for rid, extra in req_ks.items()
    }
    return SimpleNamespace(requests=requests, input_batch=SimpleNamespace(req_ids=list(req_ks)))


def test_proposer_takes_each_requests_k_from_its_sampling_params(server):
    p = _proposer(k_max=4)
    p.session.set_endpoint(server.address)
    sampled = [[1], [1], [1], []]
    num_tokens = np.array([3, 3, 3, 3])
    token_ids = np.tile(np.arange(64), (4, 1))
    assert p.propose(sampled, num_tokens, token_ids) == [[], [], [], []]  # no runner attached yet
    runner = _runner({"k2": {EXTRA_ARGS_K: 2}, "k0": {EXTRA_ARGS_K: 0}, "k4": {EXTRA_ARGS_K: 4}, "prefill": {EXTRA_ARGS_K: 3}})
    runner.propose_draft_token_ids = lambda scheduler_output: None
    p.attach(runner)
    d = p.propose(sampled, num_tokens, token_ids)
    assert [len(x) for x in d] == [2, 0, 4, 0]
    # the scheduler's bound on the step (`num_spec_tokens_to_schedule`, seen as the runner proposes)
    runner.propose_draft_token_ids(SimpleNamespace(num_spec_tokens_to_schedule=1))
    assert [len(x) for x in p.propose(sampled, num_tokens + 1, token_ids)] == [1, 0, 1, 0]
    runner.propose_draft_token_ids(SimpleNamespace(num_spec_tokens_to_schedule=0))  # a plain step: no call
    calls = p.session.calls
    assert p.propose(sampled, num_tokens + 2, token_ids) == [[], [], [], []] and p.session.calls == calls


def test_proposer_never_drafts_past_max_model_len(server):
    p = _proposer(k_max=4, max_model_len=8)
    p.session.set_endpoint(server.address)
    p.attach(_runner({"a": {EXTRA_ARGS_K: 4}}))
    d = p.propose([[1]], np.array([6]), np.tile(np.arange(8), (1, 1)))
    assert len(d[0]) == 1
