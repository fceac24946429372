"""The drafter wire's connection layer over socket pairs: both sides prove the shared secret, every
frame after the handshake is authenticated (tampered, replayed and reflected frames fail), and
every read is bounded per frame, not per recv."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest

from cluster.engine.draft_wire import (
    HANDSHAKE_MAX_BYTES, SECRET_ENV, AuthError, BodyError, FrameReader, FrameTooLarge, IdleTimeout, WireError,
    WireTimeout, client_handshake, secret_from_env, send_payload, server_handshake,
)

from tests.drafter_peer import send_body  # noqa: E402

SECRET = b"s" * 32
LIMITS = {"max_k": 4}


def handshake(server_secret=SECRET, client_secret=SECRET):
    """(server channel or its exception, client channel or its exception, client's limits)."""
    a, b = socket.socketpair()
    out: dict = {}

    def serve():
        try:
            out["server"] = server_handshake(a, server_secret, LIMITS, time.monotonic() + 5, 1 << 16)
        except Exception as e:  # noqa: BLE001 - returned to the test
            out["server"] = e

    t = threading.Thread(target=serve)
    t.start()
    try:
        ch, limits = client_handshake(b, client_secret, time.monotonic() + 5, 1 << 16)
        out["client"], out["limits"] = ch, limits
    except Exception as e:  # noqa: BLE001
        out["client"], out["limits"] = e, None
    t.join(5)
    return out["server"], out["client"], out["limits"]


def test_both_sides_prove_the_secret_and_the_drafter_sends_its_limits():
    server, client, limits = handshake()
    assert limits == LIMITS
    client.send({"x": 1}, time.monotonic() + 5)
    assert server.recv(time.monotonic() + 5) == {"x": 1}
    server.send({"y": 2}, time.monotonic() + 5)
    assert client.recv(time.monotonic() + 5) == {"y": 2}


def test_a_client_without_the_secret_is_refused():
    server, client, _ = handshake(client_secret=b"w" * 32)
    assert isinstance(server, AuthError) and "did not prove" in str(server)
    assert isinstance(client, AuthError) and SECRET_ENV in str(client)


def test_an_impostor_drafter_is_not_believed():
    """A drafter with another secret cannot tag its limits frame: the target refuses it."""
    server, client, _ = handshake(server_secret=b"i" * 32)
    assert isinstance(client, AuthError) and isinstance(server, AuthError)


def _pair():
    server, client, _ = handshake()
    return server, client


def test_a_tampered_frame_fails_its_tag():
    server, client = _pair()
    raw = _capture(client, {"seqs": [[1, 2]]})
    tampered = raw[:-1] + bytes([raw[-1] ^ 1])
    client.sock.sendall(tampered)
    with pytest.raises(AuthError, match="failed authentication"):
        server.recv(time.monotonic() + 5)


def test_a_replayed_frame_fails_its_tag():
    server, client = _pair()
    raw = _capture(client, {"n": 1})
    client.sock.sendall(raw)
    assert server.recv(time.monotonic() + 5) == {"n": 1}
    client.sock.sendall(raw)  # the same bytes again: frame number 1 expected, 0 tagged
    with pytest.raises(AuthError):
        server.recv(time.monotonic() + 5)


def test_a_frame_reflected_back_to_its_sender_fails_its_tag():
    server, client = _pair()
    raw = _capture(server, {"drafts": []})  # the drafter's own reply, sent back to it as a request
    client.sock.sendall(raw)
    with pytest.raises(AuthError):
        server.recv(time.monotonic() + 5)


def _capture(ch, obj) -> bytes:
    """The bytes `ch` would send for `obj` (its frame counter advances as for a real send)."""
    sent = []
    real = ch.sock
    ch.sock = type("S", (), {"settimeout": lambda self, t: None, "sendall": lambda self, b: sent.append(b)})()
    try:
        ch.send(obj, time.monotonic() + 5)
    finally:
        ch.sock = real
    return sent[0]


def test_an_authentic_frame_that_is_not_msgpack_is_a_body_error_and_the_stream_goes_on():
    server, client = _pair()
    send_body(client, b"\xc1")  # never valid msgpack
    with pytest.raises(BodyError):
        server.recv(time.monotonic() + 5)
    client.send({"ok": 1}, time.monotonic() + 5)
    assert server.recv(time.monotonic() + 5) == {"ok": 1}


def test_a_length_prefix_past_the_bound_is_refused_without_reading_the_body():
    a, b = socket.socketpair()
    b.sendall(struct.pack(">I", 2**31))
    with pytest.raises(FrameTooLarge, match="exceeds 65536"):
        FrameReader(a).frame(1 << 16, time.monotonic() + 5)


def test_handshake_frames_are_bounded_at_4_kib():
    a, b = socket.socketpair()
    b.sendall(struct.pack(">I", HANDSHAKE_MAX_BYTES + 1))
    with pytest.raises(AuthError, match="exceeds"):
        server_handshake(a, SECRET, LIMITS, time.monotonic() + 5, 1 << 16)


def test_a_frame_must_arrive_whole_within_its_timeout_however_it_trickles():
    a, b = socket.socketpair()
    stop = threading.Event()

    def trickle():  # a 1000-byte frame, one byte every 20 ms: every recv gets data in time
        data = struct.pack(">I", 1000) + b"x" * 1000
        for i in range(len(data)):
            if stop.wait(0.02):
                return
            try:
                b.send(data[i:i + 1])
            except OSError:
                return

    threading.Thread(target=trickle, daemon=True).start()
    t0 = time.monotonic()
    with pytest.raises(WireTimeout) as e:
        FrameReader(a).frame(1 << 16, time.monotonic() + 5, frame_timeout_s=0.3)
    stop.set()
    assert not isinstance(e.value, IdleTimeout)
    assert time.monotonic() - t0 < 5  # the frame's timeout, not 1004 x 20 ms


def test_no_frame_at_all_is_an_idle_timeout():
    a, _b = socket.socketpair()
    with pytest.raises(IdleTimeout):
        FrameReader(a).frame(1 << 16, time.monotonic() + 0.1, frame_timeout_s=5)


def test_a_peer_that_closes_mid_frame_is_a_wire_error():
    a, b = socket.socketpair()
    b.sendall(struct.pack(">I", 10) + b"abc")
    b.close()
    with pytest.raises(WireError, match="closed by peer"):
        FrameReader(a).frame(1 << 16, time.monotonic() + 5)


def test_frames_that_arrive_together_are_read_one_by_one():
    a, b = socket.socketpair()
    send_payload(b, b"one", time.monotonic() + 5)
    send_payload(b, b"two", time.monotonic() + 5)
    time.sleep(0.05)
    r = FrameReader(a)
    assert r.frame(100, time.monotonic() + 5) == b"one"
    assert r.frame(100, time.monotonic() + 5) == b"two"


def test_the_secret_comes_from_the_environment_and_is_never_echoed():
    assert secret_from_env({SECRET_ENV: "x" * 16}) == b"x" * 16
    for env in ({}, {SECRET_ENV: "short-secret"}):
        with pytest.raises(AuthError) as e:
            secret_from_env(env)
        assert SECRET_ENV in str(e.value) and "short-secret" not in str(e.value)
