"""Prefill attention through BLAS: per KV head the scores of the group's queries
against the visible rows are an sgemm, the masked softmax runs in numba (its passes
as 16-wide vector code, vrow), and the weighted sum of V is a second sgemm.

Same contract as ops.attention_prefill; used for chunks of at least
BLAS_MIN_QUERIES queries, where sgemm (tens of GFLOP/s per core) beats the
tiled numba kernel.

Causal (no window), bf16 rows: the rows are gathered to f32 once per chunk, then
flash-attention's loop: blocks of about FLASH_VECTORS query vectors (a KV head's
group of queries), each against tiles of FLASH_ROWS rows, the tile's scores (1 MiB)
staying in L2 and a running (max, sum, acc) per query vector (online softmax). At
16K rows that is 1.5x faster than one block's scores for all rows, whose 100+ MiB
went to memory five times. Transient memory: the f32 rows of the chunk's K and V.

Sliding window (window > 0): the chunk's queries go in blocks (window_block);
a block's sgemms cover only the rows its queries can see (block + window - 1 of
them), so a long chunk costs O(n * window), not O(n^2), and rows below the
first query's window are never gathered.

Quantized KV rows (any k_dtype / v_dtype but bf16/bf16) never expand into a
full-precision copy of the cache: per KV head the visible rows go in tiles of
QUANT_TILE_ROWS, each dequantized into an f32 scratch tile (kvquant.dequant_rows;
tq in its rotated basis, with the queries rotated once per chunk and the outputs
rotated back once), for all the block's queries at once, with the same online
softmax. Transient memory: two tiles plus group*n x QUANT_TILE_ROWS scores.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import kvquant
from .jit import _JIT, _bf16_to_f32, _exp_f32
from .kvquant import RowFormat
from .vrow import exp_sum_row, scaled_max

BLAS_MIN_QUERIES = 32
WINDOW_BLOCK_MIN = 128     # with a window: at least this many queries per sgemm block
FLASH_VECTORS = 256        # causal bf16: query vectors (queries x group) per block, at least
FLASH_MIN_QUERIES = 16     # ... this many queries (fewer make the sgemms too thin)
FLASH_ROWS = 1024          # ... rows per tile: 256 x 1024 f32 scores = 1 MiB, in L2
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


@njit(parallel=True, **_JIT)
def _masked_softmax(s, n, last0, window, scale, inv):
    """s f32 [group*n, cols] raw scores of query vectors a = g*n + t; query t sees columns
    first .. last0 + t, first = max(0, last0 + t - window + 1) (0 when window is 0)
    -> s = exp(scale * s - max) on visible columns, 0 elsewhere; inv[a] = 1 / their sum
    (the caller scales the weighted sum of V: one pass over the scores fewer)."""
    for a in prange(s.shape[0]):
        last = last0 + a % n
        first = max(0, last - window + 1) if window > 0 else 0
        row = s[a]
        row[:first] = 0.0
        row[last + 1:] = 0.0
        m = scaled_max(row, first, last + 1, scale)
        inv[a] = np.float32(1.0) / exp_sum_row(row, first, last + 1, scale, m)


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
    window = int(window)
    if k_dtype != "bf16" or v_dtype != "bf16":
        head_dim = q.shape[1] // n_q_heads
        _prefill_tiled(q, k_pages, v_pages, page_table, start_row, n_q_heads, scale, out, window,
                       RowFormat.get(k_dtype, head_dim), RowFormat.get(v_dtype, head_dim), row_bias)
        return
    n = q.shape[0]
    n_kv_heads, head_dim = k_pages.shape[1], k_pages.shape[3]
    group = n_q_heads // n_kv_heads
    n_rows = start_row + n
    row_lo = max(0, start_row - window + 1) if window > 0 else 0    # first row any query sees
    k = np.empty((n_kv_heads, n_rows - row_lo, head_dim), dtype=np.float32)   # [kv, rows, d]
    v = np.empty_like(k)
    _gather_f32(k_pages, page_table, row_lo, n_rows, k)
    _gather_f32(v_pages, page_table, row_lo, n_rows, v)
    scale = np.float32(scale)
    if window <= 0:
        block = max(FLASH_MIN_QUERIES, FLASH_VECTORS // group)
        _flash_blocks(q, lambda h, r0, rn: (k[h, r0:r0 + rn], v[h, r0:r0 + rn]), n_kv_heads, group,
                      head_dim, start_row, block, FLASH_ROWS, 0, scale, out, row_bias)
        return
    block = window_block(window)
    inv = np.empty(group * block, dtype=np.float32)
    for b0 in range(0, n, block):
        nb = min(block, n - b0)
        r0 = max(0, start_row + b0 - window + 1) - row_lo              # block's rows in k, v
        r1 = start_row + b0 + nb - row_lo
        scores = np.empty((group * nb, r1 - r0), dtype=np.float32)     # [group*nb, rows]
        for h in range(n_kv_heads):
            cols = slice(h * group * head_dim, (h + 1) * group * head_dim)
            np.matmul(_group_queries(q, b0, nb, cols, group, head_dim), k[h, r0:r1].T, out=scores)
            _add_bias(scores, row_bias, h, row_lo + r0, scale)
            _masked_softmax(scores, nb, start_row + b0 - row_lo - r0, window, scale, inv)
            og = scores @ v[h, r0:r1]                                    # [group*nb, d]
            og *= inv[:group * nb, None]
            _scatter_queries(out, og, b0, nb, cols, group, head_dim)


def _group_queries(q, b0, nb, cols, group, head_dim):
    """Queries b0 .. b0+nb-1 of one KV head's group (q[:, cols]) as query vectors
    a = g * nb + t: f32 [group*nb, head_dim]."""
    return q[b0:b0 + nb, cols].reshape(nb, group, head_dim).transpose(1, 0, 2).reshape(group * nb, head_dim)


def _scatter_queries(out, og, b0, nb, cols, group, head_dim):
    """_group_queries' inverse: og [group*nb, head_dim] -> out[b0:b0+nb, cols]."""
    out[b0:b0 + nb, cols] = og.reshape(group, nb, head_dim).transpose(1, 0, 2).reshape(nb, group * head_dim)


# -- online softmax over row tiles (causal bf16, quantized KV) -------------------------
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
        m_new = max(m[a], scaled_max(row, j0, j1, scale))
        alpha[a] = _exp_f32(m[a] - m_new)
        total = exp_sum_row(row, j0, j1, scale, m_new)
        row[:j0] = 0.0
        row[j1:] = 0.0
        l[a] = l[a] * alpha[a] + total
        m[a] = m_new


def _flash_blocks(q, tile, n_kv_heads, group, head_dim, start_row, block, tile_rows, window,
                  scale, out, row_bias, qmap=None, omap=None):
    """Online-softmax attention of the chunk's queries in blocks of `block`, each over
    its visible rows in tiles of tile_rows: tile(h, r0, rn) -> (K, V) f32 [rn, head_dim]
    of KV head h, rows r0 .. r0+rn-1. qmap / omap: None, or a matrix taking the group's
    query vectors into the keys' basis / the outputs back from the values'."""
    n = q.shape[0]
    nv_max = group * min(block, n)
    m = np.empty(nv_max, dtype=np.float32)
    l = np.empty(nv_max, dtype=np.float32)
    alpha = np.empty(nv_max, dtype=np.float32)
    acc = np.empty((nv_max, head_dim), dtype=np.float32)
    pv = np.empty((nv_max, head_dim), dtype=np.float32)
    scores = np.empty(nv_max * tile_rows, dtype=np.float32)
    for b0 in range(0, n, block):
        nb = min(block, n - b0)
        nv = group * nb
        r0 = max(0, start_row + b0 - window + 1) if window > 0 else 0     # rows r0 .. r1-1
        r1 = start_row + b0 + nb
        mb, lb, ab, accb, pvb = m[:nv], l[:nv], alpha[:nv], acc[:nv], pv[:nv]
        for h in range(n_kv_heads):
            cols = slice(h * group * head_dim, (h + 1) * group * head_dim)
            qg = _group_queries(q, b0, nb, cols, group, head_dim)
            if qmap is not None:
                qg = qg @ qmap
            qg = np.ascontiguousarray(qg, dtype=np.float32)
            mb.fill(-np.inf)
            lb.fill(0.0)
            accb.fill(0.0)
            for t0 in range(r0, r1, tile_rows):
                tn = min(tile_rows, r1 - t0)
                kt, vt = tile(h, t0, tn)
                s = scores[:nv * tn].reshape(nv, tn)                     # contiguous
                np.matmul(qg, kt.T, out=s)
                _add_bias(s, row_bias, h, t0, scale)
                _online_softmax_tile(s, nb, start_row + b0 - r0, t0 - r0, window, scale, mb, lb, ab)
                np.matmul(s, vt, out=pvb)
                accb *= ab[:, None]
                accb += pvb
            og = accb / lb[:, None]                                      # [group*nb, d]
            if omap is not None:
                og = og @ omap
            _scatter_queries(out, og, b0, nb, cols, group, head_dim)


# -- quantized KV: dequantized tiles ---------------------------------------------------
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


def _prefill_tiled(q, k_pages, v_pages, page_table, start_row, n_q_heads, scale, out, window,
                   kf: RowFormat, vf: RowFormat, row_bias=None):
    n_kv_heads, head_dim = k_pages.shape[1], kf.head_dim
    k_tile = np.empty((QUANT_TILE_ROWS, head_dim), dtype=np.float32)
    v_tile = np.empty((QUANT_TILE_ROWS, head_dim), dtype=np.float32)

    def tile(h, t0, tn):                 # each tile dequantized once for all the block's queries
        _dequant_tile(k_pages, page_table, h, t0, tn, kf.tag, kf.codebook, k_tile)
        _dequant_tile(v_pages, page_table, h, t0, tn, vf.tag, vf.codebook, v_tile)
        return k_tile[:tn], v_tile[:tn]

    block = q.shape[0] if window <= 0 else window_block(window)
    _flash_blocks(q, tile, n_kv_heads, n_q_heads // n_kv_heads, head_dim, start_row, block,
                  QUANT_TILE_ROWS, window, np.float32(scale), out, row_bias,
                  kf.rot.T if kf.rotated else None, vf.rot if vf.rotated else None)
