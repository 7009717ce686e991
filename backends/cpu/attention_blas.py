"""Prefill attention through BLAS: for each KV head, the scores of the group's
queries against all visible rows are one sgemm, the masked softmax runs in
place in numba, and the weighted sum of V is a second sgemm.

Same contract as ops.attention_prefill; used for chunks of at least
BLAS_MIN_QUERIES queries, where sgemm (tens of GFLOP/s per core) beats the
tiled numba kernel. Transient memory: group*n x rows f32 scores per KV head.

Sliding window (window > 0): the chunk's queries go in blocks (window_block);
a block's sgemms cover only the rows its queries can see (block + window - 1 of
them), so a long chunk costs O(n * window), not O(n^2), and rows below the
first query's window are never gathered.

Quantized KV rows (any k_dtype / v_dtype but bf16/bf16) never expand into a
full-precision copy of the cache: per KV head the visible rows go in tiles of
QUANT_TILE_ROWS, each dequantized into an f32 scratch tile (kvquant.dequant_rows;
tq in its rotated basis, with the queries rotated once per chunk and the outputs
rotated back once), scored by one sgemm, folded into a running (max, sum, acc)
per query (flash-attention's online softmax, in numba) and summed into acc by a
second sgemm. Transient memory: two tiles plus group*n x QUANT_TILE_ROWS scores.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import kvquant
from .jit import _JIT, _bf16_to_f32, _exp_f32
from .kvquant import RowFormat

BLAS_MIN_QUERIES = 32
WINDOW_BLOCK_MIN = 128     # with a window: at least this many queries per sgemm block
SCORES_BYTES = 32 << 20    # without a window: queries per sgemm block so that one block's
                           # scores stay below this (a 512-query chunk at 32K rows would
                           # otherwise hold 256 MiB of scores for Gemma 3's 4 query heads)
FULL_BLOCK_MIN = 16        # fewer queries than this make the sgemms too thin
QUANT_TILE_ROWS = 512      # rows per dequantized tile (quantized KV)


@njit(parallel=True, **_JIT)
def _gather_f32(pages, page_table, row_lo, row_hi, out):
    """bf16 pages [n_pages, n_kv_heads, page_size, head_dim], rows row_lo .. row_hi-1
    -> out f32 [n_kv_heads, row_hi - row_lo, head_dim]."""
    n_kv_heads, page_size, head_dim = pages.shape[1], pages.shape[2], pages.shape[3]
    for j in prange(row_hi - row_lo):
        r = row_lo + j
        page = page_table[r // page_size]
        off = r % page_size
        for h in range(n_kv_heads):
            src = pages[page, h, off]
            for i in range(head_dim):
                out[h, j, i] = _bf16_to_f32(src[i])


# The row loops below run over views that start at 0 (row[first:last+1]): indexed
# from a signed `first`, numba's negative-index wraparound kept LLVM from
# vectorising them (5.7x slower on an AVX2 EPYC, measured on 1536 x 8192 scores).
@njit(inline="always", **_JIT)
def _scale_max(x, scale):
    """x *= scale in place -> max(x) (-inf when empty)."""
    m = np.float32(-np.inf)
    for j in range(x.size):
        v = x[j] * scale
        x[j] = v
        m = max(m, v)
    return m


@njit(inline="always", **_JIT)
def _exp_sum(x, m):
    """x = exp(x - m) in place -> sum(x)."""
    total = np.float32(0.0)
    for j in range(x.size):
        e = _exp_f32(x[j] - m)
        x[j] = e
        total += e
    return total


@njit(parallel=True, **_JIT)
def _masked_softmax(s, n, last0, window, scale):
    """s f32 [group*n, cols] scores of query vectors a = g*n + t; query t sees columns
    first .. last0 + t, first = max(0, last0 + t - window + 1) (0 when window is 0)
    -> softmax probabilities in place (masked entries 0)."""
    for a in prange(s.shape[0]):
        last = last0 + a % n
        first = max(0, last - window + 1) if window > 0 else 0
        row = s[a]
        row[:first] = 0.0
        row[last + 1:] = 0.0
        vis = row[first:last + 1]
        m = _scale_max(vis, scale)
        inv = np.float32(1.0) / _exp_sum(vis, m)
        for j in range(vis.size):
            vis[j] *= inv


def window_block(window: int) -> int:
    """Queries per sgemm block with a sliding window: window/4 (each query then scores
    1.25 * window rows, a quarter of them masked) but at least WINDOW_BLOCK_MIN, below
    which the sgemms get too thin. Measured (2 shared cores, noisy) on 1024-query
    chunks at row 8192, windows 512 and 1024, GQA 4/1x256, 9/3x64, 32/8x128: 1.0-1.7x
    faster than block = window, and mostly faster than the tiled numba kernel."""
    return max(window // 4, WINDOW_BLOCK_MIN)


def _add_bias(scores, row_bias, h, row0, scale):
    """Raw scores [.., cols] of rows row0 .. : + row_bias[h, row] / scale on the biased
    rows, so that the softmax's scale * score carries the bias exactly once."""
    if row_bias is None:
        return
    n = min(scores.shape[1], row_bias.shape[1] - row0)
    if n > 0:
        scores[:, :n] += row_bias[h, row0:row0 + n] / scale


def attention_prefill(q, k_pages, v_pages, page_table, start_row, n_q_heads, scale, out,
                      window=0, k_dtype="bf16", v_dtype="bf16", row_bias=None):
    """q, out: f32 [n, n_q_heads*head_dim]; query i sees physical rows 0 .. start_row+i,
    or with window > 0 rows max(0, start_row+i-window+1) .. start_row+i. row_bias: None
    or f32 [n_kv_heads, n_bias], added to the scaled scores of rows 0 .. n_bias-1."""
    if k_dtype != "bf16" or v_dtype != "bf16":
        head_dim = q.shape[1] // n_q_heads
        _prefill_tiled(q, k_pages, v_pages, page_table, start_row, n_q_heads, scale, out,
                       int(window), RowFormat.get(k_dtype, head_dim), RowFormat.get(v_dtype, head_dim),
                       row_bias)
        return
    n = q.shape[0]
    n_kv_heads, head_dim = k_pages.shape[1], k_pages.shape[3]
    group = n_q_heads // n_kv_heads
    window = int(window)
    n_rows = start_row + n

    def first_row(t):                    # first row visible to query t of the chunk
        return max(0, start_row + t - window + 1) if window > 0 else 0

    row_lo = first_row(0)
    k = np.empty((n_kv_heads, n_rows - row_lo, head_dim), dtype=np.float32)   # [kv, rows, d]
    v = np.empty_like(k)
    _gather_f32(k_pages, page_table, row_lo, n_rows, k)
    _gather_f32(v_pages, page_table, row_lo, n_rows, v)
    if window > 0:
        block = window_block(window)
    else:                                # causal: a block also skips the rows after its last query
        block = max(FULL_BLOCK_MIN, min(n, SCORES_BYTES // (4 * group * n_rows)))
    scale = np.float32(scale)
    for b0 in range(0, n, block):
        nb = min(block, n - b0)
        r0 = first_row(b0) - row_lo                                    # block's rows in k, v
        r1 = start_row + b0 + nb - row_lo
        scores = np.empty((group * nb, r1 - r0), dtype=np.float32)     # [group*nb, rows]
        for h in range(n_kv_heads):
            cols = slice(h * group * head_dim, (h + 1) * group * head_dim)
            qg = q[b0:b0 + nb, cols].reshape(nb, group, head_dim).transpose(1, 0, 2)
            np.matmul(qg.reshape(group * nb, head_dim), k[h, r0:r1].T, out=scores)
            _add_bias(scores, row_bias, h, row_lo + r0, scale)
            _masked_softmax(scores, nb, start_row + b0 - row_lo - r0, window, scale)
            og = scores @ v[h, r0:r1]                                    # [group*nb, d]
            out[b0:b0 + nb, cols] = og.reshape(group, nb, head_dim).transpose(1, 0, 2).reshape(
                nb, group * head_dim)


# -- quantized KV: dequantized tiles, online softmax ---------------------------------
@njit(parallel=True, **_JIT)
def _dequant_tile(pages, page_table, kv, row_lo, n, tag, cb, out):
    """Rows row_lo .. row_lo+n-1 of kv head `kv` -> out f32 [>= n, head_dim] (tq rows in
    their rotated basis, storage order), a page's run of rows per task."""
    page_size = pages.shape[2]
    head_dim = out.shape[1]
    p0 = row_lo // page_size
    for p in prange(p0, (row_lo + n - 1) // page_size + 1):
        lo = max(row_lo, p * page_size)
        hi = min(row_lo + n, (p + 1) * page_size)
        kvquant.dequant_rows(pages[page_table[p], kv], lo - p * page_size, hi - lo, tag, cb,
                             head_dim, out[lo - row_lo:hi - row_lo])


@njit(parallel=True, **_JIT)
def _online_softmax_tile(s, n, last0, c0, window, scale, m, l, alpha):
    """s f32 [group*n, tn]: raw scores of query vectors a = g*n + t against the tile's
    columns c0 .. c0+tn-1 (columns counted from the block's first row); query t sees
    columns max(0, last0+t-window+1) (0 without a window) .. last0+t. In place:
    s -> exp(scale*s - m_new) on visible columns, 0 elsewhere; m, l [group*n] move to
    the new running max and sum; alpha [group*n] = exp(m_old - m_new), the factor for acc."""
    tn = s.shape[1]
    for a in prange(s.shape[0]):
        last = last0 + a % n
        first = max(0, last - window + 1) if window > 0 else 0
        j0 = max(first - c0, 0)
        j1 = min(last - c0 + 1, tn)
        row = s[a]
        if j1 <= j0:                           # nothing visible in this tile
            for j in range(tn):
                row[j] = 0.0
            alpha[a] = 1.0
            continue
        vis = row[j0:j1]
        m_new = max(m[a], _scale_max(vis, scale))
        alpha[a] = _exp_f32(m[a] - m_new)
        total = _exp_sum(vis, m_new)
        row[:j0] = 0.0
        row[j1:] = 0.0
        l[a] = l[a] * alpha[a] + total
        m[a] = m_new


def _prefill_tiled(q, k_pages, v_pages, page_table, start_row, n_q_heads, scale, out, window,
                   kf: RowFormat, vf: RowFormat, row_bias=None):
    n = q.shape[0]
    n_kv_heads, head_dim = k_pages.shape[1], kf.head_dim
    group = n_q_heads // n_kv_heads
    scale = np.float32(scale)

    def first_row(t):                    # first row visible to query t of the chunk
        return max(0, start_row + t - window + 1) if window > 0 else 0

    block = n if window <= 0 else window_block(window)
    k_tile = np.empty((QUANT_TILE_ROWS, head_dim), dtype=np.float32)
    v_tile = np.empty((QUANT_TILE_ROWS, head_dim), dtype=np.float32)
    for b0 in range(0, n, block):
        nb = min(block, n - b0)
        r0 = first_row(b0)                                             # rows r0 .. r1-1
        r1 = start_row + b0 + nb
        nv = group * nb
        m = np.full(nv, -np.inf, dtype=np.float32)
        l = np.zeros(nv, dtype=np.float32)
        alpha = np.empty(nv, dtype=np.float32)
        acc = np.empty((nv, head_dim), dtype=np.float32)
        pv = np.empty((nv, head_dim), dtype=np.float32)
        scores = np.empty((nv, QUANT_TILE_ROWS), dtype=np.float32)
        for h in range(n_kv_heads):
            cols = slice(h * group * head_dim, (h + 1) * group * head_dim)
            qg = q[b0:b0 + nb, cols].reshape(nb, group, head_dim).transpose(1, 0, 2).reshape(nv, head_dim)
            if kf.rotated:                                             # into the keys' basis
                qg = qg @ kf.rot.T
            qg = np.ascontiguousarray(qg, dtype=np.float32)
            m.fill(-np.inf)
            l.fill(0.0)
            acc.fill(0.0)
            for t0 in range(r0, r1, QUANT_TILE_ROWS):
                tn = min(QUANT_TILE_ROWS, r1 - t0)
                _dequant_tile(k_pages, page_table, h, t0, tn, kf.tag, kf.codebook, k_tile)
                _dequant_tile(v_pages, page_table, h, t0, tn, vf.tag, vf.codebook, v_tile)
                s = scores.reshape(-1)[:nv * tn].reshape(nv, tn)        # contiguous
                np.matmul(qg, k_tile[:tn].T, out=s)
                _add_bias(s, row_bias, h, t0, scale)
                _online_softmax_tile(s, nb, start_row + b0 - r0, t0 - r0, window, scale, m, l, alpha)
                np.matmul(s, v_tile[:tn], out=pv)
                acc *= alpha[:, None]
                acc += pv
            og = acc / l[:, None]                                      # [group*nb, d]
            if vf.rotated:                                             # back from the values' basis
                og = og @ vf.rot
            out[b0:b0 + nb, cols] = og.reshape(group, nb, head_dim).transpose(1, 0, 2).reshape(
                nb, group * head_dim)
