"""PagedKvCache against a plain Python model of the cache (hypothesis)."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from backends.bf16 import bf16_to_f32, f32_to_bf16
from backends.reference import ReferenceBackend
from engine.kv.paged import KvCache, KvCacheError

H, D = 3, 8


def fill(cache: KvCache, n: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """Append n random rows to every layer; return the bf16-rounded K, V [n, H*D] written."""
    b = cache.pool.backend
    k = rng.standard_normal((n, H * D)).astype(np.float32)
    v = rng.standard_normal((n, H * D)).astype(np.float32)
    for layer in cache.layers:
        layer.reserve(n)
        b.kv_write(cache.pool.k_pages, cache.pool.v_pages, layer.page_table(), k, v, layer.length)
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
    got_k, got_v = rows(cache, 0, cache.pool.k_pages), rows(cache, 0, cache.pool.v_pages)
    kk, vv = k.reshape(n, H, D), v.reshape(n, H, D)
    for h in range(H):
        np.testing.assert_array_equal(got_k[:, h], kk[keep2[h], h])
        np.testing.assert_array_equal(got_v[:, h], vv[keep2[h], h])
    # the other layer is untouched
    np.testing.assert_array_equal(rows(cache, 1, cache.pool.k_pages), kk)


def test_keep_all_is_identity_and_idempotent():
    rng = np.random.default_rng(0)
    cache = KvCache(ReferenceBackend(), 1, H, D, max_rows=64, page_size=4)
    k, _ = fill(cache, 10, rng)
    before = cache.pool.k_pages.copy()
    for _ in range(2):
        r = cache.layers[0].compact(np.arange(10))
        assert r.rows_after == 10 and r.bytes_after == r.bytes_before
    np.testing.assert_array_equal(cache.pool.k_pages[cache.layers[0].pages], before[cache.layers[0].pages])


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
    pages, k_before = list(layer.pages), cache.pool.k_pages.copy()
    with pytest.raises(KvCacheError, match=message):
        layer.compact(keep, window=2)
    assert layer.length == 10 and layer.pages == pages
    np.testing.assert_array_equal(cache.pool.k_pages, k_before)


def test_decode_appends_at_length_with_logical_position():
    rng = np.random.default_rng(2)
    cache = KvCache(ReferenceBackend(), 1, H, D, max_rows=64, page_size=4)
    fill(cache, 12, rng)
    layer = cache.layers[0]
    layer.compact(np.array([0, 5, 10, 11]), window=2)
    assert (layer.length, layer.logical_length, len(layer.pages)) == (4, 12, 1)
    k, _ = fill(cache, 1, rng)
    assert (layer.length, layer.logical_length) == (5, 13)
    np.testing.assert_array_equal(rows(cache, 0, cache.pool.k_pages)[4], k.reshape(1, H, D)[0])


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
    np.testing.assert_array_equal(rows(cache, 0, cache.pool.k_pages), k.reshape(10, H, D))
    np.testing.assert_array_equal(rows(twin, 0, twin.pool.k_pages), k.reshape(10, H, D)[[0, 8, 9]])
    np.testing.assert_array_equal(rows(twin, 1, twin.pool.k_pages), k.reshape(10, H, D))
