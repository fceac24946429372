"""The drafter's TCP endpoint (`cluster.engine.draft_wire`): target engines connect, prove the shared
secret, and send one request per target step; one thread per connection.

Bounds (`cluster.engine.draft_limits` for what a request may carry):
- connections: at most `max_connections`, of which at most `max_pending` still in their handshake;
  more are closed at once. A handshake must finish within `recv_timeout_s` of the accept.
- a frame must arrive whole within `recv_timeout_s` of its first byte (per frame, not per recv), be
  at most `max_frame_bytes`, and a reply must leave within the same time; a connection with no frame
  for `idle_timeout_s` is closed (the target reconnects when it next calls).
- a request outside the limits gets {"error": ...} and changes nothing; an oversized or
  unauthentic frame gets {"error": ...} when the stream allows and ends the connection.
- accept() failing on a lack of resources (EMFILE, ENFILE, ENOBUFS, ENOMEM) or on an aborted
  connection backs off (10 ms doubling to 1 s) and goes on: the listener outlives it.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time
from typing import Any, Optional

from cluster.engine.draft_limits import BadFrame, WireLimits, parse_request
from cluster.engine.draft_wire import (
    DEFAULT_MAX_FRAME_BYTES, MIN_SECRET_CHARS, BodyError, FrameTooLarge, IdleTimeout, WireError, server_handshake,
)

log = logging.getLogger("specserve.drafter")

TRANSIENT_ACCEPT_ERRNOS = frozenset({
    errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED, errno.EPROTO, errno.EPERM,
    errno.EAGAIN, errno.ETIMEDOUT, errno.ENETDOWN, errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EHOSTDOWN,
})
ACCEPT_BACKOFF_S = (0.01, 1.0)
WARN_EVERY_S = 10.0


class _RateLimitedWarning:
    """At most one WARNING per `every_s` for one kind of event, saying how many happened since."""

    def __init__(self, every_s: float = WARN_EVERY_S):
        self.every_s, self.last, self.suppressed = every_s, float("-inf"), 0
        self._lock = threading.Lock()

    def __call__(self, fmt: str, *args: Any) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self.last < self.every_s:
                self.suppressed += 1
                return
            n, self.suppressed, self.last = self.suppressed, 0, now
        log.warning(fmt + (f" ({n} more like it not logged)" if n else ""), *args)


class DraftServer:
    """TCP endpoint of a Drafter: authenticated connections, one frame in, one frame out."""

    def __init__(self, drafter, host: str = "127.0.0.1", port: int = 0, *, secret: bytes,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, max_tokens_per_call: int = 16384,
                 max_connections: int = 64, idle_timeout_s: float = 300.0, recv_timeout_s: float = 5.0):
        if len(secret) < MIN_SECRET_CHARS:
            raise ValueError(f"drafter endpoint: a secret of at least {MIN_SECRET_CHARS} characters is required")
        self.drafter = drafter
        self._secret = secret
        self.limits = WireLimits(
            max_k=drafter.max_k, vocab_size=drafter.vocab_size, max_seq_tokens=drafter.max_context,
            max_call_tokens=max_tokens_per_call, max_seqs=drafter.max_sequences,
            max_evict=max(1024, 4 * drafter.max_sequences), max_frame_bytes=max_frame_bytes,
            idle_timeout_s=idle_timeout_s,
        )
        self.max_connections = max_connections
        self.max_pending = max(4, max_connections // 4)
        self.recv_timeout_s = recv_timeout_s
        self._sock = socket.create_server((host, port))
        self.host, self.port = host, self._sock.getsockname()[1]
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()  # every accepted connection, pending ones included
        self._pending = 0
        self._warn_refused, self._warn_auth, self._warn_accept = (_RateLimitedWarning() for _ in range(3))
        self._thread = threading.Thread(target=self._accept_loop, name="draft-server", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closed.is_set()

    # -- accepting ---------------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        stats, backoff = self.drafter.stats, 0.0
        while not self._closed.is_set():
            try:
                conn, peer = self._sock.accept()
            except OSError as e:
                if self._closed.is_set():
                    return
                if e.errno in TRANSIENT_ACCEPT_ERRNOS:
                    stats.accept_errors += 1
                    backoff = min(max(2 * backoff, ACCEPT_BACKOFF_S[0]), ACCEPT_BACKOFF_S[1])
                    self._warn_accept("drafter endpoint %s: accept failed (%s: %s); retrying in %.2f s",
                                      self.address, type(e).__name__, e, backoff)
                    self._closed.wait(backoff)
                    continue
                stats.accept_failures += 1
                log.warning("drafter endpoint %s: accept loop ended (%s: %s); %d targets still connected",
                            self.address, type(e).__name__, e, len(self._conns))
                return
            backoff = 0.0
            self._admit(conn, peer)

    def _admit(self, conn: socket.socket, peer: Any) -> None:
        stats = self.drafter.stats
        with self._lock:  # close() sets _closed, then takes this lock to list the connections it drops
            closing = self._closed.is_set()  # accepted as close() began: it will not see this one
            full = len(self._conns) >= self.max_connections or self._pending >= self.max_pending
            if not (closing or full):
                self._conns.add(conn)
                self._pending += 1
        if closing:
            _close(conn)
            return
        if full:
            stats.connections_refused += 1
            self._warn_refused("drafter endpoint %s: refused a connection from %s (%d connections, %d in "
                               "their handshake; at most %d and %d)", self.address, _peer(peer), len(self._conns),
                               self._pending, self.max_connections, self.max_pending)
            _close(conn)
            return
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn, peer), name="draft-conn", daemon=True).start()
        except (OSError, RuntimeError) as e:  # the peer already left, or no thread to be had: drop it
            self._forget(conn, pending=True)
            _close(conn)
            stats.accept_errors += 1
            self._warn_accept("drafter endpoint %s: could not serve %s (%s: %s)", self.address, _peer(peer),
                              type(e).__name__, e)

    def _forget(self, conn: socket.socket, pending: bool) -> None:
        with self._lock:
            self._conns.discard(conn)
            if pending:
                self._pending -= 1

    # -- one connection ----------------------------------------------------------------------------

    def _handshake(self, conn: socket.socket, peer: Any):
        try:
            return server_handshake(conn, self._secret, self.limits.to_wire(),
                                    time.monotonic() + self.recv_timeout_s, self.limits.max_frame_bytes)
        except Exception as e:  # noqa: BLE001 - WireError, OSError, or a bug: this peer is dropped, the rest go on
            if self._closed.is_set():
                return None  # close() cut it short: not the peer's failure
            self.drafter.stats.handshake_failures += 1
            self._warn_auth("drafter endpoint %s: a connection from %s failed its handshake: %s", self.address,
                            _peer(peer), f"{type(e).__name__}: {e}"[:200])
            return None
        finally:
            with self._lock:
                self._pending -= 1

    def _serve(self, conn: socket.socket, peer: Any = None) -> None:
        """One target's connection: the handshake, then frames in, replies out, until either side
        ends it. An end that close() did not cause is logged at WARNING with the peer and why, and
        counted (an idle connection's end only at INFO)."""
        stats, frames, why, error, idle = self.drafter.stats, 0, "", False, False
        with conn:
            ch = self._handshake(conn, peer)
            if ch is None:
                self._forget(conn, pending=False)
                return
            stats.connections += 1
            try:
                while not self._closed.is_set():
                    try:
                        msg = ch.recv(time.monotonic() + self.limits.idle_timeout_s, self.recv_timeout_s)
                    except BodyError as e:  # authentic but not msgpack: say so, the stream is intact
                        stats.bad_frames += 1
                        reply: dict = {"error": str(e)}
                    else:
                        reply = self.handle(msg)
                    ch.send(reply, time.monotonic() + self.recv_timeout_s)
                    frames += 1
            except IdleTimeout:
                idle = True
            except FrameTooLarge as e:  # the rest of the stream cannot be read: say why, then end
                stats.bad_frames += 1
                why, error = str(e), True
                _try_send(ch, {"error": str(e)}, time.monotonic() + self.recv_timeout_s)
            except WireError as e:  # closed by the peer, a frame that failed its tag or came too slowly
                why, error = str(e), str(e) != "connection closed by peer"
            except Exception as e:  # noqa: BLE001 - a socket error or a bug: the loop ends, logged and counted
                why, error = f"{type(e).__name__}: {e}", True
            finally:
                self._forget(conn, pending=False)
                stats.connections -= 1
        if self._closed.is_set():
            return
        if idle:
            stats.idle_closed += 1
            log.info("drafter endpoint %s: closed a connection from %s idle for %.0f s", self.address, _peer(peer),
                     self.limits.idle_timeout_s)
            return
        stats.connections_ended += 1
        stats.connection_errors += int(error)
        log.warning("drafter endpoint %s: connection from %s ended after %d frames: %s", self.address,
                    _peer(peer), frames, why[:200])

    def handle(self, msg: Any) -> dict:
        """One request -> one reply; a request outside the limits gets {"error": ...} and changes nothing."""
        try:
            client, seqs, evict = parse_request(msg, self.limits)
        except BadFrame as e:
            self.drafter.stats.bad_frames += 1
            return {"error": f"bad request: {e}"}
        t0 = time.perf_counter()
        drafts, resync = self.drafter.propose(client, seqs, evict)
        return {"drafts": drafts, "resync": resync, "compute_s": time.perf_counter() - t0}

    def close(self) -> None:
        """Stop listening and drop every connection (targets see the drafter go away at once)."""
        self._closed.set()
        with self._lock:
            socks = [self._sock, *self._conns]
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            _close(s)


def _try_send(ch, obj: Any, deadline: float) -> None:
    try:
        ch.send(obj, deadline)
    except (OSError, WireError):
        pass


def _close(s: socket.socket) -> None:
    try:
        s.close()
    except OSError:
        pass


def _peer(peer: Optional[Any]) -> str:
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else str(peer)
