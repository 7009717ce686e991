"""The server's cache lifecycle (engine/serve/scheduler.py) driven directly: kept prompt
caches reused by later requests must give what `generate` gives alone, pages must all
come back, and failures while keeping a cache must not fail the request."""
from __future__ import annotations

import threading

import pytest

import engine
from engine.generate import SamplingParams
from engine.serve.scheduler import Scheduler
from engine.serve.sequence import Delta, Failed, Finished, Job
from engine.snapkv import SnapKvConfig

WAIT_S = 60.0


def run(sched, job) -> dict:
    """Submit one job and wait for its end: {"text", "end"}."""
    out = {"text": "", "end": None}
    done = threading.Event()

    def emit(event):
        if isinstance(event, Delta):
            out["text"] += event.text
        elif isinstance(event, (Finished, Failed)):
            out["end"] = event
            done.set()
    sched.submit(job, emit)
    assert done.wait(WAIT_S)
    return out


@pytest.fixture(scope="module")
def model(tiny_llama):
    return engine.load(tiny_llama, snapkv_budget=0)


def greedy(n):
    return SamplingParams(max_tokens=n, ignore_eos=True)


def test_an_extended_kept_cache_still_evicts_as_generate_does(model):
    """A (evicting) leaves a branch kept with its window's queries; B (no eviction)
    extends it and is kept longer; C (A's policy) extends B: the queries of C's window that
    B's positions hold were never kept, so those positions run again and C is compacted
    exactly as `generate` compacts it alone (it was left uncompacted)."""
    ev = SnapKvConfig(budget=24, window=8, sinks=2, min_tokens=16)
    sched = Scheduler(model, max_queue=4, max_running=2)
    sched.start()
    try:
        a = list(range(5, 105))
        run(sched, Job(a, greedy(4), ev))
        b = a + [7, 8, 9]
        assert run(sched, Job(b, greedy(4), None))["end"].usage["prompt_tokens_details"]["cached_tokens"] == 100
        c = b + [11, 12, 13, 14, 15, 16, 17]
        got = run(sched, Job(c, greedy(4), ev))
    finally:
        sched.stop()
    want = model.generate(c, max_tokens=4, ignore_eos=True, snapkv=ev)
    usage = got["end"].usage
    assert usage["kv_policy"] is not None and usage["kv_bytes"] == want.stats["snapkv"]["bytes_after"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == len(c) - ev.window
    assert got["text"] == want.text


def test_running_out_of_device_memory_while_keeping_a_prompt_is_not_the_requests_failure(model, monkeypatch):
    """Keeping the prompt's branch is an optimisation: device memory running out in its
    page copy leaves the request answering as generate does, nothing kept, and every page
    back in the pool (the branch's fresh pages were lost)."""
    from engine.errors import DeviceOutOfMemory
    ev = SnapKvConfig(budget=24, window=8, sinks=2, min_tokens=16)
    real, calls = model.backend.kv_copy_pages, []

    def flaky(*a, **k):
        calls.append(1)
        if len(calls) == 1:
            raise DeviceOutOfMemory("simulated: out of device memory")
        return real(*a, **k)
    monkeypatch.setattr(model.backend, "kv_copy_pages", flaky)
    sched = Scheduler(model, max_queue=4, max_running=2)
    sched.start()
    prompt = list(range(5, 105))
    try:
        got = run(sched, Job(prompt, greedy(4), ev))
    finally:
        sched.stop()
    assert calls and isinstance(got["end"], Finished)
    assert got["text"] == model.generate(prompt, max_tokens=4, ignore_eos=True, snapkv=ev).text
    pool = sched._pools[model.kv_dtype]
    assert pool.free_pages == pool.n_pages and not sched._kept


def test_keeping_a_prompt_copies_its_rows_without_holding_the_lock(model, monkeypatch):
    """The branch copy of a prompt's rows (hundreds of MiB at 32K) runs outside the
    scheduler's lock: the HTTP side's submit, cancel and /state answer meanwhile."""
    ev = SnapKvConfig(budget=24, window=8, sinks=2, min_tokens=16)
    real, copying, release = model.backend.kv_copy_pages, threading.Event(), threading.Event()

    def slow_copy(*a, **k):
        copying.set()
        assert release.wait(WAIT_S)
        return real(*a, **k)
    monkeypatch.setattr(model.backend, "kv_copy_pages", slow_copy)
    sched = Scheduler(model, max_queue=4, max_running=2)
    sched.start()
    answered = threading.Event()
    try:
        worker = threading.Thread(target=lambda: run(sched, Job(list(range(5, 105)), greedy(4), ev)))
        worker.start()
        assert copying.wait(WAIT_S)
        probe = threading.Thread(target=lambda: (sched.state(), answered.set()))
        probe.start()
        assert answered.wait(5.0), "/state waited for the copy"
        release.set()
        worker.join(WAIT_S)
        assert sched.state()["prompt_cache"]["caches"] == 1
    finally:
        release.set()
        sched.stop()


def test_a_drain_lets_a_preempted_request_finish(model, monkeypatch):
    """While draining (SIGTERM), a request preempted for pages was already streaming: it
    waits for pages until the deadline like the running ones and finishes, instead of
    being failed with the requests that never started."""
    import time
    slow = model.forward.decode_batch

    def decode_batch(tokens, caches, **kw):       # slow enough for the drain to begin mid-decode
        time.sleep(0.02)
        return slow(tokens, caches, **kw)
    monkeypatch.setattr(model.forward, "decode_batch", decode_batch)
    sched = Scheduler(model, max_queue=4, max_running=4, pool_tokens=128)   # two pages a layer
    ends, done = {}, threading.Semaphore(0)
    for name, ids in (("a", list(range(3, 63))), ("b", list(range(5, 65)))):
        def emit(event, name=name):
            if isinstance(event, (Finished, Failed)):
                ends[name] = event
                done.release()
        sched.submit(Job(ids, greedy(20), None), emit)
    sched.start()
    try:
        time.sleep(0.1)
        sched.drain(30.0)
        assert done.acquire(timeout=WAIT_S) and done.acquire(timeout=WAIT_S)
    finally:
        sched.stop()
    assert sched.counts["preempted"] >= 1
    assert all(isinstance(e, Finished) and e.usage["completion_tokens"] == 20 for e in ends.values()), ends


def test_a_quantized_cache_is_reused_only_where_its_keys_centre_on_the_same_rows(model):
    """Quantized keys are stored minus the mean of the first write's first rows: a kept
    cache continues a prompt as a fresh prefill would only when that prefill would centre
    on the same rows. A 100-token prompt's cache is not reused by a longer prompt sharing
    30 tokens (its centre came from 100 rows, a fresh one from 256); prompts that share
    their first 256 positions reuse it. Either way the answer is generate's."""
    sched = Scheduler(model, max_queue=4, max_running=2)
    sched.start()
    try:
        a = list(range(3, 103))
        run(sched, Job(a, greedy(4), None, "tq4"))
        b = a[:30] + [150 + i % 100 for i in range(150)]
        got_b = run(sched, Job(b, greedy(4), None, "tq4"))
        c = [3 + i % 250 for i in range(300)]
        run(sched, Job(c, greedy(4), None, "tq4"))
        d = c + [7, 8, 9]
        got_d = run(sched, Job(d, greedy(4), None, "tq4"))
    finally:
        sched.stop()
    assert got_b["end"].usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert got_d["end"].usage["prompt_tokens_details"]["cached_tokens"] == len(c)
    for ids, got in ((b, got_b), (d, got_d)):
        want = model.generate(ids, max_tokens=4, ignore_eos=True, kv_dtype="tq4", snapkv=False)
        assert got["text"] == want.text


def test_a_kept_cache_whose_window_moved_on_gives_way_to_the_next_longest(tmp_path):
    """The kept cache sharing the longest prefix may no longer hold the rows a
    sliding-window layer needs at that prefix (its ring moved on); the next kept cache
    that does serves the request instead of none, and the answer is generate's."""
    from tiny_gguf import write_tiny_gguf
    gemma = engine.load(write_tiny_gguf(tmp_path / "gemma3.gguf", arch="gemma3"), snapkv_budget=0)
    sched = Scheduler(gemma, max_queue=4, max_running=1)
    sched.start()
    try:
        long = list(range(5, 15)) + list(range(60, 130))   # 80 + 4: its rings hold the last rows
        run(sched, Job(long, greedy(4), None))
        short = long[:10] + [20, 21]                # 12 + 4: every row held (`long` can't serve it)
        run(sched, Job(short, greedy(4), None))
        ask = long[:40] + [7, 8, 9]                 # shares 40 with `long`, 10 with `short`
        got = run(sched, Job(ask, greedy(4), None))
    finally:
        sched.stop()
    assert got["end"].usage["prompt_tokens_details"]["cached_tokens"] == 10
    assert got["text"] == gemma.generate(ask, max_tokens=4, ignore_eos=True, snapkv=False).text
