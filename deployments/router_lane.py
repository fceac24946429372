"""The router's side of the engine replicas' local lanes (`deployments.engine_lane`): which lanes of a
pool are on this node, whether the pool may use them, and one call on a lane with the shape of a Ray
Serve streaming call (an async iterator with `cancel()`), so `deployments.engine_call` bounds,
retries and cancels it as it does a handle call.

A pool's calls take the lane only while every replica that reported its load in the last
`REPORT_WINDOW_S` has a lane on this node (`usable`): a pool with replicas on other nodes stays on
Serve's handle, whose routing sees them all. The window is long so that a load poll delayed under
load does not move a pool's calls between the lane and the handle, whose bounds are counted apart. Among the lanes, a call goes to the one with the fewest of this
router's calls (round robin on ties). A lane that refuses the connection (its replica is gone) is
forgotten and the next one tried; with none left the call goes by the handle, so a lane never costs
a call its retry.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from typing import Any, Callable, Iterable, Optional

from deployments.engine_lane import LaneClosed, chunk_from_wire, frame, pool_tag, read_frame, request_to_wire
from deployments.engine_death import EngineDead
from deployments.engine_types import EngineChunk, EngineRequest

LIST_TTL_S = 1.0  # the lane folder is listed at most this often
REPORT_WINDOW_S = 30.0  # replicas whose load report is newer than this count as the pool's
REFUSED_TTL_S = 10.0  # a lane that refused a connection is left out of listings this long
CONNECT_TIMEOUT_S = 1.0


class LaneGone(ConnectionError):
    """The replica's end of a lane closed before the call ended (its process died or stopped)."""


class LaneBusy(Exception):
    """The replica's every place and waiting place is taken (Serve's backpressure, on the lane)."""


def raise_lane_error(kind: str, message: str) -> None:
    """A replica's error frame, raised as the error a handle call would have raised."""
    if kind == "engine_dead":
        raise EngineDead(message)
    if kind == "busy":
        raise LaneBusy(message)
    if kind == "invalid":
        raise ValueError(message)
    raise RuntimeError(message)


def pick(paths: Iterable[str], inflight: dict[str, int], turn: int) -> list[str]:
    """`paths` in the order to try: fewest calls in flight first, ties rotated by `turn`.

    >>> pick(["a", "b", "c"], {"a": 2, "b": 1}, 0)
    ['c', 'b', 'a']
    >>> pick(["a", "b"], {}, 0), pick(["a", "b"], {}, 1)
    (['a', 'b'], ['b', 'a'])
    """
    paths = sorted(paths)
    if paths:
        turn %= len(paths)
        paths = paths[turn:] + paths[:turn]
    return sorted(paths, key=lambda p: inflight.get(p, 0))


class Lanes:
    """This node's lanes, as the router sees them. `folder`: the node's lane folder (None: no lane)."""

    def __init__(self, folder: Optional[str]):
        self.folder = folder
        self.inflight: dict[str, int] = {}  # lane path -> this router's calls on it
        self.calls: dict[str, int] = {}  # pool -> calls that took a lane
        self._listed: tuple[float, dict[str, dict[str, str]]] = (float("-inf"), {})
        self._turn = itertools.count()
        self._refused: dict[str, float] = {}  # lane path -> when it refused a connection

    def local(self, pool: str, now: Optional[float] = None) -> dict[str, str]:
        """The pool's lanes on this node: replica suffix -> socket path."""
        now = time.monotonic() if now is None else now
        at, by_tag = self._listed
        if now - at > LIST_TTL_S:
            by_tag = {}
            try:
                names = os.listdir(self.folder) if self.folder else []
            except OSError:
                names = []
            for name in names:
                tag, _, rest = name.partition("-")
                path = os.path.join(self.folder, name)
                if rest.endswith(".sock") and now - self._refused.get(path, float("-inf")) > REFUSED_TTL_S:
                    by_tag.setdefault(tag, {})[rest[:-5]] = path
            self._listed = (now, by_tag)
        return by_tag.get(pool_tag(pool), {})

    def usable(self, pool: str, reported: Iterable[str]) -> bool:
        """Whether the pool's calls take a lane: it has lanes here and every replica in `reported`
        (ids `<pool>-<suffix>` of the replicas that reported their load within REPORT_WINDOW_S) is
        among them."""
        lanes = self.local(pool)
        return bool(lanes) and all(r.rsplit("-", 1)[-1] in lanes for r in reported)

    def forget(self, path: str, now: Optional[float] = None) -> None:
        """A lane that refused a connection: its replica is gone (its socket file may stay behind)."""
        now = time.monotonic() if now is None else now
        self._refused = {p: t for p, t in self._refused.items() if now - t <= REFUSED_TTL_S}
        self._refused[path] = now
        for lanes in self._listed[1].values():
            for suffix, p in list(lanes.items()):
                if p == path:
                    del lanes[suffix]

    def call(self, pool: str, ereq: EngineRequest, fallback: Callable[[], Any]) -> "LaneCall":
        return LaneCall(self, pool, ereq, fallback)


class LaneCall:
    """One engine call on a lane of `pool` (or, when none connects, by `fallback()`, a handle call)."""

    def __init__(self, lanes: Lanes, pool: str, ereq: EngineRequest, fallback: Callable[[], Any]):
        self._lanes, self._pool, self._ereq, self._fallback_fn = lanes, pool, ereq, fallback
        self._fallback: Any = None
        self._reader: Optional[asyncio.StreamReader] = None
        self._writer: Optional[asyncio.StreamWriter] = None
        self._path: Optional[str] = None
        self.via = "lane"

    def __aiter__(self) -> "LaneCall":
        return self

    async def _connect(self) -> None:
        lanes = self._lanes
        paths = pick(lanes.local(self._pool).values(), lanes.inflight, next(lanes._turn))
        for path in paths:
            try:
                self._reader, self._writer = await asyncio.wait_for(asyncio.open_unix_connection(path),
                                                                    CONNECT_TIMEOUT_S)
            except (OSError, asyncio.TimeoutError):
                lanes.forget(path)
                continue
            self._path = path
            lanes.inflight[path] = lanes.inflight.get(path, 0) + 1
            lanes.calls[self._pool] = lanes.calls.get(self._pool, 0) + 1
            self._writer.write(frame({"req": request_to_wire(self._ereq)}))
            return
        self.via = "handle"
        self._fallback = self._fallback_fn()

    async def __anext__(self) -> EngineChunk:
        if self._reader is None and self._fallback is None:
            await self._connect()
        if self._fallback is not None:
            return await self._fallback.__anext__()
        assert self._reader is not None
        try:
            msg = await read_frame(self._reader)
        except LaneClosed:
            self._release()
            raise LaneGone(f"pool {self._pool!r}: the engine replica closed its lane") from None
        if "chunk" in msg:
            return chunk_from_wire(msg["chunk"])
        self._release()
        if "error" in msg:
            err = msg["error"]
            raise_lane_error(str(err.get("kind")), str(err.get("message")))
        raise StopAsyncIteration

    def _release(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._path is not None:
            n = self._lanes.inflight.get(self._path, 1) - 1
            if n > 0:
                self._lanes.inflight[self._path] = n
            else:
                self._lanes.inflight.pop(self._path, None)
            self._path = None

    def cancel(self) -> None:
        """Hang up (the replica aborts the request in vLLM), or cancel the handle call."""
        if self._fallback is not None:
            self._fallback.cancel()
        self._release()
