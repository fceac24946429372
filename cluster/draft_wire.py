"""The wire between a target engine's remote proposer and a drafter replica: one framed msgpack
message per target step each way, over a plain TCP connection (no Ray on the per-step path).

A frame is a 4-byte big-endian length followed by a msgpack map.

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

A drafter that lost a sequence's state (restart, eviction) answers `resync` = the committed length
it still has (0 when it knows nothing), with no drafts for it; the target resends from there.
"""

from __future__ import annotations

import socket
import struct
from typing import Any

import msgpack

MAX_FRAME_BYTES = 64 * 1024 * 1024
_LEN = struct.Struct(">I")


class WireError(ConnectionError):
    """The connection broke or carried a malformed frame."""


def send_frame(sock: socket.socket, obj: Any) -> None:
    body = msgpack.packb(obj, use_bin_type=True)
    if len(body) > MAX_FRAME_BYTES:
        raise WireError(f"frame of {len(body)} bytes exceeds {MAX_FRAME_BYTES}")
    sock.sendall(_LEN.pack(len(body)) + body)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise WireError("connection closed by peer")
        buf += chunk
    return bytes(buf)


def recv_frame(sock: socket.socket) -> Any:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > MAX_FRAME_BYTES:
        raise WireError(f"frame of {n} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        return msgpack.unpackb(_recv_exact(sock, n), raw=False, strict_map_key=False)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError) as e:
        raise WireError(f"malformed frame: {e}") from None
