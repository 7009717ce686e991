"""Prefill attention through BLAS: for each KV head, the scores of the group's
queries against all visible rows are one sgemm, the causal softmax runs in
place in numba, and the weighted sum of V is a second sgemm.

Same contract as ops.attention_prefill; used for chunks of at least
BLAS_MIN_QUERIES queries, where sgemm (tens of GFLOP/s per core) beats the
tiled numba kernel. Transient memory: group*n x rows f32 scores per KV head.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .ops import _JIT, _bf16_to_f32, _exp_f32

BLAS_MIN_QUERIES = 32


@njit(parallel=True, **_JIT)
def _gather_f32(pages, page_table, n_rows, out):
    """bf16 pages [n_pages, n_kv_heads, page_size, head_dim] -> out f32 [n_kv_heads, n_rows, head_dim]."""
    n_kv_heads, page_size, head_dim = pages.shape[1], pages.shape[2], pages.shape[3]
    for r in prange(n_rows):
        page = page_table[r // page_size]
        off = r % page_size
        for h in range(n_kv_heads):
            src = pages[page, h, off]
            for i in range(head_dim):
                out[h, r, i] = _bf16_to_f32(src[i])


@njit(parallel=True, **_JIT)
def _causal_softmax(s, n, start_row, scale):
    """s f32 [group*n, rows] scores of query vectors a = g*n + t (query t sees rows
    0 .. start_row+t) -> softmax probabilities in place (masked entries 0)."""
    rows = s.shape[1]
    for a in prange(s.shape[0]):
        last = start_row + a % n
        row = s[a]
        m = np.float32(-np.inf)
        for j in range(last + 1):
            v = row[j] * scale
            row[j] = v
            m = max(m, v)
        total = np.float32(0.0)
        for j in range(last + 1):
            e = _exp_f32(row[j] - m)
            row[j] = e
            total += e
        inv = np.float32(1.0) / total
        for j in range(last + 1):
            row[j] *= inv
        for j in range(last + 1, rows):
            row[j] = 0.0


def attention_prefill(q, k_pages, v_pages, page_table, start_row, n_q_heads, scale, out):
    """q, out: f32 [n, n_q_heads*head_dim]; query i sees physical rows 0 .. start_row+i."""
    n = q.shape[0]
    n_kv_heads, head_dim = k_pages.shape[1], k_pages.shape[3]
    group = n_q_heads // n_kv_heads
    n_rows = start_row + n
    k = np.empty((n_kv_heads, n_rows, head_dim), dtype=np.float32)   # [kv, rows, d]
    v = np.empty_like(k)
    _gather_f32(k_pages, page_table, n_rows, k)
    _gather_f32(v_pages, page_table, n_rows, v)
    scores = np.empty((group * n, n_rows), dtype=np.float32)          # [group*n, rows]
    for h in range(n_kv_heads):
        cols = slice(h * group * head_dim, (h + 1) * group * head_dim)
        qg = q[:, cols].reshape(n, group, head_dim).transpose(1, 0, 2).reshape(group * n, head_dim)
        np.matmul(qg, k[h].T, out=scores)
        _causal_softmax(scores, n, start_row, np.float32(scale))
        og = scores @ v[h]                                              # [group*n, d]
        out[:, cols] = og.reshape(group, n, head_dim).transpose(1, 0, 2).reshape(n, group * head_dim)
