"""The target's side of the drafter wire against a drafter that misbehaves: every malformed reply,
draft ids outside the target's vocabulary, a drafter without the secret, a missing secret, and a bug
in the proposer are a step without drafts, never an exception in vLLM's engine core."""

from __future__ import annotations

import logging
import socket
import threading
import time
from types import SimpleNamespace

import pytest

from cluster.engine.draft_limits import WireLimits
from cluster.engine.draft_wire import SECRET_ENV, WireError, server_handshake
from cluster.engine.draft_client import TcpDraftClient, connector
from cluster.engine.remote_proposer import RemoteDraftProposer, RemoteDraftSession, SeqWork
from tests.drafter_peer import SECRET

LIMITS = WireLimits(max_k=4, vocab_size=97, max_seq_tokens=64, max_call_tokens=256, max_seqs=8, max_evict=64,
                    max_frame_bytes=1 << 16, idle_timeout_s=30.0)
GOOD = {"drafts": [[5, 6]], "resync": [-1], "compute_s": 0.0}


class ScriptedDrafter:
    """Authenticates like a drafter, then answers each request with the next scripted reply."""

    def __init__(self, replies: list, secret: bytes = SECRET):
        self.replies, self.secret = list(replies), secret
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        with conn:
            try:
                ch = server_handshake(conn, self.secret, LIMITS.to_wire(), time.monotonic() + 5, 1 << 16)
                while self.replies:
                    ch.recv(time.monotonic() + 30)
                    ch.send(self.replies.pop(0), time.monotonic() + 5)
            except (WireError, OSError):
                return

    def close(self):
        self.sock.close()


def session_for(drafter, vocab_size=None) -> RemoteDraftSession:
    s = RemoteDraftSession(lambda ep: TcpDraftClient(ep, SECRET), timeout_s=5.0, failures_to_open=100,
                           vocab_size=vocab_size)
    s.set_endpoint(drafter.address)
    return s


@pytest.mark.parametrize("reply, error", [
    ({"drafts": [[5, 200]], "resync": [-1], "compute_s": 0.0}, "not a token id in [0, 97)"),
    ({"drafts": [[5, -1]], "resync": [-1], "compute_s": 0.0}, "not a token id"),
    ({"drafts": [[1, 2, 3, 4, 5]], "resync": [-1], "compute_s": 0.0}, "more than 2"),
    ({"drafts": [[5], [6]], "resync": [-1, -1], "compute_s": 0.0}, "2 entries, more than 1"),
    ({"drafts": [[5, 6]], "resync": [-1], "compute_s": float("nan")}, "compute_s"),
    ({"drafts": [[5.0, 6]], "resync": [-1], "compute_s": 0.0}, "drafts[0][0]"),
    ({"drafts": [[5, 6]], "resync": [99], "compute_s": 0.0}, "resync[0]"),
    ({"drafts": "5 6", "resync": [-1], "compute_s": 0.0}, "drafts: not a list"),
    ({"error": "bad request: seqs[0].k"}, "drafter refused the call"),
    (["not", "a", "map"], "not a map"),
    (None, "not a map"),
])
def test_a_malformed_reply_is_a_failed_call_and_the_next_good_one_drafts(reply, error):
    drafter = ScriptedDrafter([reply, GOOD])
    try:
        s = session_for(drafter)
        assert s.step([SeqWork("a", [1, 2, 3], 2)]) == [[]]
        assert s.failures == 1 and error in s.last_error and s.sent == {}  # nothing counted as sent
        assert s.step([SeqWork("a", [1, 2, 3, 4], 2)]) == [[5, 6]]  # reconnected, whole sequence resent
    finally:
        drafter.close()


def test_draft_ids_are_checked_against_the_targets_vocabulary():
    """A drafter with a larger vocabulary than the target's: an id the target cannot hold is refused."""
    drafter = ScriptedDrafter([{"drafts": [[5, 60]], "resync": [-1], "compute_s": 0.0}])
    try:
        s = session_for(drafter, vocab_size=50)
        assert s.step([SeqWork("a", [1, 2, 3], 2)]) == [[]] and "[0, 50)" in s.last_error
    finally:
        drafter.close()


def test_a_drafter_without_the_secret_is_not_believed():
    drafter = ScriptedDrafter([GOOD], secret=b"impostor-secret-0123456789")
    try:
        s = session_for(drafter)
        assert s.step([SeqWork("a", [1, 2, 3], 2)]) == [[]]
        assert s.failures == 1 and SECRET_ENV in s.last_error
    finally:
        drafter.close()


def _proposer():
    cfg = SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=4),
        model_config=SimpleNamespace(max_model_len=64, get_vocab_size=lambda: 97),
        additional_config={"specserve": {"remote_drafter": {"timeout_s": 5.0}}},
    )
    return RemoteDraftProposer(cfg)


def test_an_engine_without_the_secret_drafts_nothing_and_says_what_to_set(monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    drafter = ScriptedDrafter([GOOD])
    try:
        p = _proposer()
        p.session.set_endpoint(drafter.address)
        assert p.session.step([SeqWork("a", [1, 2, 3], 2)]) == [[]]
        assert SECRET_ENV in p.session.last_error and "not set" in p.session.last_error
    finally:
        drafter.close()
    assert connector({SECRET_ENV: "x" * 16})("127.0.0.1:1").endpoint == "127.0.0.1:1"


def test_the_proposer_never_raises_into_the_engine_core(monkeypatch, caplog):
    monkeypatch.setenv(SECRET_ENV, SECRET.decode())
    p = _proposer()
    assert p.session.vocab_size == 97
    p.attach(SimpleNamespace(requests={}, input_batch=SimpleNamespace(req_ids=["a", "b"])))

    def bug(batch):
        raise IndexError("a bug in the bookkeeping")

    monkeypatch.setattr(p.session, "step", bug)
    import numpy as np

    with caplog.at_level(logging.WARNING, logger="specserve.remote_proposer"):
        for _ in range(3):
            assert p.propose([[1], [1]], np.array([3, 3]), np.tile(np.arange(64), (2, 1))) == [[], []]
    assert p.errors == 3
    assert sum("IndexError" in r.getMessage() for r in caplog.records) == 2  # the 1st and 2nd, then the 4th...
