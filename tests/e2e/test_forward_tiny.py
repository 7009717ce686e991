"""The whole forward pass on small random-weight GGUFs: CPU vs the numpy
reference, prefill chunking, and SnapKV wiring (keep sets, positions, logits)."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

import engine
from engine.errors import EngineError
from engine.snapkv import SnapKvConfig, SnapKvSelector
from _backends import nmse
from tiny_gguf import STEPS_AGREE, write_tiny_gguf


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    return {
        "llama-f32": write_tiny_gguf(d / "llama.gguf"),
        "llama-q8": write_tiny_gguf(d / "llama-q8.gguf", qtype=Q.Q8_0, seed=1),
        "qwen2-q4_1": write_tiny_gguf(d / "qwen2.gguf", arch="qwen2", qtype=Q.Q4_1, seed=2),
        "llama-q4_k": write_tiny_gguf(d / "llama-q4k.gguf", dim=256, n_heads=4, n_kv_heads=1, ffn_dim=256,
                                      qtype=Q.Q4_K, seed=3),
        "gemma3-q8": write_tiny_gguf(d / "gemma3-q8.gguf", arch="gemma3", dim=64, n_heads=4, n_kv_heads=1,
                                     head_dim=32, ffn_dim=128, ctx=1024, qtype=Q.Q8_0, seed=4),
    }


PROMPT = list(range(3, 200, 2)) * 3     # 291 token ids


@pytest.mark.parametrize("name", ["llama-f32", "llama-q8", "qwen2-q4_1", "llama-q4_k"])
def test_cpu_matches_reference(models, name):
    ref = engine.load(models[name], backend="reference", prefill_chunk=64)
    cpu = engine.load(models[name], backend="cpu", prefill_chunk=64)
    ids = PROMPT[:150]
    a, b = cpu.logits(ids), ref.logits(ids)
    assert nmse(a, b) < 1e-6
    ra, rb = cpu.generate(ids, max_tokens=12, ignore_eos=True), ref.generate(ids, max_tokens=12, ignore_eos=True)
    assert ra.tokens == rb.tokens


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_prefill_chunking_and_token_by_token_agree(models, backend):
    ids = PROMPT[:70]
    whole = engine.load(models["qwen2-q4_1"], backend=backend, prefill_chunk=256).logits(ids)
    chunked = engine.load(models["qwen2-q4_1"], backend=backend, prefill_chunk=16).logits(ids)
    m = engine.load(models["qwen2-q4_1"], backend=backend, prefill_chunk=1)
    one_by_one = m.logits(ids)
    np.testing.assert_allclose(chunked, whole, **STEPS_AGREE)
    np.testing.assert_allclose(one_by_one, whole, **STEPS_AGREE)


def test_generation_continues_a_cache(models):
    m = engine.load(models["llama-q8"], backend="cpu")
    cache, logits = m.prefill(PROMPT[:40])
    token = int(np.argmax(logits))
    step = m.forward.decode(token, cache)
    full = m.logits(PROMPT[:40] + [token])
    np.testing.assert_allclose(step, full, **STEPS_AGREE)
    assert (cache.length, cache.logical_length) == (41, 41)


def _fail_in_layer(backend, op: str, layer: int, error: BaseException):
    """Patch backend.op to raise `error` on its call for `layer` (0-based, one call a layer)."""
    real, calls = getattr(backend, op), []

    def failing(*a, **k):
        calls.append(1)
        if len(calls) == layer + 1:
            raise error
        return real(*a, **k)
    return failing


@pytest.mark.parametrize("where", ["decode", "prefill", "download"])
def test_a_step_interrupted_midway_leaves_a_cache_that_refuses_more(models, monkeypatch, where):
    """Ctrl-C (or an error) inside a step after some layers took their rows leaves the
    layers at different positions: the cache then refuses further steps with a clear
    error instead of answering from a cache that is not the prompt, until released.
    A failure before any layer took rows (a bad token) leaves it usable."""
    from engine.kv.paged import KvCacheError
    m = engine.load(models["llama-q8"], backend="cpu", prefill_chunk=16)
    cache, logits = m.prefill(PROMPT[:40])
    with pytest.raises(EngineError, match="outside the vocabulary"):
        m.forward.decode(10 ** 9, cache)                        # refused before any write (not a crash)
    assert cache.interrupted is None
    op = {"decode": "attention_decode", "prefill": "attention_prefill", "download": "download"}[where]
    monkeypatch.setattr(m.backend, op, _fail_in_layer(m.backend, op, 1 if op != "download" else 0,
                                                      KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        if where == "prefill":
            m.prefill(PROMPT[40:80], cache=cache)
        else:                        # download: every layer took its row, the logits never came
            m.forward.decode(int(np.argmax(logits)), cache)
    monkeypatch.undo()
    assert cache.interrupted == "KeyboardInterrupt"
    if where != "download":
        assert len({layer.logical_length for layer in cache.layers}) == 2
    with pytest.raises(KvCacheError, match="in the middle of a step"):
        m.forward.decode(int(np.argmax(logits)), cache)
    with pytest.raises(KvCacheError, match="in the middle of a step"):
        m.prefill(PROMPT[40:50], cache=cache)
    cache.release()
    _, again = m.prefill(PROMPT[:40], cache=cache)
    np.testing.assert_array_equal(again, logits)


def test_a_model_run_from_another_thread_keeps_its_thread_count(models, monkeypatch):
    """numba's thread count is per thread: generate() run from a thread pool (or a stream
    consumed on several threads) still runs its kernels on the model's `threads`."""
    import concurrent.futures
    import numba
    m = engine.load(models["llama-q8"], backend="cpu", threads=1)
    seen, real = [], m.backend.attention_decode

    def watched(*a, **k):
        seen.append(numba.get_num_threads())
        return real(*a, **k)
    monkeypatch.setattr(m.backend, "attention_decode", watched)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(m.generate, PROMPT[:20], max_tokens=3, ignore_eos=True).result()
    assert seen and set(seen) == {1}


# -- SnapKV wiring ------------------------------------------------------------------------

def policy(**kw):
    base = dict(budget=96, window=16, sinks=4, kernel=5, pool="avg", granularity="head", min_tokens=32)
    base.update(kw)
    return SnapKvConfig(**base)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_budget_at_least_prompt_is_bit_identical(models, backend):
    m = engine.load(models["llama-q8"], backend=backend, prefill_chunk=64)
    ids = PROMPT[:150]
    off = m.generate(ids, max_tokens=8, ignore_eos=True, snapkv=False)
    cache_off = m.last_cache
    on = m.generate(ids, max_tokens=8, ignore_eos=True, snapkv=policy(budget=150))
    assert on.tokens == off.tokens
    a = m.prefill(ids, snapkv=False)[1]
    b = m.prefill(ids, snapkv=policy(budget=200))[1]
    np.testing.assert_array_equal(a, b)
    assert m.last_cache.eviction is None and cache_off.eviction is None


@pytest.mark.parametrize("granularity", ["head", "layer", "global"])
def test_compaction_lengths_positions_and_keep_sets(models, granularity):
    m = engine.load(models["llama-q8"], backend="cpu", prefill_chunk=64)
    m.forward.page_size = 16                 # small pages, so compaction frees some
    ids = PROMPT[:200]
    cfg = policy(granularity=granularity)
    cache, _ = m.prefill(ids, snapkv=cfg)
    st = m.cache_stats()
    assert st["logical_length"] == 200 and st["eviction"]["rows_after"] == 96
    keeps = [l["keep"] for l in st["layers"]]
    for layer, keep in zip(st["layers"], keeps):
        assert layer["length"] == 96 and layer["logical_length"] == 200
        assert keep.shape == (m.config.n_kv_heads, 96)
        assert (np.diff(keep, axis=1) > 0).all()
        assert (keep[:, :4] == np.arange(4)).all() and (keep[:, -16:] == np.arange(184, 200)).all()
        if granularity != "head":
            assert (keep == keep[0]).all()
    if granularity == "global":
        assert all((k == keeps[0]).all() for k in keeps)
    page_bytes = 2 * m.config.n_kv_heads * 16 * m.config.head_dim * 2
    assert st["eviction"]["bytes_before"] == m.config.n_layers * 13 * page_bytes     # ceil(200 / 16) pages
    assert st["eviction"]["bytes_after"] == m.config.n_layers * 6 * page_bytes      # ceil(96 / 16) pages
    assert all(l["pages"] == 6 for l in st["layers"])
    # decode continues at the logical position
    m.forward.decode(5, cache)
    assert (cache.layers[0].length, cache.logical_length) == (97, 201)


def test_pyramid_layer_budgets_free_pages_per_layer(models):
    """allocation="pyramid": each layer keeps its own budget (falling with depth, the
    same total as uniform), holds only the pages of those rows, and decodes on."""
    m = engine.load(models["llama-q8"], backend="cpu", prefill_chunk=64)
    m.forward.page_size = 16
    cfg = policy(budget=64, allocation="pyramid")
    cache, _ = m.prefill(PROMPT[:200], snapkv=cfg)
    budgets = SnapKvSelector(cfg).layer_budgets(m.config.n_layers, 200)
    lengths = [layer.length for layer in cache.layers]
    assert lengths == budgets and sum(lengths) == 64 * m.config.n_layers and lengths[0] > lengths[-1]
    assert [layer.n_pages for layer in cache.layers] == [-(-b // 16) for b in budgets]
    for layer in m.cache_stats()["layers"]:
        assert (layer["keep"][:, -16:] == np.arange(184, 200)).all()
    m.forward.decode(5, cache)
    assert [layer.length for layer in cache.layers] == [b + 1 for b in budgets]



def masked_twin(cache, keeps):
    """A dense masked reference: `cache` (the uncompacted prompt) with every row a head
    dropped hidden by a logit bias of EMPTY_BIAS, so attention sees the kept rows only."""
    from engine.kv.merge import EMPTY_BIAS
    for layer, keep in zip(cache.layers, keeps):
        mask = np.full((len(keep), layer.length), EMPTY_BIAS, dtype=np.float32)
        for h, k in enumerate(keep):
            mask[h, k] = 0
        layer._set_bias(mask)
    return cache


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("allocation,merge", [("adaptive", 0), ("pyramid-adaptive", 0), ("adaptive", 4)])
def test_adaptive_head_budgets_hold_only_each_heads_rows(models, backend, allocation, merge):
    """allocation="adaptive": a layer's KV heads keep different numbers of rows (their
    sum is n_kv_heads x the layer's budget), each head holds only its own (the layer only
    the pages they fill), and decode equals the uncompacted cache with each head's
    dropped rows masked out, token after token."""
    m = engine.load(models["qwen2-q4_1"], backend=backend, prefill_chunk=64)
    m.forward.page_size = 8                          # pages small enough for the heads' rows to show
    cfg = policy(budget=64, allocation=allocation, merge=merge)
    full, cache = [], m.forward.new_cache()
    logits = m.forward.prefill(PROMPT[:200], cache, snapkv=cfg) if merge else None
    if not merge:
        steps = m.forward.prefill_steps(PROMPT[:200], cache, snapkv=cfg,
                                        before_evict=lambda c, q: full.append(c.copy()))
        while True:
            try:
                next(steps)
            except StopIteration as end:
                logits = end.value
                break
    H, ps = m.config.n_kv_heads, m.forward.page_size
    budgets = SnapKvSelector(cfg).layer_budgets(len(cache.layers), 200)
    ragged = 0
    for layer, stats, budget in zip(cache.layers, cache.stats()["layers"], budgets):
        lengths = [len(k) + merge for k in layer.last_keep]
        assert sum(lengths) == H * budget
        assert list(stats["head_rows"] if stats["head_rows"] is not None else [layer.length] * H) == lengths
        for k in layer.last_keep:
            assert (k[:4] == np.arange(4)).all() and (k[-16:] == np.arange(184, 200)).all()
        if len(set(lengths)) > 1:
            ragged += 1
            assert layer.ragged and layer.n_pages == -(-sum(-(-n // ps) for n in lengths) // H)
    assert ragged > 0                                # the votes did move rows between heads
    token = int(np.argmax(logits))
    if merge:                                        # merged rows: no dense reference; decode runs on
        assert np.isfinite(m.forward.decode(token, cache)).all()
        return
    ref = masked_twin(full[0], [l.last_keep for l in cache.layers])
    for _ in range(4):                               # the new rows land at each head's own row
        a, b = m.forward.decode(token, cache), m.forward.decode(token, ref)
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
        token = int(np.argmax(a))


@pytest.mark.parametrize("name", ["qwen2-q4_1", "gemma3-q8"])
def test_a_short_continuation_is_evicted_with_the_kept_window_queries(models, name):
    """A prompt's cache kept before its eviction with the window's queries (tail_queries),
    continued by fewer tokens than the window and evicted as a whole, keeps the rows and
    gives the logits of a fresh prefill of the whole prompt, sliding-window layers too
    (which could not go back to run the window again); without the queries it is not
    compacted."""
    path = models[name]
    m = engine.load(path, backend="cpu", prefill_chunk=32, snapkv_budget=0)
    cfg = SnapKvConfig(budget=48, window=16, sinks=2, min_tokens=16)
    ids, more = PROMPT[:150], PROMPT[150:160]
    kept = []

    def keep(cache, q):
        branch = cache.copy()
        branch.tail_queries = (cache.logical_length - q.shape[2], q.copy())
        kept.append(branch)

    for _ in m.forward.prefill_steps(ids, m.forward.new_cache(), snapkv=cfg, before_evict=keep):
        pass
    branch, bare = kept[0], kept[0].copy()
    bare.tail_queries = None
    got = m.forward.prefill(more, branch, snapkv=cfg, compact_continued=True)
    fresh = m.forward.new_cache()
    want = m.forward.prefill(ids + more, fresh, snapkv=cfg)
    assert branch.eviction is not None and branch.logical_length == fresh.logical_length == 160
    for a, b in zip(branch.layers, fresh.layers):
        assert a.length == b.length
        if b.last_keep is not None:
            np.testing.assert_array_equal(a.last_keep, b.last_keep)
    np.testing.assert_allclose(got, want, **STEPS_AGREE)
    m.forward.prefill(more, bare, snapkv=cfg, compact_continued=True)
    assert bare.eviction is None and bare.layers[-1].length == 160


def test_chunked_and_unchunked_prefill_select_the_same_rows(models):
    ids = PROMPT[:200]
    keeps = []
    for chunk in (256, 40, 7):
        m = engine.load(models["qwen2-q4_1"], backend="cpu", prefill_chunk=chunk)
        m.prefill(ids, snapkv=policy())
        keeps.append([l["keep"] for l in m.cache_stats()["layers"]])
    for other in keeps[1:]:
        for a, b in zip(keeps[0], other):
            np.testing.assert_array_equal(a, b)


def test_cpu_and_reference_select_the_same_rows(models):
    ids = PROMPT[:200]
    sets = []
    for backend in ("cpu", "reference"):
        m = engine.load(models["llama-f32"], backend=backend, prefill_chunk=64)
        m.prefill(ids, snapkv=policy())
        sets.append([l["keep"] for l in m.cache_stats()["layers"]])
    agree = np.mean([np.isin(a, b).mean() for a, b in zip(*sets)])
    assert agree > 0.98      # only near-ties may differ between f32 kernels and the f64 oracle


def test_decode_after_compaction_equals_masked_full_attention(models):
    """Logits after eviction equal a full-cache run in which the evicted rows are
    masked out of attention for the decode step (computed by the reference)."""
    m = engine.load(models["llama-f32"], backend="reference", prefill_chunk=64)
    ids = PROMPT[:200]
    cache, logits = m.prefill(ids, snapkv=policy(granularity="layer"))
    keep = [l.last_keep[0] for l in cache.layers]
    token = int(np.argmax(logits))
    evicted_logits = m.forward.decode(token, cache)

    full, _ = m.prefill(ids, snapkv=False)
    for layer, k in zip(full.layers, keep):            # compact the full cache by hand in numpy
        layer.compact(k)
    np.testing.assert_allclose(m.forward.decode(token, full), evicted_logits, rtol=1e-6, atol=1e-6)


def test_continued_prompt_not_compacted_again(models):
    m = engine.load(models["llama-q8"], backend="cpu", prefill_chunk=64)
    cache, _ = m.prefill(PROMPT[:200], snapkv=policy())
    assert cache.layers[0].length == 96
    m.prefill(PROMPT[:50], cache=cache, snapkv=policy())
    assert cache.layers[0].length == 146 and cache.logical_length == 250
    m.prefill(PROMPT[:50], cache=cache, snapkv=policy(), compact_continued=True)
    assert cache.layers[0].length == 96 and cache.logical_length == 300


@pytest.mark.parametrize("name", ["qwen2-q4_1", "gemma3-q8"])
def test_decode_batch_equals_one_sequence_at_a_time(models, name):
    """A batched decode step over caches of different lengths, eviction and row formats
    gives each sequence exactly the logits of its own decode step (the server's
    concurrent answers depend on it), also with sliding-window layers (gemma3)."""
    path = models[name]
    m = engine.load(path, backend="cpu", prefill_chunk=32, snapkv_budget=0)
    specs = [(PROMPT[:150], SnapKvConfig(budget=48, window=8, sinks=2, min_tokens=16), None),
             (PROMPT[7:20], False, "tq4"), (PROMPT[40:110], False, None)]

    def start():
        out = []
        for ids, snap, dt in specs:
            cache, logits = m.prefill(ids, snapkv=snap, kv_dtype=dt)
            out.append((cache, int(np.argmax(logits))))
        return out

    batched, alone = start(), start()
    assert batched[0][0].eviction is not None
    for _ in range(3):
        got = m.forward.decode_batch([t for _, t in batched], [c for c, _ in batched])
        want = np.stack([m.forward.decode(t, c) for c, t in alone])
        np.testing.assert_array_equal(got, want)
        batched = [(c, int(np.argmax(row))) for (c, _), row in zip(batched, got)]
        alone = [(c, int(np.argmax(row))) for (c, _), row in zip(alone, want)]
    assert [c.length for c, _ in batched] == [c.length for c, _ in alone]
    with pytest.raises(ValueError, match="twice"):
        m.forward.decode_batch([1, 2], [batched[0][0], batched[0][0]])


def test_kv_pages_split_over_pools_by_a_buffer_cap_change_nothing(models):
    """A backend that caps one KV buffer (Vulkan: maxStorageBufferRange) gets the layers'
    pages in several pools (here the biggest layer's size: the global layer alone, the
    sliding-window layers together); prefill with SnapKV, decode, and a pool shared by
    caches give the logits of one pool, bit for bit."""
    path = models["gemma3-q8"]
    plain = engine.load(path, backend="cpu", prefill_chunk=32, snapkv_budget=0)
    capped = engine.load(path, backend="cpu", prefill_chunk=32, snapkv_budget=0)
    one = plain.new_cache()
    biggest = max(l.max_pages for l in one.layers) * one.pool.n_kv_heads * one.pool.page_size * 32 * 2
    capped.backend.max_kv_buffer_bytes = biggest
    split = capped.new_cache().pool
    assert len(one.pool.segments) == 1 and len(split.segments) == 2
    assert [split.segment_index(i) for i in range(6)] == [0, 0, 0, 0, 0, 1]
    snap = SnapKvConfig(budget=48, window=8, sinks=2, min_tokens=16)

    def run(m, pool=None):
        out = []
        for ids, s in ((PROMPT[:150], snap), (PROMPT[40:110], False)):
            cache, logits = m.prefill(ids, snapkv=s, cache=m.new_cache(pool=pool))
            rows = [logits]
            for _ in range(3):
                rows.append(m.forward.decode(int(np.argmax(rows[-1])), cache))
            out.append(np.stack(rows))
        return out

    want = run(plain)
    for got in (run(capped), run(capped, capped.new_pool(2 * 1024))):   # room for both caches
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("allocation,merge", [("pyramid", 0), ("adaptive", 0), ("uniform", 8)])
def test_a_cache_with_unequal_budgets_is_not_scored_again(models, allocation, merge):
    """SnapKV scores rows of one count shared by every layer and head, none of them
    merged: continuing a pyramid, adaptive or merged cache with compaction fails in one
    line before any work, and the cache is left as it was (without compaction it
    continues)."""
    m = engine.load(models["qwen2-q4_1"], backend="cpu", prefill_chunk=64)
    cfg = policy(budget=64, allocation=allocation, merge=merge)
    cache = m.forward.new_cache()
    m.forward.prefill(PROMPT[:200], cache, snapkv=cfg)
    assert cache.eviction["rows_after"] == 64        # rows a head attends to, on average: the budget
    before = (cache.logical_length, [l.length for l in cache.layers])
    with pytest.raises(engine.EngineError, match="cannot be compacted again"):
        m.forward.prefill(PROMPT[200:260], cache, snapkv=cfg, compact_continued=True)
    assert (cache.logical_length, [l.length for l in cache.layers]) == before
    m.forward.prefill(PROMPT[200:260], cache, snapkv=cfg)
    assert cache.logical_length == 260


def test_work_bytes_counts_a_prefill_chunks_buffers(models):
    """The memory check's prefill buffers (forward.work_bytes): what Scratch allocates
    for a chunk, plus the stacked gate/up mat-mul result written beside it."""
    from engine.forward import Scratch, work_bytes
    m = engine.load(models["qwen2-q4_1"], backend="reference")
    s = Scratch(m.backend, m.config, 64)
    held = sum(a.nbytes for name, a in vars(s).items() if name != "ids" and hasattr(a, "nbytes"))
    assert work_bytes(m.config, 64) == held + 64 * 2 * m.config.ffn_dim * 4
