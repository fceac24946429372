"""The wire between a target engine's remote proposer and a drafter replica: one framed msgpack
message per target step each way, over a TCP connection both ends authenticated with a shared
secret (no Ray on the per-step path). What a message may carry: `cluster.engine.draft_limits`.

Connecting (the drafter speaks first; handshake frames are plain and at most 4 KiB)::

    drafter -> target   {"v": 2, "nonce": Ns}                          16 random bytes each
    target  -> drafter  {"nonce": Nc, "proof": HMAC(S, "client" Ns Nc)}
    drafter -> target   {"limits": {...}}   the first authenticated frame (below), which proves S
                        or {"error": "authentication failed"}, plain, and the connection closes

S is the shared secret: the variable SECRET_ENV in both processes' environment (a Kubernetes
Secret in production; `specserve up` makes a new one per start). Neither side sends it, and a
recorded handshake is useless against the other side's fresh nonce. Every frame after that is

    4-byte big-endian length n | 16-byte tag | msgpack body (n - 16 bytes)
    tag = BLAKE2b-128(key K; direction | frame number | body),   K = HMAC-SHA256(S, "session" Ns Nc)

so a frame injected into the connection, replayed, reordered or reflected back fails its tag. The
body is not encrypted: the wire carries token ids between pods, as Ray's own traffic does
(docs/security.md). Why this and not gRPC: the per-step round trip, measured in docs/security.md.

Request (target -> drafter), one per target step for the whole running batch::

    {"client": str,                      # the target engine's proposer (its sequences' namespace)
     "evict": [seq_id, ...],             # sequences that finished since the last call
     "seqs": [[seq_id, start, tokens, k], ...]}

`tokens` are the sequence's committed tokens from position `start` on (the prompt on the first
call, then what the target accepted plus its bonus token). An empty `seqs` is a ping.

Reply (drafter -> target)::

    {"drafts": [[int, ...], ...],        # up to k draft tokens per sequence, in request order
     "resync": [int, ...],               # -1, or the position the drafter needs tokens from
     "compute_s": float}                 # drafter's own work for this call (the rest is transport)
    or {"error": str}                    # a request outside the limits; no sequence's state changed

A drafter that lost a sequence's state (restart, eviction) answers `resync` = the committed length
it still has (0 when it knows nothing), with no drafts for it; the target resends from there.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import struct
import time
from typing import Any, Mapping, Optional

import msgpack

PROTOCOL = 2
SECRET_ENV = "SPECSERVE_DRAFTER_SECRET"
MIN_SECRET_CHARS = 16
DEFAULT_MAX_FRAME_BYTES = 1 << 20
HANDSHAKE_MAX_BYTES = 4096
NONCE_BYTES = 16
TAG_BYTES = 16
_LEN = struct.Struct(">I")
_NUM = struct.Struct(">Q")
_CLIENT, _SERVER, _SESSION = b"specserve-drafter client", b"specserve-drafter server", b"specserve-drafter session"


class WireError(ConnectionError):
    """The connection broke, timed out, failed authentication or carried a frame it cannot go on
    after; it must be closed."""


class WireTimeout(WireError):
    """A deadline passed before a whole frame arrived or left."""


class IdleTimeout(WireTimeout):
    """No frame began before the deadline: the peer sent nothing."""


class AuthError(WireError):
    """The handshake failed, or a frame's tag did not verify."""


class FrameTooLarge(WireError):
    """A length prefix past the bound (the frame is not read)."""


class BodyError(ValueError):
    """An authentic frame whose body is not msgpack: the stream is intact, the connection may go on."""


# -- the secret ---------------------------------------------------------------------------------------


def new_secret() -> str:
    return secrets.token_urlsafe(32)


def secret_from_env(environ: Mapping[str, str] = os.environ, name: str = SECRET_ENV) -> bytes:
    """The shared secret, or AuthError saying what to set (never its value)."""
    value = environ.get(name, "")
    if len(value) < MIN_SECRET_CHARS:
        raise AuthError(f"drafter wire: {name} is {'too short' if value else 'not set'} in this process's "
                        f"environment (a secret of at least {MIN_SECRET_CHARS} characters, the same for "
                        "drafters and engines; `specserve up` sets one for a local Ray)")
    return value.encode()


# -- bounded socket I/O -------------------------------------------------------------------------------


def _left(deadline: float, what: str) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise WireTimeout(f"timed out {what}")
    return left


class FrameReader:
    """Reads length-prefixed frames from a socket, each within its deadline. What one recv brings
    beyond the frame stays for the next (at most 64 KiB: memory is bounded by the frame bound)."""

    CHUNK = 65536

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = bytearray()

    def _fill(self, deadline: float, want: int) -> None:
        self.sock.settimeout(_left(deadline, "waiting for a frame"))
        try:
            chunk = self.sock.recv(min(max(want, self.CHUNK), 1 << 20))
        except socket.timeout:
            raise WireTimeout("timed out waiting for a frame") from None
        if not chunk:
            raise WireError("connection closed by peer")
        self.buf += chunk

    def frame(self, max_bytes: int, deadline: float, frame_timeout_s: Optional[float] = None) -> bytes:
        """One frame's payload. Its first byte must come by `deadline` (else IdleTimeout); all of it
        by `deadline` too, or, with `frame_timeout_s`, within that long of its first byte (a whole
        frame per timeout, not a recv: a peer trickling bytes cannot hold the connection past it)."""
        if not self.buf:
            try:
                self._fill(deadline, _LEN.size)
            except WireTimeout:
                raise IdleTimeout("no frame began in time") from None
        if frame_timeout_s is not None:
            deadline = time.monotonic() + frame_timeout_s
        while len(self.buf) < _LEN.size:
            self._fill(deadline, _LEN.size - len(self.buf))
        (n,) = _LEN.unpack_from(self.buf)
        if n > max_bytes:
            raise FrameTooLarge(f"frame of {n} bytes exceeds {max_bytes}")
        end = _LEN.size + n
        while len(self.buf) < end:
            self._fill(deadline, end - len(self.buf))
        payload = bytes(self.buf[_LEN.size:end])
        del self.buf[:end]
        return payload


def send_payload(sock: socket.socket, payload: bytes, deadline: float) -> None:
    sock.settimeout(_left(deadline, "sending a frame"))
    try:
        sock.sendall(_LEN.pack(len(payload)) + payload)
    except socket.timeout:
        raise WireTimeout("timed out sending a frame (the peer does not read)") from None


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(body: bytes) -> Any:
    """msgpack -> Python; BodyError for anything that is not one whole msgpack object."""
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=True)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError, TypeError) as e:
        raise BodyError(f"malformed frame: {type(e).__name__}: {str(e)[:100]}") from None


# -- the authenticated channel ------------------------------------------------------------------------


class Channel:
    """A connection after the handshake: frames tagged with the session key, numbered each way.
    The tag is keyed BLAKE2b (a MAC by construction, a third of HMAC-SHA256's time per frame here)."""

    def __init__(self, reader: FrameReader, key: bytes, outgoing: bytes, incoming: bytes, max_recv_bytes: int):
        self.reader, self.sock = reader, reader.sock
        self._key, self._out, self._in = key, outgoing, incoming
        self._sent = self._received = 0
        self.max_recv_bytes = max_recv_bytes

    def _tag(self, direction: bytes, number: int, body: bytes) -> bytes:
        h = hashlib.blake2b(direction + _NUM.pack(number), key=self._key, digest_size=TAG_BYTES)
        h.update(body)
        return h.digest()

    def send(self, obj: Any, deadline: float, max_bytes: Optional[int] = None) -> None:
        body = pack(obj)
        if max_bytes is not None and len(body) + TAG_BYTES > max_bytes:
            raise FrameTooLarge(f"frame of {len(body) + TAG_BYTES} bytes exceeds {max_bytes}")
        tag = self._tag(self._out, self._sent, body)
        self._sent += 1
        send_payload(self.sock, tag + body, deadline)

    def recv(self, deadline: float, frame_timeout_s: Optional[float] = None) -> Any:
        """The next frame's object (`FrameReader.frame` for the deadlines). AuthError on a bad tag;
        BodyError (the connection may go on) on an authentic frame that is not msgpack."""
        return unpack(self.recv_authentic(deadline, frame_timeout_s))

    def recv_authentic(self, deadline: float, frame_timeout_s: Optional[float] = None) -> bytes:
        payload = self.reader.frame(self.max_recv_bytes, deadline, frame_timeout_s)
        tag, body = payload[:TAG_BYTES], payload[TAG_BYTES:]
        if len(payload) < TAG_BYTES or not hmac.compare_digest(tag, self._tag(self._in, self._received, body)):
            raise AuthError("frame failed authentication")
        self._received += 1
        return body


def _proof(secret: bytes, role: bytes, ns: bytes, nc: bytes) -> bytes:
    return hmac.digest(secret, role + ns + nc, "sha256")


def _recv_plain(reader: FrameReader, deadline: float) -> dict:
    try:
        msg = unpack(reader.frame(HANDSHAKE_MAX_BYTES, deadline))
    except (BodyError, FrameTooLarge) as e:
        raise AuthError(f"handshake: {e}") from None
    if not isinstance(msg, dict):
        raise AuthError("handshake: not a map")
    return msg


def _nonce(msg: dict, key: str) -> bytes:
    v = msg.get(key)
    if not isinstance(v, bytes) or len(v) != NONCE_BYTES:
        raise AuthError(f"handshake: no {key}")
    return v


def server_handshake(sock: socket.socket, secret: bytes, limits: dict, deadline: float,
                     max_recv_bytes: int) -> Channel:
    """The drafter's side: the peer must prove the secret by `deadline`; it then gets `limits`."""
    reader, ns = FrameReader(sock), os.urandom(NONCE_BYTES)
    send_payload(sock, pack({"v": PROTOCOL, "nonce": ns}), deadline)
    msg = _recv_plain(reader, deadline)
    nc, proof = _nonce(msg, "nonce"), msg.get("proof")
    if not isinstance(proof, bytes) or not hmac.compare_digest(proof, _proof(secret, _CLIENT, ns, nc)):
        try:
            send_payload(sock, pack({"error": "authentication failed"}), deadline)
        except (OSError, WireError):
            pass
        raise AuthError("the peer did not prove the shared secret")
    ch = Channel(reader, _proof(secret, _SESSION, ns, nc), b"s", b"c", max_recv_bytes)
    ch.send({"limits": limits}, deadline)
    return ch


def client_handshake(sock: socket.socket, secret: bytes, deadline: float, max_recv_bytes: int) -> tuple[Channel, Any]:
    """The target's side: prove the secret, check the drafter's proof; -> (channel, its limits as sent)."""
    reader = FrameReader(sock)
    hello = _recv_plain(reader, deadline)
    if hello.get("v") != PROTOCOL:
        raise AuthError(f"handshake: not a drafter of wire protocol {PROTOCOL}")
    ns, nc = _nonce(hello, "nonce"), os.urandom(NONCE_BYTES)
    send_payload(sock, pack({"nonce": nc, "proof": _proof(secret, _CLIENT, ns, nc)}), deadline)
    ch = Channel(reader, _proof(secret, _SESSION, ns, nc), b"c", b"s", max_recv_bytes)
    try:
        first = ch.recv_authentic(deadline)
    except AuthError:
        raise AuthError("the drafter refused the shared secret, or did not prove it (a different "
                        f"{SECRET_ENV} on the two sides?)") from None
    try:
        msg = unpack(first)
    except BodyError as e:
        raise AuthError(f"handshake: {e}") from None
    if not isinstance(msg, dict) or "limits" not in msg:
        raise AuthError("handshake: no limits from the drafter")
    return ch, msg["limits"]
