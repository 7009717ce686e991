"""The CPU backend's quantized KV rows (backends/cpu/kvquant.py, kvsimd.py) against
backends/kvformat.py alone, independently of the reference backend:

  f16 conversions           every f16 pattern; f32 ties, subnormals, overflow vs numpy
  dequantized rows          bit-identical to KvFormat.dequantize(_rotated) (the vector IR)
  kv_write                  q8_0 / q4_0 bytes identical to KvFormat.quantize (ggml's
                            rounding); tq codes equal but for near-ties, scales within 1 ulp
  attention, votes          NMSE < 1e-8 against float64 over KvFormat.dequantize rows
  kv_gather, kv_copy_pages  whole quantized rows (scales included) move bit for bit

Pools are NaN-poisoned (0xFF bytes: an f16 NaN scale) with scrambled page tables,
so a read of an unused slot or through a wrong page shows up as NaN.
"""
from __future__ import annotations

import math
import os
import platform
import subprocess
import sys

import numpy as np
import pytest
from numba import njit

from backends.cpu import CpuBackend, kvquant
from backends.cpu.jit import _f16_to_f32, _f32_to_f16
from backends.kvformat import KV_DTYPES, KvFormat, codebook, parse_kv_dtype
from engine.errors import ConfigError

CPU = CpuBackend()
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TARGETS = {   # as tests/backends/test_cpu_portable.py
    "avx2": {"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": "+avx2,+fma,+f16c,+popcnt,+bmi2,-avx512f"},
    "sse2": {"NUMBA_CPU_NAME": "x86-64", "NUMBA_CPU_FEATURES": "+sse2,-avx,-avx2,-avx512f,-f16c"},
}
QUANT = [d for d in KV_DTYPES if d != "bf16"]
TOL_ATTN = 1e-8
POISON = {np.dtype(np.uint8): 0xFF, np.dtype(np.uint16): 0x7FC0}   # f16 NaN scale / bf16 NaN


def nmse(got, want) -> float:
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape
    assert np.all(np.isfinite(got)), "non-finite output (read of a poisoned slot?)"
    return float(np.sum((got - want) ** 2) / max(np.sum(want ** 2), 1e-300))


# -- f16 -----------------------------------------------------------------------------
@njit(cache=False)
def _all_f16_to_f32(out):
    for h in range(65536):
        out[h] = _f16_to_f32(np.uint8(h & 0xFF), np.uint8(h >> 8))


@njit(cache=False)
def _f32_array_to_f16(x, out):
    for i in range(x.shape[0]):
        out[i] = _f32_to_f16(x[i])


def test_f16_to_f32_every_pattern():
    got = np.empty(65536, dtype=np.float32)
    _all_f16_to_f32(got)
    want = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


def test_f32_to_f16_matches_numpy():
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32)
    f16 = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16)
    f16 = f16[np.isfinite(f16)].astype(np.float32)
    edges = np.concatenate([
        f16, np.nextafter(f16, np.float32(np.inf)), np.nextafter(f16, np.float32(-np.inf)),
        (f16[:-1] + f16[1:]) / 2,                          # ties (exact in f32 for most)
        np.float32([65504, 65519.99, 65520, 1e6, np.inf, -np.inf, 2.0 ** -25, 2.0 ** -24 * 1.5,
                    2.0 ** -26, 1e-40, -0.0]),
    ]).astype(np.float32)
    x = np.concatenate([bits.view(np.float32), edges])
    x = x[~np.isnan(x)]
    got = np.empty(x.shape, dtype=np.uint16)
    _f32_array_to_f16(x, got)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(got, want)
    nan = np.empty(1, dtype=np.uint16)
    _f32_array_to_f16(np.float32([np.nan]), nan)
    assert np.isnan(nan.view(np.float16)[0])


# -- dequantized rows ----------------------------------------------------------------
@njit(cache=False)
def _dequant_all(rows, tag, cb, head_dim, out):
    for j0 in range(0, rows.shape[0], 16):
        n = min(16, rows.shape[0] - j0)
        kvquant.dequant_rows(rows, j0, n, tag, cb, head_dim, out[j0:j0 + n])


def test_row_format_tables():
    fmt = kvquant.RowFormat.get("tq4", 64)
    assert fmt.code == KV_DTYPES.index("tq4") and fmt.rotated
    assert sorted(kvquant.storage_order("tq3", 64)) == list(range(64))
    np.testing.assert_array_equal(fmt.codebook, codebook(4))
    np.testing.assert_array_equal(kvquant.RowFormat.get("tq3", 64).codebook[:8], codebook(3))
    with pytest.raises(ConfigError):
        kvquant.RowFormat.get("q4_0", 80)                 # not a multiple of 32


@pytest.mark.parametrize("dtype,head_dim", [(d, hd) for d in QUANT for hd in (64, 256)]
                         + [("q8_0", 96), ("q4_0", 96), ("tq4", 80), ("tq3", 80), ("tq4", 72),
                            ("tq3", 72)])       # odd widths: the vector pieces' scalar tails
def test_dequant_rows_bit_identical(dtype, head_dim):
    rng = np.random.default_rng(head_dim)
    fmt = KvFormat.get(dtype, head_dim)
    x = rng.standard_normal((100, head_dim)).astype(np.float32) * np.float32(3.0)
    x[:10] *= np.float32(1e-6)                         # subnormal f16 scales
    x[10] = 0.0
    rows = fmt.quantize(x)
    rf = kvquant.RowFormat.get(dtype, head_dim)
    got = np.full((100, head_dim), np.nan, dtype=np.float32)
    _dequant_all(rows, rf.tag, rf.codebook, head_dim, got)
    if rf.rotated:   # the kernels' basis: rotated, in storage order
        want = fmt.dequantize_rotated(rows)[:, kvquant.storage_order(dtype, head_dim)]
    else:
        want = fmt.dequantize(rows)
    np.testing.assert_array_equal(got, want)


# -- kv_write ------------------------------------------------------------------------
def make_pool(rng, n_rows, n_kv, page_size, head_dim, k_dtype, v_dtype, spare_pages=3):
    """Poisoned pools and a scrambled page table covering n_rows (+ one spare entry)."""
    n_used = -(-n_rows // page_size)
    n_pages = n_used + spare_pages
    pools = []
    for dtype in (k_dtype, v_dtype):
        fmt = KvFormat.get(dtype, head_dim)
        pools.append(np.full(fmt.page_shape(n_pages, n_kv, page_size), POISON[np.dtype(fmt.storage)],
                             dtype=fmt.storage))
    page_table = rng.permutation(n_pages).astype(np.int32)[:n_used + 1]
    return pools[0], pools[1], page_table


def stored_rows(pages, page_table, n_rows):
    """pages -> their rows 0 .. n_rows-1 as [n_rows, n_kv, row_width]."""
    r = np.arange(n_rows)
    return pages[page_table[r // pages.shape[2]], :, r % pages.shape[2]]


def awkward_rows(rng, n, width):
    """f32 [n, width]: normal rows, then (as far as n goes) the cases ggml's rounding is
    picky about."""
    x = rng.standard_normal((max(n, 7), width)).astype(np.float32)
    x[0] = 0.0                                          # zero block: d = 0, inverse 0
    x[1] *= np.float32(1e-6)                            # subnormal f16 scale
    x[2] *= np.float32(300.0)
    x[3, :] = np.float32(0.5)                           # every value a tie
    x[4] = np.round(x[4] * 8) / 8                       # many exact halves after scaling
    x[5, ::32] = np.float32(127.0)                      # amax 127: d = 1, x * id exact
    x[5, 1::32] = np.float32(0.49999997)               # roundf 0, trunc(v + 0.5) would give 1
    x[5, 2::32] = np.float32(-2.5)
    x[6, ::32] = np.float32(-8.0)                       # q4_0: the signed max picks -8
    x[6, 1::32] = np.float32(8.0)
    return x[rng.permutation(len(x))[:n]] if n < 7 else x


@pytest.mark.parametrize("dtype", ["q8_0", "q4_0"])
@pytest.mark.parametrize("n_kv,head_dim,page_size,start_row,n", [
    (3, 64, 16, 5, 40), (1, 256, 16, 0, 7), (2, 96, 64, 70, 1)])
def test_kv_write_ggml_bytes(dtype, n_kv, head_dim, page_size, start_row, n):
    rng = np.random.default_rng(n + head_dim)
    fmt = KvFormat.get(dtype, head_dim)
    k_pages, v_pages, page_table = make_pool(rng, start_row + n, n_kv, page_size, head_dim, dtype, dtype)
    before = k_pages.copy()
    k = awkward_rows(rng, n, n_kv * head_dim)
    v = rng.standard_normal((n, n_kv * head_dim)).astype(np.float32)
    CPU.kv_write(k_pages, v_pages, page_table, k, v, start_row, dtype, dtype)
    rows = stored_rows(k_pages, page_table, start_row + n)
    np.testing.assert_array_equal(rows[start_row:], fmt.quantize(k.reshape(n, n_kv, head_dim)))
    np.testing.assert_array_equal(stored_rows(v_pages, page_table, start_row + n)[start_row:],
                                  fmt.quantize(v.reshape(n, n_kv, head_dim)))
    np.testing.assert_array_equal(rows[:start_row], stored_rows(before, page_table, start_row))


def test_kv_write_q8_0_round_half_away():
    """roundf, not trunc(v + 0.5): 0.49999997 * 1 rounds to 0, 2.5 to 3, -2.5 to -3."""
    x = np.zeros((1, 32), dtype=np.float32)
    x[0, :4] = [127.0, 0.49999997, 2.5, -2.5]
    k_pages, v_pages, page_table = make_pool(np.random.default_rng(0), 1, 1, 4, 32, "q8_0", "q8_0")
    CPU.kv_write(k_pages, v_pages, page_table, x, x, 0, "q8_0", "q8_0")
    row = k_pages[page_table[0], 0, 0]
    assert row[:2].view(np.float16)[0] == 1.0
    np.testing.assert_array_equal(row[2:6].view(np.int8), [127, 0, 3, -3])
    np.testing.assert_array_equal(row, KvFormat.get("q8_0", 32).quantize(x)[0])


@pytest.mark.parametrize("dtype", ["tq4", "tq3"])
@pytest.mark.parametrize("head_dim", [64, 256, 72])
def test_kv_write_tq_codes(dtype, head_dim):
    """Rotation and code assignment as KvFormat.quantize: codes may differ only where a
    rotated coordinate sits on a boundary to within summation order, the scale by 1 ulp."""
    rng = np.random.default_rng(head_dim)
    n, n_kv = 500, 2
    fmt = KvFormat.get(dtype, head_dim)
    k_pages, v_pages, page_table = make_pool(rng, n, n_kv, 64, head_dim, dtype, dtype)
    k = awkward_rows(rng, n, n_kv * head_dim)
    CPU.kv_write(k_pages, v_pages, page_table, k, k, 0, dtype, dtype)   # > 8 rows: parallel
    CPU.kv_write(k_pages, v_pages, page_table, k[:3], k[:3], 0, dtype, dtype)   # serial
    got = stored_rows(k_pages, page_table, n).reshape(n * n_kv, -1)
    want = fmt.quantize(k.reshape(n * n_kv, head_dim))
    np.testing.assert_array_equal(got, stored_rows(v_pages, page_table, n).reshape(n * n_kv, -1))
    sg, sw = got[:, :2].copy().view(np.float16)[:, 0], want[:, :2].copy().view(np.float16)[:, 0]
    ulp = np.abs(sg.view(np.int16).astype(np.int32) - sw.view(np.int16).astype(np.int32))
    assert ulp.max() <= 1 and (ulp > 0).mean() < 0.01
    bits = {"tq4": 4, "tq3": 3}[dtype]
    from backends.kvformat import _unpack
    codes_got = _unpack(got[:, 2:], bits, head_dim)
    codes_want = _unpack(want[:, 2:], bits, head_dim)
    differ = codes_got != codes_want
    assert differ.mean() < 1e-3
    assert np.all(np.abs(codes_got.astype(int) - codes_want)[differ] == 1)   # neighbours only
    # and what attention reads is (all but) the same
    assert nmse(fmt.dequantize(got), fmt.dequantize(want)) < 1e-5


def test_alloc_kv_pool_formats():
    for dtypes in ("bf16", "q8_0", "tq3", "q8_0/tq4", "bf16/q4_0"):
        k_dtype, v_dtype = parse_kv_dtype(dtypes)
        kp, vp = CPU.alloc_kv_pool(5, 3, 16, 64, k_dtype, v_dtype)
        for pages, dtype in ((kp, k_dtype), (vp, v_dtype)):
            fmt = KvFormat.get(dtype, 64)
            assert pages.shape == fmt.page_shape(5, 3, 16) and pages.dtype == fmt.storage
    assert CpuBackend.kv_dtypes == KV_DTYPES
    with pytest.raises(ConfigError):
        CPU.alloc_kv_pool(5, 3, 16, 64, "q5_k", "bf16")


# -- attention -----------------------------------------------------------------------
def read_rows_f64(pages, page_table, rows, dtype, head_dim):
    """Dequantized f64 [n_kv, len(rows), head_dim] through KvFormat alone."""
    rows = np.asarray(rows)
    stored = pages[page_table[rows // pages.shape[2]], :, rows % pages.shape[2]]
    return KvFormat.get(dtype, head_dim).dequantize(stored).astype(np.float64).transpose(1, 0, 2)


def attention_f64(q, k_pages, v_pages, page_table, query_rows, n_q, scale, window, k_dtype, v_dtype):
    """f64 softmax attention of each query over its visible rows, read one by one."""
    n, hd = q.shape[0], q.shape[1] // n_q
    group = n_q // k_pages.shape[1]
    out = np.empty((n, n_q, hd))
    for t, r in enumerate(query_rows):
        rows = np.arange(max(0, r - window + 1) if window else 0, r + 1)
        keys = read_rows_f64(k_pages, page_table, rows, k_dtype, hd)
        values = read_rows_f64(v_pages, page_table, rows, v_dtype, hd)
        for h in range(n_q):
            logits = keys[h // group] @ q[t, h * hd:(h + 1) * hd].astype(np.float64) * scale
            p = np.exp(logits - logits.max())
            out[t, h] = (p / p.sum()) @ values[h // group]
    return out.reshape(n, n_q * hd)


def filled(rng, n_rows, n_q, n_kv, head_dim, page_size, k_dtype, v_dtype, poison_lo=0):
    """Pools holding rows 0..n_rows-1 written by the CPU kernel; rows below poison_lo
    poisoned again (a sliding-window layer's dropped rows)."""
    k_pages, v_pages, page_table = make_pool(rng, n_rows, n_kv, page_size, head_dim, k_dtype, v_dtype)
    k = (rng.standard_normal((n_rows, n_kv * head_dim)) * 2).astype(np.float32)
    v = rng.standard_normal((n_rows, n_kv * head_dim)).astype(np.float32)
    CPU.kv_write(k_pages, v_pages, page_table, k, v, 0, k_dtype, v_dtype)
    r = np.arange(poison_lo)
    for pages in (k_pages, v_pages):
        pages[page_table[r // page_size], :, r % page_size] = POISON[pages.dtype]
    return k_pages, v_pages, page_table


KV_PAIRS = [(d, d) for d in QUANT] + [("q8_0", "tq4"), ("bf16", "q4_0"), ("tq3", "bf16")]
SHAPES = [(9, 3, 64, 16), (4, 1, 256, 64)]           # default model; Gemma 3 (GQA 4/1 x 256)


@pytest.mark.parametrize("k_dtype,v_dtype", KV_PAIRS)
@pytest.mark.parametrize("n_q,n_kv,head_dim,page_size", SHAPES)
@pytest.mark.parametrize("n_rows,window", [(1, 0), (37, 0), (300, 0), (3000, 0), (3000, 700),
                                           (2000, 1500)])
def test_attention_decode(k_dtype, v_dtype, n_q, n_kv, head_dim, page_size, n_rows, window):
    """Serial (<= 1024 rows) and parallel paths, with and without a sliding window."""
    rng = np.random.default_rng(n_rows + head_dim + window)
    lo = max(0, n_rows - window) if window else 0
    k_pages, v_pages, page_table = filled(rng, n_rows, n_q, n_kv, head_dim, page_size,
                                          k_dtype, v_dtype, poison_lo=lo)
    q = rng.standard_normal((1, n_q * head_dim)).astype(np.float32)
    scale = 1.0 / math.sqrt(head_dim)
    out = np.zeros_like(q)
    CPU.attention_decode(q, k_pages, v_pages, page_table, n_rows, n_q, scale, out, window,
                         k_dtype, v_dtype)
    want = attention_f64(q, k_pages, v_pages, page_table, [n_rows - 1], n_q, scale, window,
                         k_dtype, v_dtype)
    assert nmse(out, want) < TOL_ATTN


@pytest.mark.parametrize("k_dtype,v_dtype", KV_PAIRS)
@pytest.mark.parametrize("n_q,n_kv,head_dim,page_size", SHAPES)
@pytest.mark.parametrize("start_row,n,window", [
    (0, 7, 0), (37, 7, 0), (600, 1, 64),            # numba kernel (< 32 queries)
    (5, 40, 0), (700, 300, 0),                      # BLAS: several dequantized tiles
    (700, 300, 64), (300, 64, 512)])                # BLAS with a window: several query blocks
def test_attention_prefill(k_dtype, v_dtype, n_q, n_kv, head_dim, page_size, start_row, n, window):
    rng = np.random.default_rng(start_row * 31 + n + head_dim + window)
    n_rows = start_row + n
    lo = max(0, start_row - window + 1) if window else 0
    k_pages, v_pages, page_table = filled(rng, n_rows, n_q, n_kv, head_dim, page_size,
                                          k_dtype, v_dtype, poison_lo=lo)
    q = rng.standard_normal((n, n_q * head_dim)).astype(np.float32)
    scale = 1.0 / math.sqrt(head_dim)
    out = np.zeros_like(q)
    CPU.attention_prefill(q, k_pages, v_pages, page_table, start_row, n_q, scale, out, window,
                          k_dtype, v_dtype)
    want = attention_f64(q, k_pages, v_pages, page_table, start_row + np.arange(n), n_q, scale,
                         window, k_dtype, v_dtype)
    assert nmse(out, want) < TOL_ATTN


@pytest.mark.parametrize("k_dtype", QUANT)
@pytest.mark.parametrize("n_q,n_kv,head_dim,page_size,n_rows,window", [
    (9, 3, 64, 16, 300, 8), (4, 1, 256, 64, 700, 32), (9, 3, 64, 16, 7, 7)])
def test_snapkv_votes(k_dtype, n_q, n_kv, head_dim, page_size, n_rows, window):
    rng = np.random.default_rng(n_rows + window)
    k_pages, _, page_table = filled(rng, n_rows, n_q, n_kv, head_dim, page_size, k_dtype, "bf16")
    q_window = rng.standard_normal((n_q, window, head_dim)).astype(np.float32)
    scale = 1.0 / math.sqrt(head_dim)
    got = CPU.snapkv_votes(q_window, k_pages, page_table, n_rows, scale, k_dtype)
    keys = read_rows_f64(k_pages, page_table, np.arange(n_rows), k_dtype, head_dim)
    prefix = n_rows - window
    want = np.zeros((n_kv, prefix))
    visible = np.arange(n_rows)[None, :] <= (prefix + np.arange(window))[:, None]
    for h in range(n_q):
        logits = np.where(visible, q_window[h].astype(np.float64) @ keys[h // (n_q // n_kv)].T * scale,
                          -np.inf)
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        want[h // (n_q // n_kv)] += (p / p.sum(axis=1, keepdims=True))[:, :prefix].sum(axis=0)
    assert got.shape == want.shape and got.dtype == np.float32
    if want.size:
        assert nmse(got, want) < TOL_ATTN


# -- moving rows ---------------------------------------------------------------------
@pytest.mark.parametrize("k_dtype,v_dtype", [("q8_0", "q8_0"), ("q4_0", "tq3"), ("tq4", "bf16")])
def test_kv_gather_and_copy_pages(k_dtype, v_dtype):
    """Compacting a quantized cache moves whole rows (scales with them), so it equals
    quantizing the compacted f32 rows; K and V rows may differ in width."""
    rng = np.random.default_rng(7)
    n_kv, hd, ps, n_rows, n_keep = 3, 64, 16, 100, 37
    k_pages, v_pages, page_table = make_pool(rng, n_rows, n_kv, ps, hd, k_dtype, v_dtype)
    k = rng.standard_normal((n_rows, n_kv * hd)).astype(np.float32)
    v = rng.standard_normal((n_rows, n_kv * hd)).astype(np.float32)
    CPU.kv_write(k_pages, v_pages, page_table, k, v, 0, k_dtype, v_dtype)
    keep = np.array([np.concatenate([np.sort(rng.choice(n_rows - 4, n_keep - 4, replace=False)),
                                     np.arange(n_rows - 4, n_rows)]) for _ in range(n_kv)])
    untouched = stored_rows(k_pages, page_table, n_rows)[n_keep:]
    CPU.kv_gather(k_pages, v_pages, page_table, keep)
    for pages, x, dtype in ((k_pages, k, k_dtype), (v_pages, v, v_dtype)):
        fmt = KvFormat.get(dtype, hd)
        rows = stored_rows(pages, page_table, n_rows)
        for h in range(n_kv):
            np.testing.assert_array_equal(rows[:n_keep, h], fmt.quantize(x[keep[h], h * hd:(h + 1) * hd]))
    np.testing.assert_array_equal(stored_rows(k_pages, page_table, n_rows)[n_keep:], untouched)
    dst_k, dst_v = np.zeros_like(k_pages), np.zeros_like(v_pages)
    pages = page_table[:3]
    CPU.kv_copy_pages(k_pages, v_pages, dst_k, dst_v, pages)
    np.testing.assert_array_equal(dst_k[pages], k_pages[pages])
    np.testing.assert_array_equal(dst_v[pages], v_pages[pages])
    CPU.kv_copy_pages(dst_k, dst_v, dst_k, dst_v, pages[:1], pages[2:])      # within one pool, to another page
    np.testing.assert_array_equal(dst_k[pages[2]], k_pages[pages[0]])
    np.testing.assert_array_equal(dst_v[pages[2]], v_pages[pages[0]])
    np.testing.assert_array_equal(dst_k[pages[1]], k_pages[pages[1]])


@pytest.mark.parametrize("dtype", QUANT)
def test_decode_over_compacted_quantized_cache(dtype):
    """Eviction's invariant on quantized pages: attention over the gathered rows equals
    f64 attention over the full cache with the evicted rows masked."""
    rng = np.random.default_rng(11)
    n_q, n_kv, hd, ps, n_rows, n_keep = 9, 3, 64, 16, 1500, 1100      # > 1024 kept: parallel
    k_pages, v_pages, page_table = filled(rng, n_rows, n_q, n_kv, hd, ps, dtype, dtype)
    keys = read_rows_f64(k_pages, page_table, np.arange(n_rows), dtype, hd)
    values = read_rows_f64(v_pages, page_table, np.arange(n_rows), dtype, hd)
    keep = np.array([np.concatenate([np.sort(rng.choice(n_rows - 8, n_keep - 8, replace=False)),
                                     np.arange(n_rows - 8, n_rows)]) for _ in range(n_kv)])
    q = rng.standard_normal((1, n_q * hd)).astype(np.float32)
    want = np.empty((n_q, hd))
    for h in range(n_q):
        kv = h // (n_q // n_kv)
        logits = keys[kv, keep[kv]] @ q[0, h * hd:(h + 1) * hd].astype(np.float64) / 8.0
        p = np.exp(logits - logits.max())
        want[h] = (p / p.sum()) @ values[kv, keep[kv]]
    CPU.kv_gather(k_pages, v_pages, page_table, keep)
    out = np.zeros_like(q)
    CPU.attention_decode(q, k_pages, v_pages, page_table, n_keep, n_q, 1 / 8.0, out, 0, dtype, dtype)
    assert nmse(out.reshape(n_q, hd), want) < TOL_ATTN


# -- other CPUs ----------------------------------------------------------------------
@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 targets")
@pytest.mark.parametrize("target", ["avx2", "sse2"])
def test_other_x86_targets(target, tmp_path):
    """kvsimd's codebook lookup and f16 scales have three code paths (AVX-512 vpermps,
    AVX2 ymm vpermps, a select tree; F16C or integer f16): rerun the f16, dequantization
    and kv_write tests compiled for an AVX2 CPU and for baseline x86-64 (the rest
    of the kernels is plain numba, the same source on every target). A target whose
    paths are this CPU's own is skipped: the whole suite has just run them."""
    from backends.cpu import kvsimd
    if target == "avx2" and kvsimd.HAVE_AVX2 and kvsimd.HAVE_F16C and not kvsimd.HAVE_AVX512F:
        pytest.skip("this CPU is AVX2 + F16C without AVX-512: the suite already ran these paths")
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path), **TARGETS[target])
    check = ("from backends.cpu import kvsimd as S; "
             "print(S.HAVE_AVX512F, S.HAVE_AVX2, S.HAVE_F16C)")
    r = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == {"avx2": ["False", "True", "True"], "sse2": ["False", "False", "False"]}[target]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                        "-k", "test_f16 or test_f32_to_f16 or test_dequant or test_kv_write",
                        __file__], env=env, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "failed" not in r.stdout
