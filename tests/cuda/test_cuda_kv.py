"""CUDA KV-cache writes and moves (backends/cuda/elementwise.py, kernels/kv.cu) for every
KV row format (backends/kvformat.py) on the tests' executor (conftest.py `ex`: the CPU
harness unless SHARPI_CUDA_EXECUTOR names another).

kv_write quantizes on the device: q8_0 / q4_0 rows must be the bytes KvFormat.quantize
(ggml's reference rounding) writes, bit for bit, including the awkward rows: all zero,
halves that roundf takes away from zero, 0.49999997 (which trunc(v + 0.5) would round up),
several values of the same largest |x| (q4_0 takes the first), scales that are f16
subnormals or round up to the next binade. tq4 / tq3 codes equal the oracle's except at
near-ties and the f16 scale is within 1 ulp (the device sums in f32, the oracle in f64).
Head dims 64 and 256, and tq3 at 40 (17-byte rows: byte-wise moves). Moves copy whole
rows / pages whatever their width; unused slots hold 0xFF bytes, so a stray write shows.
"""
from __future__ import annotations

import numpy as np
import pytest

from _backends import assert_rows_written
from backends.cuda import elementwise
from backends.kvformat import KvFormat, is_rotated
from backends.reference import ReferenceBackend

REF = ReferenceBackend()
QUANT = ["q8_0", "q4_0", "tq4", "tq3", "rq4_0"]


def empty_pools(n_pages, n_kv, page_size, head_dim, kv):
    return [np.full(f.page_shape(n_pages, n_kv, page_size), 0xFF if f.name != "bf16" else 0x7FC0, f.storage)
            for f in (KvFormat.get(d, head_dim) for d in kv)]


def awkward_rows(head_dim: int, dtype: str) -> np.ndarray:
    """f32 [8, head_dim]: rows whose rounding is easy to get wrong."""
    rng = np.random.default_rng(head_dim)
    rows = rng.standard_normal((8, head_dim)).astype(np.float32)
    rows[0] = 0.0                                                   # d = 0: q = 0 (q8_0), 8 (q4_0)
    rows[1, :] = np.tile(np.float32([127.0, 2.5, -2.5, 0.5, -0.5, 1.5, 0.49999997, -126.5]), head_dim // 8)
    rows[2] *= np.float32(1e-6)                                     # f16 subnormal scales
    rows[3] *= np.float32(3e-9)                                     # ... and scales that round to 0
    top = np.abs(rows[4]).max()
    rows[4, ::7] = -top                                             # ties for the largest |x|
    rows[4, ::11] = top
    rows[5] = np.float32(65504.0 * 8 * 0.999)                       # scales near the f16 top
    rows[5, 1::2] *= -1
    if is_rotated(dtype):
        rows[5] /= 16                                               # (rotated: a value up to sqrt(64) |x|)
    rows[6] *= np.float32(1e4)
    rows[7, :] = np.float32(-8.0)                                   # q4_0: max = -8, d = 1
    rows[7, 3] = 7.5
    return rows


@pytest.mark.parametrize("dtype,head_dim", [(d, h) for d in QUANT for h in (64, 256, 40)
                                             if not (h % 32 and "q" in d)])   # q8_0, q4_0, rq4_0: D % 32 == 0
def test_kv_write_bytes(ex, dtype, head_dim):
    """kv_write into a pool of one format (V bf16) through a permuted page table, random
    rows and the awkward ones, at start_row past a page boundary."""
    rng = np.random.default_rng(head_dim + len(dtype))
    n_kv, page_size, start_row = 2, 16, 13
    rows = np.concatenate([awkward_rows(head_dim, dtype), rng.standard_normal((9, head_dim)).astype(np.float32) * 3])
    n = rows.shape[0]
    k = np.concatenate([rows, rows[::-1] * 0.5], axis=1)                          # [n, 2 * head_dim]
    v = rng.standard_normal(k.shape).astype(np.float32)
    pools = empty_pools(5, n_kv, page_size, head_dim, (dtype, "bf16"))
    page_table = rng.permutation(5).astype(np.int32)
    want_k, want_v = (p.copy() for p in pools)
    REF.kv_write(want_k, want_v, page_table, k, v, start_row, dtype, "bf16")
    kbig = np.pad(k, ((0, 0), (3, 1)), constant_values=np.nan)                  # k as a column slice
    dev_k, dev_v, dev_pt = (ex.asarray(a) for a in (*pools, page_table))
    kdev = ex.asarray(kbig)
    elementwise.kv_write(ex, dev_k, dev_v, dev_pt, kdev[:, 3:3 + k.shape[1]], ex.asarray(v), start_row, dtype, "bf16")
    assert_rows_written(ex.to_host(dev_k), want_k, dtype, head_dim)
    np.testing.assert_array_equal(ex.to_host(dev_v), want_v)


@pytest.mark.parametrize("kv", [("q8_0", "tq4"), ("tq3", "bf16"), ("q4_0", "q4_0")])
def test_kv_write_pair(ex, kv):
    """Keys and values of different formats in one call (a launch per pool)."""
    rng = np.random.default_rng(7)
    n_kv, head_dim, page_size = 3, 64, 16
    k, v = (rng.standard_normal((7, n_kv * head_dim)).astype(np.float32) for _ in range(2))
    pools = empty_pools(4, n_kv, page_size, head_dim, kv)
    page_table = np.array([2, 0, 3, 1], np.int32)
    want = [p.copy() for p in pools]
    REF.kv_write(*want, page_table, k, v, 12, *kv)
    dev = [ex.asarray(p) for p in pools]
    elementwise.kv_write(ex, *dev, ex.asarray(page_table), ex.asarray(k), ex.asarray(v), 12, *kv)
    for got, w, dtype in zip(dev, want, kv):
        assert_rows_written(ex.to_host(got), w, dtype, head_dim)


@pytest.mark.parametrize("kv", [("bf16", "bf16"), ("q8_0", "tq4")])
def test_kv_write_past_the_page_table_is_refused(ex, kv):
    """The kernels index the page table unchecked: rows past its pages are an error
    before any launch (a stale entry would send them into another sequence's page)."""
    n_kv, head_dim, page_size = 2, 64, 16
    k = v = ex.asarray(np.ones((4, n_kv * head_dim), np.float32))
    pools = [ex.asarray(p) for p in empty_pools(4, n_kv, page_size, head_dim, kv)]
    page_table = ex.asarray(np.array([2, 0], np.int32))             # 32 rows
    elementwise.kv_write(ex, *pools, page_table, k, v, 28, *kv)     # rows 28..31: fit
    before = [ex.to_host(p).copy() for p in pools]
    with pytest.raises(ValueError, match="the page table has 2"):
        elementwise.kv_write(ex, *pools, page_table, k, v, 29, *kv)
    for p, b in zip(pools, before):
        np.testing.assert_array_equal(ex.to_host(p), b)


@pytest.mark.parametrize("kv,head_dim", [(("q8_0", "tq3"), 64), (("tq3", "tq3"), 40), (("bf16", "q4_0"), 64)])
def test_kv_gather_and_copy_any_width(ex, kv, head_dim):
    """Whole rows move with their scales (K and V rows of different widths; tq3 at head_dim
    40 is 17 bytes a row: byte units); listed pages copy whole, the others stay."""
    rng = np.random.default_rng(head_dim)
    n_kv, page_size, n_rows = 2, 8, 45
    pools = empty_pools(8, n_kv, page_size, head_dim, kv)
    page_table = rng.permutation(8).astype(np.int32)
    k, v = (rng.standard_normal((n_rows, n_kv * head_dim)).astype(np.float32) for _ in range(2))
    REF.kv_write(*pools, page_table, k, v, 0, *kv)
    keep = np.stack([np.sort(rng.choice(n_rows, 20, replace=False)) for _ in range(n_kv)])
    want = [p.copy() for p in pools]
    REF.kv_gather(*want, page_table, keep)
    dev = [ex.asarray(p) for p in pools]
    elementwise.kv_gather(ex, *dev, ex.asarray(page_table), keep)
    for got, w in zip(dev, want):
        np.testing.assert_array_equal(ex.to_host(got), w)

    dst = empty_pools(8, n_kv, page_size, head_dim, kv)
    pages = np.sort(page_table[[0, 3, 5]]).astype(np.int32)
    want = [d.copy() for d in dst]
    REF.kv_copy_pages(*pools, *want, pages)
    dev_dst = [ex.asarray(d) for d in dst]
    elementwise.kv_copy_pages(ex, *(ex.asarray(p) for p in pools), *dev_dst, pages)
    for got, w in zip(dev_dst, want):
        np.testing.assert_array_equal(ex.to_host(got), w)
    src, dst = pages[:1], pages[2:]                                         # within one pool, to another page
    REF.kv_copy_pages(*want, *want, src, dst)
    elementwise.kv_copy_pages(ex, *dev_dst, *dev_dst, src, dst)
    for got, w in zip(dev_dst, want):
        np.testing.assert_array_equal(ex.to_host(got), w)


GRID_Y_MAX = 65535          # CUDA's limit on grid y and z (x: 2^31 - 1)


@pytest.mark.parametrize("kv", [("bf16", "bf16"), ("q8_0", "tq3")])
def test_copy_more_pages_than_grid_y_allows(ex, kv):
    """Branching a cache of more than 65,535 pages: the pages are on grid x, every one is
    copied (pages of one row of one head keep the harness to seconds; q8_0 / tq3 at
    head_dim 32: 34 / 14-byte pages, u16 units)."""
    rng = np.random.default_rng(3)
    n_pages, n_copy = GRID_Y_MAX + 1000, GRID_Y_MAX + 37
    head_dim = 2 if kv == ("bf16", "bf16") else 32
    src = [rng.integers(0, 256, p.nbytes, np.uint8).view(p.dtype).reshape(p.shape)        # any bytes
           for p in empty_pools(n_pages, 1, 1, head_dim, kv)]
    dst = empty_pools(n_pages, 1, 1, head_dim, kv)
    pages = rng.permutation(n_pages)[:n_copy].astype(np.int32)
    dst_pages = rng.permutation(n_pages)[:n_copy].astype(np.int32)
    want = [d.copy() for d in dst]
    REF.kv_copy_pages(*src, *want, pages, dst_pages)
    dev_dst = [ex.asarray(d) for d in dst]
    elementwise.kv_copy_pages(ex, *(ex.asarray(p) for p in src), *dev_dst, pages, dst_pages)
    for got, w in zip(dev_dst, want):
        np.testing.assert_array_equal(ex.to_host(got), w)


class LaunchRecorder:
    """Stands in for an executor: records each launch's (kernel, grid, block), runs nothing."""

    def __init__(self):
        self.launches = []

    def asarray(self, host):
        return host

    def function(self, file, name, defines=()):
        return lambda grid, block, args, shared_mem=0: self.launches.append((name, grid, block))


def test_copy_pages_puts_millions_of_pages_on_grid_x():
    """A pool of three million pages (a long context at page_size 1) in one launch: x
    takes up to 2^31 - 1 blocks."""
    rec = LaunchRecorder()
    pools = empty_pools(3_000_000, 1, 1, 2, ("bf16", "bf16"))
    elementwise.kv_copy_pages(rec, *pools, *pools, np.arange(1_500_000), np.arange(1_500_000, 3_000_000))
    assert rec.launches == [("kv_copy_pages_u32", (1_500_000, 1), (elementwise.COPY_THREADS,))]
