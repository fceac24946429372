"""The drafter endpoint's loops, without a model: a connection's serve loop and the accept loop
ending (other than by close()) are logged at WARNING with the peer and the reason, and counted in
the drafter's stats."""

from __future__ import annotations

import logging
import socket
import struct
import time

from deployments.drafter import Drafter, DraftServer
from tests.drafter_peer import SECRET, call, connect
from tests.waiting import wait_until


def server():
    return DraftServer(Drafter(model=None), "127.0.0.1", 0, secret=SECRET)


def warnings(caplog, srv=None) -> list[str]:
    """The drafter's WARNINGs (of `srv` only: servers of earlier tests may still be closing)."""
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "specserve.drafter"
            and (srv is None or srv.address in r.getMessage())]


def test_a_peer_closing_its_connection_is_logged_and_counted(caplog):
    srv = server()
    stats = srv.drafter.stats
    try:
        with caplog.at_level(logging.WARNING, logger="specserve.drafter"):
            ch, _ = connect(srv)
            with ch.sock:
                assert call(ch, {"client": "t", "seqs": []})["drafts"] == []  # a ping
                assert wait_until(lambda: stats.connections == 1, timeout_s=30)
                port = ch.sock.getsockname()[1]
            assert wait_until(lambda: stats.connections_ended == 1, timeout_s=30)
        assert stats.connections == 0 and stats.connection_errors == 0
        (msg,) = warnings(caplog, srv)
        assert f"127.0.0.1:{port}" in msg and "after 1 frames" in msg and "closed by peer" in msg
    finally:
        srv.close()


def test_an_oversized_frame_ends_the_connection_as_an_error(caplog):
    srv = server()
    stats = srv.drafter.stats
    try:
        with caplog.at_level(logging.WARNING, logger="specserve.drafter"):
            ch, _ = connect(srv)
            with ch.sock:
                ch.sock.sendall(struct.pack(">I", 2**31))  # a frame far past the limit
                assert wait_until(lambda: stats.connection_errors == 1, timeout_s=30)
        assert stats.connections_ended == 1
        assert any("exceeds" in m for m in warnings(caplog, srv))
    finally:
        srv.close()


def test_a_bug_in_handling_a_frame_ends_the_connection_logged_not_silently(caplog, monkeypatch):
    srv = server()
    monkeypatch.setattr(srv, "handle", lambda msg: 1 / 0)
    try:
        with caplog.at_level(logging.WARNING, logger="specserve.drafter"):
            ch, _ = connect(srv)
            with ch.sock:
                ch.send({"client": "t", "seqs": []}, time.monotonic() + 5)
                assert wait_until(lambda: srv.drafter.stats.connection_errors == 1, timeout_s=30)
        assert any("ZeroDivisionError" in m for m in warnings(caplog, srv))
        assert srv.alive()  # the listener is unaffected
    finally:
        srv.close()


def test_the_accept_loop_ending_on_an_error_is_logged_and_counted(caplog):
    srv = server()
    try:
        with caplog.at_level(logging.WARNING, logger="specserve.drafter"):
            srv._sock.shutdown(socket.SHUT_RDWR)  # the listening socket fails under the loop
            srv._sock.close()
            assert wait_until(lambda: not srv._thread.is_alive(), timeout_s=30)
        assert srv.drafter.stats.accept_failures == 1 and not srv.alive()
        assert any("accept loop ended" in m and srv.address in m for m in warnings(caplog))
    finally:
        srv.close()


def test_close_ends_the_loops_without_warnings(caplog):
    srv = server()
    with caplog.at_level(logging.WARNING, logger="specserve.drafter"):
        ch, _ = connect(srv)
        assert wait_until(lambda: srv.drafter.stats.connections == 1, timeout_s=30)
        srv.close()
        assert wait_until(lambda: srv.drafter.stats.connections == 0 and not srv._thread.is_alive(), timeout_s=30)
        ch.sock.close()
    assert warnings(caplog, srv) == [] and srv.drafter.stats.accept_failures == 0
