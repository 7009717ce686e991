"""The scheduler: one model, one worker thread, a bounded FIFO of requests.

The HTTP layer submits a `Job` with an `emit` callback and gets a `Handle`; the
worker thread owns every model call, so the asyncio event loop never waits on
compute. Each worker iteration is one *step*:

  1. retire cancelled requests (their caches dropped at once) and admit waiting
     ones, FIFO, while fewer than `max_running` run;
  2. prefill a newly admitted request (cancellable between prefill chunks);
  3. otherwise one decode step of every running request, round robin.

In this slice `max_running` is 1 by default, so requests run one after another.
Batching is meant to replace step 3 only: collect `next_token()` of every running
sequence, run one batched forward over their caches, `feed()` the logits back.
Chunked prefill interleaved with decode replaces step 2 with one chunk per step.

Admission: at most `max_running + max_queue` requests are held (running plus
waiting); `submit` raises QueueFull beyond that (the HTTP layer answers 503).
"""
from __future__ import annotations

import itertools
import threading
import time
import weakref
from collections import deque

from ..errors import EngineError
from .sequence import Cancelled, Failed, Job, Sequence


class QueueFull(Exception):
    """More requests than the server holds (running + max_queue waiting)."""


class Handle:
    """A submitted request: its id, its sequence once admitted, and a cancel flag
    (set from any thread, read by the worker before every step)."""

    def __init__(self, rid: str, job: Job, emit):
        self.id, self.job, self.emit = rid, job, emit
        self.sequence: Sequence | None = None
        self.cancelled = False
        self.submitted = time.monotonic()


class Scheduler:
    def __init__(self, model, max_queue: int = 16, max_running: int = 1):
        if max_queue < 0 or max_running < 1:
            raise ValueError(f"max_queue must be >= 0 and max_running >= 1, got {max_queue}, {max_running}")
        self.model = model
        self.max_queue, self.max_running = max_queue, max_running
        self._cv = threading.Condition()
        self._waiting: deque[Handle] = deque()      # FIFO, not yet admitted
        self._running: list[Handle] = []            # admitted: prefill then decode
        self._ids = itertools.count(1)
        self._caches = weakref.WeakSet()            # every KvCache a request made that is still alive
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.counts = {"completed": 0, "cancelled": 0, "failed": 0, "rejected": 0}

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="engine-worker", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel everything and stop the worker (it finishes the step it is in)."""
        with self._cv:
            self._stopping = True
            for h in list(self._waiting) + self._running:
                h.cancelled = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    # -- requests -------------------------------------------------------------------------
    def submit(self, job: Job, emit) -> Handle:
        """Queue a job; `emit(event)` is called from the worker thread with Delta,
        then Finished or Failed. Raises QueueFull when the server is full."""
        with self._cv:
            if self._stopping:
                raise QueueFull("the server is shutting down")
            if len(self._waiting) + len(self._running) >= self.max_running + self.max_queue:
                self.counts["rejected"] += 1
                raise QueueFull(f"the server is full: {len(self._running)} running and "
                                f"{len(self._waiting)} waiting (--max-queue {self.max_queue}); retry later")
            handle = Handle(f"{next(self._ids)}", job, emit)
            self._waiting.append(handle)
            self._cv.notify_all()
            return handle

    def cancel(self, handle: Handle) -> None:
        """Cancel a request (a client went away). A waiting one leaves the queue now;
        a running one is dropped by the worker before its next step, cache included.
        No-op for a request that has finished."""
        with self._cv:
            if handle.cancelled or (handle.sequence is not None and handle.sequence.state == "done"):
                return
            handle.cancelled = True
            if handle in self._waiting:
                self._waiting.remove(handle)
                self.counts["cancelled"] += 1
            self._cv.notify_all()

    def state(self) -> dict:
        """What the server holds right now (GET /state)."""
        with self._cv:
            running = [{"id": h.id, "state": h.sequence.state if h.sequence else "admitted",
                        "prompt_tokens": len(h.job.ids),
                        "completion_tokens": len(h.sequence.tokens) if h.sequence else 0,
                        "cancelled": h.cancelled} for h in self._running]
            waiting = len(self._waiting)
        caches = list(self._caches)
        return {"running": running, "waiting": waiting, "max_queue": self.max_queue,
                "max_running": self.max_running, "caches_held": len(caches),
                "kv_bytes_held": sum(c.bytes for c in caches), **self.counts}

    # -- the worker -----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and not self._waiting and not self._running:
                    self._cv.wait()
                if self._stopping:
                    self._drop_all()
                    return
                self._retire_cancelled()
                while self._waiting and len(self._running) < self.max_running:
                    self._running.append(self._waiting.popleft())
                running = list(self._running)
            try:
                self._step(running)
            except Exception as e:   # a bug in the loop itself: fail the requests, keep serving
                for h in running:
                    self._fail(h, e)

    def _step(self, running: list[Handle]) -> None:
        fresh = next((h for h in running if h.sequence is None and not h.cancelled), None)
        if fresh is not None:
            self._guarded(fresh, self._prefill)
            return
        for h in running:
            if not h.cancelled and h.sequence is not None and h.sequence.state == "decode":
                self._guarded(h, self._decode)

    def _prefill(self, h: Handle) -> None:
        seq = Sequence(self.model, h.job, h.emit)
        h.sequence = seq
        seq.allocate()
        self._caches.add(seq.cache)
        seq.prefill(should_stop=lambda: h.cancelled)

    def _decode(self, h: Handle) -> None:
        seq = h.sequence
        if not seq.decode_step():
            self._retire(h, "completed")        # the cache is gone before the client hears
            h.emit(seq.finished)

    def _guarded(self, h: Handle, step) -> None:
        """Run one step of one request; its failure fails it alone."""
        try:
            step(h)
        except Cancelled:
            self._retire(h, None)
        except Exception as e:
            self._fail(h, e)

    def _fail(self, h: Handle, e: BaseException) -> None:
        if isinstance(e, EngineError):
            status, message = 400, str(e)
        else:
            status, message = 500, f"internal error: {type(e).__name__}: {e}"
        if h.sequence is not None:
            h.sequence.release()
        self._retire(h, "failed")
        if not h.cancelled:
            h.emit(Failed(status, message))

    def _retire(self, h: Handle, outcome: str | None) -> None:
        with self._cv:
            if h in self._running:
                self._running.remove(h)
                self.counts[outcome or "cancelled"] += 1
        if h.sequence is not None:
            h.sequence.release()

    def _retire_cancelled(self) -> None:
        """(lock held) Drop running requests whose client went away, caches first."""
        for h in [h for h in self._running if h.cancelled]:
            if h.sequence is not None:
                h.sequence.release()
            self._running.remove(h)
            self.counts["cancelled"] += 1

    def _drop_all(self) -> None:
        for h in self._running:
            if h.sequence is not None:
                h.sequence.release()
        self._running.clear()
        self._waiting.clear()
