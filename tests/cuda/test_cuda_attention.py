"""CUDA attention ops (backends/cuda/attention.py, kernels/attention.cu and
kernels/snapkv_votes.cu) on the tests' executor (conftest.py `ex`: the CPU harness unless
SHARPI_CUDA_EXECUTOR names another) against the numpy reference
(backends/reference.py), NMSE < 1e-8 as in tests/backends/test_ops.py.

Covers what the generic parity cases there do not: head_dim 64, 96, 128 and 256
(all three prefill tile shapes, and words beyond a lane's share), GQA 32/8, 9/3, 4/1,
14/2 (a group split over two decode blocks) and 8/8; decode over 1, 7, 300 and 3000
rows (one split, a few, many); prefill chunks at start_row > 0 whose length is not a
multiple of the query tile, through row-strided q/out views; SnapKV votes with
windows 1, 16 and 32 over row counts that are not multiples of the page size, with
several stats splits and partial query chunks; sliding windows 1, 7, 64 and 512 over
row counts below and above the window; merged rows' log-count bias (row_bias) through a
row-strided view, past and short of the attended rows. Unused page slots hold bf16 NaN and page
tables are permuted, so a read outside the valid rows shows up (with a window, the
rows below it are NaN too and its whole pages are gone from the table: entry -1, a
read there is a memcheck error); outputs are column slices of NaN-filled buffers,
so a write outside the view shows up too. The quantized KV row formats (q8_0, q4_0, tq4,
tq3 and mixed key/value pairs) run decode, prefill, windows and votes at the end.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from backends.bf16 import BF16_QNAN
from backends.cuda import attention
from backends.kvformat import KV_DTYPES, KvFormat
from _backends import nmse
from backends.reference import ReferenceBackend

REF = ReferenceBackend()
TOL = 1e-8


def filled_pool(rng, n_rows, n_kv, page_size, head_dim, kscale=2.0):
    """Host pools (bf16 NaN everywhere but rows 0..n_rows-1) and a permuted page table
    with one spare entry."""
    n_used = -(-n_rows // page_size)
    shape = (n_used + 3, n_kv, page_size, head_dim)
    k_pages = np.full(shape, BF16_QNAN, np.uint16)
    v_pages = np.full(shape, BF16_QNAN, np.uint16)
    page_table = rng.permutation(shape[0]).astype(np.int32)[:n_used + 1]
    k = (rng.standard_normal((n_rows, n_kv * head_dim)) * kscale).astype(np.float32)
    v = rng.standard_normal((n_rows, n_kv * head_dim)).astype(np.float32)
    REF.kv_write(k_pages, v_pages, page_table, k, v, 0)
    return k_pages, v_pages, page_table


def drop_below(k_pages, v_pages, page_table, lo):
    """Copies as a sliding-window layer leaves them: rows below `lo` bf16 NaN, and the
    pages wholly below it returned to the pool (page-table entry -1)."""
    page_size = k_pages.shape[2]
    k_pages, v_pages, page_table = k_pages.copy(), v_pages.copy(), page_table.copy()
    for r in range(lo):
        page = page_table[r // page_size]
        if page >= 0:
            k_pages[page, :, r % page_size] = BF16_QNAN
            v_pages[page, :, r % page_size] = BF16_QNAN
    page_table[:lo // page_size] = -1
    return k_pages, v_pages, page_table


def nan_view(ex, host, pad_left, pad_right):
    """Device copy of host f32 [n, w] as the column slice [:, pad_left:pad_left+w] of a
    NaN-filled [n, pad_left + w + pad_right] buffer: (buffer, view)."""
    n, w = host.shape
    big = np.full((n, pad_left + w + pad_right), np.nan, np.float32)
    big[:, pad_left:pad_left + w] = host
    dev = ex.asarray(big)
    return dev, dev[:, pad_left:pad_left + w]


def upload(ex, *arrays):
    return [ex.asarray(a) for a in arrays]


# (n_q_heads, n_kv_heads, head_dim, page_size)
SHAPES = [(32, 8, 128, 16), (9, 3, 64, 16), (4, 1, 256, 16), (14, 2, 96, 32)]


# -- decode ------------------------------------------------------------------------------
@pytest.mark.parametrize("n_q,n_kv,head_dim,page_size", SHAPES + [(8, 8, 64, 16)])
@pytest.mark.parametrize("n_rows", [1, 7, 300, 3000])
def test_attention_decode(ex, n_q, n_kv, head_dim, page_size, n_rows):
    rng = np.random.default_rng(n_rows * 7 + head_dim + n_q)
    k_pages, v_pages, page_table = filled_pool(rng, n_rows, n_kv, page_size, head_dim)
    width = n_q * head_dim
    q = rng.standard_normal((1, width)).astype(np.float32)
    scale = 1.0 / math.sqrt(head_dim)
    want = np.empty_like(q)
    REF.attention_decode(q, k_pages, v_pages, page_table, n_rows, n_q, scale, want)

    _, q_dev = nan_view(ex, q, 3, 5)
    out_buf, out = nan_view(ex, np.full_like(q, np.nan), 2, 6)
    attention.attention_decode(ex, q_dev, *upload(ex, k_pages, v_pages, page_table), n_rows, n_q, scale, out)
    got = ex.to_host(out_buf)
    assert nmse(got[:, 2:2 + width], want) < TOL
    assert np.all(np.isnan(got[:, :2])) and np.all(np.isnan(got[:, 2 + width:]))


# (window, n_rows): rows below, at and above the window
WINDOW_DECODE = [(1, 1), (1, 2), (1, 100), (7, 3), (7, 7), (7, 8), (7, 300),
                 (64, 40), (64, 65), (64, 1000), (512, 300), (512, 513), (512, 3000)]


@pytest.mark.parametrize("n_q,n_kv,head_dim,page_size", SHAPES)
@pytest.mark.parametrize("window,n_rows", WINDOW_DECODE)
def test_attention_decode_window(ex, n_q, n_kv, head_dim, page_size, window, n_rows):
    rng = np.random.default_rng(n_rows * 5 + window + head_dim)
    pools = drop_below(*filled_pool(rng, n_rows, n_kv, page_size, head_dim), max(0, n_rows - window))
    width = n_q * head_dim
    q = rng.standard_normal((1, width)).astype(np.float32)
    scale = 1.0 / math.sqrt(head_dim)
    want = np.empty_like(q)
    REF.attention_decode(q, *pools, n_rows, n_q, scale, want, window=window)

    out_buf, out = nan_view(ex, np.full_like(q, np.nan), 2, 6)
    attention.attention_decode(ex, ex.asarray(q), *upload(ex, *pools), n_rows, n_q, scale, out, window=window)
    got = ex.to_host(out_buf)
    assert nmse(got[:, 2:2 + width], want) < TOL
    assert np.all(np.isnan(got[:, :2])) and np.all(np.isnan(got[:, 2 + width:]))


class LaunchLog:
    """An executor that records (kernel name, grid) of every launch, then runs it."""

    def __init__(self, ex):
        self.ex, self.launches = ex, []

    def __getattr__(self, name):
        return getattr(self.ex, name)

    def function(self, file, name, defines=()):
        fn = self.ex.function(file, name, defines)

        def launch(grid, block, args, **kw):
            self.launches.append((name, tuple(grid)))
            return fn(grid, block, args, **kw)
        return launch


def test_decode_window_work(ex):
    """With a window the splits cover only the window's rows: the same launch as a
    context of `window` rows, whatever n_rows is."""
    rng = np.random.default_rng(11)
    n_q, n_kv, head_dim, n_rows, window = 32, 8, 64, 3000, 64
    pools = drop_below(*filled_pool(rng, n_rows, n_kv, 16, head_dim), n_rows - window)
    q = rng.standard_normal((1, n_q * head_dim)).astype(np.float32)
    log = LaunchLog(ex)
    attention.attention_decode(log, ex.asarray(q), *upload(ex, *pools), n_rows, n_q, 0.125, ex.zeros(q.shape),
                               window=window)
    n_chunks, _, n_splits, _ = attention.decode_geometry(window, n_q, n_kv)
    assert log.launches[0] == ("attention_decode_split", (n_kv * n_chunks, n_splits))
    assert n_splits < attention.decode_geometry(n_rows, n_q, n_kv)[2]


def test_decode_geometry():
    """1-2 splits for short contexts, many for long ones; no split is empty; group
    chunks of at most DEC_HEADS query heads, balanced."""
    assert attention.decode_geometry(7, 9, 3)[2:] == (1, 7)
    assert attention.decode_geometry(100, 32, 8)[2] == 2
    for n_rows, n_q, n_kv in [(300, 9, 3), (3000, 32, 8), (3000, 4, 1), (100_000, 32, 8), (65, 14, 2)]:
        n_chunks, per_block, n_splits, rows = attention.decode_geometry(n_rows, n_q, n_kv)
        assert 1 <= n_splits <= attention.DEC_MAX_SPLITS and (n_splits - 1) * rows < n_rows <= n_splits * rows
        assert per_block <= attention.DEC_HEADS and (n_chunks - 1) * per_block < n_q // n_kv <= n_chunks * per_block
    assert attention.decode_geometry(3000, 32, 8)[2] >= 32
    assert attention.decode_geometry(65, 14, 2)[:2] == (2, 4)


@pytest.mark.parametrize("n_q,n_kv", [(9, 3), (14, 2), (12, 2), (32, 8), (4, 1)])
def test_recorded_decode_launches_enough_splits(n_q, n_kv):
    """A recorded decode step launches decode_split_bound(capacity) splits and each replay
    works out its own count from the rows it attends: that bound must cover the count of
    every row count up to the capacity (checked to 50K rows: the bound never falls as
    rows grow and is never below the count; the rounded count of the capacity is no
    such bound: Qwen2.5's 14/2 heads at 20,032 rows
    give 254 splits, at 16,384 rows 256, whose last two would never run)."""
    assert attention.decode_geometry(20_032, 14, 2)[2] == 254 < attention.decode_geometry(16_384, 14, 2)[2]
    splits = np.array([attention.decode_geometry(r, n_q, n_kv)[2] for r in range(1, 50_001)])
    bound = np.array([attention.decode_split_bound(r, n_q, n_kv) for r in range(1, 50_001)])
    assert (np.diff(bound) >= 0).all() and (splits <= bound).all() and bound.max() <= attention.DEC_MAX_SPLITS


def test_decode_scratch_allocated_once(ex):
    """A growing context reuses the partials buffer: a decode token allocates nothing."""
    rng = np.random.default_rng(3)
    n_q, n_kv, head_dim = 9, 3, 64
    pools = filled_pool(rng, 900, n_kv, 16, head_dim)
    k_pages, v_pages, page_table = upload(ex, *pools)
    q_host = rng.standard_normal((1, n_q * head_dim)).astype(np.float32)
    q, out = ex.asarray(q_host), ex.zeros((1, n_q * head_dim))
    attention.attention_decode(ex, q, k_pages, v_pages, page_table, 200, n_q, 0.125, out)
    buf = ex.cache["attention_decode"]
    for n_rows in (201, 500, 900):
        attention.attention_decode(ex, q, k_pages, v_pages, page_table, n_rows, n_q, 0.125, out)
        want = np.empty_like(q_host)
        REF.attention_decode(q_host, *pools, n_rows, n_q, 0.125, want)
        assert nmse(ex.to_host(out), want) < TOL
    assert ex.cache["attention_decode"] is buf


# -- prefill ---------------------------------------------------------------------------------
@pytest.mark.parametrize("n_q,n_kv,head_dim,page_size", SHAPES)
@pytest.mark.parametrize("start_row,n", [(0, 1), (0, 45), (37, 70), (300, 17)])
def test_attention_prefill(ex, n_q, n_kv, head_dim, page_size, start_row, n):
    rng = np.random.default_rng(start_row * 13 + n + head_dim)
    n_rows = start_row + n
    k_pages, v_pages, page_table = filled_pool(rng, n_rows, n_kv, page_size, head_dim)
    width = n_q * head_dim
    q = rng.standard_normal((n, width)).astype(np.float32)
    scale = 1.0 / math.sqrt(head_dim)
    want = np.empty_like(q)
    REF.attention_prefill(q, k_pages, v_pages, page_table, start_row, n_q, scale, want)

    _, q_dev = nan_view(ex, q, 0, 2 * n_kv * head_dim)          # q of a fused qkv row
    out_buf, out = nan_view(ex, np.full_like(q, np.nan), 4, 3)
    attention.attention_prefill(ex, q_dev, *upload(ex, k_pages, v_pages, page_table), start_row, n_q, scale, out)
    got = ex.to_host(out_buf)
    assert nmse(got[:, 4:4 + width], want) < TOL
    assert np.all(np.isnan(got[:, :4])) and np.all(np.isnan(got[:, 4 + width:]))


@pytest.mark.parametrize("n_q,n_kv,head_dim,page_size", SHAPES)
@pytest.mark.parametrize("window", [1, 7, 64, 512])
@pytest.mark.parametrize("start_row,n", [(0, 45), (37, 70), (600, 40)])
def test_attention_prefill_window(ex, n_q, n_kv, head_dim, page_size, window, start_row, n):
    """Windows that start inside, at and below a block's first tile; queries of one block
    whose windows begin tiles apart (window 1 and 7 with BQ 64); whole tiles skipped."""
    rng = np.random.default_rng(start_row * 11 + n + window + head_dim)
    n_rows = start_row + n
    pools = drop_below(*filled_pool(rng, n_rows, n_kv, page_size, head_dim), max(0, start_row - window + 1))
    width = n_q * head_dim
    q = rng.standard_normal((n, width)).astype(np.float32)
    scale = 1.0 / math.sqrt(head_dim)
    want = np.empty_like(q)
    REF.attention_prefill(q, *pools, start_row, n_q, scale, want, window=window)

    _, q_dev = nan_view(ex, q, 0, 2 * n_kv * head_dim)          # q of a fused qkv row
    out_buf, out = nan_view(ex, np.full_like(q, np.nan), 4, 3)
    attention.attention_prefill(ex, q_dev, *upload(ex, *pools), start_row, n_q, scale, out, window=window)
    got = ex.to_host(out_buf)
    assert nmse(got[:, 4:4 + width], want) < TOL
    assert np.all(np.isnan(got[:, :4])) and np.all(np.isnan(got[:, 4 + width:]))


def test_prefill_window_matches_decode(ex):
    """Token-by-token decode and one windowed prefill chunk agree on every query."""
    rng = np.random.default_rng(12)
    n_q, n_kv, head_dim, start_row, n, window = 9, 3, 64, 50, 20, 16
    pools = upload(ex, *filled_pool(rng, start_row + n, n_kv, 16, head_dim))
    q = rng.standard_normal((n, n_q * head_dim)).astype(np.float32)
    out = ex.zeros(q.shape)
    attention.attention_prefill(ex, ex.asarray(q), *pools, start_row, n_q, 0.125, out, window=window)
    got = ex.to_host(out)
    for i in range(n):
        one = ex.zeros((1, q.shape[1]))
        attention.attention_decode(ex, ex.asarray(q[i:i + 1]), *pools, start_row + i + 1, n_q, 0.125, one,
                                   window=window)
        np.testing.assert_allclose(got[i], ex.to_host(one)[0], rtol=1e-4, atol=1e-5)


def test_prefill_shared_memory_fits():
    for head_dim in range(2, attention.MAX_HEAD_DIM + 1, 2):
        name, bq = attention.prefill_kernel(head_dim)
        assert attention.prefill_smem_bytes(bq, head_dim) <= 48 * 1024, (head_dim, name)


def test_peaked_softmax(ex):
    """Large logits (|s| ~ 50): the online max keeps every exponent in range."""
    rng = np.random.default_rng(8)
    n_q, n_kv, head_dim, start_row, n = 9, 3, 64, 90, 40
    k_pages, v_pages, page_table = filled_pool(rng, start_row + n, n_kv, 16, head_dim, kscale=8.0)
    q = (rng.standard_normal((n, n_q * head_dim)) * 6).astype(np.float32)
    dev = upload(ex, k_pages, v_pages, page_table)
    want = np.empty_like(q)
    REF.attention_prefill(q, k_pages, v_pages, page_table, start_row, n_q, 0.125, want)
    out = ex.zeros(q.shape)
    attention.attention_prefill(ex, ex.asarray(q), *dev, start_row, n_q, 0.125, out)
    assert nmse(ex.to_host(out), want) < TOL
    REF.attention_decode(q[-1:], k_pages, v_pages, page_table, start_row + n, n_q, 0.125, want[:1])
    out = ex.zeros((1, q.shape[1]))
    attention.attention_decode(ex, ex.asarray(q[-1:]), *dev, start_row + n, n_q, 0.125, out)
    assert nmse(ex.to_host(out), want[:1]) < TOL
    q_window = (rng.standard_normal((n_q, 16, head_dim)) * 6).astype(np.float32)
    got = attention.snapkv_votes(ex, q_window, dev[0], dev[2], start_row + n, 0.125)
    assert nmse(got, REF.snapkv_votes(q_window, k_pages, page_table, start_row + n, 0.125)) < TOL


# -- SnapKV votes -----------------------------------------------------------------------------
VOTES_CASES = [shape + rows for shape in SHAPES for rows in [(301, 32), (77, 32), (45, 16), (20, 1)]] + [
    (32, 8, 128, 16, 1000, 32),      # stats splits of two row tiles (queries staged once)
    (32, 8, 256, 16, 1000, 32),      # ... and of two 128-dim slices (queries staged per tile)
]


@pytest.mark.parametrize("n_q,n_kv,head_dim,page_size,n_rows,window", VOTES_CASES)
def test_snapkv_votes(ex, n_q, n_kv, head_dim, page_size, n_rows, window):
    rng = np.random.default_rng(n_rows * 3 + window + head_dim)
    k_pages, _, page_table = filled_pool(rng, n_rows, n_kv, page_size, head_dim)
    q_window = rng.standard_normal((n_q, window, head_dim)).astype(np.float32)
    scale = 1.0 / math.sqrt(head_dim)
    want = REF.snapkv_votes(q_window, k_pages, page_table, n_rows, scale)
    got = attention.snapkv_votes(ex, q_window, ex.asarray(k_pages), ex.asarray(page_table), n_rows, scale)
    assert isinstance(got, np.ndarray) and got.dtype == np.float32
    assert got.shape == want.shape == (n_kv, n_rows - window)
    assert nmse(got, want) < TOL


def test_votes_geometry():
    """Several stats splits, each a whole number of 32-row tiles, none empty."""
    n_qchunks, n_splits, rows = attention.votes_geometry(301, 96, 3)
    assert n_qchunks == 3 and n_splits > 1 and rows % attention.SNAP_RT == 0
    assert attention.votes_geometry(1000, 128, 8)[2] == 2 * attention.SNAP_RT
    for n_rows, n_queries, n_kv in [(20, 7, 2), (301, 96, 3), (100_000, 128, 8), (100_000, 128, 1)]:
        _, n_splits, rows = attention.votes_geometry(n_rows, n_queries, n_kv)
        assert (n_splits - 1) * rows < n_rows <= n_splits * rows


def test_snapkv_votes_device_query_and_empty_prefix(ex):
    rng = np.random.default_rng(4)
    k_pages, _, page_table = filled_pool(rng, 40, 3, 16, 64)
    q_window = rng.standard_normal((9, 8, 64)).astype(np.float32)
    dev_k, dev_pt = ex.asarray(k_pages), ex.asarray(page_table)
    got = attention.snapkv_votes(ex, ex.asarray(q_window), dev_k, dev_pt, 40, 0.125)
    assert nmse(got, REF.snapkv_votes(q_window, k_pages, page_table, 40, 0.125)) < TOL
    empty = attention.snapkv_votes(ex, q_window, dev_k, dev_pt, 8, 0.125)
    assert empty.shape == (3, 0) and empty.dtype == np.float32


# -- merged rows: row_bias ------------------------------------------------------------------------
def bias_view(ex, rng, n_kv, n_bias):
    """Host log-counts f32 [n_kv, n_bias] and their device copy as a column slice of a
    NaN-filled buffer: a read past n_bias or off the row stride shows up as NaN."""
    host = rng.uniform(-2.0, 9.0, (n_kv, n_bias)).astype(np.float32)
    return host, nan_view(ex, host, 3, 5)[1]


# Beyond tests/backends/test_ops.py: head_dim 96 and 256 (the d128 and d256 prefill tiles),
# GQA 14/2 (two decode chunks per group), a row-strided bias, n_bias above n_rows and 0.
@pytest.mark.parametrize("n_q,n_kv,head_dim,page_size", SHAPES[2:])
@pytest.mark.parametrize("n_rows,n_bias", [(7, 3), (300, 299), (3000, 1000), (40, 64), (50, 0)])
def test_attention_decode_row_bias(ex, n_q, n_kv, head_dim, page_size, n_rows, n_bias):
    rng = np.random.default_rng(n_rows + n_bias + head_dim)
    pools = filled_pool(rng, n_rows, n_kv, page_size, head_dim)
    q = rng.standard_normal((1, n_q * head_dim)).astype(np.float32)
    bias, bias_dev = bias_view(ex, rng, n_kv, n_bias)
    scale = 1.0 / math.sqrt(head_dim)
    want = np.empty_like(q)
    REF.attention_decode(q, *pools, n_rows, n_q, scale, want, row_bias=bias)
    out = ex.zeros(q.shape)
    attention.attention_decode(ex, ex.asarray(q), *upload(ex, *pools), n_rows, n_q, scale, out, row_bias=bias_dev)
    assert nmse(ex.to_host(out), want) < TOL


@pytest.mark.parametrize("n_q,n_kv,head_dim,page_size", SHAPES[2:])
@pytest.mark.parametrize("start_row,n,n_bias", [(17, 7, 17), (300, 45, 120), (20, 40, 100)])
def test_attention_prefill_row_bias(ex, n_q, n_kv, head_dim, page_size, start_row, n, n_bias):
    rng = np.random.default_rng(start_row + n + n_bias + head_dim)
    pools = filled_pool(rng, start_row + n, n_kv, page_size, head_dim)
    q = rng.standard_normal((n, n_q * head_dim)).astype(np.float32)
    bias, bias_dev = bias_view(ex, rng, n_kv, n_bias)
    scale = 1.0 / math.sqrt(head_dim)
    want = np.empty_like(q)
    REF.attention_prefill(q, *pools, start_row, n_q, scale, want, row_bias=bias)
    out = ex.zeros(q.shape)
    attention.attention_prefill(ex, ex.asarray(q), *upload(ex, *pools), start_row, n_q, scale, out,
                                row_bias=bias_dev)
    assert nmse(ex.to_host(out), want) < TOL


def test_rejects_bad_row_bias(ex):
    k = ex.zeros((2, 3, 16, 64), np.uint16)
    pools = (k, ex.zeros(k.shape, np.uint16), ex.asarray(np.arange(2, dtype=np.int32)))
    q = ex.zeros((1, 9 * 64))
    for bad in (ex.zeros((3 * 8,)), ex.zeros((2, 8)), ex.zeros((3, 8), np.float64), ex.zeros((3, 8, 1)),
                ex.zeros((3, 16))[:, ::2]):
        with pytest.raises(ValueError, match="row_bias must be f32"):
            attention.attention_decode(ex, q, *pools, 5, 9, 0.1, ex.zeros(q.shape), row_bias=bad)
        with pytest.raises(ValueError, match="row_bias must be f32"):
            attention.attention_prefill(ex, q, *pools, 0, 9, 0.1, ex.zeros(q.shape), row_bias=bad)


# -- argument checks -----------------------------------------------------------------------------
def test_rejects_unsupported_shapes(ex):
    def pools(head_dim, n_kv=3):
        k = ex.zeros((2, n_kv, 16, head_dim), np.uint16)
        return k, ex.zeros((2, n_kv, 16, head_dim), np.uint16), ex.asarray(np.arange(2, dtype=np.int32))

    for head_dim, match in [(63, "even"), (258, "at most 256")]:
        k, v, pt = pools(head_dim)
        q = ex.zeros((1, 9 * head_dim))
        with pytest.raises(ValueError, match=match):
            attention.attention_decode(ex, q, k, v, pt, 5, 9, 0.1, ex.zeros(q.shape))
        with pytest.raises(ValueError, match=match):
            attention.attention_prefill(ex, q, k, v, pt, 0, 9, 0.1, ex.zeros(q.shape))
    k, v, pt = pools(64)
    q = ex.zeros((1, 10 * 64))
    with pytest.raises(ValueError, match="multiple of 3 KV heads"):
        attention.attention_decode(ex, q, k, v, pt, 5, 10, 0.1, ex.zeros(q.shape))
    with pytest.raises(ValueError, match="multiple of 3 KV heads"):
        attention.snapkv_votes(ex, np.zeros((10, 4, 64), np.float32), k, pt, 20, 0.1)
    with pytest.raises(ValueError, match="pages"):                       # 40 rows need 3 pages
        attention.attention_decode(ex, ex.zeros((1, 9 * 64)), k, v, pt, 40, 9, 0.1, ex.zeros((1, 9 * 64)))
    with pytest.raises(ValueError, match="window"):
        attention.snapkv_votes(ex, np.zeros((9, 40, 64), np.float32), k, pt, 20, 0.1)


# -- quantized KV rows -------------------------------------------------------------------------
# Every row format of backends/kvformat.py through the kernels' own paths: decode over one
# split and many (GQA 3:1 at head_dim 64, Gemma 3's 4:1 at 256, tq3 at head_dim 40: odd
# row bytes, fewer units than lanes), prefill tiles at start_row 0 and past 256 rows, a
# sliding window, votes over two 128-value slices; mixed pairs with the rotated format on
# either side. Unused slots hold 0xFF bytes (an f16 NaN scale); pages below a window are
# gone from the table (-1). The reference reads what KvFormat.dequantize gives.
QKV = [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("tq4", "tq4"), ("tq3", "tq3"), ("rq4_0", "rq4_0"), ("tq3", "q4_0"),
       ("q8_0", "tq4")]
QKV_IDS = ["/".join(dict.fromkeys(c)) for c in QKV]


def quant_cases(shapes):
    """(kv, *shape) for every pair of QKV and shape its formats allow (q8_0 / q4_0 / rq4_0: head_dim
    a multiple of 32), with readable ids."""
    return [pytest.param(kv, *shape, id=f"{kv_id}-{'-'.join(map(str, shape))}")
            for kv, kv_id in zip(QKV, QKV_IDS) for shape in shapes
            if not (shape[2] % 32 and any("q" in d for d in kv))]


def quant_pool(rng, n_rows, n_kv, page_size, head_dim, kv, kscale=2.0):
    """Host pools of formats kv = (k_dtype, v_dtype), NaN-poisoned but rows 0..n_rows-1,
    and a permuted page table with one spare entry."""
    n_used = -(-n_rows // page_size)
    fmts = [KvFormat.get(d, head_dim) for d in kv]
    k_pages, v_pages = (np.full(f.page_shape(n_used + 3, n_kv, page_size), BF16_QNAN if f.name == "bf16" else 0xFF,
                                f.storage) for f in fmts)
    page_table = rng.permutation(n_used + 3).astype(np.int32)[:n_used + 1]
    k = (rng.standard_normal((n_rows, n_kv * head_dim)) * kscale).astype(np.float32)
    v = rng.standard_normal((n_rows, n_kv * head_dim)).astype(np.float32)
    REF.kv_write(k_pages, v_pages, page_table, k, v, 0, *kv)
    return k_pages, v_pages, page_table


def drop_below_any(k_pages, v_pages, page_table, lo):
    """drop_below for pools of any format: rows below lo poisoned, whole pages gone (-1)."""
    page_size = k_pages.shape[2]
    k_pages, v_pages, page_table = k_pages.copy(), v_pages.copy(), page_table.copy()
    for r in range(lo):
        page = page_table[r // page_size]
        if page >= 0:
            for pages in (k_pages, v_pages):
                pages[page, :, r % page_size] = BF16_QNAN if pages.dtype == np.uint16 else 0xFF
    page_table[:lo // page_size] = -1
    return k_pages, v_pages, page_table


@pytest.mark.parametrize("kv,n_q,n_kv,head_dim,page_size,n_rows,window", quant_cases([
    (9, 3, 64, 16, 7, 0), (4, 1, 256, 16, 3000, 0), (9, 3, 64, 16, 1000, 64), (6, 2, 40, 16, 300, 0)]))
def test_attention_decode_quantized(ex, kv, n_q, n_kv, head_dim, page_size, n_rows, window):
    rng = np.random.default_rng(n_rows + head_dim + window)
    pools = quant_pool(rng, n_rows, n_kv, page_size, head_dim, kv)
    if window:
        pools = drop_below_any(*pools, n_rows - window)
    width = n_q * head_dim
    q = rng.standard_normal((1, width)).astype(np.float32)
    scale = 1.0 / math.sqrt(head_dim)
    want = np.empty_like(q)
    REF.attention_decode(q, *pools, n_rows, n_q, scale, want, window, *kv)

    _, q_dev = nan_view(ex, q, 3, 5)
    out_buf, out = nan_view(ex, np.full_like(q, np.nan), 2, 6)
    attention.attention_decode(ex, q_dev, *upload(ex, *pools), n_rows, n_q, scale, out, window, *kv)
    got = ex.to_host(out_buf)
    assert nmse(got[:, 2:2 + width], want) < TOL
    assert np.all(np.isnan(got[:, :2])) and np.all(np.isnan(got[:, 2 + width:]))


def quant_prefill_case(rng, kv, n_q, n_kv, head_dim, page_size, start_row, n, window):
    """(pools, q, scale, the reference's output) of a prefill chunk of n queries at start_row
    over pools of formats kv, rows below the first query's window gone."""
    pools = quant_pool(rng, start_row + n, n_kv, page_size, head_dim, kv)
    if window:
        pools = drop_below_any(*pools, max(0, start_row - window + 1))
    q = rng.standard_normal((n, n_q * head_dim)).astype(np.float32)
    scale = 1.0 / math.sqrt(head_dim)
    want = np.empty_like(q)
    REF.attention_prefill(q, *pools, start_row, n_q, scale, want, window, *kv)
    return pools, q, scale, want


@pytest.mark.parametrize("kv,n_q,n_kv,head_dim,page_size,start_row,n,window", quant_cases([
    (9, 3, 64, 16, 0, 45, 0), (4, 1, 256, 16, 300, 17, 0), (9, 3, 64, 16, 37, 70, 7), (6, 2, 40, 16, 20, 9, 0)]))
def test_attention_prefill_quantized(ex, kv, n_q, n_kv, head_dim, page_size, start_row, n, window):
    rng = np.random.default_rng(start_row * 13 + n + head_dim + window)
    pools, q, scale, want = quant_prefill_case(rng, kv, n_q, n_kv, head_dim, page_size, start_row, n, window)
    width = n_q * head_dim
    _, q_dev = nan_view(ex, q, 0, 2 * n_kv * head_dim)          # q of a fused qkv row
    out_buf, out = nan_view(ex, np.full_like(q, np.nan), 4, 3)
    attention.attention_prefill(ex, q_dev, *upload(ex, *pools), start_row, n_q, scale, out, window, *kv)
    got = ex.to_host(out_buf)
    assert nmse(got[:, 4:4 + width], want) < TOL
    assert np.all(np.isnan(got[:, :4])) and np.all(np.isnan(got[:, 4 + width:]))


# (kv, n_q, n_kv, head_dim, page_size, start_row, n, window): grids small enough to split the
# rows (attention.prefill_splits > 1; BQ 64, 32, 16), one whose first blocks see fewer tiles
# than there are splits (empty splits), a window, and the formats whose values the combine
# (tq) or rotate.cu (rq4_0) turns back.
SPLIT_CASES = [(("bf16", "bf16"), 9, 3, 64, 16, 1500, 8, 0), (("bf16", "bf16"), 32, 8, 128, 16, 600, 45, 0),
               (("bf16", "bf16"), 4, 1, 256, 16, 0, 1000, 0), (("bf16", "bf16"), 9, 3, 64, 16, 1400, 40, 512),
               (("q8_0", "tq4"), 9, 3, 64, 16, 1500, 8, 0), (("tq3", "tq3"), 4, 1, 256, 16, 900, 40, 0),
               (("rq4_0", "rq4_0"), 9, 3, 64, 16, 1500, 8, 0), (("q4_0", "q8_0"), 9, 3, 64, 16, 1400, 40, 512)]


@pytest.mark.parametrize("kv,n_q,n_kv,head_dim,page_size,start_row,n,window", SPLIT_CASES,
                         ids=["-".join(map(str, [*dict.fromkeys(c[0]), *c[1:]])) for c in SPLIT_CASES])
def test_attention_prefill_split_rows(ex, kv, n_q, n_kv, head_dim, page_size, start_row, n, window):
    """A grid too small for a GPU over long rows splits each block's rows and merges the
    splits (the decode combine): the same output as the reference, every row written."""
    bq = attention.prefill_kernel(head_dim)[1]
    assert attention.prefill_splits(n, start_row, window, bq, n_q) > 1
    rng = np.random.default_rng(start_row + n + head_dim + window)
    pools, q, scale, want = quant_prefill_case(rng, kv, n_q, n_kv, head_dim, page_size, start_row, n, window)
    out = ex.asarray(np.full_like(q, np.nan))                    # dense rows: the split path
    attention.attention_prefill(ex, ex.asarray(q), *upload(ex, *pools), start_row, n_q, scale, out, window, *kv)
    assert nmse(ex.to_host(out), want) < TOL
    assert "attention_prefill_splits" in ex.cache


@pytest.mark.parametrize("k_dtype", ["q8_0", "q4_0", "tq4", "tq3", "rq4_0"])
@pytest.mark.parametrize("n_q,n_kv,head_dim,page_size,n_rows,window", [
    (9, 3, 64, 16, 301, 32), (4, 1, 256, 16, 1000, 32)])
def test_snapkv_votes_quantized(ex, k_dtype, n_q, n_kv, head_dim, page_size, n_rows, window):
    rng = np.random.default_rng(n_rows * 3 + window + head_dim)
    k_pages, _, page_table = quant_pool(rng, n_rows, n_kv, page_size, head_dim, (k_dtype, "bf16"))
    q_window = rng.standard_normal((n_q, window, head_dim)).astype(np.float32)
    scale = 1.0 / math.sqrt(head_dim)
    want = REF.snapkv_votes(q_window, k_pages, page_table, n_rows, scale, k_dtype)
    got = attention.snapkv_votes(ex, q_window, ex.asarray(k_pages), ex.asarray(page_table), n_rows, scale, k_dtype)
    assert got.shape == want.shape == (n_kv, n_rows - window)
    assert nmse(got, want) < TOL


def test_prefill_shared_memory_fits_every_format():
    for head_dim in range(8, attention.MAX_HEAD_DIM + 1, 8):
        name, bq = attention.prefill_kernel(head_dim)
        for k_dtype in KV_DTYPES:
            for v_dtype in KV_DTYPES:
                if head_dim % 32 and ("q" in k_dtype or "q" in v_dtype):
                    continue
                assert attention.prefill_smem_bytes(bq, head_dim, k_dtype, v_dtype) <= 48 * 1024, \
                    (head_dim, k_dtype, v_dtype)


def test_rotated_formats_rotate_once(ex):
    """Rotated keys rotate the queries once, rotated values the output back once: the
    launches around the attention kernels (tq values in the combine, rq4_0 values, read
    as q4_0 rows, by rotate.cu), and no rotation for the other formats."""
    rng = np.random.default_rng(21)
    n_q, n_kv, head_dim, n_rows = 9, 3, 64, 300
    q = rng.standard_normal((1, n_q * head_dim)).astype(np.float32)
    for kv, want in [(("tq4", "tq3"), ["rotate_vectors_1", "attention_decode_split", "attention_decode_combine"]),
                     (("rq4_0", "rq4_0"), ["rotate_vectors_1", "attention_decode_split", "attention_decode_combine",
                                           "rotate_vectors_1"]),
                     (("q8_0", "q4_0"), ["attention_decode_split", "attention_decode_combine"])]:
        log = LaunchLog(ex)
        pools = upload(ex, *quant_pool(rng, n_rows, n_kv, 16, head_dim, kv))
        attention.attention_decode(log, ex.asarray(q), *pools, n_rows, n_q, 0.125, ex.zeros(q.shape), 0, *kv)
        assert [name for name, _ in log.launches] == want
        log = LaunchLog(ex)
        attention.attention_prefill(log, ex.asarray(np.repeat(q, 5, 0)), *pools, n_rows - 5, n_q, 0.125,
                                    ex.zeros((5, q.shape[1])), 0, *kv)
        rotations = [name for name, _ in log.launches if name.startswith("rotate")]
        assert len(rotations) == (0 if kv[0] == "q8_0" else 2)


def test_rejects_pool_of_another_format(ex):
    k, v, pt = upload(ex, *quant_pool(np.random.default_rng(2), 20, 3, 16, 64, ("q8_0", "q8_0")))
    q = ex.zeros((1, 9 * 64))
    with pytest.raises(ValueError, match="uint16"):
        attention.attention_decode(ex, q, k, v, pt, 20, 9, 0.1, ex.zeros(q.shape))      # read as bf16
    with pytest.raises(ValueError, match="no q4_0 row"):
        attention.attention_decode(ex, q, k, v, pt, 20, 9, 0.1, ex.zeros(q.shape), 0, "q4_0", "q4_0")
