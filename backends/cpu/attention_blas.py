"""Prefill attention through BLAS, flash-attention's loop: per KV head the chunk's
queries go in blocks of about FLASH_VECTORS query vectors (the head's group of query
heads times the block's queries), each block over its visible rows in tiles
(tile_rows): a tile's scores are one sgemm, kept in L2 with its K and V rows; the
masked softmax folds them into a running (max, sum, acc) per query vector (online
softmax; its passes are 16-wide vector code, vrow) and the weighted sum of V is a
second sgemm.

Same contract as ops.attention_prefill; used for chunks of at least
BLAS_MIN_QUERIES queries, where sgemm (tens of GFLOP/s per core) beats the
tiled numba kernel.

The (KV head, block) items run on numba's thread count of Python threads, each
calling single-threaded sgemms (the GIL is released in them and in the nogil numba
steps) rather than the BLAS's threads and numba's parallel regions in turn, which
contended for the cores (the OpenMP workers spin between regions, see backend.py).
Measured with `engine bench` on 2 cores against one sgemm pair over all of a block's
rows (whose 100+ MiB of scores at 16K went to memory five times): Qwen2.5-Coder-0.5B
prefill at 8K 1.8x, Gemma 3 at 4K 1.35x.

bf16 rows are gathered to f32 once per chunk (transient memory: the K and V rows the
chunk sees, f32). Quantized rows (any k_dtype / v_dtype but bf16/bf16) never expand
into a full-precision copy of the cache: each item dequantizes its tiles into f32
scratch (kvquant.dequant_rows; tq in its rotated basis, with the queries rotated into
it and the outputs back).

Sliding window (window > 0): a block's tiles cover only the rows its queries can see
(block + window - 1 of them), so a long chunk costs O(n * window), not O(n^2), and
rows below the first query's window are never read.
"""
from __future__ import annotations

import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor, wait

import numba
import numpy as np
from numba import njit, prange

from . import kvquant
from .jit import _JIT, _bf16_to_f32, _exp_f32
from .kvquant import RowFormat
from .vrow import exp_sum_row, scaled_max

BLAS_MIN_QUERIES = 32
FLASH_VECTORS = 256        # query vectors (queries x group) per block, at most, but
FLASH_MIN_QUERIES = 16     # ... at least this many queries (fewer make the sgemms too thin)
FLASH_TILE_BYTES = 3 << 19  # rows per tile: a tile's scores, K and V rows (f32) in 1.5 MiB
                            # of L2 (1024 rows for 256 vectors of head_dim 64)


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
    n = q.shape[0]
    n_kv_heads = k_pages.shape[1]
    head_dim = q.shape[1] // n_q_heads
    group = n_q_heads // n_kv_heads
    n_rows = start_row + n
    row_lo = max(0, start_row - window + 1) if window > 0 else 0    # first row any query sees
    qmap = omap = None
    if k_dtype == "bf16" and v_dtype == "bf16":
        k = np.empty((n_kv_heads, n_rows - row_lo, head_dim), dtype=np.float32)   # [kv, rows, d]
        v = np.empty_like(k)
        _gather_f32(k_pages, page_table, row_lo, n_rows, k)
        _gather_f32(v_pages, page_table, row_lo, n_rows, v)

        def tile(h, t0, tn):
            return k[h, t0 - row_lo:t0 - row_lo + tn], v[h, t0 - row_lo:t0 - row_lo + tn]
    else:
        kf, vf = RowFormat.get(k_dtype, head_dim), RowFormat.get(v_dtype, head_dim)
        qmap = kf.rot.T if kf.rotated else None                        # into the keys' basis
        omap = vf.rot if vf.rotated else None                          # back from the values'
        scratch = threading.local()

        def tile(h, t0, tn):
            if not hasattr(scratch, "k") or scratch.k.shape[0] < tn:
                scratch.k = np.empty((tn, head_dim), dtype=np.float32)
                scratch.v = np.empty((tn, head_dim), dtype=np.float32)
            _dequant_tile(k_pages, page_table, h, t0, tn, kf.tag, kf.codebook, scratch.k)
            _dequant_tile(v_pages, page_table, h, t0, tn, vf.tag, vf.codebook, scratch.v)
            return scratch.k[:tn], scratch.v[:tn]

    block = _even(n, max(FLASH_MIN_QUERIES, FLASH_VECTORS // group))
    items = [(h, b0) for b0 in range(0, n, block) for h in range(n_kv_heads)]
    items.reverse()                      # the blocks that see the most rows first
    scale = np.float32(scale)

    def run(item):
        h, b0 = item
        nb = min(block, n - b0)
        cols = slice(h * group * head_dim, (h + 1) * group * head_dim)
        qg = _group_queries(q, b0, nb, cols, group, head_dim)
        if qmap is not None:
            qg = qg @ qmap
        og = _flash_block(np.ascontiguousarray(qg, dtype=np.float32), tile, h, nb,
                          start_row + b0, window, scale, row_bias)
        if omap is not None:
            og = og @ omap
        _scatter_queries(out, og, b0, nb, cols, group, head_dim)

    _run_items(run, items)


def _group_queries(q, b0, nb, cols, group, head_dim):
    """Queries b0 .. b0+nb-1 of one KV head's group (q[:, cols]) as query vectors
    a = g * nb + t: f32 [group*nb, head_dim]."""
    return q[b0:b0 + nb, cols].reshape(nb, group, head_dim).transpose(1, 0, 2).reshape(group * nb, head_dim)


def _scatter_queries(out, og, b0, nb, cols, group, head_dim):
    """_group_queries' inverse: og [group*nb, head_dim] -> out[b0:b0+nb, cols]."""
    out[b0:b0 + nb, cols] = og.reshape(group, nb, head_dim).transpose(1, 0, 2).reshape(nb, group * head_dim)


def _even(total: int, most: int) -> int:
    """The size of the fewest equal parts of `total` of at most `most` each (the last
    part may be smaller): no thin last part."""
    parts = -(-total // most)
    return -(-total // parts)


def tile_rows(nv: int, head_dim: int) -> int:
    """Rows per tile for nv query vectors: FLASH_TILE_BYTES over a row's f32 scores, K
    and V, a multiple of 64."""
    return max(64, FLASH_TILE_BYTES // (4 * (nv + 2 * head_dim)) // 64 * 64)


def _flash_block(qg, tile, h, nb, first_q, window, scale, row_bias):
    """Attention of one block's query vectors qg [group*nb, d] (a = g*nb + t is query
    t of group member g, at row first_q + t) over their visible rows, in tiles from
    tile(h, r0, rn) -> (K, V) f32 [rn, d] of rows r0 .. r0+rn-1 -> f32 [group*nb, d]."""
    nv, head_dim = qg.shape
    r0 = max(0, first_q - window + 1) if window > 0 else 0                # rows r0 .. r1-1
    r1 = first_q + nb
    m = np.full(nv, -np.inf, dtype=np.float32)
    l = np.zeros(nv, dtype=np.float32)
    alpha = np.empty(nv, dtype=np.float32)
    acc = np.zeros((nv, head_dim), dtype=np.float32)
    pv = np.empty((nv, head_dim), dtype=np.float32)
    rows = _even(r1 - r0, tile_rows(nv, head_dim))
    scores = np.empty(nv * rows, dtype=np.float32)
    for t0 in range(r0, r1, rows):
        tn = min(rows, r1 - t0)
        kt, vt = tile(h, t0, tn)
        s = scores[:nv * tn].reshape(nv, tn)                             # contiguous
        np.matmul(qg, kt.T, out=s)
        _add_bias(s, row_bias, h, t0, scale)
        _online_softmax_tile(s, nb, first_q - t0, window, scale, m, l, alpha)
        np.matmul(s, vt, out=pv)
        acc *= alpha[:, None]
        acc += pv
    acc /= l[:, None]
    return acc


@njit(**_JIT)
def _online_softmax_tile(s, n, last0, window, scale, m, l, alpha):
    """s f32 [group*n, tn]: raw scores of query vectors a = g*n + t against the tile's
    columns; query t sees columns max(0, last0+t-window+1) (0 without a window) ..
    last0+t (which may lie outside the tile). In place: s -> exp(scale*s - m_new) on
    visible columns, 0 elsewhere; m, l [group*n] move to the new running max and sum;
    alpha [group*n] = exp(m_old - m_new), the factor for acc."""
    tn = s.shape[1]
    for a in range(s.shape[0]):
        last = last0 + a % n
        j0 = max(last - window + 1, 0) if window > 0 else 0
        j1 = min(last + 1, tn)
        row = s[a]
        if j1 <= j0:                           # nothing visible in this tile
            row[:] = 0.0
            alpha[a] = 1.0
            continue
        m_new = max(m[a], scaled_max(row, j0, j1, scale))
        alpha[a] = _exp_f32(m[a] - m_new)
        total = exp_sum_row(row, j0, j1, scale, m_new)
        row[:j0] = 0.0
        row[j1:] = 0.0
        l[a] = l[a] * alpha[a] + total
        m[a] = m_new


@njit(**_JIT)
def _dequant_tile(pages, page_table, kv, row_lo, n, tag, cb, out):
    """Rows row_lo .. row_lo+n-1 of kv head `kv` -> out f32 [>= n, head_dim] (tq rows in
    their rotated basis, storage order), a page's run of rows at a time."""
    page_size = pages.shape[2]
    head_dim = out.shape[1]
    for p in range(row_lo // page_size, (row_lo + n - 1) // page_size + 1):
        lo = max(row_lo, p * page_size)
        hi = min(row_lo + n, (p + 1) * page_size)
        kvquant.dequant_rows(pages[page_table[p], kv], lo - p * page_size, hi - lo, tag, cb,
                             head_dim, out[lo - row_lo:hi - row_lo])


# -- the items on threads -------------------------------------------------------------
# numba's thread count never exceeds NUMBA_NUM_THREADS; the pool starts a thread only
# when a submitted item finds none idle, so a process that never prefills starts none.
_POOL = ThreadPoolExecutor(max_workers=numba.config.NUMBA_NUM_THREADS, thread_name_prefix="attention")
_BLAS = None                             # threadpoolctl's controllers of the loaded BLAS


def _blas_libs():
    global _BLAS
    if _BLAS is None:
        from threadpoolctl import ThreadpoolController
        _BLAS = ThreadpoolController().select(user_api="blas").lib_controllers
    return _BLAS


def _run_items(run, items) -> None:
    """run(item) for every item, on numba's thread count (of the calling thread) of
    threads, each taking the next item when it is done; the BLAS single-threaded
    meanwhile. An exception in any item is raised here after all have stopped."""
    workers = min(numba.get_num_threads(), len(items))
    if workers <= 1:
        for item in items:
            run(item)
        return
    pending = iter(items)
    lock = threading.Lock()

    def worker():
        while True:
            with lock:
                item = next(pending, None)
            if item is None:
                return
            run(item)

    with _single_threaded_blas():
        futures = [_POOL.submit(worker) for _ in range(workers)]
        wait(futures)
        for f in futures:
            f.result()


_BLAS_USERS = [0, None]            # callers inside _single_threaded_blas, the counts it saved
_BLAS_LOCK = threading.Lock()


@contextlib.contextmanager
def _single_threaded_blas():
    """The BLAS at one thread while any caller is inside (two prefills may overlap: the
    first saves the thread counts, the last restores them; each saving and restoring
    alone would leave the BLAS at one thread for good)."""
    with _BLAS_LOCK:
        if _BLAS_USERS[0] == 0:
            libs = _blas_libs()
            _BLAS_USERS[1] = [(lib, lib.get_num_threads()) for lib in libs]
            for lib in libs:
                lib.set_num_threads(1)
        _BLAS_USERS[0] += 1
    try:
        yield
    finally:
        with _BLAS_LOCK:
            _BLAS_USERS[0] -= 1
            if _BLAS_USERS[0] == 0:
                for lib, n in _BLAS_USERS[1]:
                    lib.set_num_threads(n)
