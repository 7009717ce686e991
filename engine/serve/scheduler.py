"""The scheduler: one model, one worker thread, a bounded FIFO of requests.

The HTTP layer submits a `Job` with an `emit` callback and gets a `Handle`; the
worker thread owns every model call, so the asyncio event loop never waits on
compute. Each worker iteration is one *step*:

  1. retire cancelled requests (their pages back to the pool at once) and admit
     waiting ones, FIFO, while fewer than `max_running` run and their pages fit;
  2. one prefill chunk of the oldest request still in its prompt (chunked prefill
     interleaved with decode: a long prompt delays running streams by one chunk
     per step, never by the whole prompt);
  3. one decode step of every request past its prompt, batched: one forward pass
     over all their tokens (`ForwardPass.decode_batch`: each weight runs once over
     the batch, attention over each request's own pages, whatever its eviction
     budget and row format); when every request in it decodes greedily with nothing
     else reading its logits, their argmax on the device and only the ids back
     (`ForwardPass.decode_batch(..., argmax=True)`).

Memory: the caches of all requests take pages from one shared PagePool per KV row
format (`pool_tokens` positions' worth of pages; by default `max_running` whole
contexts). A request is admitted when the pages of its prompt and its next token
fit beside what the running requests hold and need for their next step (a
reservation of HORIZON tokens, see Sequence.pages_needed; eviction shrinks it once
the prompt is compacted). Before every step the running requests' next step must
fit: if it does not, kept caches go first, then the request that arrived last is
preempted (its pages return; it waits at the head of the queue and resumes by
prefilling its prompt and generated tokens again), so no request finds the pool
empty mid-step and the oldest always progress. One that could never fit (prompt +
max_tokens beyond the pool) fails with 400; one that does not fit yet waits (FIFO).

Prompt cache (`prompt_cache` caches at most, on the pools' pages, dropped oldest first
when pages run short): a finished request's cache when it holds positions (no
eviction), and, for an evicting request, a branch of its whole prompt's cache taken
just before compaction when its pages fit. A request whose prompt extends a kept cache
starts from it and runs only the rest; an evicting one is then evicted as a whole, with
its own last tokens as the observation window, as if prefilled from scratch. So the
next turn of a long conversation costs its new tokens, not the whole prompt again, and
sees every row of the earlier turns, not only those the first question kept.

Admission: at most `max_running + max_queue` requests are held (running plus
waiting); `submit` raises QueueFull beyond that (the HTTP layer answers 503).

Device errors (engine/errors.py): out of device memory fails the requests of the step
it hit (503 with Retry-After), the device's cached memory is given back, and serving
goes on. A sticky fault (DeviceFault) ends the worker: `fault` holds its message, every
request held fails with it (streams get it as their last event), `submit` refuses new
ones (503), no more device work runs, and `on_fault(message)` is called (`engine
serve` shuts down there and exits with status 1).

Drain (SIGTERM, `drain(timeout)`): `submit` refuses new requests (503 shutting_down),
waiting ones fail at once, running ones have `timeout` seconds to finish, then the rest
end as after a fault (`_end_all`: their streams get the error and [DONE]) and
`on_drained()` is called (`engine serve` stops uvicorn there and exits 0).
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque

from ..errors import DeviceError, DeviceFault, DeviceOutOfMemory, EngineError
from ..kv.paged import KvCacheError
from ..forward import CENTRE_ROWS
from ..model import available_memory_bytes
from ..grammar import fill_masks
from .sequence import Failed, Job, Sequence


HORIZON = 1    # generated tokens a running request's reservation covers: its next step
RETRY_AFTER_S = 1    # Retry-After of a request that failed for device memory
MAX_KV_POOLS = 4     # KV row layouts (a request's kv_dtype) the server holds page pools for at once
log = logging.getLogger("engine.serve")


class QueueFull(Exception):
    """The server takes no request now (503): more than it holds (running + max_queue
    waiting), or it is shutting down; `code` says which (OpenAI's error code)."""

    def __init__(self, message: str, code: str = "queue_full"):
        super().__init__(message)
        self.code = code


class PoolsBusy(EngineError):
    """A request asks for a KV row layout the server has no pool for, and every pool it
    holds (MAX_KV_POOLS) has pages in use (503: retry later)."""


class Handle:
    """A submitted request: its id, its sequence once admitted, and a cancel flag
    (set from any thread, read by the worker before every step)."""

    def __init__(self, rid: str, job: Job, emit):
        self.id, self.job, self.emit = rid, job, emit
        self.sequence: Sequence | None = None
        self.cancelled = False
        self.submitted = time.monotonic()
        self.last_token_at: float | None = None     # when its last token was sampled (latency metrics)


class Scheduler:
    def __init__(self, model, max_queue: int = 16, max_running: int = 4, pool_tokens: int | None = None,
                 prompt_cache: int = 4):
        if max_queue < 0 or max_running < 1:
            raise ValueError(f"max_queue must be >= 0 and max_running >= 1, got {max_queue}, {max_running}")
        self.model = model
        self.max_queue, self.max_running = max_queue, max_running
        self.pool_tokens = pool_tokens or max_running * model.ctx
        if self.pool_tokens < 1:
            raise ValueError(f"pool_tokens must be >= 1, got {pool_tokens}")
        self._pools = {}                            # KV row format -> shared PagePool, made on first use,
                                                    # least recently used first
        self._default_kv = model.kv_dtype_of(None)  # the server's own layout: its pool is never dropped
        short = self._short_of_memory(self._default_kv)
        if short:                                   # at start, not at the first request
            raise EngineError(f"{short}: lower --kv-pool-tokens (default --parallel x the context), "
                              f"--parallel or --ctx")
        self.prompt_cache = prompt_cache            # finished requests' caches kept for reuse (0: none)
        self._kept: list[tuple[list[int], object]] = []   # (token ids held, KvCache), oldest first
        self._cv = threading.Condition()
        self._waiting: deque[Handle] = deque()      # FIFO, not yet admitted
        self._running: list[Handle] = []            # admitted: prefill then decode
        self._ids = itertools.count(1)
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.fault: str | None = None               # a sticky device fault's message: the worker has ended
        self.on_fault = None                        # callable(message), from the worker when it faults
        self._free_memory = False                   # a step ran out of device memory: give the cache back
        self.draining = False                       # shutting down: nothing new is admitted
        self._drain_deadline: float | None = None   # when the running requests are ended (drain)
        self.on_drained = None                      # callable(), from the worker once a drain has ended all
        self.metrics = None                         # metrics.Metrics: latency histograms, if set
        self.counts = {"completed": 0, "cancelled": 0, "failed": 0, "rejected": 0, "preempted": 0,
                       "prompt_tokens": 0, "cached_tokens": 0, "generation_tokens": 0}

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

    def drain(self, timeout: float) -> None:
        """Graceful shutdown (SIGTERM): refuse new requests (503 "shutting_down"), fail the
        waiting ones now, let the running ones finish within `timeout` seconds, then end
        the rest with a 503 "shutting_down" failure (a stream gets it as its last event,
        then [DONE]) and call `on_drained()`. A second call ends them at once."""
        with self._cv:
            now = time.monotonic()
            self._drain_deadline = now + timeout if not self.draining else now
            self.draining = True
            self._cv.notify_all()

    # -- requests -------------------------------------------------------------------------
    def check_room(self) -> None:
        """Raises QueueFull when `submit` would refuse a request now: the HTTP layer asks
        before rendering and tokenizing one, so a full server answers a burst cheaply
        (submit still decides)."""
        with self._cv:
            self._check_room()

    def _check_room(self) -> None:
        """(lock held) QueueFull unless a request can be taken now."""
        if self.fault is not None:
            raise QueueFull(self.fault, "device_fault")
        if self._stopping or self.draining:
            raise QueueFull("the server is shutting down", "shutting_down")
        if len(self._waiting) + len(self._running) >= self.max_running + self.max_queue:
            self.counts["rejected"] += 1
            raise QueueFull(f"the server is full: {len(self._running)} running and "
                            f"{len(self._waiting)} waiting (--max-queue {self.max_queue}); retry later")

    def submit(self, job: Job, emit) -> Handle:
        """Queue a job; `emit(event)` is called from the worker thread with Delta,
        then Finished or Failed. Raises QueueFull when the server is full."""
        with self._cv:
            self._check_room()
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
                        "pages_reserved": h.sequence.pages_needed(horizon=HORIZON) if h.sequence else 0,
                        "preemptions": h.sequence.preemptions if h.sequence else 0,
                        "cancelled": h.cancelled} for h in self._running]
            waiting = len(self._waiting)
            pools = {name: {"pages": p.n_pages, "pages_used": p.n_pages - p.free_pages, "bytes": p.bytes,
                            "segments": [{"kv_dtype": g.kv_dtype, "pages": g.n_pages,
                                          "pages_used": g.n_pages - g.free_pages, "page_bytes": g.page_bytes}
                                         for g in p.segments]} for name, p in self._pools.items()}
            caches = [h.sequence.cache for h in self._running if h.sequence is not None]
            held = sum(c.bytes for c in caches if c is not None)
            kept = {"caches": len(self._kept), "tokens": [len(ids) for ids, _ in self._kept],
                    "kv_bytes": sum(c.bytes for _, c in self._kept)}
            return {"running": running, "waiting": waiting, "max_queue": self.max_queue,
                    "max_running": self.max_running, "pool_tokens": self.pool_tokens, "kv_pools": pools,
                    "kv_bytes_held": held, "prompt_cache": kept, "fault": self.fault, **self.counts}

    # -- the worker -----------------------------------------------------------------------
    def _run(self) -> None:
        bind = getattr(self.model.backend, "bind_thread", None)   # per-thread settings (CPU threads)
        if bind is not None:
            bind()
        while True:
            try:
                if not self._iteration():
                    return
            except Exception as e:     # a bug outside a step's guard: nothing held can be trusted
                log.exception("engine serve: the worker failed")
                if self.fault is None:
                    self.fault = f"the server's worker failed ({type(e).__name__}: {e}): restart it"
                self._end_after_fault()
                return

    def _iteration(self) -> bool:
        """One turn of the worker: wait for work, admit, step, free memory after a
        failed step; False when the worker is done."""
        with self._cv:
            while not self._stopping and not self._waiting and not self._running and not self.draining:
                self._cv.wait()
            if self._stopping:
                self._drop_all()
                return False
            draining = self.draining
            if draining:
                self._retire_cancelled()
                # waiting ones not started are answered now; a preempted one (it was streaming)
                # waits for pages until the deadline like the running ones
                shed = [h for h in self._waiting if h.sequence is None]
                self._waiting = deque(h for h in self._waiting if h.sequence is not None)
                self.counts["failed"] += len(shed)
                over = not (self._running or self._waiting) or time.monotonic() >= self._drain_deadline
        if draining:
            for h in shed:
                h.emit(_SHUTTING_DOWN)
            if over:
                self._end_all(_SHUTTING_DOWN, self.on_drained)
                return False
        with self._cv:
            self._retire_cancelled()
            self._make_room()
            admitted = self._admit()
            running = list(self._running)
        for h, failure in admitted:         # could never be admitted: answered outside the lock
            h.emit(failure)
        if self.fault is None:
            try:
                self._step(running)
            except Exception as e:   # a bug in the loop itself: fail the requests, keep serving
                with self._cv:           # not those the step already finished (they were answered)
                    left = [h for h in running if h in self._running]
                for h in left:
                    self._fail(h, e)
        if self.fault is not None:
            self._end_after_fault()
            return False
        if self._free_memory:           # the failed step's arrays are gone by now
            self._free_memory = False
            free = getattr(self.model.backend, "free_cached_memory", None)
            if free is not None:
                free()
        return True

    def _pool(self, kv_dtype: str | None):
        """(lock held) The pool of a KV row layout, made on first use; at most
        MAX_KV_POOLS at once (a client names the layout: each pool is a whole
        --kv-pool-tokens of pages). At the cap the least recently used idle pool other
        than the server's own layout is dropped, with its kept caches, to make room, else
        PoolsBusy; a pool larger than the memory free is PoolsBusy too (_short_of_memory)."""
        name = self.model.kv_dtype_of(kv_dtype)
        if name in self._pools:
            self._pools[name] = self._pools.pop(name)          # most recently used last
            return self._pools[name]
        victim = None
        if len(self._pools) >= MAX_KV_POOLS:
            victim = self._idle_pool()
            if victim is None:
                raise PoolsBusy(f"the server holds KV pools for {MAX_KV_POOLS} row formats "
                                f"({', '.join(self._pools)}), all in use: retry later, or ask for one of them")
        short = self._short_of_memory(name, self._pools[victim].bytes if victim else 0)
        if short:
            raise PoolsBusy(f"{short}: ask for the server's own kv_dtype ({self._default_kv})")
        if victim is not None:
            self._drop_pool(victim)
        self._pools[name] = self.model.new_pool(self.pool_tokens, name)
        return self._pools[name]

    def _short_of_memory(self, name: str, reclaim: int = 0) -> str | None:
        """Why a pool of `name` would not fit in the memory free now (plus `reclaim` bytes
        a dropped pool would give back), or None: device memory on CUDA, less a reserve
        for the steps' buffers; host memory on the CPU, less the pages of the pools
        held that were never written (allocated but not yet taken from the OS: every
        pool can fill); unknown elsewhere (None)."""
        backend = self.model.backend
        device_free = getattr(backend, "free_memory_bytes", None)
        free = device_free() if device_free is not None else (
            available_memory_bytes() if backend.name in ("cpu", "reference") else None)
        if free is None:
            return None
        if device_free is not None:
            free -= getattr(backend, "reserve_bytes", 0)       # for the steps' buffers
        else:
            free -= sum(p.untouched_bytes for p in self._pools.values())
        need = self.model.forward.pool_bytes(self.pool_tokens, name)
        if need <= free + reclaim:
            return None
        where = "device memory free" if device_free is not None else "memory available"
        return (f"a KV pool of {self.pool_tokens} positions in {name} needs {need / 2**20:.0f} MiB, "
                f"more than the {where} ({max(free + reclaim, 0) / 2**20:.0f} MiB, once the pools held "
                f"are full and a reserve kept)")

    def _idle_pool(self) -> str | None:
        """(lock held) The least recently used pool no admitted or preempted request has a
        cache on, never the server's own layout; None if there is none."""
        busy = {id(h.sequence.cache.pool) for h in itertools.chain(self._running, self._waiting)
                if h.sequence is not None and h.sequence.cache is not None}
        return next((name for name, pool in self._pools.items()
                     if name != self._default_kv and id(pool) not in busy), None)

    def _drop_pool(self, name: str) -> None:
        """(lock held) Drop a pool, its kept caches released."""
        pool = self._pools.pop(name)
        for _, cache in self._kept:
            if cache.pool is pool:
                cache.release()
        self._kept = [(ids, c) for ids, c in self._kept if c.pool is not pool]

    def _admit(self) -> list:
        """(lock held) Admit waiting requests in order while they fit: a running slot and
        the pages of their prompt and next token, kept caches dropped oldest first to make room
        (with nothing running, any request that can fit at all does). A request starts
        from the kept cache sharing its longest prefix, if any. Returns [(handle, Failed)]
        of requests that cannot be admitted, taken off the queue, counted as failed."""
        never = []
        while self._waiting and len(self._running) < self.max_running:
            h = self._waiting[0]
            seq = h.sequence                    # a preempted one resumes
            if seq is None:
                seq = Sequence(self.model, h.job, h.emit)
                seq.before_evict = lambda cache, q, ids=h.job.ids: self._keep_prompt(ids, cache, q)
            try:
                pool = self._pool(h.job.kv_dtype)   # made on first use: may fail (memory)
                reused = self._reuse(seq, pool)
                if seq.cache is None:
                    seq.allocate(pool)          # no pages yet: they come as rows arrive
            except Exception as e:
                seq.release()                   # a reused cache's pages go back
                self._waiting.popleft()
                self.counts["failed"] += 1
                self._note_device_error(e)
                never.append((h, _failure(e)))
                if self.fault is not None:
                    break
                continue
            segments = range(len(pool.segments))
            if any(seq.pages_needed(k) > pool.segments[k].n_pages for k in segments):
                seq.release()
                self._waiting.popleft()
                self.counts["failed"] += 1
                never.append((h, Failed(400, f"this request may need {seq.pages_needed()} KV pages ({len(h.job.ids)} prompt "
                                             f"tokens + max_tokens {h.job.params.max_tokens}) but the server's "
                                             f"pool holds {pool.n_pages} (--kv-pool-tokens {self.pool_tokens}): "
                                             f"lower max_tokens or raise --kv-pool-tokens")))
                continue
            need = [seq.pages_needed(k, HORIZON) for k in segments]
            while self._short(pool, need) and self._drop_kept(pool):
                pass
            if self._short(pool, need):
                if reused is not None:          # back on the shelf (truncated) for later
                    self._shelve(reused[:seq.cached_tokens], seq.cache)
                else:
                    seq.cache.release()
                seq.cache, seq.cached_tokens = None, 0
                break                           # FIFO: the head waits for pages, nothing overtakes it
            self._waiting.popleft()
            h.sequence = seq
            self._running.append(h)
            self.counts["cached_tokens"] += seq.cached_tokens
        return never

    # -- prompt cache: finished requests' caches, reused by requests that extend them ----------
    def _reuse(self, seq: Sequence, pool):
        """Give `seq` the kept cache (of `pool`) sharing the longest prefix with its prompt,
        taken off the shelf; returns that cache's token ids, or None. At least one prompt
        token is left to run, and when the request's policy evicts the prompt, its whole
        observation window, unless the cache kept the queries of the window's positions it
        holds (`tail_queries`), so eviction sees the prompt as a fresh prefill would."""
        job, candidates = seq.job, []
        if job.echo and job.logprobs is not None:   # every prompt token is scored: run them all
            return None
        # quantized keys are stored minus the mean of the first write's first rows: a cache
        # continues exactly as a fresh prefill only when that prefill would centre on the same
        # rows (the first min(CENTRE_ROWS, chunk, prompt) positions), shared in full
        centre = min(CENTRE_ROWS, self.model.forward.chunk, len(job.ids) + len(seq.tokens))
        window_from = None                          # the observation window's first position
        if job.snapkv is not None and len(job.ids) >= job.snapkv.window and job.snapkv.compacts(len(job.ids)):
            window_from = len(job.ids) - job.snapkv.window
        for i, (ids, cache) in enumerate(self._kept):
            if cache.pool is not pool:
                continue
            n = 0
            for a, b in zip(ids, job.ids[:len(job.ids) - 1]):
                if a != b:
                    break
                n += 1
            if cache.centre_rows and (cache.centre_rows != centre or n < centre):
                continue
            tq = cache.tail_queries                  # (first position, queries [.., .., count, ..])
            if window_from is not None and n > window_from and (
                    tq is None or tq[0] > window_from or n > tq[0] + tq[1].shape[2]):
                n = window_from                     # the window's queries run again (a cache a
                                                    # request extended holds some without theirs)
            if n > 0:
                candidates.append((n, i))
        for n, i in sorted(candidates, reverse=True):   # longest shared prefix first, newest on ties
            ids, cache = self._kept[i]
            try:
                seq.reuse(cache, n)
            except KvCacheError:                # a sliding-window layer moved past the prefix:
                continue                        # the cache is unchanged, the next may serve
            del self._kept[i]
            return ids
        return None

    def _keep(self, seq: Sequence) -> None:
        """(lock held) Shelve a finished sequence's cache for reuse when it holds positions
        (not compacted)."""
        cache = seq.cache
        if self.prompt_cache <= 0 or cache is None or cache.eviction is not None or cache.logical_length == 0:
            return
        self._shelve(seq.fed_ids(), cache)
        seq.cache = None

    def _shelve(self, ids: list[int], cache) -> None:
        """(lock held) A cache on the shelf, newest last, at most prompt_cache of them."""
        self._kept.append((ids, cache))
        while len(self._kept) > self.prompt_cache:
            self._kept.pop(0)[1].release()

    def _keep_prompt(self, ids, cache, q_window) -> None:
        """(worker, at an evicting prompt's end, before compaction) Shelve a branch of the
        whole prompt's cache, when its pages fit beside what the running requests hold and
        need: a follow-up that extends this prompt then continues it and is evicted as a
        whole, with its own question as the window, as a re-prefill would be, without
        prefilling the prompt again. The branch keeps the observation window's queries
        (q_window f32 [n_layers, n_heads, W, head_dim]), so a follow-up shorter than its
        window need not run the prompt's last tokens again. Dropped first when pages run
        short, as every kept cache is."""
        if self.prompt_cache <= 0:
            return
        # the lock is taken only to shelve: the running requests, the kept caches and the
        # pools' pages change on this thread alone, and the copy (a whole prompt's rows)
        # must not hold up the HTTP side's submit, cancel and state
        pool = cache.pool
        if self._short(pool, [cache.pages_held(k) for k in range(len(pool.segments))]):
            return
        try:
            branch = cache.branch()
        except (DeviceOutOfMemory, KvCacheError) as e:   # keeping is an optimisation: the request goes on
            log.warning("prompt cache not kept: %s", e)
            self._free_memory = True
            return
        branch.tail_queries = (cache.logical_length - q_window.shape[2], q_window)
        with self._cv:
            self._shelve(list(ids[:cache.logical_length]), branch)

    def _short(self, pool, need: list[int] | None = None) -> bool:
        """Whether some segment of `pool` lacks room for `need` (pages per segment) beside
        what the running requests hold and need for their next step and the kept caches
        hold."""
        for k, seg in enumerate(pool.segments):
            held = sum(r.sequence.pages_needed(k, HORIZON) for r in self._running
                       if r.sequence.cache is not None and r.sequence.cache.pool is pool)
            kept = sum(c.pages_held(k) for _, c in self._kept if c.pool is pool)
            if held + (need[k] if need else 0) + kept > seg.n_pages:
                return True
        return False

    def _make_room(self) -> None:
        """(lock held) Make the next step of the running requests fit their pools: drop
        kept caches, oldest first, then preempt the running request that arrived last
        (back to the head of the queue) until it does. A request alone always fits: it
        was admitted only if its prompt and max_tokens fit the pool."""
        for pool in {id(h.sequence.cache.pool): h.sequence.cache.pool for h in self._running
                     if h.sequence.cache is not None}.values():
            while self._short(pool):
                if self._drop_kept(pool):
                    continue
                users = [h for h in self._running if h.sequence.cache is not None and h.sequence.cache.pool is pool]
                if len(users) < 2:
                    break
                last = max(users, key=lambda h: h.submitted)
                last.sequence.preempt()
                self._running.remove(last)
                self._waiting.appendleft(last)
                self.counts["preempted"] += 1

    def _drop_kept(self, pool) -> bool:
        """Release the oldest kept cache of `pool`; False when there is none."""
        for i, (_, cache) in enumerate(self._kept):
            if cache.pool is pool:
                del self._kept[i]
                cache.release()
                return True
        return False

    def _step(self, running: list[Handle]) -> None:
        prefilling = next((h for h in running if not h.cancelled and h.sequence.state == "new"), None)
        if prefilling is not None:
            seq = prefilling.sequence
            before = seq.cache.logical_length if seq.cache is not None else 0
            self._guarded(prefilling, lambda h: h.sequence.prefill_step())
            if seq.cache is not None:
                self.counts["prompt_tokens"] += seq.cache.logical_length - before
            if self.fault is not None:      # the device is gone: nothing more runs on it
                return
        decoding = [h for h in running if not h.cancelled and h.sequence.state == "decode"]
        if decoding:
            self._decode(decoding)

    def _decode(self, handles: list[Handle]) -> None:
        """One token of every sequence in `handles`: sample (a sequence may finish here),
        then one batched forward over those still going."""
        live, tokens = [], []
        constrained = [h.sequence.job.constraint for h in handles if h.sequence.job.constraint is not None]
        if constrained:
            try:
                fill_masks(constrained)     # every grammar's next mask at once, in llguidance's threads
            except Exception as e:          # (a failure shows again, per request, in next_token)
                log.warning("engine serve: computing grammar masks failed: %s", e)
        for h in handles:
            n = len(h.sequence.tokens)
            try:
                token = h.sequence.next_token()
            except Exception as e:
                self._fail(h, e)
                continue
            self.counts["generation_tokens"] += len(h.sequence.tokens) - n
            if self.metrics is not None and len(h.sequence.tokens) > n:
                self.metrics.token(h)
            if token is None:
                if self.metrics is not None:
                    self.metrics.finished(h)
                with self._cv:
                    self._keep(h.sequence)
                self._retire(h, "completed")    # the pages are back before the client hears
                h.emit(h.sequence.finished)
            else:
                live.append(h)
                tokens.append(token)
        if not live:
            return
        caches = [h.sequence.cache for h in live]
        greedy = all(h.sequence.greedy for h in live)   # then only the ids come back from the device
        try:
            out = self.model.forward.decode_batch(tokens, caches, argmax=greedy)
        except Exception as e:
            for h in live:
                self._fail(h, e)
            return
        for h, row in zip(live, out):
            if greedy:
                h.sequence.feed_best(row)
            else:
                h.sequence.feed(row)

    def _guarded(self, h: Handle, step) -> None:
        """Run one step of one request; its failure fails it alone."""
        try:
            step(h)
        except Exception as e:
            self._fail(h, e)

    def _fail(self, h: Handle, e: BaseException) -> None:
        self._note_device_error(e)
        self._retire(h, "failed")            # off the running list under the lock, then released
        if not h.cancelled:
            h.emit(_failure(e))

    def _note_device_error(self, e: BaseException) -> None:
        if isinstance(e, DeviceFault) and self.fault is None:
            self.fault = str(e)
        elif isinstance(e, DeviceOutOfMemory) and not self._free_memory:
            self._free_memory = True
            log.warning("engine serve: a request failed: %s", e)

    def _end_after_fault(self) -> None:
        """(worker, last) The device faulted: fail every request still held with the
        fault (a stream ends with it), refuse new ones, drop the caches (host bookkeeping
        only: no device call runs again), then `on_fault`."""
        on_fault = self.on_fault
        self._end_all(Failed(503, self.fault, "device_fault"),
                      None if on_fault is None else lambda: on_fault(self.fault))

    def _end_all(self, failure: Failed, then) -> None:
        """(worker, last) Fail every request still held with `failure`, refuse new ones,
        drop the caches, then call `then()` (a device fault, the end of a drain)."""
        with self._cv:
            self._stopping = True
            held = [h for h in list(self._running) + list(self._waiting) if not h.cancelled]
            self.counts["failed"] += len(held)
            self._drop_all()
        for h in held:
            h.emit(failure)
        if then is not None:
            then()

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
        while self._kept:
            self._kept.pop()[1].release()
        for h in self._running:
            if h.sequence is not None:
                h.sequence.release()
        self._running.clear()
        self._waiting.clear()


_SHUTTING_DOWN = Failed(503, "the server is shutting down: this request was ended before it finished",
                        "shutting_down")


def _failure(e: BaseException) -> Failed:
    """400 for an engine error the request caused; 503 when the device ran out of
    memory (retry) or faulted (the server is going down); else 500."""
    if isinstance(e, DeviceOutOfMemory):
        return Failed(503, str(e), "device_out_of_memory", RETRY_AFTER_S)
    if isinstance(e, DeviceFault):
        return Failed(503, str(e), "device_fault")
    if isinstance(e, PoolsBusy):
        return Failed(503, str(e), "kv_pools_busy", RETRY_AFTER_S)
    if isinstance(e, DeviceError):
        return Failed(500, str(e), "device_error")
    if isinstance(e, EngineError):
        return Failed(400, str(e))
    return Failed(500, f"internal error: {type(e).__name__}: {e}")
