"""Hostile clients against a real DraftServer on loopback (a tiny random Llama behind it): garbage,
oversized length prefixes, clients without the secret, slowloris, requests past every limit, too
many connections, idle connections, and accept() failing with EMFILE. Each probe asserts the safe
behaviour, that no sequence's state changed, and that a good client is served afterwards."""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from cluster.engine.draft_client import TcpDraftClient  # noqa: E402
from cluster.engine.draft_wire import AuthError, FrameReader, client_handshake, pack  # noqa: E402
from cluster.engine.remote_proposer import RemoteDraftSession, SeqWork  # noqa: E402
from deployments.drafter import DraftModel, Drafter, DraftServer  # noqa: E402
from tests.drafter_peer import SECRET, call, connect, greedy, send_body  # noqa: E402
from tests.waiting import wait_until  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RECV_TIMEOUT_S = 0.5


def make_server(hf_model, **wire):
    drafter = Drafter(DraftModel(hf_model), max_sequences=8, max_context=64, max_k=4)
    opts = dict(max_frame_bytes=64 << 10, max_tokens_per_call=128, max_connections=6, idle_timeout_s=30.0,
                recv_timeout_s=RECV_TIMEOUT_S)
    return DraftServer(drafter, "127.0.0.1", 0, secret=SECRET, **{**opts, **wire})


@pytest.fixture
def server(hf_model):
    s = make_server(hf_model)
    yield s
    s.close()


_n = [0]


def serves_a_good_client(server, hf_model) -> bool:
    """A new, authenticated connection gets the drafts greedy decoding gives."""
    _n[0] += 1
    ch, _ = connect(server)
    with ch.sock:
        reply = call(ch, {"client": "good", "seqs": [[f"g{_n[0]}", 0, [3, 1, 4], 3]]})
    return reply.get("drafts") == [greedy(hf_model, [3, 1, 4], 3)]


def snapshot(drafter) -> dict:
    return {key: (tuple(st.tokens), st.committed, st.cache.length) for key, st in drafter._seqs.items()}


def closed_by_server(sock: socket.socket, within_s: float) -> bool:
    """True when the server closes `sock` within `within_s` (whatever it sent before)."""
    sock.settimeout(within_s)
    deadline = time.monotonic() + within_s
    try:
        while time.monotonic() < deadline:
            if not sock.recv(65536):
                return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False
    return False


def raw_after_hello(server) -> socket.socket:
    """A connection that read the drafter's hello and has not proved anything."""
    s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    FrameReader(s).frame(4096, time.monotonic() + 5)
    return s


# -- before the handshake ------------------------------------------------------------------------------


def test_garbage_bytes_are_dropped_at_the_handshake(server, hf_model):
    s = raw_after_hello(server)
    s.sendall(b"GET / HTTP/1.1\r\nHost: drafter\r\n\r\n" + os.urandom(200))
    assert closed_by_server(s, 5)
    assert wait_until(lambda: server.drafter.stats.handshake_failures == 1, timeout_s=30)
    assert server.drafter.stats.calls == 0
    assert serves_a_good_client(server, hf_model)


def test_an_oversized_length_prefix_before_the_handshake_is_refused_at_once(server, hf_model):
    s = raw_after_hello(server)
    t0 = time.monotonic()
    s.sendall(struct.pack(">I", 60 << 20))  # under the old 64 MiB bound: it used to be read
    assert closed_by_server(s, 10) and time.monotonic() - t0 < 5  # not waiting for 60 MiB
    assert serves_a_good_client(server, hf_model)


def test_a_client_without_the_secret_gets_no_drafts(server, hf_model):
    s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    with pytest.raises(AuthError):
        client_handshake(s, b"not-the-secret-0123456789", time.monotonic() + 5, 1 << 20)
    # One that skips the handshake and sends a request as the old wire did: closed, nothing computed.
    s = raw_after_hello(server)
    body = pack({"client": "t", "seqs": [["a", 0, [1, 2, 3], 4]]})
    s.sendall(struct.pack(">I", len(body)) + body)
    assert closed_by_server(s, 5)
    assert server.drafter.stats.calls == 0 and snapshot(server.drafter) == {}
    assert wait_until(lambda: server.drafter.stats.handshake_failures == 2, timeout_s=30)
    assert serves_a_good_client(server, hf_model)


def trickle_until_closed(sock: socket.socket, claimed_bytes: int, max_s: float) -> float:
    """Claim a frame of `claimed_bytes`, then send one byte every 50 ms (every recv is in time, the
    frame would take claimed_bytes / 20 seconds); -> seconds until the server closed the socket."""
    t0 = time.monotonic()
    sock.sendall(struct.pack(">I", claimed_bytes))
    while time.monotonic() - t0 < max_s:
        try:
            sock.send(b"x")
        except OSError:
            return time.monotonic() - t0
        if closed_by_server(sock, 0.05):
            return time.monotonic() - t0
    return float("inf")


def test_a_slowloris_handshake_is_dropped_after_the_receive_timeout(server, hf_model):
    s = raw_after_hello(server)
    assert trickle_until_closed(s, 1000, max_s=20) < RECV_TIMEOUT_S + 5  # not the 50 s the frame would take
    assert serves_a_good_client(server, hf_model)


# -- after the handshake -------------------------------------------------------------------------------


def test_a_slowloris_request_is_dropped_after_the_receive_timeout(server, hf_model):
    ch, _ = connect(server)
    assert trickle_until_closed(ch.sock, 1000, max_s=20) < RECV_TIMEOUT_S + 5
    assert serves_a_good_client(server, hf_model)


def test_an_oversized_frame_gets_an_error_reply_and_the_connection_ends(server, hf_model):
    ch, _ = connect(server)
    call(ch, {"client": "t", "seqs": [["a", 0, [1, 2, 3], 2]]})
    before = snapshot(server.drafter)
    ch.sock.sendall(struct.pack(">I", 60 << 20))
    assert "exceeds 65536" in ch.recv(time.monotonic() + 5)["error"]
    assert closed_by_server(ch.sock, 5)
    assert snapshot(server.drafter) == before
    assert serves_a_good_client(server, hf_model)


def test_a_frame_with_a_forged_tag_ends_the_connection(server, hf_model):
    ch, _ = connect(server)
    body = pack({"client": "t", "seqs": [["a", 0, [1, 2, 3], 2]]})
    ch.sock.sendall(struct.pack(">I", 16 + len(body)) + b"\0" * 16 + body)
    assert closed_by_server(ch.sock, 5)
    assert server.drafter.stats.calls == 0
    assert serves_a_good_client(server, hf_model)


BAD_REQUESTS = {
    "k past the drafter's max": {"client": "t", "seqs": [["s", 5, [6], 5]]},
    "a token id past the vocabulary": {"client": "t", "seqs": [["s", 5, [97], 2]]},
    "a negative token id": {"client": "t", "seqs": [["s", 5, [-3], 2]]},
    "a NaN token": {"client": "t", "seqs": [["s", 5, [float("nan")], 2]]},
    "an infinite start": {"client": "t", "seqs": [["s", float("inf"), [6], 2]]},
    "a float k": {"client": "t", "seqs": [["s", 5, [6], 1.5]]},
    "a sequence past max_context": {"client": "t", "seqs": [["s", 5, [6] * 60, 2]]},
    "too many sequences": {"client": "t", "seqs": [["s", 5, [6], 2]] + [[f"x{i}", 0, [1], 1] for i in range(8)]},
    "too many tokens in the call": {"client": "t", "seqs": [["s", 5, [6], 2]] + [[f"x{i}", 0, [1] * 60, 1] for i in range(3)]},
    "a repeated sequence": {"client": "t", "seqs": [["s", 5, [6], 2], ["s", 6, [7], 2]]},
    "an eviction that is not an id": {"client": "t", "evict": [{"s": 1}], "seqs": [["s", 5, [6], 2]]},
    "a wrong shape": {"client": "t", "seqs": [["s", 5, [6]]]},
    "not a map": [1, 2, 3],
}


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
def test_a_request_past_a_limit_gets_an_error_reply_and_changes_no_state(server, hf_model, name):
    """The valid part of the bad request ("s" advancing by token 6) must not be applied either."""
    ch, _ = connect(server)
    ctx = [1, 2, 3, 4, 5]
    assert call(ch, {"client": "t", "seqs": [["s", 0, ctx, 2]]})["drafts"] == [greedy(hf_model, ctx, 2)]
    before, calls = snapshot(server.drafter), server.drafter.stats.calls
    reply = call(ch, BAD_REQUESTS[name])
    assert "bad request" in reply["error"]
    assert snapshot(server.drafter) == before and server.drafter.stats.calls == calls
    # The same connection goes on, and the sequence continues as if the bad request never came.
    assert call(ch, {"client": "t", "seqs": [["s", 5, [6], 2]]})["drafts"] == [greedy(hf_model, ctx + [6], 2)]
    assert server.drafter.stats.bad_frames == 1
    assert serves_a_good_client(server, hf_model)


def test_an_authentic_frame_that_is_not_msgpack_gets_an_error_reply(server, hf_model):
    ch, _ = connect(server)
    send_body(ch, b"\x91\xc1")  # a list holding a never-valid byte
    assert "malformed frame" in ch.recv(time.monotonic() + 5)["error"]
    assert call(ch, {"client": "t", "seqs": []})["drafts"] == []
    assert serves_a_good_client(server, hf_model)


# -- connections ---------------------------------------------------------------------------------------


def test_connections_past_the_cap_are_refused_and_the_rest_are_served(server, hf_model):
    held = [connect(server)[0] for _ in range(6)]
    assert wait_until(lambda: server.drafter.stats.connections == 6, timeout_s=30)
    extra = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    assert closed_by_server(extra, 10)  # no hello: closed at once
    assert server.drafter.stats.connections_refused == 1
    assert call(held[0], {"client": "t", "seqs": []})["drafts"] == []
    held.pop().sock.close()
    assert wait_until(lambda: server.drafter.stats.connections == 5, timeout_s=30)
    assert serves_a_good_client(server, hf_model)


def test_handshakes_under_way_are_capped_and_time_out(server, hf_model):
    established, _ = connect(server)
    pending = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(server.max_pending)]
    time.sleep(0.1)
    extra = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    assert closed_by_server(extra, 10)
    assert call(established, {"client": "t", "seqs": []})["drafts"] == []  # an established target is unaffected
    for s in pending:  # they never proved anything: dropped after the receive timeout
        assert closed_by_server(s, RECV_TIMEOUT_S + 10)
    assert serves_a_good_client(server, hf_model)


def test_an_idle_connection_is_closed_and_the_target_reconnects_without_a_failed_step(hf_model):
    server = make_server(hf_model, idle_timeout_s=0.6)
    try:
        ch, limits = connect(server)
        assert limits.idle_timeout_s == 0.6
        assert closed_by_server(ch.sock, 10)
        assert wait_until(lambda: server.drafter.stats.idle_closed == 1, timeout_s=30)
        assert server.drafter.stats.connections_ended == 0  # an idle end is not a failure
        session = RemoteDraftSession(lambda ep: TcpDraftClient(ep, SECRET), timeout_s=5.0)
        session.set_endpoint(server.address)
        toks = [1, 2, 3]
        for pause in (0.0, 0.4, 1.0):  # past half the idle timeout the client reconnects before calling
            time.sleep(pause)
            toks.append(len(toks))  # the target's next committed token
            assert len(session.step([SeqWork("a", list(toks), 2)])[0]) == 2
        assert session.failures == 0
    finally:
        server.close()


EMFILE_CHILD = """
import json, os, resource, sys
sys.path.insert(0, {root!r})
from deployments.drafter import Drafter, DraftServer
from tests.drafter_peer import SECRET
srv = DraftServer(Drafter(model=None), "127.0.0.1", 0, secret=SECRET, max_connections=100)
n_open = len(os.listdir("/proc/self/fd"))
resource.setrlimit(resource.RLIMIT_NOFILE, (n_open + 2, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
print(srv.port, flush=True)
for line in sys.stdin:
    print(json.dumps(srv.drafter.stats.__dict__), flush=True)
"""


def test_accept_failing_with_emfile_does_not_end_the_listener():
    child = subprocess.Popen([sys.executable, "-c", EMFILE_CHILD.format(root=str(ROOT))], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
    held = []
    try:
        port = int(child.stdout.readline())
        server = type("S", (), {"port": port})()
        while True:  # fill the drafter's descriptors with served connections
            try:
                ch, _ = connect(server, timeout_s=2)
            except (AuthError, OSError):
                break
            held.append(ch)
            assert call(ch, {"client": "t", "seqs": []})["drafts"] == []
            assert len(held) < 10, "the descriptor limit was not reached"
        child.stdin.write("stats\n")
        child.stdin.flush()
        assert json.loads(child.stdout.readline())["accept_errors"] >= 1  # accept() failed, EMFILE
        for ch in held:
            ch.sock.close()
        time.sleep(0.2)
        ch, _ = connect(server, timeout_s=10)  # served again once descriptors are free
        assert call(ch, {"client": "t", "seqs": []})["drafts"] == []
        child.stdin.write("stats\n")
        child.stdin.flush()
        stats = json.loads(child.stdout.readline())
        assert stats["accept_failures"] == 0  # the loop never ended
    finally:
        child.kill()
        child.wait(10)


def test_the_replica_shutdown_closes_its_endpoint_once(hf_model):
    """`DrafterServer.shutdown` (what Ray Serve's `__del__` hook calls) drops the listener and every
    connection; a second call is harmless."""
    from deployments.drafter import DrafterServer

    replica = DrafterServer("d", "unused", model=DraftModel(hf_model), host="127.0.0.1", secret=SECRET,
                            max_context=64, max_k=4)
    host, port = replica.server.address.rsplit(":", 1)
    held = socket.create_connection((host, int(port)), timeout=5)
    replica.shutdown()
    held.settimeout(5)  # the held connection is dropped, not left open: past the server's greeting,
    try:                # end of stream or a reset (an open one times out here)
        while held.recv(4096):
            pass
    except ConnectionResetError:
        pass
    held.close()
    with pytest.raises(OSError):
        socket.create_connection((host, int(port)), timeout=2).close()
    replica.shutdown()
    replica.__del__()
