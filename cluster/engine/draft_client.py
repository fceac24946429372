"""The target's end of the drafter wire (`cluster.engine.draft_wire`): one persistent, authenticated TCP
connection to one drafter replica (`TcpDraftClient`), the `connector` that makes them with the wire's secret
from the engine's environment, and `plan_call`, which keeps a call inside the limits the drafter announced
(`cluster.engine.draft_limits`). Every failure of a call is `DrafterUnavailable`, after which the step goes
on without drafts; `cluster.engine.remote_proposer.RemoteDraftSession` calls through here once per step.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any, Callable, Optional

from cluster.engine.draft_limits import WireLimits
from cluster.engine.draft_wire import BodyError, Channel, WireError, client_handshake, secret_from_env

FRAME_HEADROOM = 1024  # a request's bytes besides its sequences and evictions (client id, keys, tag)
MAX_REPLY_BYTES = 1 << 20  # a reply is drafts: at most max_seqs x max_k ids (4 MiB would be 500 000 ids)


class DrafterUnavailable(ConnectionError):
    """The drafter did not answer in time, refused, or answered garbage; the step goes on without drafts."""


class TcpDraftClient:
    """One persistent, authenticated connection to one drafter replica (`cluster.engine.draft_wire`); any
    error closes it (reconnect next call). Every method is bounded by the caller's deadline."""

    def __init__(self, endpoint: str, secret: bytes, max_reply_bytes: int = MAX_REPLY_BYTES):
        host, _, port = endpoint.rpartition(":")
        self.endpoint = endpoint
        self._addr = (host, int(port))
        self._secret = secret
        self.max_reply_bytes = max_reply_bytes
        self._ch: Optional[Channel] = None
        self.limits: Optional[WireLimits] = None
        self._last_used = 0.0

    def open(self, deadline: float) -> WireLimits:
        """Connect and authenticate unless connected; -> the drafter's limits. A connection unused for
        half the drafter's idle timeout is replaced first (the drafter may be closing it)."""
        now = time.monotonic()
        if self._ch is not None and now - self._last_used > self.limits.idle_timeout_s / 2:
            self.close()
        if self._ch is None:
            try:
                sock = socket.create_connection(self._addr, timeout=max(deadline - now, 1e-3))
                try:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    ch, raw = client_handshake(sock, self._secret, deadline, self.max_reply_bytes)
                    self.limits = WireLimits.from_wire(raw)
                except BaseException:
                    sock.close()
                    raise
            except (OSError, WireError, BodyError) as e:  # socket.timeout is an OSError; bad limits (BadFrame) go up as they are
                raise DrafterUnavailable(f"connect: {type(e).__name__}: {e}") from None
            self._ch = ch
        self._last_used = now
        return self.limits

    def call(self, msg: dict, deadline: float) -> Any:
        """One request, one reply (unchecked: the session checks it against what it asked)."""
        if self._ch is None:
            raise DrafterUnavailable("not connected")
        try:
            self._ch.send(msg, deadline, max_bytes=self.limits.max_frame_bytes)
            reply = self._ch.recv(deadline)
        except (OSError, WireError, BodyError) as e:
            self.close()  # a late reply must never be read as the next step's
            raise DrafterUnavailable(f"{type(e).__name__}: {e}") from None
        self._last_used = time.monotonic()
        return reply

    def close(self) -> None:
        if self._ch is not None:
            try:
                self._ch.sock.close()
            except OSError:
                pass
            self._ch = None


def plan_call(todo: list, sent: dict[str, int], evict: set[str], lim: WireLimits) -> tuple[list, list, list[str]]:
    """Keep a call inside the drafter's limits. todo: [(index, SeqWork)] with K > 0.

    -> (calls: [(index, SeqWork, start, k)], seqs: the request's entries, evict: ids to send).
    A sequence past the drafter's context, with an id too long, or whose new tokens hold an id
    outside the drafter's vocabulary is not sent (and the drafter forgets it); sequences past the
    call's sequence, token or frame-size budget wait for the next step; K is capped at max_k."""
    sendable = []
    for i, w in todo:
        if len(w.tokens) > lim.max_seq_tokens or not 0 < len(w.req_id) <= lim.max_id_chars:
            if sent.pop(w.req_id, None) is not None:
                evict.add(w.req_id)
        else:
            sendable.append((i, w))
    evict_now = sorted(evict)[: lim.max_evict]
    calls, seqs, budget = [], [], lim.max_call_tokens
    room = lim.max_frame_bytes - FRAME_HEADROOM - sum(len(e) + 3 for e in evict_now)  # msgpack sizes, at most
    for i, w in sendable:
        n = len(w.tokens)
        start = min(sent.get(w.req_id, 0), n)
        new = [int(t) for t in w.tokens[start:]]
        size = len(w.req_id) + 5 * len(new) + 24
        if (len(calls) >= lim.max_seqs or len(new) > budget or size > room
                or (new and not 0 <= min(new) <= max(new) < lim.vocab_size)):
            continue
        budget, room = budget - len(new), room - size
        k = min(int(w.k), lim.max_k)
        calls.append((i, w, start, k))
        seqs.append([w.req_id, start, new, k])
    return calls, seqs, evict_now


def connector(environ=None) -> Callable[[str], TcpDraftClient]:
    """endpoint -> TcpDraftClient with the wire's secret from this process's environment (the engine
    core inherits the replica's). Without one, every call fails saying what to set (last_error)."""
    try:
        secret = secret_from_env(os.environ if environ is None else environ)
    except WireError as e:
        missing = str(e)

        def refuse(endpoint: str) -> TcpDraftClient:
            raise DrafterUnavailable(missing)

        return refuse
    return lambda endpoint: TcpDraftClient(endpoint, secret)
