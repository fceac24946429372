"""The engine replica's local lane: a router on the same node streams a generation straight from the
replica over a Unix socket, instead of through a Ray Serve handle call.

A handle call crosses Ray's actor transport (gRPC, with Ray's mutual TLS) and Serve's routing and
replica wrappers in both processes; on a 2-core machine that was most of what the path added before
the first token (BENCHMARKS.md, time to first token). The lane is one connection per request on a
socket in the node's Ray session folder (folder 0700, socket 0600: this user's processes only, as
Ray's own sockets there), carrying length-prefixed JSON frames:

    router -> replica   {"req": EngineRequest}            (the OpenAI body as a latin-1 string)
    replica -> router   {"chunk": EngineChunk} ...        then {"end": true}
                        or {"error": {"kind", "message"}}  kind: engine_dead | invalid | busy | internal

What the handle call gave is kept: the replica admits `max_ongoing_requests` calls at once and lets
`max_queued_requests` more wait (`cluster.api.admission.Admission`, Serve's bound), then answers
`busy` (the router's 429); a router that hangs up aborts the request in vLLM (the replica watches its
connection); a dead engine answers `engine_dead`, which the router retries once as before. The calls
on the lane are added to the replica's autoscaling metrics (`lane_ongoing`), since Serve does not
see them. The router side is `deployments.router_lane`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import os
import struct
import time
from contextlib import aclosing
from typing import Any, AsyncIterator, Callable, Optional

from cluster.api.admission import Admission, Full
from deployments.engine_death import EngineDead
from deployments.engine_types import EngineChunk, EngineRequest

log = logging.getLogger("specserve.engine")

LANE_FOLDER = "specserve-lanes"
MAX_FRAME_BYTES = 64 * 1024 * 1024  # a request frame holds the body the router already bounded
REQUEST_READ_TIMEOUT_S = 10.0  # a connection that sends no request within this is closed
SUN_PATH_MAX = 107  # Linux's bound on a Unix socket's path


class LaneClosed(ConnectionError):
    """The other end closed the lane before a whole frame came."""


# -- frames (pure) ---------------------------------------------------------------------------------


def frame(obj: dict[str, Any]) -> bytes:
    """One frame: 4-byte big-endian length, then compact JSON.

    >>> frame({"end": True})
    b'\\x00\\x00\\x00\\x0c{"end":true}'
    """
    data = json.dumps(obj, separators=(",", ":")).encode()
    return struct.pack(">I", len(data)) + data


async def read_frame(reader: asyncio.StreamReader, max_bytes: int = MAX_FRAME_BYTES) -> dict[str, Any]:
    """The next frame's object; LaneClosed at end of stream, ValueError past `max_bytes` or not JSON."""
    try:
        head = await reader.readexactly(4)
        (n,) = struct.unpack(">I", head)
        if n > max_bytes:
            raise ValueError(f"lane frame of {n} bytes exceeds {max_bytes}")
        obj = json.loads(await reader.readexactly(n))
    except asyncio.IncompleteReadError:
        raise LaneClosed("lane closed") from None
    if not isinstance(obj, dict):
        raise ValueError("lane frame is not a JSON object")
    return obj


def request_to_wire(req: EngineRequest) -> dict[str, Any]:
    d = dataclasses.asdict(req)
    if req.openai is not None:
        d["openai"] = {**req.openai, "body": bytes(req.openai["body"]).decode("latin-1")}
    return d


def request_from_wire(d: dict[str, Any]) -> EngineRequest:
    """The inverse of `request_to_wire`.

    >>> r = EngineRequest("r", "ngram", 3, k_step_alpha=0.5, openai={"path": "/v1/x", "body": b"{}"})
    >>> request_from_wire(json.loads(json.dumps(request_to_wire(r)))) == r
    True
    """
    d = dict(d)
    if d.get("openai") is not None:
        d["openai"] = {**d["openai"], "body": str(d["openai"]["body"]).encode("latin-1")}
    return EngineRequest(**d)


def chunk_from_wire(d: dict[str, Any]) -> EngineChunk:
    """An EngineChunk from its frame (logprobs' token ids come back as ints).

    >>> c = EngineChunk("a", [1], logprobs=[{5: -0.5}], stats={"k": 3})
    >>> chunk_from_wire(json.loads(json.dumps(dataclasses.asdict(c)))) == c
    True
    """
    d = dict(d)
    if d.get("logprobs") is not None:
        d["logprobs"] = [{int(t): lp for t, lp in pos.items()} for pos in d["logprobs"]]
    return EngineChunk(**d)


def error_kind(e: BaseException) -> str:
    """How a replica-side failure crosses the lane (the router raises it again as the same kind)."""
    if isinstance(e, EngineDead):
        return "engine_dead"
    if isinstance(e, Full):
        return "busy"
    if isinstance(e, ValueError):
        return "invalid"
    return "internal"


# -- where the lanes are ---------------------------------------------------------------------------


def pool_tag(pool: str) -> str:
    """A short, path-safe tag of a pool name (pool names are free text in the config)."""
    return hashlib.sha1(pool.encode()).hexdigest()[:10]


def lane_path(folder: str, pool: str, replica: str) -> str:
    """`folder/<pool tag>-<replica suffix>.sock`; the replica id is `<pool>-<hex>` (EngineServer)."""
    return os.path.join(folder, f"{pool_tag(pool)}-{replica.rsplit('-', 1)[-1]}.sock")


def node_lane_folder() -> Optional[str]:
    """This node's lane folder (in Ray's session folder, which every worker of the node shares), or
    None outside a Ray worker."""
    try:
        import ray

        return os.path.join(ray._private.worker.global_worker.node.get_session_dir_path(), LANE_FOLDER)
    except Exception:  # noqa: BLE001 - no Ray node here: no lane
        return None


# -- the replica's side ----------------------------------------------------------------------------


class LaneServer:
    """Serves `generate(EngineRequest) -> async iterator of EngineChunk` on a Unix socket."""

    def __init__(self, path: str, generate: Callable[[EngineRequest], AsyncIterator[EngineChunk]],
                 ongoing: int, queued: int):
        self.path = path
        self._generate = generate
        self.admission = Admission(ongoing, queued)
        self._server: Optional[asyncio.AbstractServer] = None

    @property
    def ongoing(self) -> int:
        """Calls on the lane running or waiting for a place (the autoscaler's `lane_ongoing`)."""
        return self.admission.running + self.admission.waiting

    async def start(self) -> "LaneServer":
        if len(self.path) > SUN_PATH_MAX:
            raise OSError(f"lane socket path longer than {SUN_PATH_MAX} bytes: {self.path}")
        os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
        if os.path.exists(self.path):
            os.unlink(self.path)
        old = os.umask(0o177)  # the socket is created 0600
        try:
            self._server = await asyncio.start_unix_server(self._serve, path=self.path)
        finally:
            os.umask(old)
        return self

    def close(self) -> None:
        """Stop taking calls (calls under way go on) and remove the socket."""
        if self._server is not None:
            self._server.close()
            self._server = None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    async def drain(self, grace_s: float) -> None:
        """Close, then give the calls under way up to `grace_s` to end (a stopping replica's grace)."""
        self.close()
        deadline = time.monotonic() + grace_s
        while self.ongoing and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                req = request_from_wire((await asyncio.wait_for(read_frame(reader), REQUEST_READ_TIMEOUT_S))["req"])
            except (LaneClosed, asyncio.TimeoutError):
                return
            except (ValueError, KeyError, TypeError) as e:
                await _send(writer, {"error": {"kind": "invalid", "message": f"lane request: {e}"[:500]}})
                return
            call = asyncio.ensure_future(self._call(req, writer))
            hangup = asyncio.ensure_future(reader.read(1))  # the router sends nothing more: EOF is a hang-up
            try:
                await asyncio.wait({call, hangup}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for t in (call, hangup):
                    if not t.done():
                        t.cancel()
                await asyncio.gather(call, hangup, return_exceptions=True)
        finally:
            writer.close()

    async def _call(self, req: EngineRequest, writer: asyncio.StreamWriter) -> None:
        try:
            async with self.admission.slot():
                async with aclosing(self._generate(req)) as chunks:
                    async for chunk in chunks:
                        await _send(writer, {"chunk": dataclasses.asdict(chunk)})
            await _send(writer, {"end": True})
        except (asyncio.CancelledError, ConnectionError):
            raise
        except Exception as e:  # noqa: BLE001 - every failure goes back to the router, typed
            if error_kind(e) == "internal":
                log.exception("lane call %s failed", req.request_id)
            await _send(writer, {"error": {"kind": error_kind(e), "message": str(e)[:2000] or type(e).__name__}})


async def _send(writer: asyncio.StreamWriter, obj: dict[str, Any]) -> None:
    writer.write(frame(obj))
    await writer.drain()
