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
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .ops import _JIT, _bf16_to_f32, _exp_f32

BLAS_MIN_QUERIES = 32
WINDOW_BLOCK_MIN = 128     # with a window: at least this many queries per sgemm block


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
def _masked_softmax(s, n, last0, window, scale):
    """s f32 [group*n, cols] scores of query vectors a = g*n + t; query t sees columns
    first .. last0 + t, first = max(0, last0 + t - window + 1) (0 when window is 0)
    -> softmax probabilities in place (masked entries 0)."""
    cols = s.shape[1]
    for a in prange(s.shape[0]):
        last = last0 + a % n
        first = 0
        if window > 0:
            first = max(0, last - window + 1)
        row = s[a]
        for j in range(first):
            row[j] = 0.0
        m = np.float32(-np.inf)
        for j in range(first, last + 1):
            v = row[j] * scale
            row[j] = v
            m = max(m, v)
        total = np.float32(0.0)
        for j in range(first, last + 1):
            e = _exp_f32(row[j] - m)
            row[j] = e
            total += e
        inv = np.float32(1.0) / total
        for j in range(first, last + 1):
            row[j] *= inv
        for j in range(last + 1, cols):
            row[j] = 0.0


def window_block(window: int) -> int:
    """Queries per sgemm block with a sliding window: window/4 (each query then scores
    1.25 * window rows, a quarter of them masked) but at least WINDOW_BLOCK_MIN, below
    which the sgemms get too thin. Measured (2 shared cores, noisy) on 1024-query
    chunks at row 8192, windows 512 and 1024, GQA 4/1x256, 9/3x64, 32/8x128: 1.0-1.7x
    faster than block = window, and mostly faster than the tiled numba kernel."""
    return max(window // 4, WINDOW_BLOCK_MIN)


def attention_prefill(q, k_pages, v_pages, page_table, start_row, n_q_heads, scale, out,
                      window=0):
    """q, out: f32 [n, n_q_heads*head_dim]; query i sees physical rows 0 .. start_row+i,
    or with window > 0 rows max(0, start_row+i-window+1) .. start_row+i."""
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
    block = n if window <= 0 else window_block(window)
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
            _masked_softmax(scores, nb, start_row + b0 - row_lo - r0, window, scale)
            og = scores @ v[h, r0:r1]                                    # [group*nb, d]
            out[b0:b0 + nb, cols] = og.reshape(group, nb, head_dim).transpose(1, 0, 2).reshape(
                nb, group * head_dim)
