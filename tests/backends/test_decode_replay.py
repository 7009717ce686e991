"""Decode through recorded steps (engine/replay.py) against fresh launches, on the
backends that record: CUDA on the tests' executor (the CPU harness without a GPU: the
recorded launches run again one by one; on a GPU a CUDA graph captured from them) and
Vulkan (lavapipe here: the recorded command buffer submitted again).

A replayed step runs the same kernels over the same arrays, reading the token, its
position and each layer's rows from the step buffer, with the same split of the
attended rows: its logits must equal the fresh launches' bit for bit, across page-table
growth, sliding-window rings, SnapKV compaction of the cache it was recorded on,
quantized KV formats, and a new cache (recorded again, counted). Batched steps
(decode_batch) replay one recording per batch size while their membership holds."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

import engine
from engine.errors import EngineError
from _backends import EXECUTOR_IDS, available_backends, cuda_test_executor
from engine.snapkv import SnapKvConfig
from tiny_gguf import write_tiny_gguf

PROMPT = list(range(3, 200, 2)) * 3
EXECUTOR = cuda_test_executor()


@pytest.fixture(params=[pytest.param("cuda", id=f"cuda-{EXECUTOR_IDS[EXECUTOR]}"),
                        pytest.param("vulkan", id="vulkan", marks=pytest.mark.skipif(
                            "vulkan" not in available_backends(), reason="no Vulkan device / kp"))])
def backend(request, monkeypatch):
    """The backend name; CUDA on the tests' executor."""
    monkeypatch.setenv("SHARPI_CUDA_EXECUTOR", EXECUTOR)
    return request.param


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-replay")
    return {
        "llama-q8": write_tiny_gguf(d / "llama.gguf", qtype=Q.Q8_0, seed=1),
        "qwen2-q4_1": write_tiny_gguf(d / "qwen2.gguf", arch="qwen2", qtype=Q.Q4_1, seed=2),
        "llama-q4_k-gqa4": write_tiny_gguf(d / "gqa4.gguf", dim=256, n_heads=4, n_kv_heads=1, ffn_dim=256,
                                           qtype=Q.Q4_K, seed=3),          # head_dim 64: every KV format
        "gemma3-w16": write_tiny_gguf(d / "gemma3.gguf", arch="gemma3", qtype=Q.Q8_0, seed=4,
                                      n_layers=6, sliding_window=16),
    }


def pair(path, backend, **kw):
    """(replayed, fresh): the same model loaded with decode replay on and off."""
    on = engine.load(path, backend=backend, snapkv_budget=0, decode_replay="on", **kw)
    off = engine.load(path, backend=backend, snapkv_budget=0, decode_replay="off", **kw)
    assert on.forward.replay is not None and off.forward.replay is None
    return on, off


def decode_logits(model, cache, first_logits, n):
    """n greedy decode steps: the logits of each."""
    out, logits = [], first_logits
    for _ in range(n):
        logits = model.forward.decode(int(np.argmax(logits)), cache)
        out.append(logits)
    return out


def check_same(on, off, ids, n, snapkv=False, kv_dtype=None):
    ca, la = on.prefill(ids, snapkv=snapkv, kv_dtype=kv_dtype)
    cb, lb = off.prefill(ids, snapkv=snapkv, kv_dtype=kv_dtype)
    np.testing.assert_array_equal(la, lb)
    for i, (a, b) in enumerate(zip(decode_logits(on, ca, la, n), decode_logits(off, cb, lb, n))):
        np.testing.assert_array_equal(a, b, err_msg=f"decode step {i}")
    assert ca.length == cb.length and ca.logical_length == cb.logical_length
    return ca


@pytest.mark.parametrize("name,kv_dtype,prompt,n", [
    ("llama-q8", "bf16", 60, 8),              # rows 60 .. 68: a new page (64 rows) while replaying
    ("llama-q4_k-gqa4", "q8_0/tq4", 120, 6),  # tq values: the combine always runs
    ("llama-q4_k-gqa4", "rq4_0", 130, 4),     # rotated rows, 3 splits of the attended rows
    ("llama-q4_k-gqa4", "rq4_0:0=q8_0/rq4_0", 100, 5),   # layer 0 in other formats (RoPE fused there only)
])
def test_replayed_decode_equals_fresh_launches(backend, tiny, name, kv_dtype, prompt, n):
    on, off = pair(tiny[name], backend, prefill_chunk=64)
    check_same(on, off, PROMPT[:prompt], n, kv_dtype=kv_dtype)
    assert on.forward.replay.stats == {"recordings": 1, "replays": n - 1}


def test_sliding_window_rings_replay(backend, tiny):
    """Gemma 3's sliding-window layers (window 16) reuse their ring of pages while one
    recording replays; the global layer grows."""
    on, off = pair(tiny["gemma3-w16"], backend, prefill_chunk=32)
    check_same(on, off, PROMPT[:50], 20)
    assert on.forward.replay.stats == {"recordings": 1, "replays": 19}


def test_snapkv_compaction_of_the_recorded_cache_replays(backend, tiny):
    """A cache compacted by SnapKV replays fine, and so does the same cache after a
    continued prompt compacts it again (fewer rows, the tables rewritten in place): one
    recording for all."""
    on, off = pair(tiny["qwen2-q4_1"], backend, prefill_chunk=64)
    cfg = SnapKvConfig(budget=64, window=16, min_tokens=32)
    ca = check_same(on, off, PROMPT[:150], 4, snapkv=cfg)
    assert ca.eviction["rows_after"] == 64
    caches = []
    for m in (on, off):
        cache, _ = m.prefill(PROMPT[:150], snapkv=cfg)
        first = decode_logits(m, cache, m.forward.decode(7, cache), 3)
        cache, logits = m.prefill(PROMPT[150:230], cache, snapkv=cfg, compact_continued=True)
        caches.append((cache, first + [logits] + decode_logits(m, cache, logits, 4)))
    (a, la), (b, lb) = caches
    assert a.length == b.length < a.logical_length
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(x, y)
    assert on.forward.replay.stats["recordings"] == 2    # check_same's cache, then this one


def test_a_new_cache_records_again_and_adaptive_budgets_run_fresh(backend, tiny):
    on, _ = pair(tiny["qwen2-q4_1"], backend, prefill_chunk=64)
    for _ in range(2):
        on.generate(PROMPT[:40], max_tokens=3, ignore_eos=True)
    assert on.forward.replay.stats == {"recordings": 2, "replays": 2}
    cfg = SnapKvConfig(budget=64, window=16, min_tokens=32, allocation="adaptive")
    cache, logits = on.prefill(PROMPT[:150], snapkv=cfg)
    assert any(kv.ragged for kv in cache.layers)
    decode_logits(on, cache, logits, 2)                   # heads with their own rows: not replayed
    assert on.forward.replay.stats == {"recordings": 2, "replays": 2}


def test_greedy_tokens_on_the_device(backend, tiny):
    """decode_argmax (argmax_rows on the device: one int read back) gives the tokens of the
    argmax of decode's logits, replayed or not; steps alternating between the two outputs
    keep a recording each and record nothing more."""
    on, off = pair(tiny["qwen2-q4_1"], backend, prefill_chunk=64)
    runs = []
    for m, device in ((on, True), (off, True), (off, False)):
        cache, logits = m.prefill(PROMPT[:70])
        token, seq = int(np.argmax(logits)), []
        for i in range(8):
            if device and i % 2 == 0:
                token = m.forward.decode_argmax(token, cache)
            else:
                token = int(np.argmax(m.forward.decode(token, cache)))
            seq.append(token)
        runs.append(seq)
    assert runs[0] == runs[1] == runs[2]
    assert on.forward.replay.stats == {"recordings": 2, "replays": 6}


def test_greedy_batches_on_the_device(backend, tiny):
    """decode_batch(argmax=True) (a server's all-greedy step: n ids read back) gives the
    argmax of each row of decode_batch's logits, replayed or not, steps alternating
    between the two outputs over caches of different lengths and key formats."""
    on, off = pair(tiny["llama-q4_k-gqa4"], backend, prefill_chunk=64)
    runs = []
    for m, device in ((on, True), (off, True), (off, False)):
        caches, tokens = [], []
        for ids, dt in ((PROMPT[:70], "bf16"), (PROMPT[3:20], "q8_0"), (PROMPT[9:50], "rq4_0")):
            cache, logits = m.prefill(ids, kv_dtype=dt)
            caches.append(cache)
            tokens.append(int(np.argmax(logits)))
        seq = []
        for i in range(6):
            if device and i % 2 == 0:
                best = m.forward.decode_batch(tokens, caches, argmax=True)
                assert best.shape == (3,) and best.dtype == np.int64
            else:
                best = np.argmax(m.forward.decode_batch(tokens, caches), axis=1)
            tokens = [int(t) for t in best]
            seq.append(tokens)
        runs.append(seq)
    assert runs[0] == runs[1] == runs[2]
    assert on.forward.replay.stats == {"recordings": 2, "replays": 4}


def test_bad_token_is_refused_before_any_work(backend, tiny):
    on, _ = pair(tiny["llama-q8"], backend, prefill_chunk=64)
    cache, logits = on.prefill(PROMPT[:20])
    on.forward.decode(int(np.argmax(logits)), cache)
    length = cache.length
    with pytest.raises(EngineError, match="outside the vocabulary"):
        on.forward.decode(on.config.vocab_size, cache)
    assert cache.length == length


def test_a_collected_cache_drops_only_its_own_recording(backend, tiny):
    """Greedy (argmax) and logits steps keep a recording each: a cache of one collected
    drops that one only, so the other cache goes on replaying."""
    import gc
    on, _ = pair(tiny["llama-q8"], backend, prefill_chunk=64)
    a, la = on.prefill(PROMPT[:20])
    b, lb = on.prefill(PROMPT[:30])
    on.forward.decode_argmax(int(np.argmax(la)), a)
    on.forward.decode(int(np.argmax(lb)), b)
    del a
    gc.collect()
    on.forward.decode(7, b)
    assert on.forward.replay.stats == {"recordings": 2, "replays": 1}


def test_a_failed_replay_is_not_counted_as_steady(backend, tiny, monkeypatch):
    """A recording counts as replayed (its CUDA graph captured) only once a replay of it
    ran whole: after a failed first replay, the next one is not steady state."""
    on, _ = pair(tiny["llama-q8"], backend, prefill_chunk=64)
    cache, logits = on.prefill(PROMPT[:20])
    on.forward.decode(int(np.argmax(logits)), cache)           # records
    real = on.backend.replay
    monkeypatch.setattr(on.backend, "replay", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("capture failed")))
    with pytest.raises(RuntimeError):
        on.forward.decode(7, cache)
    assert cache.interrupted is None                            # no layer took the row
    monkeypatch.setattr(on.backend, "replay", real)
    before = dict(on.forward.decode_counters)
    on.forward.decode(7, cache)
    assert not on.forward.replay.steady and on.forward.decode_counters["replayed_tokens"] == before["replayed_tokens"]
    on.forward.decode(8, cache)
    assert on.forward.replay.steady


def batch_steps(model, caches, tokens, steps):
    """`steps` batched greedy steps from tokens (one per cache): the logits of each."""
    out = []
    for _ in range(steps):
        logits = model.forward.decode_batch(tokens, caches)
        out.append(logits)
        tokens = [int(t) for t in np.argmax(logits, axis=1)]
    return out, tokens


def test_batched_steps_replay_and_membership_changes_record_again(backend, tiny):
    """decode_batch replays one recording per batch size, bit for bit the fresh launches'
    logits, across caches of different lengths and row formats (one crossing a page); a
    sequence leaving or joining (another membership), the batch's order, or a batch size
    seen before with other caches records again; single-sequence decode keeps its own."""
    on, off = pair(tiny["llama-q4_k-gqa4"], backend, prefill_chunk=64)
    prompts = [PROMPT[:60], PROMPT[5:40], PROMPT[9:100]]
    dtypes = ["bf16", "q8_0/tq4", "rq4_0"]
    runs = []
    for m in (on, off):
        caches, tokens = [], []
        for ids, dt in zip(prompts, dtypes):
            cache, logits = m.prefill(ids, kv_dtype=dt)
            caches.append(cache)
            tokens.append(int(np.argmax(logits)))
        a, tokens = batch_steps(m, caches, tokens, 6)                    # 3 sequences; one crosses row 64
        b, tokens2 = batch_steps(m, caches[:2], tokens[:2], 3)           # the third leaves
        c, _ = batch_steps(m, caches[::-1], tokens[::-1], 2)             # all three, another order
        d = decode_logits(m, caches[2], c[-1][0], 3)                     # one sequence alone
        e, _ = batch_steps(m, caches[1:], [tokens2[1], 5], 2)            # 2 again, other caches
        runs.append(a + b + c + [x[None] for x in d] + e)
    for i, (x, y) in enumerate(zip(*runs)):
        np.testing.assert_array_equal(x, y, err_msg=f"step {i}")
    # recorded: 3 (a), 2 (b), 3 reordered (c), 1 (d), 2 with other caches (e)
    assert on.forward.replay.stats == {"recordings": 5, "replays": 5 + 2 + 1 + 2 + 1}
    d = on.forward.decode_stats()
    assert d["tokens"] == 18 + 6 + 6 + 3 + 4 and d["recordings"] == 5


def test_batches_past_the_mat_vec_rows_run_fresh(backend, tiny):
    """A batched step of more sequences than the CUDA mat-vec takes (MV_MAX_TOKENS rows)
    runs its projections as dequantized rows and a GEMM, which a recording cannot hold
    (cuBLAS allocates its output): such a step is not kept and runs fresh every time, its
    logits those of decode replay off; Vulkan records and replays it."""
    from backends.cuda.quant import MV_MAX_TOKENS
    n = MV_MAX_TOKENS + 1
    on, off = pair(tiny["qwen2-q4_1"], backend, prefill_chunk=64)
    runs = []
    for m in (on, off):
        caches, tokens = [], []
        for i in range(n):
            cache, logits = m.prefill(PROMPT[i:i + 20 + i])
            caches.append(cache)
            tokens.append(int(np.argmax(logits)))
        runs.append(batch_steps(m, caches, tokens, 3)[0])
    for i, (x, y) in enumerate(zip(*runs)):
        np.testing.assert_array_equal(x, y, err_msg=f"step {i}")
    stats = on.forward.replay.stats
    assert stats == ({"recordings": 3, "replays": 0} if backend == "cuda" else {"recordings": 1, "replays": 2})


def test_a_kept_recording_holds_the_arrays_it_is_keyed_by(backend, tiny):
    """The replay key compares arrays by identity, so the arrays of a kept recording must
    stay alive while it is kept (a freed one's address could go to a new array, which
    would then replay the old recording over the old buffer): a layer's key centre
    replaced, the old one is still referenced from the recording, and the next step
    records again."""
    import sys
    on, _ = pair(tiny["llama-q4_k-gqa4"], backend, prefill_chunk=64)
    cache, logits = on.prefill(PROMPT[:30], kv_dtype="q8_0")
    decode_logits(on, cache, logits, 2)
    kv = cache.layers[0]
    old = kv.key_centre
    kv.key_centre = on.backend.upload(on.backend.download(old))
    assert sys.getrefcount(old) > 2              # `old`, getrefcount's argument, and the recording
    before = on.forward.replay.stats["recordings"]
    decode_logits(on, cache, logits, 1)
    assert on.forward.replay.stats["recordings"] == before + 1


def test_large_step_buffers_replay_on_device_local_memory(backend, tiny, monkeypatch):
    """On a GPU, buffers over STAGED_MAX_BYTES live in device memory only, with no host
    side for a replay to rewrite: a recorded step's buffer (2 + 2 x layers ints a
    sequence, over 64 KiB for a large batch of a deep model) keeps its staging copy
    whatever its size. Device-local buffers forced on lavapipe with the limit lowered
    below the tiny model's step buffer: replayed logits equal fresh launches'."""
    if backend != "vulkan":
        pytest.skip("Vulkan's device-local buffers")
    import backends
    from backends.vulkan import backend as mod
    monkeypatch.setattr(mod, "STAGED_MAX_BYTES", 16)

    def gpu_style(name="cpu", threads=None, quiet=False, auto_gpu_only=False):
        b = mod.VulkanBackend(device_local=True)
        backends.check_complete(b)
        return b

    monkeypatch.setattr(backends, "get_backend", gpu_style)
    on, off = pair(tiny["llama-q8"], backend, prefill_chunk=64)
    check_same(on, off, PROMPT[:40], 4)
    assert on.forward.replay.stats["replays"] == 3


def test_replayed_steps_launch_nothing(backend, tiny):
    """decode_stats: a recorded step's launches, then none while it replays."""
    on, off = pair(tiny["llama-q8"], backend, prefill_chunk=64)
    for m in (on, off):
        cache, logits = m.prefill(PROMPT[:30])
        since = dict(m.forward.decode_counters)
        decode_logits(m, cache, logits, 1)
        first = m.forward.decode_stats(since)
        since = dict(m.forward.decode_counters)
        decode_logits(m, cache, logits, 4)
        later = m.forward.decode_stats(since)
        assert first["tokens"] == 1 and later["tokens"] == 4 and first["launches_per_token"] > 10
        assert later["host_us_per_token"] > 0
        if m is on:
            assert later["launches_per_token"] == 0 and (later["recordings"], later["replays"]) == (0, 4)
            assert first["replayed_host_us_per_token"] is None       # the recording is not a replay
            # nor is the first replay, which captures the CUDA graph: 3 of the 4 steps count
            assert m.forward.decode_counters["replayed_tokens"] - since["replayed_tokens"] == 3
            assert later["replayed_host_us_per_token"] > 0
        else:
            assert later["launches_per_token"] == first["launches_per_token"] and later["replays"] == 0
            assert later["replayed_host_us_per_token"] is None


def test_replay_past_the_context_of_a_compacted_cache(backend, tiny):
    """A compacted cache holds few rows while its positions keep counting: a step whose
    position passes the RoPE table the recording bound (the context, here 512: a table of
    4096) records again with a larger one, so replayed logits stay the fresh ones (the
    shaders would read past the table)."""
    on, off = pair(tiny["qwen2-q4_1"], backend, prefill_chunk=64, ctx=512)
    cfg = SnapKvConfig(budget=64, window=16, min_tokens=32)
    got = []
    for m in (on, off):
        cache, logits = m.prefill(PROMPT[:150], snapkv=cfg)
        out = decode_logits(m, cache, logits, 2)
        for kv in cache.layers:               # a long history after compaction: positions 4094 ..
            kv.logical_length += 4094 - cache.logical_length
        out += decode_logits(m, cache, out[-1], 4)
        got.append(out)
    for i, (a, b) in enumerate(zip(*got)):
        np.testing.assert_array_equal(a, b, err_msg=f"decode step {i}")
    assert on.forward.replay.stats["recordings"] >= 2


def test_an_emptied_cache_sets_its_key_centre_afresh(backend, tiny):
    """A released cache decoding again from nothing (quantized keys): its first write sets
    the key centre, which a recorded step cannot read back: that step runs fresh, the next
    record, and the logits equal fresh launches'."""
    on, off = pair(tiny["llama-q4_k-gqa4"], backend, prefill_chunk=64, ctx=512)
    got = []
    for m in (on, off):
        cache, logits = m.prefill(PROMPT[:70], kv_dtype="q8_0")
        cache.release()
        assert cache.centre_rows == 0
        got.append(decode_logits(m, cache, logits, 4))
        assert cache.centre_rows == 1
    for i, (a, b) in enumerate(zip(*got)):
        np.testing.assert_array_equal(a, b, err_msg=f"decode step {i}")
