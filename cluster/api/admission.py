"""How much a router replica's own doors let in. `Admission`: at most `ongoing` calls run at once,
at most `queued` more wait for a place (-1: no bound), and past that a call is turned away at once:
the bound Ray Serve's proxy and replica applied (a deployment's `max_ongoing_requests` and
`max_queued_requests`), kept in the replica now that its doors take calls without a proxy.
`PerClient`: at most so many open connections per client address.

Pure logic, no I/O: `deployments/router_door.py` turns a refusal into HTTP 503 with Retry-After or
gRPC UNAVAILABLE (Admission), or HTTP 429 and a closed connection (PerClient).
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import AsyncIterator


class Full(Exception):
    """Every place and every waiting place is taken."""


class Admission:
    def __init__(self, ongoing: int, queued: int):
        if ongoing < 1 or queued < -1:
            raise ValueError(f"ongoing must be >= 1 and queued >= -1 (got {ongoing}, {queued})")
        self.ongoing, self.queued = ongoing, queued
        self._free = asyncio.Semaphore(ongoing)
        self.running = 0
        self.waiting = 0
        self.refused = 0  # calls turned away since start (the doors report each to a metric themselves)

    def _may_wait(self) -> bool:
        return self.queued < 0 or self.waiting < self.queued

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold one place for the call's life; raise Full at once when none is free and no one more
        may wait. A call cancelled while it waits leaves no trace."""
        if self._free.locked() and not self._may_wait():
            self.refused += 1
            raise Full()
        self.waiting += 1
        try:
            await self._free.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            self._free.release()


class PerClient:
    """Open connections per client address, at most `cap` each (0: no bound)."""

    def __init__(self, cap: int):
        if cap < 0:
            raise ValueError(f"cap must be >= 0 (got {cap})")
        self.cap = cap
        self.open: dict[str, int] = {}
        self.refused = 0

    def enter(self, client: str) -> bool:
        """Count one more connection of `client`; False (and nothing counted) past the cap."""
        n = self.open.get(client, 0)
        if self.cap and n >= self.cap:
            self.refused += 1
            return False
        self.open[client] = n + 1
        return True

    def leave(self, client: str) -> None:
        n = self.open.get(client, 0) - 1
        if n > 0:
            self.open[client] = n
        else:
            self.open.pop(client, None)
