"""Merged rows (engine/kv/merge.py): evicted rows kept as k-means means with a
log-count logit bias, and the cache and attention that carry them."""
import math

import numpy as np
import pytest

from backends.bf16 import bf16_to_f32, f32_to_bf16
from backends.reference import ReferenceBackend, read_rows
from engine.errors import ConfigError
from engine.kv.merge import EMPTY_BIAS, kmeans, merged_rows
from engine.kv.paged import KvCache
from engine.snapkv import SnapKvConfig, SnapKvSelector

H, D = 2, 32
REF = ReferenceBackend()


def filled(n: int, rng, kv_dtype: str = "bf16") -> KvCache:
    cache = KvCache(REF, 1, H, D, max_rows=256, page_size=16, kv=kv_dtype)
    layer = cache.layers[0]
    layer.reserve(n)
    k = (rng.standard_normal((n, H * D)) * 2).astype(np.float32)
    v = rng.standard_normal((n, H * D)).astype(np.float32)
    REF.kv_write(layer.pool.k_pages, layer.pool.v_pages, layer.page_table(), k, v, 0, kv_dtype, kv_dtype)
    layer.advance(n)
    return cache


def layer_rows(cache: KvCache) -> tuple[np.ndarray, np.ndarray]:
    layer = cache.layers[0]
    return (read_rows(layer.pool.k_pages, layer._table, layer.length, cache.k_dtype, D),
            read_rows(layer.pool.v_pages, layer._table, layer.length, cache.v_dtype, D))


def decode(cache: KvCache, q: np.ndarray) -> np.ndarray:
    """Attention of one query (f32 [1, 2H*D]: two query heads per KV head) over the layer."""
    layer = cache.layers[0]
    out = np.empty_like(q)
    REF.attention_decode(q, layer.pool.k_pages, layer.pool.v_pages, layer.page_table(), layer.length, 2 * H,
                         1 / math.sqrt(D), out, 0, cache.k_dtype, cache.v_dtype, row_bias=layer.bias())
    return out


def random_keep(rng, n: int, n_keep: int) -> np.ndarray:
    return np.stack([np.sort(rng.choice(n, n_keep, replace=False)) for _ in range(H)])


def test_kmeans_separates_well_apart_clusters_and_weighs_rows():
    rng = np.random.default_rng(0)
    centres = np.array([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]])
    x = np.concatenate([c + rng.standard_normal((40, 2)) * 0.1 for c in centres])
    assign = kmeans(x, np.ones(len(x)), 3)
    assert len(set(assign)) == 3
    assert all(len(set(assign[i * 40:(i + 1) * 40])) == 1 for i in range(3))


def test_merged_rows_are_weighted_means_with_log_counts():
    """Counts add up to the rows dropped; each merged row is its cluster's mean."""
    rng = np.random.default_rng(1)
    n, n_keep = 90, 30
    keys, values = rng.standard_normal((H, n, D)), rng.standard_normal((H, n, D))
    keep = random_keep(rng, n, n_keep)
    mk, mv, bias = merged_rows(keys, values, None, keep, 8)
    assert mk.shape == (H, 8, D) and bias.shape == (H, 8)
    np.testing.assert_allclose(np.exp(bias.astype(np.float64)).sum(axis=1), n - n_keep, rtol=1e-5)
    for h in range(H):    # the count-weighted mean of the merged rows is the mean of all dropped rows
        dropped = np.setdiff1d(np.arange(n), keep[h])
        w = np.exp(bias[h].astype(np.float64))
        np.testing.assert_allclose(w @ mk[h] / w.sum(), keys[h, dropped].mean(axis=0), atol=1e-5)
        np.testing.assert_allclose(w @ mv[h] / w.sum(), values[h, dropped].mean(axis=0), atol=1e-5)


def test_merging_every_dropped_row_alone_is_the_full_cache():
    """With as many clusters as dropped rows each merged row is one dropped row with
    bias log 1 = 0: the compacted cache holds every row and attends exactly as before."""
    rng = np.random.default_rng(2)
    n, n_keep = 70, 40
    cache = filled(n, rng)
    q = rng.standard_normal((1, 2 * H * D)).astype(np.float32)
    want = decode(cache, q)
    keep = random_keep(rng, n, n_keep)
    merged = merged_rows(*layer_rows(cache), None, keep, n - n_keep)
    np.testing.assert_array_equal(merged[2], 0.0)
    report = cache.layers[0].compact(keep, merged=merged)
    assert report.rows_after == n and cache.layers[0].length == n
    np.testing.assert_allclose(decode(cache, q), want, rtol=1e-5, atol=1e-6)


def test_a_merged_row_weighs_as_the_rows_it_replaces_when_they_are_equal():
    """Dropped rows that are all the same row: one merged row with bias log(c) gives the
    exact attention of the full cache (Jensen's bound is tight)."""
    rng = np.random.default_rng(3)
    n, n_keep = 48, 16
    cache = filled(n, rng)
    layer = cache.layers[0]
    keep = np.broadcast_to(np.arange(n_keep), (H, n_keep))
    k, v = (rng.standard_normal((1, H * D)).astype(np.float32) for _ in range(2))
    REF.kv_write(layer.pool.k_pages, layer.pool.v_pages, layer.page_table(), np.repeat(k, n - n_keep, 0),
                 np.repeat(v, n - n_keep, 0), n_keep)
    q = rng.standard_normal((1, 2 * H * D)).astype(np.float32)
    want = decode(cache, q)
    merged = merged_rows(*layer_rows(cache), None, keep, 1)
    np.testing.assert_allclose(merged[2], math.log(n - n_keep), rtol=1e-6)
    layer.compact(keep, merged=merged)
    assert layer.length == n_keep + 1
    np.testing.assert_allclose(decode(cache, q), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kv_dtype", ["bf16", "q8_0", "tq4"])
def test_compacting_again_carries_the_counts(kv_dtype):
    """A second compaction: merged rows that stay keep their bias where they land,
    merged rows that are dropped count their rows in the new merge; the bias bytes
    are counted in the layer's bytes; copies share the bias and branch independently."""
    rng = np.random.default_rng(4)
    n = 120
    cache = filled(n, rng, kv_dtype)
    layer = cache.layers[0]
    keep1 = random_keep(rng, n, 50)
    layer.compact(keep1, merged=merged_rows(*layer_rows(cache), None, keep1, 10))
    assert layer.length == 60 and layer.row_bias.shape == (H, 60)
    np.testing.assert_array_equal(layer.row_bias[:, :50], 0.0)
    assert layer.bytes == layer.n_pages * cache.pool.page_bytes + H * 60 * 4
    branch = cache.copy()
    keep2 = np.stack([np.concatenate([np.arange(0, 50, 2), np.arange(50, 55)]) for _ in range(H)])  # 5 merged stay
    stays = layer.row_bias[:, 50:55].copy()
    merged = merged_rows(*layer_rows(cache), layer.row_bias, keep2, 4)
    layer.compact(keep2, merged=merged)
    assert layer.length == 34
    np.testing.assert_array_equal(layer.row_bias[:, 25:30], stays)
    counts = np.exp(layer.row_bias.astype(np.float64))
    np.testing.assert_allclose(counts.sum(axis=1), n, rtol=1e-5)          # every prompt row counted once
    assert branch.layers[0].length == 60 and branch.layers[0].row_bias.shape == (H, 60)


def test_a_head_with_too_few_distinct_rows_fills_slots_never_attended():
    rng = np.random.default_rng(5)
    keys, values = rng.standard_normal((H, 10, D)), rng.standard_normal((H, 10, D))
    keys[1, 2:] = keys[1, 2]               # head 1: the dropped rows 2..9 are one row
    keep = np.broadcast_to(np.arange(2), (H, 2))
    mk, mv, bias = merged_rows(keys, values, None, keep, 4)
    assert (bias[0] > EMPTY_BIAS).all()
    assert (bias[1] == EMPTY_BIAS).sum() == 3 and np.isclose(np.exp(bias[1].max()), 8)


def test_snapkv_merge_setting():
    cfg = SnapKvConfig(budget=256, merge=64)
    assert cfg.selected == 192 and "64 of them merged rows" in cfg.summary()
    votes = np.random.default_rng(6).random((H, 1000 - cfg.window))
    assert SnapKvSelector(cfg).keep_from_votes(votes, 1000).shape == (H, 192)
    with pytest.raises(ConfigError, match="merge must be >= 0"):
        SnapKvConfig(merge=-1)
    with pytest.raises(ConfigError, match=r"budget \(100\) must be larger than merge"):
        SnapKvConfig(budget=100, merge=64)


def test_a_head_that_dropped_few_rows_takes_only_its_own_merged_rows():
    """Adaptive budgets with merging: a head that dropped fewer rows than the merged
    slots takes only its real merged rows, never rows past the ones it dropped, so the
    layer stays within its context and decodes to its end."""
    rng = np.random.default_rng(8)
    n, max_rows = 12, 16
    cache = KvCache(REF, 1, H, D, max_rows=max_rows, page_size=4)
    layer = cache.layers[0]
    layer.reserve(n)
    x = rng.standard_normal((n, H * D)).astype(np.float32)
    REF.kv_write(layer.pool.k_pages, layer.pool.v_pages, layer.page_table(), x, x, 0)
    layer.advance(n)
    keep = [np.arange(11), np.array([0, 11])]             # head 0 drops 1 row, head 1 drops 10
    merged = merged_rows(*layer_rows(cache), None, keep, 3)
    assert merged[2].shape[1] == 3 and (merged[2][0] == EMPTY_BIAS).sum() == 2
    layer.compact(keep, merged=merged)
    assert layer.head_len.tolist() == [12, 5] and layer.length == 12 and layer.row_bias.shape == (H, 12)
    np.testing.assert_allclose(np.exp(layer.row_bias[0, 11].astype(np.float64)), 1, rtol=1e-6)
    np.testing.assert_allclose(np.exp(layer.row_bias[1, 2:5].astype(np.float64)).sum(), 10, rtol=1e-5)
    for _ in range(max_rows - n):                         # to the end of the context
        layer.reserve(1)
        layer.advance(1)
    assert layer.logical_length == max_rows and layer.head_len.tolist() == [16, 9]
    layer.compact([np.arange(0, 16, 2), np.array([0, 2, 4, 8])])          # again: counts follow their rows
    assert layer.head_len.tolist() == [8, 4]
    np.testing.assert_allclose(np.exp(layer.row_bias[1, 1:3].astype(np.float64)), np.exp(
        merged[2][1][merged[2][1] > EMPTY_BIAS / 2][[0, 2]].astype(np.float64)), rtol=1e-6)
