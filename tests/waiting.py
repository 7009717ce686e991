"""Polling for the tests that drive a live server or a worker thread."""
from __future__ import annotations

import time

WAIT_S = 30.0          # longest any poll waits


def wait_until(predicate, what: str, timeout: float = WAIT_S):
    """predicate()'s first truthy value, polled every 20 ms; AssertionError naming
    `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
