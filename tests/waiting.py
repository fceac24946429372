"""Polling helper shared by tests that wait on a background thread or a server."""

from __future__ import annotations

import time


def wait_until(cond, timeout_s: float = 5.0, step_s: float = 0.05) -> bool:
    """Poll `cond` until it is true or `timeout_s` passes; returns its last value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(step_s)
    return cond()
