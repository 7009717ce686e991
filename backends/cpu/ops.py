"""numba kernels for every op except embedding/matmul (those live in quant.py).

Each public function takes the same arguments as the matching method of
backends/base.py (minus `self`) and writes into its `out`. Wrappers stay thin:
no numpy allocation on the decode path; small inputs run a serial kernel
(a parallel launch costs ~1.5 us), large ones a `prange` kernel.

KV pages are [n_pages, n_kv_heads, page_size, row_width] in one of the row
formats of backends/kvformat.py (bf16 bits, or the quantized rows of kvquant.py);
physical row r lives in page page_table[r // page_size] at offset r % page_size.
bf16 <-> f32 is done with integer shifts and an LLVM bitcast (jit.py), the same
rounding as backends/bf16.py.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange
from numba.extending import overload

from ..base import rope_inv_freq
from . import kvquant
from .jit import _JIT, _NEG_INF, _OVERLOAD, _as_f32, _bf16_to_f32, _exp_f32, _f32_to_bf16, _prefetch  # noqa: F401
from .kvquant import BF16, RowFormat

_PARALLEL_MIN = 1 << 15    # elementwise ops below this many elements run serially


# -- rms_norm / scale --------------------------------------------------------
@njit(inline="always", **_JIT)
def _rms_norm_row(x, weight, eps, out, t):
    """Row t, each weight-wide group of columns on its own (out may alias x)."""
    g = weight.shape[0]
    for b in range(0, x.shape[1], g):
        ss = 0.0
        for i in range(g):
            v = np.float64(x[t, b + i])
            ss += v * v
        inv = np.float32(1.0 / math.sqrt(ss / g + eps))
        for i in range(g):
            out[t, b + i] = x[t, b + i] * inv * weight[i]


@njit(**_JIT)
def _rms_norm_serial(x, weight, eps, out):
    for t in range(x.shape[0]):
        _rms_norm_row(x, weight, eps, out, t)


@njit(parallel=True, **_JIT)
def _rms_norm_parallel(x, weight, eps, out):
    for t in prange(x.shape[0]):
        _rms_norm_row(x, weight, eps, out, t)


def rms_norm(x, weight, eps, out):
    """x, out: f32 [n, d] (out may alias x); weight: f32 [g], g divides d (per-group norm)."""
    if x.shape[1] % weight.shape[0]:
        raise ValueError(f"rms_norm: weight width {weight.shape[0]} does not divide row width {x.shape[1]}")
    if x.shape[0] > 1 and x.size >= _PARALLEL_MIN:
        _rms_norm_parallel(x, weight, eps, out)
    else:
        _rms_norm_serial(x, weight, eps, out)


@njit(**_JIT)
def _scale_serial(x, s, out):
    for t in range(x.shape[0]):
        for i in range(x.shape[1]):
            out[t, i] = x[t, i] * s


@njit(parallel=True, **_JIT)
def _scale_parallel(x, s, out):
    for t in prange(x.shape[0]):
        for i in range(x.shape[1]):
            out[t, i] = x[t, i] * s


def scale(x, s, out):
    """out = x * s, f32 [n, d]; out may alias x."""
    if x.shape[0] > 1 and x.size >= _PARALLEL_MIN:
        _scale_parallel(x, np.float32(s), out)
    else:
        _scale_serial(x, np.float32(s), out)


# -- rope --------------------------------------------------------------------
@njit(inline="always", **_JIT)
def _rope_row(x, pos, n_heads, head_dim, rot_dim, inv_freq, neox, t):
    half = rot_dim // 2
    for i in range(half):
        # angle in float64: pos * base^(-2i/rot) reaches thousands of radians
        angle = pos * inv_freq[i]
        c = np.float32(math.cos(angle))
        s = np.float32(math.sin(angle))
        if neox:
            i0 = i
            i1 = i + half
        else:
            i0 = 2 * i
            i1 = 2 * i + 1
        for h in range(n_heads):
            base = h * head_dim
            x0 = x[t, base + i0]
            x1 = x[t, base + i1]
            x[t, base + i0] = x0 * c - x1 * s
            x[t, base + i1] = x0 * s + x1 * c


@njit(**_JIT)
def _rope_serial(x, positions, n_heads, head_dim, rot_dim, inv_freq, neox):
    for t in range(x.shape[0]):
        _rope_row(x, np.float64(positions[t]), n_heads, head_dim, rot_dim, inv_freq, neox, t)


@njit(parallel=True, **_JIT)
def _rope_parallel(x, positions, n_heads, head_dim, rot_dim, inv_freq, neox):
    for t in prange(x.shape[0]):
        _rope_row(x, np.float64(positions[t]), n_heads, head_dim, rot_dim, inv_freq, neox, t)


def rope(x, positions, n_heads, head_dim, rot_dim, freq_base, neox, freq_factors=None):
    """x: f32 [n, >= n_heads*head_dim], in place; positions: int32 [n] (host);
    freq_factors: f32 [rot_dim/2] dividing each pair's frequency, or None."""
    inv_freq = rope_inv_freq(freq_base, rot_dim, freq_factors)                  # f64 [rot_dim/2]
    args = (x, positions, n_heads, head_dim, rot_dim, inv_freq, bool(neox))
    if x.shape[0] >= 8:
        _rope_parallel(*args)
    else:
        _rope_serial(*args)


# -- kv_write ----------------------------------------------------------------
@njit(**_JIT)
def _kv_write(k_pages, v_pages, page_table, k, v, start_row):
    n_kv_heads, page_size, head_dim = k_pages.shape[1], k_pages.shape[2], k_pages.shape[3]
    for t in range(k.shape[0]):
        r = start_row + t
        page = page_table[r // page_size]
        off = r % page_size
        for h in range(n_kv_heads):
            base = h * head_dim
            for i in range(head_dim):
                k_pages[page, h, off, i] = _f32_to_bf16(k[t, base + i])
                v_pages[page, h, off, i] = _f32_to_bf16(v[t, base + i])


@njit(**_JIT)
def _kv_write_heads(k_pages, v_pages, tables, k, v, starts):
    page_size, head_dim = k_pages.shape[2], k_pages.shape[3]
    for t in range(k.shape[0]):
        for h in range(tables.shape[0]):
            r = starts[h] + t
            page = tables[h, r // page_size]
            off = r % page_size
            base = h * head_dim
            for i in range(head_dim):
                k_pages[page, 0, off, i] = _f32_to_bf16(k[t, base + i])
                v_pages[page, 0, off, i] = _f32_to_bf16(v[t, base + i])


def kv_write_heads(k_pages, v_pages, tables, k, v, starts, k_dtype="bf16", v_dtype="bf16"):
    """kv_write over ragged heads in one call (see Backend.kv_write_heads)."""
    starts = np.asarray(starts, dtype=np.int64)
    if k_dtype == "bf16" and v_dtype == "bf16":
        _kv_write_heads(k_pages, v_pages, tables, k, v, starts)
        return
    head_dim = k.shape[1] // tables.shape[0]
    for h in range(tables.shape[0]):
        cols = slice(h * head_dim, (h + 1) * head_dim)
        kvquant.write_rows(k_pages, tables[h], k[:, cols], int(starts[h]), RowFormat.get(k_dtype, head_dim))
        kvquant.write_rows(v_pages, tables[h], v[:, cols], int(starts[h]), RowFormat.get(v_dtype, head_dim))


def kv_write(k_pages, v_pages, page_table, k, v, start_row, k_dtype="bf16", v_dtype="bf16"):
    """k, v: f32 [n, n_kv_heads*head_dim] -> rows start_row .. start_row+n-1, bf16 (round
    to nearest even) or quantized as KvFormat.quantize does (kvquant.write_rows)."""
    if k_dtype == "bf16" and v_dtype == "bf16":
        _kv_write(k_pages, v_pages, page_table, k, v, start_row)
        return
    head_dim = k.shape[1] // k_pages.shape[1]
    kvquant.write_rows(k_pages, page_table, k, start_row, RowFormat.get(k_dtype, head_dim))
    kvquant.write_rows(v_pages, page_table, v, start_row, RowFormat.get(v_dtype, head_dim))


# -- attention_decode --------------------------------------------------------
# Flash-decoding. A task = (kv head, range of whole pages); it reads each K/V
# row once for all query heads of its GQA group and keeps a running
# (max, sum, acc) per query head. Rows go in tiles of <= _TILE rows that never
# cross a page, so a tile is one contiguous [n, row_width] slab:
#   scores[g, j] = q_g . K[j]: dot over dims (bf16 -> f32 by shift, 16-wide FMAs,
#     one horizontal sum per row and query head);
#   one online-softmax rescale per tile, exp vectorised over the tile's rows;
#   acc[g, :] += p[g, j] * V[j, :], vectorised over dims, 4 rows per pass.
# head_dim 64 is passed as a constant so LLVM fully unrolls to zmm code; a group
# of 3 (the default model) converts each K/V row once for its 3 query heads.
# Quantized rows (kvquant.py) take the same score and value loops: a tile's rows
# are dequantized _DEQUANT_ROWS at a time into a small f32 scratch (it stays in
# L1) that the loops read instead of the page. tq keys are scored against the
# rotated query (rotated once per head, before the tasks) and tq values summed in
# the rotated basis, rotated back once per head at the end.
# Each tile software-prefetches the same rows of the task's next page (pages
# are scattered; the hardware prefetcher does not follow the page table).
# Only rows < n_rows are ever read (unused page slots may hold NaN). Short
# contexts run one serial kernel (no parallel launch: the engine calls this op
# once per layer per token); long ones split each kv head into chunks of whole
# pages spread over the threads, then merge the chunks.
_TILE = 64                 # rows per online-softmax step (clipped to a page)
_SERIAL_MAX_ROWS = 1024    # at most this many rows: serial kernel (no launch cost)
_CHUNK_ROWS = 512          # rows per parallel task, rounded to whole pages
_DEQUANT_ROWS = 16         # quantized rows dequantized at a time (f32 scratch)


@njit(inline="always", **_JIT)
def _score_rows(rows, r0, n, qs, scores, c0, group, head_dim):
    """scores[g, c0 + j] = qs[g] . rows[r0 + j] for j < n, g < group;
    rows: bf16 bits (a page) or f32 (dequantized scratch) [.., >= head_dim]."""
    if group == 3:     # the default model: each K row converted once
        for j in range(n):
            krow = rows[r0 + j]
            s0 = np.float32(0.0)
            s1 = np.float32(0.0)
            s2 = np.float32(0.0)
            for i in range(head_dim):
                k = _as_f32(krow[i])
                s0 += qs[0, i] * k
                s1 += qs[1, i] * k
                s2 += qs[2, i] * k
            scores[0, c0 + j] = s0
            scores[1, c0 + j] = s1
            scores[2, c0 + j] = s2
    else:
        for g in range(group):
            for j in range(n):
                krow = rows[r0 + j]
                s = np.float32(0.0)
                for i in range(head_dim):
                    s += qs[g, i] * _as_f32(krow[i])
                scores[g, c0 + j] = s


@njit(inline="always", **_JIT)
def _softmax_tile(scores, n, group, m, l, acc, head_dim):
    """One online-softmax step over scores[:, :n]: rescale each head's (m, l, acc) to
    the new running max and turn its scores into weights p."""
    for g in range(group):
        bm = m[g]
        for j in range(n):
            bm = max(bm, scores[g, j])
        alpha = _exp_f32(m[g] - bm)
        m[g] = bm
        lg = np.float32(0.0)
        for j in range(n):
            p = _exp_f32(scores[g, j] - bm)
            scores[g, j] = p
            lg += p
        l[g] = l[g] * alpha + lg
        for i in range(head_dim):
            acc[g, i] *= alpha


@njit(inline="always", **_JIT)
def _value_rows(rows, r0, n, scores, c0, acc, group, head_dim):
    """acc[g] += sum_j scores[g, c0 + j] * rows[r0 + j] for j < n, 4 rows per pass over
    acc; rows: bf16 bits (a page) or f32 (dequantized scratch)."""
    n4 = n - n % 4
    if group == 3:     # each V row converted once for the 3 heads
        for j in range(0, n4, 4):
            v0 = rows[r0 + j]
            v1 = rows[r0 + j + 1]
            v2 = rows[r0 + j + 2]
            v3 = rows[r0 + j + 3]
            p00 = scores[0, c0 + j]
            p01 = scores[0, c0 + j + 1]
            p02 = scores[0, c0 + j + 2]
            p03 = scores[0, c0 + j + 3]
            p10 = scores[1, c0 + j]
            p11 = scores[1, c0 + j + 1]
            p12 = scores[1, c0 + j + 2]
            p13 = scores[1, c0 + j + 3]
            p20 = scores[2, c0 + j]
            p21 = scores[2, c0 + j + 1]
            p22 = scores[2, c0 + j + 2]
            p23 = scores[2, c0 + j + 3]
            for i in range(head_dim):
                x0 = _as_f32(v0[i])
                x1 = _as_f32(v1[i])
                x2 = _as_f32(v2[i])
                x3 = _as_f32(v3[i])
                acc[0, i] += (p00 * x0 + p01 * x1) + (p02 * x2 + p03 * x3)
                acc[1, i] += (p10 * x0 + p11 * x1) + (p12 * x2 + p13 * x3)
                acc[2, i] += (p20 * x0 + p21 * x1) + (p22 * x2 + p23 * x3)
    else:
        for j in range(0, n4, 4):
            v0 = rows[r0 + j]
            v1 = rows[r0 + j + 1]
            v2 = rows[r0 + j + 2]
            v3 = rows[r0 + j + 3]
            for g in range(group):
                p0 = scores[g, c0 + j]
                p1 = scores[g, c0 + j + 1]
                p2 = scores[g, c0 + j + 2]
                p3 = scores[g, c0 + j + 3]
                for i in range(head_dim):
                    acc[g, i] += ((p0 * _as_f32(v0[i]) + p1 * _as_f32(v1[i]))
                                  + (p2 * _as_f32(v2[i]) + p3 * _as_f32(v3[i])))
    for j in range(n4, n):
        vrow = rows[r0 + j]
        for g in range(group):
            p = scores[g, c0 + j]
            for i in range(head_dim):
                acc[g, i] += p * _as_f32(vrow[i])


def _tile_rows(pages, r0, n, tag, cb, head_dim, scratch):
    """Rows r0 .. r0+n-1 of one page of one KV head (storage [page_size, row_width])
    as (rows, first): bf16 rows as they are, (pages, r0); quantized ones dequantized
    into scratch (f32 [>= n, head_dim], kvquant.dequant_rows), (scratch, 0)."""


@overload(_tile_rows, inline="always", jit_options=_OVERLOAD)
def _tile_rows_impl(pages, r0, n, tag, cb, head_dim, scratch):
    if kvquant.fmt_of(tag) == BF16:
        return lambda pages, r0, n, tag, cb, head_dim, scratch: (pages, r0)

    def impl(pages, r0, n, tag, cb, head_dim, scratch):
        kvquant.dequant_rows(pages, r0, n, tag, cb, head_dim, scratch)
        return scratch, 0
    return impl


@njit(inline="always", **_JIT)
def _tile_step(tag):
    """Rows per pass over a tile: all of it for bf16, _DEQUANT_ROWS (the scratch) else."""
    return _TILE if kvquant.fmt_of_tag(tag) == BF16 else _DEQUANT_ROWS


@njit(inline="always", **_JIT)
def _decode_task(qs, k_pages, v_pages, page_table, kv, group, row_lo, row_hi,
                 scores, acc, m, l, kt, vt, ktag, kcb, vtag, vcb, bias, head_dim):
    """Attend rows row_lo .. row_hi-1 of kv head `kv` for its `group` query heads
    (qs f32 [n_q_heads, head_dim]: _prepare_queries); fills acc [group, head_dim]
    (rotated basis for tq values), m, l [group]. kt, vt: f32 [_DEQUANT_ROWS, head_dim]
    scratch for quantized rows; bias f32 [n_kv_heads, n_bias] is added to the scaled
    scores of rows below n_bias. Rows outside the range are never read."""
    page_size = k_pages.shape[2]
    # the group's queries, task-local: indexing the shared array measured slower (LLVM
    # must assume it aliases the score stores)
    qg = qs[kv * group:(kv + 1) * group].copy()
    k_row_bytes = k_pages.shape[3] * k_pages.itemsize
    v_row_bytes = v_pages.shape[3] * v_pages.itemsize
    k_step = _tile_step(ktag)
    v_step = _tile_step(vtag)
    for g in range(group):
        m[g] = _NEG_INF
        l[g] = 0.0
        for i in range(head_dim):
            acc[g, i] = 0.0
    p_end = (row_hi + page_size - 1) // page_size
    for pidx in range(row_lo // page_size, p_end):
        phys = page_table[pidx]
        kp = k_pages[phys, kv]
        vp = v_pages[phys, kv]
        first = max(0, row_lo - pidx * page_size)     # > 0 only on the first page
        n_page = min(page_size, row_hi - pidx * page_size)
        # next page of this task (pages sit apart in memory: the hardware
        # prefetcher does not follow the page table)
        n_next = 0
        kn = kp
        vn = vp
        if pidx + 1 < p_end:
            n_next = min(page_size, row_hi - (pidx + 1) * page_size)
            kn = k_pages[page_table[pidx + 1], kv]
            vn = v_pages[page_table[pidx + 1], kv]
        for t0 in range(first, n_page, _TILE):
            n = min(_TILE, n_page - t0)
            # prefetch the same rows of the next page, one page ahead; K and V lines
            # interleaved (a K pass then a V pass measured ~15% slower, head_dim 256)
            end = min(t0 + n, n_next)
            if k_row_bytes == v_row_bytes:
                for b in range(t0 * k_row_bytes, end * k_row_bytes, 64):
                    _prefetch(kn, b)
                    _prefetch(vn, b)
            else:
                for b in range(t0 * k_row_bytes, end * k_row_bytes, 64):
                    _prefetch(kn, b)
                for b in range(t0 * v_row_bytes, end * v_row_bytes, 64):
                    _prefetch(vn, b)
            for j0 in range(0, n, k_step):
                nj = min(k_step, n - j0)
                rows, r0 = _tile_rows(kp, t0 + j0, nj, ktag, kcb, head_dim, kt)
                _score_rows(rows, r0, nj, qg, scores, j0, group, head_dim)
            row0 = pidx * page_size + t0
            for j in range(min(n, bias.shape[1] - row0)):     # merged rows' log-counts
                for g in range(group):
                    scores[g, j] += bias[kv, row0 + j]
            _softmax_tile(scores, n, group, m, l, acc, head_dim)
            for j0 in range(0, n, v_step):
                nj = min(v_step, n - j0)
                rows, r0 = _tile_rows(vp, t0 + j0, nj, vtag, vcb, head_dim, vt)
                _value_rows(rows, r0, nj, scores, j0, acc, group, head_dim)


@njit(**_JIT)
def _decode_range(qs, k_pages, v_pages, page_table, kv, group, row_lo, row_hi,
                  scores, acc, m, l, kt, vt, ktag, kcb, vtag, vcb, bias):
    """_decode_task, compiled once per KV format pair and shared by the serial and the
    parallel kernel (not inlined: four inlined copies of the loop nest made a pair's
    first decode compile for about a minute; a call per task costs nothing measurable)."""
    head_dim = qs.shape[1]
    if head_dim == 64:   # constant trip counts: fully unrolled vector code
        _decode_task(qs, k_pages, v_pages, page_table, kv, group, row_lo, row_hi,
                     scores, acc, m, l, kt, vt, ktag, kcb, vtag, vcb, bias, 64)
    else:
        _decode_task(qs, k_pages, v_pages, page_table, kv, group, row_lo, row_hi,
                     scores, acc, m, l, kt, vt, ktag, kcb, vtag, vcb, bias, head_dim)


@njit(inline="always", **_JIT)
def _load_query(q, t, h, head_dim, scale, kfmt, krot, dst):
    """dst f32 [head_dim] = scale * head h of query t of q; for tq keys rotated into
    their storage basis (krot @ q_h), so that q . x^ = dst . y for a stored row y."""
    qh = q[t, h * head_dim:(h + 1) * head_dim]
    if kvquant.is_rotated(kfmt):
        for p in range(head_dim):
            s = np.float32(0.0)
            for i in range(head_dim):
                s += krot[p, i] * qh[i]
            dst[p] = s * scale
    else:
        for i in range(head_dim):
            dst[i] = qh[i] * scale


@njit(inline="always", **_JIT)
def _prepare_queries(q, t, n_q_heads, head_dim, scale, kfmt, krot, qs):
    """qs f32 [n_q_heads, head_dim]: every head of query t through _load_query."""
    for h in range(n_q_heads):
        _load_query(q, t, h, head_dim, scale, kfmt, krot, qs[h])


@njit(inline="always", **_JIT)
def _store_head(vec, w, vfmt, vrot_t, out, t, h, head_dim):
    """out[t, head h] = w * vec, for tq values rotated back (vec @ rot = vrot_t @ vec)."""
    o = out[t, h * head_dim:(h + 1) * head_dim]
    if kvquant.is_rotated(vfmt):
        for i in range(head_dim):
            s = np.float32(0.0)
            for p in range(head_dim):
                s += vrot_t[i, p] * vec[p]
            o[i] = s * w
    else:
        for i in range(head_dim):
            o[i] = vec[i] * w


@njit(**_JIT)
def _decode_serial(q, k_pages, v_pages, page_table, row_lo, n_rows, n_q_heads, scale, out,
                   bias, ktag, krot, kcb, vtag, vrot_t, vcb):
    kfmt = kvquant.fmt_of_tag(ktag)
    vfmt = kvquant.fmt_of_tag(vtag)
    n_kv_heads = k_pages.shape[1]
    head_dim = q.shape[1] // n_q_heads
    group = n_q_heads // n_kv_heads
    qs = np.empty((n_q_heads, head_dim), dtype=np.float32)
    _prepare_queries(q, 0, n_q_heads, head_dim, scale, kfmt, krot, qs)
    scores = np.empty((group, _TILE), dtype=np.float32)
    acc = np.empty((group, head_dim), dtype=np.float32)
    m = np.empty(group, dtype=np.float32)
    l = np.empty(group, dtype=np.float32)
    kt = np.empty((_DEQUANT_ROWS, head_dim), dtype=np.float32)
    vt = np.empty((_DEQUANT_ROWS, head_dim), dtype=np.float32)
    for kv in range(n_kv_heads):
        _decode_range(qs, k_pages, v_pages, page_table, kv, group, row_lo, n_rows,
                      scores, acc, m, l, kt, vt, ktag, kcb, vtag, vcb, bias)
        for g in range(group):
            _store_head(acc[g], np.float32(1.0) / l[g], vfmt, vrot_t, out, 0, kv * group + g,
                        head_dim)


@njit(parallel=True, **_JIT)
def _decode_parallel(q, k_pages, v_pages, page_table, row_lo, n_rows, n_q_heads, scale, out,
                     chunk_rows, bias, ktag, krot, kcb, vtag, vrot_t, vcb):
    """Chunks are the chunk_rows-aligned (whole-page) row ranges, the first one clipped
    to start at row_lo."""
    kfmt = kvquant.fmt_of_tag(ktag)
    vfmt = kvquant.fmt_of_tag(vtag)
    n_kv_heads = k_pages.shape[1]
    head_dim = q.shape[1] // n_q_heads
    group = n_q_heads // n_kv_heads
    qs = np.empty((n_q_heads, head_dim), dtype=np.float32)
    _prepare_queries(q, 0, n_q_heads, head_dim, scale, kfmt, krot, qs)
    chunk0 = row_lo // chunk_rows
    n_chunks = (n_rows + chunk_rows - 1) // chunk_rows - chunk0
    n_tasks = n_kv_heads * n_chunks
    part_acc = np.empty((n_tasks, group, head_dim), dtype=np.float32)
    part_max = np.empty((n_tasks, group), dtype=np.float32)
    part_sum = np.empty((n_tasks, group), dtype=np.float32)
    for task in prange(n_tasks):
        kv = task // n_chunks
        chunk = chunk0 + task % n_chunks
        scores = np.empty((group, _TILE), dtype=np.float32)
        kt = np.empty((_DEQUANT_ROWS, head_dim), dtype=np.float32)
        vt = np.empty((_DEQUANT_ROWS, head_dim), dtype=np.float32)
        lo = max(row_lo, chunk * chunk_rows)
        hi = min(n_rows, (chunk + 1) * chunk_rows)
        _decode_range(qs, k_pages, v_pages, page_table, kv, group, lo, hi, scores,
                      part_acc[task], part_max[task], part_sum[task], kt, vt, ktag, kcb, vtag, vcb, bias)
    o = np.empty(head_dim, dtype=np.float32)
    for h in range(n_q_heads):
        kv = h // group
        total = _merge_chunks(part_acc, part_max, part_sum, kv * n_chunks, (kv + 1) * n_chunks, h % group, o)
        _store_head(o, np.float32(1.0) / total, vfmt, vrot_t, out, 0, h, head_dim)


@njit(inline="always", **_JIT)
def _merge_chunks(part_acc, part_max, part_sum, first, end, g, o):
    """o f32 [head_dim] = query g's partial sums of chunks first .. end-1 merged (each
    rescaled to their largest max); returns the merged softmax denominator."""
    gm = np.float32(_NEG_INF)
    for c in range(first, end):
        gm = max(gm, part_max[c, g])
    total = np.float32(0.0)
    for c in range(first, end):
        total += part_sum[c, g] * _exp_f32(part_max[c, g] - gm)
    for i in range(o.shape[0]):
        o[i] = 0.0
    for c in range(first, end):
        w = _exp_f32(part_max[c, g] - gm)
        pa = part_acc[c, g]
        for i in range(o.shape[0]):
            o[i] += w * pa[i]
    return total


@njit(**_JIT)
def _decode_heads_serial(q, k_pages, v_pages, tables, n_rows, n_q_heads, scale, out,
                         bias, ktag, krot, kcb, vtag, vrot_t, vcb):
    """_decode_serial over ragged heads: the pools one head per page, KV head kv's rows
    0 .. n_rows[kv]-1 through tables[kv] (its group's queries, table and bias row passed
    as those of a one-head cache)."""
    kfmt = kvquant.fmt_of_tag(ktag)
    vfmt = kvquant.fmt_of_tag(vtag)
    n_kv_heads = tables.shape[0]
    head_dim = q.shape[1] // n_q_heads
    group = n_q_heads // n_kv_heads
    qs = np.empty((n_q_heads, head_dim), dtype=np.float32)
    _prepare_queries(q, 0, n_q_heads, head_dim, scale, kfmt, krot, qs)
    scores = np.empty((group, _TILE), dtype=np.float32)
    acc = np.empty((group, head_dim), dtype=np.float32)
    m = np.empty(group, dtype=np.float32)
    l = np.empty(group, dtype=np.float32)
    kt = np.empty((_DEQUANT_ROWS, head_dim), dtype=np.float32)
    vt = np.empty((_DEQUANT_ROWS, head_dim), dtype=np.float32)
    for kv in range(n_kv_heads):
        _decode_range(qs[kv * group:(kv + 1) * group], k_pages, v_pages, tables[kv], 0, group, 0, n_rows[kv],
                      scores, acc, m, l, kt, vt, ktag, kcb, vtag, vcb, bias[kv:kv + 1])
        for g in range(group):
            _store_head(acc[g], np.float32(1.0) / l[g], vfmt, vrot_t, out, 0, kv * group + g,
                        head_dim)


@njit(parallel=True, **_JIT)
def _decode_heads_parallel(q, k_pages, v_pages, tables, n_rows, n_q_heads, scale, out,
                           chunk_rows, bias, ktag, krot, kcb, vtag, vrot_t, vcb):
    """_decode_parallel over ragged heads (as _decode_heads_serial): each head's rows in
    chunks of chunk_rows, the tasks of all heads spread over the threads."""
    kfmt = kvquant.fmt_of_tag(ktag)
    vfmt = kvquant.fmt_of_tag(vtag)
    n_kv_heads = tables.shape[0]
    head_dim = q.shape[1] // n_q_heads
    group = n_q_heads // n_kv_heads
    qs = np.empty((n_q_heads, head_dim), dtype=np.float32)
    _prepare_queries(q, 0, n_q_heads, head_dim, scale, kfmt, krot, qs)
    first = np.zeros(n_kv_heads + 1, dtype=np.int64)             # head kv's tasks: first[kv] ..
    for kv in range(n_kv_heads):
        first[kv + 1] = first[kv] + (n_rows[kv] + chunk_rows - 1) // chunk_rows
    n_tasks = first[n_kv_heads]
    part_acc = np.empty((n_tasks, group, head_dim), dtype=np.float32)
    part_max = np.empty((n_tasks, group), dtype=np.float32)
    part_sum = np.empty((n_tasks, group), dtype=np.float32)
    for task in prange(n_tasks):
        kv = 0
        while first[kv + 1] <= task:
            kv += 1
        lo = (task - first[kv]) * chunk_rows
        scores = np.empty((group, _TILE), dtype=np.float32)
        kt = np.empty((_DEQUANT_ROWS, head_dim), dtype=np.float32)
        vt = np.empty((_DEQUANT_ROWS, head_dim), dtype=np.float32)
        _decode_range(qs[kv * group:(kv + 1) * group], k_pages, v_pages, tables[kv], 0, group, lo,
                      min(n_rows[kv], lo + chunk_rows), scores, part_acc[task], part_max[task],
                      part_sum[task], kt, vt, ktag, kcb, vtag, vcb, bias[kv:kv + 1])
    o = np.empty(head_dim, dtype=np.float32)
    for h in range(n_q_heads):
        kv = h // group
        total = _merge_chunks(part_acc, part_max, part_sum, first[kv], first[kv + 1], h % group, o)
        _store_head(o, np.float32(1.0) / total, vfmt, vrot_t, out, 0, h, head_dim)


def _row_bias(row_bias, n_kv_heads):
    """The kernels' bias argument: row_bias as f32 [n_kv_heads, n_bias], or no columns."""
    if row_bias is None:
        return np.zeros((n_kv_heads, 0), dtype=np.float32)
    row_bias = np.ascontiguousarray(row_bias, dtype=np.float32)
    if row_bias.ndim != 2 or row_bias.shape[0] != n_kv_heads:
        raise ValueError(f"row_bias must be [{n_kv_heads}, n_bias], got shape {row_bias.shape}")
    return row_bias


def attention_decode_heads(q, k_pages, v_pages, tables, n_rows, n_q_heads, scale, out,
                           k_dtype="bf16", v_dtype="bf16", row_bias=None):
    """attention_decode over ragged heads in one call (see Backend.attention_decode_heads)."""
    n_rows = np.asarray(n_rows, dtype=np.int64)
    bias = _row_bias(row_bias, tables.shape[0])
    head_dim = q.shape[1] // n_q_heads
    formats = (*RowFormat.get(k_dtype, head_dim).key_args(), *RowFormat.get(v_dtype, head_dim).value_args())
    if n_rows.sum() <= tables.shape[0] * _SERIAL_MAX_ROWS:     # attention_decode's rule, by total rows
        _decode_heads_serial(q, k_pages, v_pages, tables, n_rows, n_q_heads, scale, out, bias, *formats)
    else:
        chunk_rows = max(1, _CHUNK_ROWS // k_pages.shape[2]) * k_pages.shape[2]
        _decode_heads_parallel(q, k_pages, v_pages, tables, n_rows, n_q_heads, scale, out, chunk_rows, bias,
                               *formats)


def attention_decode(q, k_pages, v_pages, page_table, n_rows, n_q_heads, scale, out, window=0,
                     k_dtype="bf16", v_dtype="bf16", row_bias=None):
    """q, out: f32 [1, n_q_heads*head_dim]; attends physical rows 0 .. n_rows-1, or with
    window > 0 only rows max(0, n_rows-window) .. n_rows-1 (the rest are never read,
    so a token costs O(window), not O(n_rows)). row_bias: None or f32 [n_kv_heads,
    n_bias], added to the scaled scores of rows 0 .. n_bias-1."""
    bias = _row_bias(row_bias, k_pages.shape[1])
    head_dim = q.shape[1] // n_q_heads
    kf = RowFormat.get(k_dtype, head_dim)
    vf = RowFormat.get(v_dtype, head_dim)
    row_lo = max(0, n_rows - window) if window > 0 else 0
    if n_rows - row_lo <= _SERIAL_MAX_ROWS:
        _decode_serial(q, k_pages, v_pages, page_table, row_lo, n_rows, n_q_heads, scale, out,
                       bias, *kf.key_args(), *vf.value_args())
    else:
        page_size = k_pages.shape[2]
        chunk_rows = max(1, _CHUNK_ROWS // page_size) * page_size
        _decode_parallel(q, k_pages, v_pages, page_table, row_lo, n_rows, n_q_heads, scale, out,
                         chunk_rows, bias, *kf.key_args(), *vf.value_args())


# -- attention_prefill -------------------------------------------------------
# Tasks = (kv head, block of queries). A task holds the group's queries of its
# block ([group*QB, head_dim]), converts K/V tiles of TILE rows to f32 once
# (K transposed so scores vectorise over rows) and runs an online softmax.
# Quantized rows are dequantized into the same tiles (tq in the rotated basis,
# with the queries rotated once and the outputs rotated back once).
# With a sliding window the tiles start at the block's first query's first
# visible row: rows below it are never read, so a block costs O(QB + window).
_PREFILL_QB = 16
_PREFILL_TILE = 64


@njit(parallel=True, **_JIT)
def _attention_prefill(q, k_pages, v_pages, page_table, start_row, n_q_heads, scale, out,
                       window, bias, ktag, krot, kcb, vtag, vrot_t, vcb):
    n_kv_heads = k_pages.shape[1]
    n_blocks = (q.shape[0] + _PREFILL_QB - 1) // _PREFILL_QB
    for task in prange(n_kv_heads * n_blocks):
        _prefill_block(q, k_pages, v_pages, page_table, start_row, n_q_heads, scale, out, window,
                       bias, task // n_blocks, task % n_blocks * _PREFILL_QB, ktag, krot, kcb, vtag, vrot_t,
                       vcb)


@njit(**_JIT)
def _prefill_block(q, k_pages, v_pages, page_table, start_row, n_q_heads, scale, out, window,
                   bias, kv, t0, ktag, krot, kcb, vtag, vrot_t, vcb):
    """The queries t0 .. t0+_PREFILL_QB-1 of kv head `kv`'s group (one task of
    _attention_prefill; a call, not the prange body itself, so numba's parallel
    lowering handles a small loop and the loop nest compiles once)."""
    n = q.shape[0]
    page_size = k_pages.shape[2]
    head_dim = q.shape[1] // n_q_heads
    group = n_q_heads // k_pages.shape[1]
    kfmt = kvquant.fmt_of_tag(ktag)
    vfmt = kvquant.fmt_of_tag(vtag)
    nq = min(_PREFILL_QB, n - t0)
    nv = group * nq                       # query vectors: index a = g * nq + t
    qs = np.empty((nv, head_dim), dtype=np.float32)
    last = np.empty(nv, dtype=np.int64)   # last visible row of each query vector
    for g in range(group):
        for t in range(nq):
            a = g * nq + t
            last[a] = start_row + t0 + t
            _load_query(q, t0 + t, kv * group + g, head_dim, scale, kfmt, krot, qs[a])
    kt = np.empty((head_dim, _PREFILL_TILE), dtype=np.float32)   # K tile, transposed
    vt = np.empty((_PREFILL_TILE, head_dim), dtype=np.float32)
    row_scratch = np.empty((1, head_dim), dtype=np.float32)     # one dequantized row
    s = np.empty((nv, _PREFILL_TILE), dtype=np.float32)
    acc = np.zeros((nv, head_dim), dtype=np.float32)
    m = np.full(nv, _NEG_INF, dtype=np.float32)
    l = np.zeros(nv, dtype=np.float32)
    rows_end = start_row + t0 + nq        # rows visible to the block's last query
    rows_lo = 0                           # first row visible to the block's first query
    if window > 0:
        rows_lo = max(0, start_row + t0 - window + 1)
    for r0 in range(rows_lo, rows_end, _PREFILL_TILE):
        tn = min(_PREFILL_TILE, rows_end - r0)
        for j in range(tn):
            r = r0 + j
            page = page_table[r // page_size]
            off = r % page_size
            krows, ki = _tile_rows(k_pages[page, kv], off, 1, ktag, kcb, head_dim, row_scratch)
            for i in range(head_dim):
                kt[i, j] = _as_f32(krows[ki, i])
            vrows, vi = _tile_rows(v_pages[page, kv], off, 1, vtag, vcb, head_dim, row_scratch)
            for i in range(head_dim):
                vt[j, i] = _as_f32(vrows[vi, i])
        for a in range(nv):
            visible = min(tn, last[a] - r0 + 1)
            j0 = 0                        # first visible column of the tile
            if window > 0:
                j0 = max(0, last[a] - window + 1 - r0)
            if visible <= j0:             # tile wholly masked for this query
                continue
            for j in range(tn):
                s[a, j] = 0.0
            for i in range(head_dim):
                qi = qs[a, i]
                for j in range(tn):
                    s[a, j] += qi * kt[i, j]
            for j in range(min(tn, bias.shape[1] - r0)):      # merged rows' log-counts
                s[a, j] += bias[kv, r0 + j]
            bm = m[a]
            for j in range(j0, visible):
                bm = max(bm, s[a, j])
            alpha = _exp_f32(m[a] - bm)
            m[a] = bm
            l[a] *= alpha
            for i in range(head_dim):
                acc[a, i] *= alpha
            la = l[a]
            aa = acc[a]
            for j in range(j0, visible):
                p = _exp_f32(s[a, j] - bm)
                la += p
                vj = vt[j]
                for i in range(head_dim):
                    aa[i] += p * vj[i]
            l[a] = la
    for g in range(group):
        for t in range(nq):
            a = g * nq + t
            _store_head(acc[a], np.float32(1.0) / l[a], vfmt, vrot_t, out, t0 + t,
                        kv * group + g, head_dim)


def attention_prefill(q, k_pages, v_pages, page_table, start_row, n_q_heads, scale, out,
                      window=0, k_dtype="bf16", v_dtype="bf16", row_bias=None):
    """q, out: f32 [n, n_q_heads*head_dim]; query i sees rows 0 .. start_row+i, or with
    window > 0 rows max(0, start_row+i-window+1) .. start_row+i. row_bias as in decode."""
    head_dim = q.shape[1] // n_q_heads
    _attention_prefill(q, k_pages, v_pages, page_table, start_row, n_q_heads, scale, out,
                       int(window), _row_bias(row_bias, k_pages.shape[1]),
                       *RowFormat.get(k_dtype, head_dim).key_args(),
                       *RowFormat.get(v_dtype, head_dim).value_args())


# -- silu_gate / add ---------------------------------------------------------
@njit(**_JIT)
def _silu_gate_serial(gate, up, out):
    for t in range(gate.shape[0]):
        for i in range(gate.shape[1]):
            g = gate[t, i]
            out[t, i] = g / (np.float32(1.0) + np.exp(-g)) * up[t, i]


@njit(parallel=True, **_JIT)
def _silu_gate_parallel(gate, up, out):
    for t in prange(gate.shape[0]):
        for i in range(gate.shape[1]):
            g = gate[t, i]
            out[t, i] = g / (np.float32(1.0) + np.exp(-g)) * up[t, i]


def silu_gate(gate, up, out):
    """out = silu(gate) * up, all f32 [n, f]."""
    if gate.shape[0] > 1 and gate.size >= _PARALLEL_MIN:
        _silu_gate_parallel(gate, up, out)
    else:
        _silu_gate_serial(gate, up, out)


# gelu_tanh(g) = 0.5 g (1 + tanh(u)) = g / (1 + exp(-2u)), u = sqrt(2/pi) (g + 0.044715 g^3):
# the exp form vectorises 16-wide through _exp_f32 (exp clamps at 88, so a very
# negative g gives a tiny negative number, as tanh does).
_GELU_K2 = np.float32(2.0 * math.sqrt(2.0 / math.pi))
_GELU_C = np.float32(0.044715)


@njit(inline="always", **_JIT)
def _gelu_tanh(g):
    return g / (np.float32(1.0) + _exp_f32(-_GELU_K2 * (g + _GELU_C * g * g * g)))


@njit(**_JIT)
def _gelu_gate_serial(gate, up, out):
    for t in range(gate.shape[0]):
        for i in range(gate.shape[1]):
            out[t, i] = _gelu_tanh(gate[t, i]) * up[t, i]


@njit(parallel=True, **_JIT)
def _gelu_gate_parallel(gate, up, out):
    for t in prange(gate.shape[0]):
        for i in range(gate.shape[1]):
            out[t, i] = _gelu_tanh(gate[t, i]) * up[t, i]


def gelu_gate(gate, up, out):
    """out = gelu_tanh(gate) * up, all f32 [n, f]."""
    if gate.shape[0] > 1 and gate.size >= _PARALLEL_MIN:
        _gelu_gate_parallel(gate, up, out)
    else:
        _gelu_gate_serial(gate, up, out)


@njit(**_JIT)
def _add_serial(a, b, out):
    for t in range(a.shape[0]):
        for i in range(a.shape[1]):
            out[t, i] = a[t, i] + b[t, i]


@njit(parallel=True, **_JIT)
def _add_parallel(a, b, out):
    for t in prange(a.shape[0]):
        for i in range(a.shape[1]):
            out[t, i] = a[t, i] + b[t, i]


def add(a, b, out):
    """out = a + b, f32 [n, d]; out may alias a; b [1, d] is added to every row."""
    if b.shape[0] != a.shape[0]:
        np.add(a, b, out=out)
    elif a.shape[0] > 1 and a.size >= _PARALLEL_MIN:
        _add_parallel(a, b, out)
    else:
        _add_serial(a, b, out)


# -- snapkv_votes ------------------------------------------------------------
_VOTE_CHUNK_ROWS = 256


@njit(parallel=True, **_JIT)
def _snapkv_votes(q_window, k_pages, page_table, n_rows, scale, votes, ktag, kcb):
    """q_window: f32 [n_q_heads, W, head_dim], for tq keys already in their storage basis."""
    n_q_heads, window, head_dim = q_window.shape
    n_kv_heads, page_size = k_pages.shape[1], k_pages.shape[2]
    group = n_q_heads // n_kv_heads
    prefix = n_rows - window
    n_chunks = (n_rows + _VOTE_CHUNK_ROWS - 1) // _VOTE_CHUNK_ROWS
    logits = np.empty((n_q_heads, window, n_rows), dtype=np.float32)   # O(H * W * L)
    # 1. logits of every window query against every row (masked later)
    for task in prange(n_kv_heads * n_chunks):
        kv = task // n_chunks
        r0 = (task % n_chunks) * _VOTE_CHUNK_ROWS
        r1 = min(n_rows, r0 + _VOTE_CHUNK_ROWS)
        kf = np.empty(head_dim, dtype=np.float32)
        row_scratch = np.empty((1, head_dim), dtype=np.float32)
        for r in range(r0, r1):
            page = page_table[r // page_size]
            off = r % page_size
            rows, ri = _tile_rows(k_pages[page, kv], off, 1, ktag, kcb, head_dim, row_scratch)
            for i in range(head_dim):
                kf[i] = _as_f32(rows[ri, i])
            for g in range(group):
                h = kv * group + g
                for w in range(window):
                    s = np.float32(0.0)
                    for i in range(head_dim):
                        s += q_window[h, w, i] * kf[i]
                    logits[h, w, r] = s * scale
    # 2. causal softmax statistics per (query head, window query), full row
    row_max = np.empty((n_q_heads, window), dtype=np.float32)
    row_inv = np.empty((n_q_heads, window), dtype=np.float32)
    for hw in prange(n_q_heads * window):
        h = hw // window
        w = hw % window
        last = prefix + w                      # the query's own row
        mx = np.float32(_NEG_INF)
        for r in range(last + 1):
            mx = max(mx, logits[h, w, r])
        total = 0.0
        for r in range(last + 1):
            total += _exp_f32(logits[h, w, r] - mx)
        row_max[h, w] = mx
        row_inv[h, w] = 1.0 / total
    # 3. prefix probabilities summed over window queries and the KV group
    for task in prange(n_kv_heads * n_chunks):
        kv = task // n_chunks
        r0 = (task % n_chunks) * _VOTE_CHUNK_ROWS
        r1 = min(prefix, r0 + _VOTE_CHUNK_ROWS)
        for r in range(r0, r1):
            votes[kv, r] = 0.0
        for g in range(group):
            h = kv * group + g
            for w in range(window):
                mx = row_max[h, w]
                inv = row_inv[h, w]
                for r in range(r0, r1):
                    votes[kv, r] += _exp_f32(logits[h, w, r] - mx) * inv


def snapkv_votes(q_window, k_pages, page_table, n_rows, scale, k_dtype="bf16"):
    """q_window: f32 [n_q_heads, W, head_dim] -> host f32 [n_kv_heads, n_rows - W]."""
    fmt = RowFormat.get(k_dtype, q_window.shape[2])
    if fmt.rotated:                            # score in the keys' storage basis
        q_window = np.ascontiguousarray(q_window @ fmt.rot.T, dtype=np.float32)
    votes = np.empty((k_pages.shape[1], n_rows - q_window.shape[1]), dtype=np.float32)
    _snapkv_votes(q_window, k_pages, page_table, n_rows, scale, votes, fmt.tag, fmt.codebook)
    return votes


# -- kv_gather ---------------------------------------------------------------
@njit(parallel=True, **_JIT)
def _kv_gather(k_pages, v_pages, page_table, keep):
    """Rows of any storage format: K and V rows may differ in width (k_dtype != v_dtype)."""
    page_size, k_width, v_width = k_pages.shape[2], k_pages.shape[3], v_pages.shape[3]
    for h in prange(keep.shape[0]):          # heads are independent
        for j in range(keep.shape[1]):       # in order: rows only move down
            src = keep[h, j]
            if src == j:
                continue
            sp = page_table[src // page_size]
            so = src % page_size
            dp = page_table[j // page_size]
            do = j % page_size
            for i in range(k_width):
                k_pages[dp, h, do, i] = k_pages[sp, h, so, i]
            for i in range(v_width):
                v_pages[dp, h, do, i] = v_pages[sp, h, so, i]


def kv_gather(k_pages, v_pages, page_table, keep):
    """keep: int64 [n_kv_heads, n_keep] sorted rows per KV head (host); pages of any
    row format (whole rows move, scales with them)."""
    _kv_gather(k_pages, v_pages, page_table, keep)
