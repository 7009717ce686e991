"""Polling for the tests that drive a live server or a worker thread."""
from __future__ import annotations

import contextlib
import threading
import time

WAIT_S = 30.0          # longest any poll waits
HOLD_S = 30.0          # longest a held worker stays held


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


@contextlib.contextmanager
def held_worker(model):
    """Hold the worker before every decode step until the gate opens (HOLD_S at most)."""
    gate = threading.Event()
    real = model.forward.decode_batch

    def decode_batch(tokens, caches, **kw):
        gate.wait(HOLD_S)
        return real(tokens, caches, **kw)

    model.forward.decode_batch = decode_batch
    try:
        yield gate
    finally:
        gate.set()
        del model.forward.decode_batch
