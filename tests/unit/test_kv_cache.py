"""PagedKvCache against a plain Python model of the cache (hypothesis)."""
import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

from backends.bf16 import bf16_to_f32, f32_to_bf16
from backends.kvformat import parse_kv_dtype
from backends.reference import ReferenceBackend, read_rows
from engine.errors import ConfigError
from engine.kv.merge import EMPTY_BIAS
from engine.kv.paged import KvCache, KvCacheError, PagePool, layer_pages

H, D = 3, 8


def fill(cache: KvCache, n: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """Append n random rows to every layer; return the bf16-rounded K, V [n, H*D] written."""
    b = cache.pool.backend
    k = rng.standard_normal((n, H * D)).astype(np.float32)
    v = rng.standard_normal((n, H * D)).astype(np.float32)
    for layer in cache.layers:
        layer.reserve(n)
        b.kv_write(layer.pool.k_pages, layer.pool.v_pages, layer.page_table(), k, v, layer.length)
        layer.advance(n)
    return bf16_to_f32(f32_to_bf16(k)), bf16_to_f32(f32_to_bf16(v))


def rows(cache: KvCache, layer: int, pages: np.ndarray) -> np.ndarray:
    """Rows 0..length-1 of one layer as f32 [length, H, D]."""
    l = cache.layers[layer]
    ps = cache.pool.page_size
    out = np.empty((l.length, H, D), np.float32)
    for r in range(l.length):
        out[r] = bf16_to_f32(pages[l.pages[r // ps], :, r % ps, :])
    return out


@st.composite
def cache_case(draw):
    page_size = draw(st.sampled_from([1, 4, 16]))
    n = draw(st.integers(1, 60))
    per_head = draw(st.booleans())
    n_keep = draw(st.integers(1, n))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    if per_head:
        keep = np.stack([np.sort(rng.choice(n, n_keep, replace=False)) for _ in range(H)])
    else:
        keep = np.sort(rng.choice(n, n_keep, replace=False))
    return page_size, n, keep, rng


@settings(max_examples=60, deadline=None)
@given(cache_case())
def test_compact_matches_model(case):
    page_size, n, keep, rng = case
    cache = KvCache(ReferenceBackend(), 2, H, D, max_rows=64, page_size=page_size)
    k, v = fill(cache, n, rng)
    free_before = cache.pool.free_pages
    report = cache.layers[0].compact(keep)
    layer = cache.layers[0]
    keep2 = np.broadcast_to(keep, (H, keep.shape[-1]))
    n_keep = keep2.shape[1]
    assert layer.length == n_keep and layer.logical_length == n
    assert len(layer.pages) == -(-n_keep // page_size)
    assert cache.pool.free_pages == free_before + (-(-n // page_size)) - len(layer.pages)
    assert report.bytes_before == (-(-n // page_size)) * cache.pool.page_bytes
    assert report.bytes_after == layer.bytes
    got_k, got_v = rows(cache, 0, cache.pool.segments[0].k_pages), rows(cache, 0, cache.pool.segments[0].v_pages)
    kk, vv = k.reshape(n, H, D), v.reshape(n, H, D)
    for h in range(H):
        np.testing.assert_array_equal(got_k[:, h], kk[keep2[h], h])
        np.testing.assert_array_equal(got_v[:, h], vv[keep2[h], h])
    # the other layer is untouched
    np.testing.assert_array_equal(rows(cache, 1, cache.pool.segments[0].k_pages), kk)


def test_keep_all_is_identity_and_idempotent():
    rng = np.random.default_rng(0)
    cache = KvCache(ReferenceBackend(), 1, H, D, max_rows=64, page_size=4)
    k, _ = fill(cache, 10, rng)
    before = cache.pool.segments[0].k_pages.copy()
    for _ in range(2):
        r = cache.layers[0].compact(np.arange(10))
        assert r.rows_after == 10 and r.bytes_after == r.bytes_before
    np.testing.assert_array_equal(cache.pool.segments[0].k_pages[cache.layers[0].pages], before[cache.layers[0].pages])


@pytest.mark.parametrize("keep,message", [
    (np.array([3, 1, 5]), "sorted"),
    (np.array([1, 1, 5]), "sorted"),
    (np.array([0, 4, 10]), "out of range"),
    (np.array([-1, 4, 9]), "out of range"),
    (np.array([0, 1, 2]), "window"),
    (np.zeros((2, 3), dtype=np.int64), "shape"),
    (np.array([], dtype=np.int64), "empty"),
    (np.array([0.0, 9.0]), "integers"),
])
def test_bad_keep_sets_leave_cache_untouched(keep, message):
    rng = np.random.default_rng(1)
    cache = KvCache(ReferenceBackend(), 1, H, D, max_rows=64, page_size=4)
    fill(cache, 10, rng)
    layer = cache.layers[0]
    pages, k_before = list(layer.pages), cache.pool.segments[0].k_pages.copy()
    with pytest.raises(KvCacheError, match=message):
        layer.compact(keep, window=2)
    assert layer.length == 10 and layer.pages == pages
    np.testing.assert_array_equal(cache.pool.segments[0].k_pages, k_before)



def head_rows_of(cache: KvCache, layer: int, h: int) -> np.ndarray:
    """Head h's K rows of one layer, f32 [rows, D]: through its own table of sub-pages
    when the layer's heads are ragged, else the layer's table."""
    l, ps = cache.layers[layer], cache.pool.page_size
    seg = cache.pool.segment(layer)
    if not l.ragged:
        return rows(cache, layer, seg.k_pages)[:, h]
    view = seg.head_view()[0]
    return np.stack([bf16_to_f32(view[l.heads[h][r // ps], 0, r % ps]) for r in range(int(l.head_len[h]))])


def fill_heads(cache: KvCache, n: int, rng) -> np.ndarray:
    """fill() for any layer, ragged heads written one head at a time (as ForwardPass does);
    returns the bf16-rounded K [n, H, D]."""
    b = cache.pool.backend
    k = rng.standard_normal((n, H * D)).astype(np.float32)
    v = rng.standard_normal((n, H * D)).astype(np.float32)
    for layer in cache.layers:
        layer.reserve(n)
        if layer.ragged:
            kv, vv = layer.pool.head_view()
            for h in range(H):
                b.kv_write(kv, vv, layer.head_table(h), k[:, h * D:(h + 1) * D], v[:, h * D:(h + 1) * D],
                           int(layer.head_len[h]))
        else:
            b.kv_write(layer.pool.k_pages, layer.pool.v_pages, layer.page_table(), k, v, layer.length)
        layer.advance(n)
    return bf16_to_f32(f32_to_bf16(k)).reshape(n, H, D)


def pages_for(lengths, page_size: int = 4) -> int:
    """Pages ragged heads of these row counts fill: their sub-pages, n_kv_heads to a page."""
    return -(-sum(-(-int(n) // page_size) for n in lengths) // H)


def test_ragged_keep_sets_give_each_head_its_own_rows_and_free_the_rest():
    """One keep set per KV head with different lengths (adaptive head budgets): each head
    holds exactly its survivors, in order, and the layer only the pages their sub-pages
    fill (not the longest head's rows for every head); heads grow on their own, and a
    second compaction keeps rows of each head's own numbering."""
    rng = np.random.default_rng(4)
    cache = KvCache(ReferenceBackend(), 1, H, D, max_rows=64, page_size=4)
    k, _ = fill(cache, 20, rng)
    k = k.reshape(20, H, D)
    sets = [np.array([0, 3, 5, 6, 7, 9, 10, 11, 12, 14, 18, 19]), np.array([0, 18, 19]), np.array([1, 2, 19])]
    report = cache.layers[0].compact(sets, window=1)
    layer = cache.layers[0]
    assert layer.ragged and (layer.length, layer.logical_length, report.rows_after) == (12, 20, 12)
    assert layer.head_rows.tolist() == [12, 3, 3] and layer.row_bias is None
    assert len(layer.pages) == pages_for([12, 3, 3]) == 2          # uniform rows of 12: 3 pages
    assert report.bytes_after == 2 * cache.pool.page_bytes and cache.pool.free_pages == cache.pool.n_pages - 2
    for h, s in enumerate(sets):
        np.testing.assert_array_equal(head_rows_of(cache, 0, h), k[s, h])
    assert all((a == b).all() for a, b in zip(layer.last_keep, sets))
    with pytest.raises(KvCacheError, match="page table per head"):
        layer.page_table()
    more = fill_heads(cache, 6, rng)                 # every head appends the same 6 rows
    assert layer.head_rows.tolist() == [18, 9, 9] and layer.length == 18 and layer.logical_length == 26
    assert len(layer.pages) == pages_for([18, 9, 9]) == 4
    for h, s in enumerate(sets):
        np.testing.assert_array_equal(head_rows_of(cache, 0, h), np.concatenate([k[s, h], more[:, h]]))
    # compacted again, each set numbering its own head's rows
    again = [np.array([0, 4, 17]), np.array([2, 3, 8]), np.array([0, 1, 2, 3, 4, 5, 6, 7, 8])]
    before = [head_rows_of(cache, 0, h) for h in range(H)]
    layer.compact(again, window=1)
    assert layer.head_rows.tolist() == [3, 3, 9] and len(layer.pages) == pages_for([3, 3, 9]) == 2
    for h, s in enumerate(again):
        np.testing.assert_array_equal(head_rows_of(cache, 0, h), before[h][s])
    assert cache.pool.free_pages == cache.pool.n_pages - 2
    with pytest.raises(KvCacheError, match="head 1's keep set out of range: rows must lie in 0..2"):
        layer.compact([np.array([0, 1, 2]), np.array([0, 3]), np.array([8])])
    twin = cache.copy()                              # a copy holds the same rows per head
    fill_heads(twin, 2, rng)
    assert layer.head_rows.tolist() == [3, 3, 9] and twin.layers[0].head_rows.tolist() == [5, 5, 11]
    for h in range(H):
        np.testing.assert_array_equal(head_rows_of(twin, 0, h)[:len(before[h][again[h]])], before[h][again[h]])
    cache.release()
    assert not layer.ragged and cache.pool.free_pages == cache.pool.n_pages


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([1, 2, 4, 8]))
def test_ragged_compaction_frees_exactly_the_pages_of_the_rows_dropped(seed, page_size):
    """Any ragged keep sets, then decode steps and a second compaction: each head holds its
    kept rows in order and the layer exactly ceil(sub-pages / n_kv_heads) pages, the rest
    back in the pool; a branch on the same pool holds the same rows on pages of its own."""
    rng = np.random.default_rng(seed)
    b = ReferenceBackend()
    pool = PagePool(b, [2 * (-(-40 // page_size))], H, page_size, D)
    cache = KvCache(b, 1, H, D, max_rows=40, page_size=page_size, pool=pool)
    n = int(rng.integers(2, 24))
    model = [list(r) for r in fill(cache, n, rng)[0].reshape(n, H, D).transpose(1, 0, 2)]   # per head: rows
    layer = cache.layers[0]
    for _ in range(2):
        rows_now = [len(m) for m in model]
        sets = [np.sort(rng.choice(r, size=int(rng.integers(1, r + 1)), replace=False)) for r in rows_now]
        layer.compact(sets)
        model = [[m[i] for i in s] for m, s in zip(model, sets)]
        lengths = [len(m) for m in model]
        held = len(layer.pages)
        assert held == pages_for(lengths, page_size) and pool.free_pages == pool.n_pages - held
        if len(set(lengths)) > 1 or layer.ragged:
            assert layer.head_rows.tolist() == lengths
        step = int(rng.integers(0, 4))
        new = fill_heads(cache, step, rng)
        model = [m + list(new[:, h]) for h, m in enumerate(model)]
        for h in range(H):
            np.testing.assert_array_equal(head_rows_of(cache, 0, h), np.array(model[h]).reshape(-1, D))
    twin = cache.branch()
    assert not set(twin.layers[0].pages) & set(layer.pages)
    for h in range(H):
        np.testing.assert_array_equal(head_rows_of(twin, 0, h), head_rows_of(cache, 0, h))


@pytest.mark.parametrize("sets,message", [
    ([np.array([0, 9])] * 2, "needs 3 sets"),
    ([np.array([0, 9]), np.array([9, 0]), np.array([9])], "head 1's keep set must be sorted"),
    ([np.array([0, 9]), np.array([], dtype=np.int64), np.array([9])], "head 1's keep set is empty"),
    ([np.array([0, 9]), np.array([0, 8]), np.array([9])], "head 1's keep set drops part of the observation"),
    ([np.array([0, 9]), np.array([9]), np.array([3, 10])], "head 2's keep set out of range"),
])
def test_bad_ragged_keep_sets_leave_cache_untouched(sets, message):
    cache = KvCache(ReferenceBackend(), 1, H, D, max_rows=64, page_size=4)
    fill(cache, 10, np.random.default_rng(5))
    layer = cache.layers[0]
    pages, k_before = list(layer.pages), cache.pool.segments[0].k_pages.copy()
    with pytest.raises(KvCacheError, match=message):
        layer.compact(sets, window=1)
    assert layer.length == 10 and layer.pages == pages and layer.row_bias is None
    np.testing.assert_array_equal(cache.pool.segments[0].k_pages, k_before)

def test_decode_appends_at_length_with_logical_position():
    rng = np.random.default_rng(2)
    cache = KvCache(ReferenceBackend(), 1, H, D, max_rows=64, page_size=4)
    fill(cache, 12, rng)
    layer = cache.layers[0]
    layer.compact(np.array([0, 5, 10, 11]), window=2)
    assert (layer.length, layer.logical_length, len(layer.pages)) == (4, 12, 1)
    k, _ = fill(cache, 1, rng)
    assert (layer.length, layer.logical_length) == (5, 13)
    np.testing.assert_array_equal(rows(cache, 0, cache.pool.segments[0].k_pages)[4], k.reshape(1, H, D)[0])


def test_capacity_error():
    cache = KvCache(ReferenceBackend(), 1, H, D, max_rows=8, page_size=4)
    with pytest.raises(KvCacheError, match="context"):
        cache.layers[0].reserve(9)


def test_copy_is_independent():
    rng = np.random.default_rng(3)
    cache = KvCache(ReferenceBackend(), 2, H, D, max_rows=64, page_size=4)
    k, _ = fill(cache, 10, rng)
    twin = cache.copy()
    twin.layers[0].compact(np.array([0, 8, 9]))
    assert cache.layers[0].length == 10 and twin.layers[0].length == 3
    np.testing.assert_array_equal(rows(cache, 0, cache.pool.segments[0].k_pages), k.reshape(10, H, D))
    np.testing.assert_array_equal(rows(twin, 0, twin.pool.segments[0].k_pages), k.reshape(10, H, D)[[0, 8, 9]])
    np.testing.assert_array_equal(rows(twin, 1, twin.pool.segments[0].k_pages), k.reshape(10, H, D))


def test_a_copy_of_a_cache_on_a_shared_pool_has_every_other_page_free():
    """copy() makes a pool of its own: every page but the copied cache's is free there,
    whatever other caches hold in the shared pool it came from."""
    rng = np.random.default_rng(4)
    b = ReferenceBackend()
    pool = PagePool(b, [20], H, 4, D)
    a = KvCache(b, 1, H, D, max_rows=80, page_size=4, pool=pool)
    other = KvCache(b, 1, H, D, max_rows=80, page_size=4, pool=pool)
    fill(other, 8, rng)                                  # 2 pages
    k, _ = fill(a, 16, rng)                              # 4 pages
    fill(other, 40, rng)                                 # 10 more
    twin = a.copy()
    seg = twin.pool.segments[0]
    assert seg.free_pages == 20 - 4
    fill(twin, 64, rng)                                  # grows to all 20 pages
    assert seg.free_pages == 0
    np.testing.assert_array_equal(rows(twin, 0, seg.k_pages)[:16], k.reshape(16, H, D))


def test_an_interrupted_cache_is_not_branched_or_copied():
    b = ReferenceBackend()
    cache = KvCache(b, 2, H, D, max_rows=64, page_size=4, pool=PagePool(b, [20, 20], H, 4, D))
    fill(cache, 6, np.random.default_rng(5))
    cache.interrupted = "KeyboardInterrupt"
    for make_twin in (cache.copy, cache.branch):
        with pytest.raises(KvCacheError, match="middle of a step"):
            make_twin()
    cache.release()
    cache.check_usable()


# -- sliding-window layers (Gemma 3's local layers) --------------------------------------

NQ = 2 * H          # query heads for the attention checks (GQA group of 2)


def poison_free_pages(cache: KvCache) -> None:
    """Fill every page in the pool's free list with bf16 NaN, so a read of a returned
    page shows up as NaN in an attention output."""
    free = np.array(cache.pool.segments[0]._free, dtype=np.int64)
    if free.size:
        cache.pool.segments[0].k_pages[free] = 0x7FC0
        cache.pool.segments[0].v_pages[free] = 0x7FC0


def windowed_attention(q, k, v, start, window):
    """Plain numpy: queries at rows start.. over model rows k, v f32 [rows, H*D], each
    seeing its last `window` rows -> f64 [n, NQ*D]."""
    n = q.shape[0]
    qh = q.reshape(n, NQ, D).astype(np.float64)
    kh, vh = k.reshape(-1, H, D).astype(np.float64), v.reshape(-1, H, D).astype(np.float64)
    out = np.zeros((n, NQ, D))
    for i in range(n):
        p = start + i
        lo = max(0, p - window + 1)
        for h in range(NQ):
            s = kh[lo:p + 1, h // 2] @ qh[i, h] / np.sqrt(D)
            w = np.exp(s - s.max())
            out[i, h] = (w / w.sum()) @ vh[lo:p + 1, h // 2]
    return out.reshape(n, NQ * D)


@st.composite
def window_case(draw):
    page_size = draw(st.sampled_from([1, 4, 16]))
    window = draw(st.integers(1, 40))
    max_step = draw(st.integers(1, 24))
    steps = draw(st.lists(st.integers(1, max_step), min_size=1, max_size=14))
    return page_size, window, max_step, steps, np.random.default_rng(draw(st.integers(0, 2**16)))


@settings(max_examples=80, deadline=None)
@given(window_case(), st.booleans())
@example((4, 8, 7, [7, 2, 1, 1, 3, 1, 1, 1, 1, 1, 7, 1], np.random.default_rng(0)), False)   # ring + 1 pages
@example((4, 8, 7, [7, 2, 1, 1, 3, 1, 1, 1, 1, 1, 7, 1], np.random.default_rng(0)), True)    # folded
def test_window_layer_returns_pages_exactly_when_they_fall_out(case, fold):
    """A sliding-window layer next to a full layer in one pool, stepped like prefill
    chunks and decode (folded after each multi-row step, or not): every row a step's
    queries need is held (attention over the layer, with returned pages poisoned,
    equals plain attention over all rows), it holds exactly the pages with a row the
    next query can see, a decode step or a fold reuses the page `ring` entries back
    instead of taking one, the pool never runs dry at its planned size, and bytes
    count the distinct pages held."""
    (page_size, window, max_step, steps, rng), fold_after = case, fold
    max_rows = sum(steps)
    b = ReferenceBackend()
    cache = KvCache(b, 2, H, D, max_rows=max_rows, page_size=page_size, windows=(window, 0), max_step=max_step)
    local, full = cache.layers
    assert cache.pool.n_pages == layer_pages(max_rows, page_size, window, max_step) + -(-max_rows // page_size)
    assert local.ring == -(-window // page_size)
    K = np.zeros((0, H * D), np.float32)
    V = np.zeros((0, H * D), np.float32)
    for n in steps:
        start = local.length
        k = rng.standard_normal((n, H * D)).astype(np.float32)
        v = rng.standard_normal((n, H * D)).astype(np.float32)
        for layer in cache.layers:
            layer.reserve(n)
            b.kv_write(cache.pool.segments[0].k_pages, cache.pool.segments[0].v_pages, layer.page_table(), k, v, layer.length)
        assert local.first_row <= max(0, start - window + 1)          # every row the step needs is held
        assert len(local.pages) <= local.max_pages
        K = np.concatenate([K, bf16_to_f32(f32_to_bf16(k))])
        V = np.concatenate([V, bf16_to_f32(f32_to_bf16(v))])
        q = rng.standard_normal((n, NQ * D)).astype(np.float32)
        out = np.zeros((n, NQ * D), np.float32)
        b.attention_prefill(q, cache.pool.segments[0].k_pages, cache.pool.segments[0].v_pages, local.page_table(), start, NQ,
                            1 / np.sqrt(D), out, window=window)
        np.testing.assert_allclose(out, windowed_attention(q, K, V, start, window), rtol=1e-5, atol=1e-5)
        for layer in cache.layers:
            layer.advance(n)
        if fold_after and n > 1:
            cache.fold()
        # table entries first .. of the pages with a row the next query can see
        first = max(0, local.length - window + 1) // page_size
        assert local.first_page == first and local.first_row <= max(0, local.length - window + 1)
        assert len(local.pages) == -(-local.length // page_size) - first
        assert local.n_pages == len(set(local.pages)) <= len(local.pages)
        if fold_after:                  # a ring: entry i + ring shares entry i's page
            assert local.n_pages == min(len(local.pages), local.ring)
        else:                           # decode steps share; a multi-row step may leave one more
            assert local.n_pages <= local.ring + 1
        assert local.bytes == local.n_pages * cache.pool.page_bytes
        assert cache.bytes == local.bytes + full.bytes
        assert cache.pool.free_pages == cache.pool.n_pages - local.n_pages - len(full.pages)
        assert (local.length, local.logical_length) == (len(K), len(K))
        poison_free_pages(cache)
    # the full layer kept every row; the window layer's intact rows are the last ones written
    np.testing.assert_array_equal(rows(cache, 1, cache.pool.segments[0].k_pages).reshape(len(K), -1), K)
    ps = page_size
    assert local.first_row <= max(0, local.length - window + 1)
    for r in range(local.first_row, local.length):
        got = bf16_to_f32(cache.pool.segments[0].k_pages[local.pages[r // ps - local.first_page], :, r % ps, :])
        np.testing.assert_array_equal(got.reshape(-1), K[r])
    assert cache.length == full.length and cache.stats()["layers"][0]["first_row"] == local.first_row


def test_window_layer_holds_a_bounded_number_of_pages():
    """Prefill 2000 rows in chunks of 64, then decode 300: a window-of-32 layer never
    holds more than ceil((32 - 1 + 64) / 16) + 1 pages, and the pool sized for it
    suffices; folded after the prefill and while decoding it holds its ring of 2 pages
    (32 rows, the window exactly)."""
    cache = KvCache(ReferenceBackend(), 1, H, D, max_rows=2400, page_size=16, windows=(32,), max_step=64)
    layer = cache.layers[0]
    assert layer.max_pages == 7 and cache.pool.n_pages == 7 and layer.ring == 2
    most = 0
    for n in [64] * 31 + [16]:
        layer.reserve(n)
        most = max(most, layer.n_pages)
        layer.advance(n)
        most = max(most, layer.n_pages)
    cache.fold()
    assert layer.n_pages == 2 and layer.first_row == 2000 - 32
    for _ in range(300):
        layer.reserve(1)
        assert layer.n_pages == 2
        layer.advance(1)
    assert layer.length == 2300 and most <= 7 and layer.n_pages == 2
    assert layer.first_row == 2300 - 32 and cache.pool.free_pages == 5


def test_window_layer_refuses_compaction_and_oversized_steps():
    cache = KvCache(ReferenceBackend(), 1, H, D, max_rows=256, page_size=4, windows=(8,), max_step=8)
    fill(cache, 8, np.random.default_rng(5))
    with pytest.raises(KvCacheError, match="never compacted"):
        cache.layers[0].compact(np.arange(8))
    with pytest.raises(KvCacheError, match="sliding-window"):
        cache.layers[0].reserve(64)
    assert cache.layers[0].length == 8


def test_copy_of_a_window_cache_continues_identically():
    rng = np.random.default_rng(6)
    cache = KvCache(ReferenceBackend(), 2, H, D, max_rows=128, page_size=4, windows=(6, 0), max_step=8)
    for _ in range(5):
        fill(cache, 7, rng)
    twin = cache.copy()
    assert [l.first_page for l in twin.layers] == [l.first_page for l in cache.layers]
    assert twin.bytes == cache.bytes and twin.pool.free_pages == cache.pool.free_pages
    for c in (cache, twin):
        fill(c, 8, np.random.default_rng(7))
    a, b = cache.layers[0], twin.layers[0]
    assert (a.length, a.first_page, len(a.pages)) == (b.length, b.first_page, len(b.pages))
    for r in range(a.first_row, a.length):
        pa = cache.pool.segments[0].k_pages[a.pages[r // 4 - a.first_page], :, r % 4]
        pb = twin.pool.segments[0].k_pages[b.pages[r // 4 - b.first_page], :, r % 4]
        np.testing.assert_array_equal(pa, pb)
    np.testing.assert_array_equal(rows(cache, 1, cache.pool.segments[0].k_pages),
                                  rows(twin, 1, twin.pool.segments[0].k_pages))


def held_rows(cache: KvCache, layer: int) -> np.ndarray:
    """K rows first_row .. length - 1 of one layer, f32 [rows, H, D]."""
    l, ps = cache.layers[layer], cache.pool.page_size
    pages = cache.pool.segment(layer).k_pages
    return np.stack([bf16_to_f32(pages[l.pages[r // ps - l.first_page], :, r % ps]) for r in range(l.first_row, l.length)])


def test_branch_takes_fresh_pages_of_the_same_pool_and_continues_independently():
    """KvCache.branch: a second cache on the same pool (a sliding-window layer and a full
    one), on pages of its own, equal to a copy in a pool of its own as both go on, while
    the original is compacted; released, its pages return; without room, nothing is taken."""
    rng = np.random.default_rng(8)
    b = ReferenceBackend()
    pool = PagePool(b, [14, 30], H, 4, D)
    cache = KvCache(b, 2, H, D, max_rows=64, page_size=4, windows=(6, 0), max_step=8, pool=pool)
    for _ in range(3):
        fill(cache, 7, rng)
    ref = cache.copy()                                  # the same rows in a pool of its own
    free = pool.free_pages
    twin = cache.branch()
    assert twin.pool is pool and pool.free_pages == free - cache.pages_held()
    for mine, theirs in zip(cache.layers, twin.layers):
        assert not set(mine.pages) & set(theirs.pages)
        assert (theirs.length, theirs.logical_length, theirs.first_page) == (mine.length, mine.logical_length,
                                                                            mine.first_page)
    cache.layers[1].compact(np.array([0, 5, 20]))
    fill(cache, 3, rng)
    for c in (twin, ref):
        fill(c, 8, np.random.default_rng(9))
    for layer in (0, 1):
        np.testing.assert_array_equal(held_rows(twin, layer), held_rows(ref, layer))
    assert cache.layers[1].length == 6 and twin.layers[1].length == 29
    twin.release()
    assert pool.free_pages == pool.n_pages - cache.pages_held()
    small = PagePool(b, [4, 3], H, 4, D)
    full = KvCache(b, 2, H, D, max_rows=64, page_size=4, windows=(6, 0), max_step=8, pool=small)
    fill(full, 7, rng)
    before = small.free_pages
    with pytest.raises(KvCacheError, match="branching the cache needs 4 free pages, segment 0 has 3"):
        full.branch()
    assert small.free_pages == before


class CappedBackend(ReferenceBackend):
    """A backend binding each KV buffer whole, at most `max_kv_buffer_bytes` of it (Vulkan:
    maxStorageBufferRange)."""
    def __init__(self, cap):
        super().__init__()
        self.max_kv_buffer_bytes = cap


def test_layers_take_pages_from_segments_within_the_backend_buffer_limit():
    """The pool is split into segments, consecutive layers each, every K and V buffer
    within the backend's limit; each layer takes its pages from its own segment, and
    writing, compacting, branching and releasing a cache work as on one pool."""
    page = H * 4 * D * 2                           # bytes of one bf16 page of 4 rows in one buffer
    windows = (0, 0, 6, 0, 0, 0, 6)                # layer pages at 64 rows: 16, 16, 5, 16, 16, 16, 5
    cache = KvCache(CappedBackend(40 * page), 7, H, D, max_rows=64, page_size=4, windows=windows, max_step=8)
    pool = cache.pool
    assert [s.n_pages for s in pool.segments] == [37, 32, 21]
    assert [pool.segment_index(i) for i in range(7)] == [0, 0, 0, 1, 1, 2, 2]
    assert all(s.k_pages.nbytes <= 40 * page and s.v_pages.nbytes <= 40 * page for s in pool.segments)
    assert all(layer.pool is pool.segment(i) for i, layer in enumerate(cache.layers))
    rng = np.random.default_rng(8)
    K = np.concatenate([fill(cache, n, rng)[0] for n in (8, 8, 8, 1, 1)])
    for i in (0, 3, 5):
        np.testing.assert_array_equal(rows(cache, i, cache.layers[i].pool.k_pages).reshape(26, -1), K)
    assert cache.pages_needed(0) == sum(cache.pages_needed(0, s) for s in range(3)) == cache.pages_held()
    free = [s.free_pages for s in pool.segments]
    cache.layers[3].compact(np.arange(0, 26, 3))   # 9 rows: 3 of its 7 pages stay
    assert [s.free_pages for s in pool.segments] == [free[0], free[1] + 4, free[2]]
    twin = cache.copy()
    assert [s.n_pages for s in twin.pool.segments] == [37, 32, 21]
    for i in range(7):
        a, b = cache.layers[i], twin.layers[i]
        for r in range(a.first_row, a.length):
            np.testing.assert_array_equal(a.pool.k_pages[a._table[r // 4], :, r % 4],
                                          b.pool.k_pages[b._table[r // 4], :, r % 4])
    cache.release()
    assert [s.free_pages for s in pool.segments] == [37, 32, 21]
    one = KvCache(ReferenceBackend(), 7, H, D, max_rows=64, page_size=4, windows=windows, max_step=8)
    assert len(one.pool.segments) == 1 and one.pool.n_pages == pool.n_pages == 90


# -- quantized rows (backends/kvformat.py) ----------------------------------------------

QD = 32                                        # head_dim every KV dtype accepts
KV_DTYPES_TESTED = ["bf16", "q8_0", "q4_0", "tq4", "tq3", "rq4_0", "q8_0/tq4"]


def quantized_cache(kv_dtype: str, n_layers: int = 2, page_size: int = 4, max_rows: int = 64) -> KvCache:
    return KvCache(ReferenceBackend(), n_layers, H, QD, max_rows=max_rows, page_size=page_size, kv=kv_dtype)


def fill_f32(cache: KvCache, n: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """Append n random rows (with an outlier channel) to every layer; return the f32
    K, V [n, H, QD] written (before quantization)."""
    b = cache.pool.backend
    k = rng.standard_normal((n, H, QD)).astype(np.float32)
    k[:, :, 3] *= 20
    v = rng.standard_normal((n, H, QD)).astype(np.float32)
    for layer in cache.layers:
        layer.reserve(n)
        b.kv_write(cache.pool.segments[0].k_pages, cache.pool.segments[0].v_pages, layer.page_table(), k.reshape(n, -1),
                   v.reshape(n, -1), layer.length, k_dtype=cache.k_dtype, v_dtype=cache.v_dtype)
        layer.advance(n)
    return k, v


def stored_rows(cache: KvCache, layer: int, pages: np.ndarray) -> np.ndarray:
    """The stored rows 0..length-1 of one layer, as they sit in the pages: [length, H, row_width]."""
    l = cache.layers[layer]
    ps = cache.pool.page_size
    return np.stack([pages[l.pages[r // ps], :, r % ps, :] for r in range(l.length)])


@pytest.mark.parametrize("kv_dtype,row_bytes", [("bf16", 2 * QD + 2 * QD), ("q8_0", 34 + 34), ("q4_0", 18 + 18),
                                                ("tq4", 18 + 18), ("tq3", 14 + 14), ("q8_0/tq4", 34 + 18)])
def test_page_bytes_count_the_real_row_bytes(kv_dtype, row_bytes):
    cache = quantized_cache(kv_dtype, page_size=16)
    assert cache.pool.page_bytes == H * 16 * row_bytes
    k_fmt, v_fmt = cache.pool.k_format, cache.pool.v_format
    assert cache.pool.segments[0].k_pages.shape == k_fmt.page_shape(cache.pool.n_pages, H, 16)
    assert cache.pool.segments[0].v_pages.dtype == v_fmt.storage
    assert cache.pool.segments[0].k_pages.nbytes + cache.pool.segments[0].v_pages.nbytes == cache.pool.n_pages * cache.pool.page_bytes
    fill_f32(cache, 20, np.random.default_rng(0))
    st = cache.stats()
    assert st["bytes"] == cache.bytes == 2 * 2 * cache.pool.page_bytes       # 2 layers x ceil(20/16) pages
    assert (st["kv_dtype"], st["k_dtype"], st["v_dtype"]) == (kv_dtype, *parse_kv_dtype(kv_dtype))


@st.composite
def quantized_case(draw):
    kv_dtype = draw(st.sampled_from(KV_DTYPES_TESTED))
    page_size, n, keep, rng = draw(cache_case())
    return kv_dtype, page_size, n, keep, rng


@settings(max_examples=60, deadline=None)
@given(quantized_case())
def test_compacting_a_quantized_cache_equals_quantizing_the_kept_rows(case):
    """Compaction moves whole stored rows (values and scales): the compacted cache holds,
    byte for byte, the quantized f32 rows of the kept positions."""
    kv_dtype, page_size, n, keep, rng = case
    cache = quantized_cache(kv_dtype, page_size=page_size)
    k, v = fill_f32(cache, n, rng)
    report = cache.layers[0].compact(keep)
    keep2 = np.broadcast_to(keep, (H, keep.shape[-1]))
    heads = np.arange(H)[None, :]
    # rows quantized as written (all n at once: a tq rotation's last bits may depend on
    # how many rows one BLAS call rotates), then the kept ones picked
    qk, qv = cache.pool.k_format.quantize(k), cache.pool.v_format.quantize(v)
    np.testing.assert_array_equal(stored_rows(cache, 0, cache.pool.segments[0].k_pages), qk[keep2.T, heads])
    np.testing.assert_array_equal(stored_rows(cache, 0, cache.pool.segments[0].v_pages), qv[keep2.T, heads])
    assert report.bytes_after == len(cache.layers[0].pages) * cache.pool.page_bytes
    assert report.bytes_before == (-(-n // page_size)) * cache.pool.page_bytes
    np.testing.assert_array_equal(stored_rows(cache, 1, cache.pool.segments[0].k_pages), cache.pool.k_format.quantize(k))
    # what attention reads: the dequantized kept rows
    got = read_rows(cache.pool.segments[0].k_pages, cache.layers[0].page_table(), keep2.shape[1], cache.k_dtype, QD)
    np.testing.assert_array_equal(got, cache.pool.k_format.dequantize(qk[keep2.T, heads]).transpose(1, 0, 2))


@pytest.mark.parametrize("kv_dtype", ["q8_0", "tq4", "q4_0/tq3"])
def test_copy_branches_quantized_pages_independently(kv_dtype):
    rng = np.random.default_rng(3)
    cache = quantized_cache(kv_dtype)
    k, v = fill_f32(cache, 10, rng)
    twin = cache.copy()
    assert (twin.k_dtype, twin.v_dtype, twin.kv_dtype) == (cache.k_dtype, cache.v_dtype, kv_dtype)
    assert twin.pool.segments[0].k_pages.dtype == np.uint8 and twin.pool.page_bytes == cache.pool.page_bytes
    twin.layers[0].compact(np.array([0, 8, 9]))
    fill_f32(twin, 2, rng)
    kf, vf = cache.pool.k_format, cache.pool.v_format
    np.testing.assert_array_equal(stored_rows(cache, 0, cache.pool.segments[0].k_pages), kf.quantize(k))
    np.testing.assert_array_equal(stored_rows(cache, 0, cache.pool.segments[0].v_pages), vf.quantize(v))
    np.testing.assert_array_equal(stored_rows(twin, 0, twin.pool.segments[0].k_pages)[:3], kf.quantize(k[[0, 8, 9]]))
    np.testing.assert_array_equal(stored_rows(twin, 1, twin.pool.segments[0].v_pages)[:10], vf.quantize(v))
    assert cache.layers[0].length == 10 and twin.layers[0].length == 5
    assert twin.bytes < cache.bytes


def test_unsupported_kv_dtype_is_refused_by_the_pool():
    with pytest.raises(ConfigError, match="q8_0 needs a head_dim divisible by 32"):
        KvCache(ReferenceBackend(), 1, H, 16, max_rows=8, kv="q8_0")


def test_caches_on_a_shared_pool_take_pages_as_they_grow_and_release_them():
    """Two caches on one pool: pages come as rows arrive, pages_needed bounds what a
    cache can come to hold (full and sliding-window layers), release returns every page
    and leaves an empty cache, and a pool of other rows or heads is refused."""
    from engine.kv.paged import PagePool
    b = ReferenceBackend()
    rng = np.random.default_rng(0)
    pool = PagePool(b, 40, H, 4, D)
    a = KvCache(b, 2, H, D, max_rows=64, page_size=4, windows=(6, 0), max_step=8, pool=pool)
    c = KvCache(b, 2, H, D, max_rows=64, page_size=4, pool=pool)
    assert pool.free_pages == 40 and a.bytes == 0
    bound = a.pages_needed(30)
    held = []
    for n in (8, 8, 8, 1, 1, 1, 1, 1, 1):
        fill(a, n, rng)
        held.append(sum(len(l.pages) for l in a.layers))
    assert max(held) <= bound and a.pages_needed(0) == held[-1]
    fill(c, 10, rng)
    assert pool.free_pages == 40 - held[-1] - 2 * 3
    a.release()
    a.release()                                        # idempotent
    assert pool.free_pages == 40 - 6 and a.bytes == 0 and a.length == 0 and a.logical_length == 0
    K, _ = fill(a, 5, rng)                             # reusable, on other pages
    np.testing.assert_array_equal(rows(a, 1, pool.segments[0].k_pages).reshape(5, -1), K)
    c.release()
    a.release()
    assert pool.free_pages == 40
    with pytest.raises(ValueError, match="shared pool"):
        KvCache(b, 1, H, D * 2, max_rows=64, page_size=4, pool=pool)


def test_truncate_keeps_the_first_positions_and_refuses_what_it_cannot():
    b = ReferenceBackend()
    rng = np.random.default_rng(1)
    cache = KvCache(b, 2, H, D, max_rows=64, page_size=4, windows=(6, 0), max_step=8)
    K, _ = fill(cache, 8, rng)
    fill(cache, 8, rng)
    free = cache.pool.free_pages
    cache.truncate(14)                               # the window layer still holds rows 9..13
    assert (cache.length, cache.logical_length) == (14, 14) and cache.pool.free_pages == free
    with pytest.raises(KvCacheError, match="sliding-window"):
        cache.truncate(5)                            # rows 0..4 are gone from the window layer
    assert cache.logical_length == 14
    full = KvCache(b, 1, H, D, max_rows=64, page_size=4)
    K, _ = fill(full, 10, rng)
    full.truncate(5)
    assert len(full.layers[0].pages) == 2 and full.pool.free_pages == full.pool.n_pages - 2
    np.testing.assert_array_equal(rows(full, 0, full.pool.segments[0].k_pages).reshape(5, -1), K[:5])
    full.layers[0].compact(np.arange(3))
    full.eviction = {"policy": "test"}
    with pytest.raises(KvCacheError, match="compacted"):
        full.truncate(2)


def test_a_dropped_cache_frees_its_pages_without_the_cycle_collector():
    """Caches hold no reference cycles: one dropped (compacted, ragged, copied or not)
    returns its buffers at once. (A cycle kept every cache of a long `engine eval` until
    Python's cycle collector happened to run: gigabytes.)"""
    import gc
    import weakref
    gc.disable()
    try:
        rng = np.random.default_rng(11)
        cache = KvCache(ReferenceBackend(), 2, H, D, max_rows=64, page_size=4)
        fill(cache, 20, rng)
        cache.layers[0].compact([np.array([0, 3, 19]), np.array([19]), np.array([1, 2, 5, 19])])
        twin = cache.copy()
        fill_heads(twin, 2, rng)
        refs = [weakref.ref(c.pool) for c in (cache, twin)] + [weakref.ref(cache.pool.segments[0])]
        del cache, twin
        assert all(r() is None for r in refs)
    finally:
        gc.enable()
