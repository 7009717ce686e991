"""numba kernels for every op except embedding/matmul (those live in quant.py).

Each public function takes the same arguments as the matching method of
backends/base.py (minus `self`) and writes into its `out`. Wrappers stay thin:
no numpy allocation on the decode path; small inputs run a serial kernel
(a parallel launch costs ~1.5 us), large ones a `prange` kernel.

KV pages are uint16 bf16 bits [n_pages, n_kv_heads, page_size, head_dim];
physical row r lives in page page_table[r // page_size] at offset r % page_size.
bf16 <-> f32 is done with integer shifts and an LLVM bitcast (`_bits_f32`,
`_f32_bits`), the same rounding as backends/bf16.py.
"""
from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from ..base import rope_inv_freq

# fastmath without nnan/ninf: the kernels rely on -inf (empty softmax state) and
# on NaN propagating (tests poison unused page slots with NaN).
_JIT = dict(cache=True, fastmath={"reassoc", "contract", "arcp", "nsz", "afn"})
_PARALLEL_MIN = 1 << 15    # elementwise ops below this many elements run serially
_NEG_INF = -np.inf


# -- bit casts ---------------------------------------------------------------
@intrinsic
def _bits_f32(typingctx, bits):
    """uint32 -> float32 with the same bits."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


@intrinsic
def _f32_bits(typingctx, value):
    """float32 -> uint32 with the same bits."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


@njit(inline="always", **_JIT)
def _bf16_to_f32(b):
    return _bits_f32(np.uint32(b) << np.uint32(16))


@njit(inline="always", **_JIT)
def _f32_to_bf16(x):
    """Round to nearest even; NaN stays a quiet NaN."""
    u = _f32_bits(np.float32(x))
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16((u >> np.uint32(16)) | np.uint32(0x40))
    lsb = (u >> np.uint32(16)) & np.uint32(1)
    return np.uint16((u + np.uint32(0x7FFF) + lsb) >> np.uint32(16))


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


def kv_write(k_pages, v_pages, page_table, k, v, start_row):
    """k, v: f32 [n, n_kv_heads*head_dim] -> bf16 rows start_row .. start_row+n-1."""
    _kv_write(k_pages, v_pages, page_table, k, v, start_row)


# -- attention_decode --------------------------------------------------------
# Flash-decoding. A task = (kv head, range of whole pages); it reads each K/V
# row once for all query heads of its GQA group and keeps a running
# (max, sum, acc) per query head. Rows go in tiles of <= _TILE rows that never
# cross a page, so a tile is one contiguous [n, head_dim] uint16 slab:
#   scores[g, j] = q_g . K[j]: dot over dims (bf16 -> f32 by shift, 16-wide FMAs,
#     one horizontal sum per row and query head);
#   one online-softmax rescale per tile, exp vectorised over the tile's rows;
#   acc[g, :] += p[g, j] * V[j, :], vectorised over dims, 4 rows per pass.
# head_dim 64 is passed as a constant so LLVM fully unrolls to zmm code; a group
# of 3 (the default model) converts each K/V row once for its 3 query heads.
# Each tile software-prefetches the same rows of the task's next page (pages
# are scattered; the hardware prefetcher does not follow the page table).
# Only rows < n_rows are ever read (unused page slots may hold NaN). Short
# contexts run one serial kernel (no parallel launch: the engine calls this op
# once per layer per token); long ones split each kv head into chunks of whole
# pages spread over the threads, then merge the chunks.
_TILE = 64                 # rows per online-softmax step (clipped to a page)
_SERIAL_MAX_ROWS = 1024    # at most this many rows: serial kernel (no launch cost)
_CHUNK_ROWS = 512          # rows per parallel task, rounded to whole pages


@intrinsic
def _prefetch(typingctx, arr, byte_off):
    """Prefetch (read, keep in all cache levels) the cache line at arr's data + byte_off."""
    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        i8p = ir.IntType(8).as_pointer()
        ptr = builder.gep(builder.bitcast(ary.data, i8p), [args[1]])
        i32 = ir.IntType(32)
        fn = builder.module.declare_intrinsic("llvm.prefetch", fnty=ir.FunctionType(
            ir.VoidType(), [i8p, i32, i32, i32]))
        builder.call(fn, [ptr, i32(0), i32(3), i32(1)])
        return context.get_dummy_value()
    return types.none(arr, types.int64), codegen


@njit(inline="always", **_JIT)
def _exp_f32(x):
    """expf, all in f32 so it vectorises 16-wide (Cephes polynomial, ~1 ulp).
    Underflows to 0 below -87.3 (exp(-inf) = 0); NaN stays NaN."""
    xc = min(max(x, np.float32(-87.33654)), np.float32(88.0))
    n = np.float32(math.floor(xc * np.float32(1.442695040888963) + np.float32(0.5)))
    r = xc - n * np.float32(0.693359375) - n * np.float32(-2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    y = (p * r * r + r + np.float32(1.0)) * _bits_f32(np.uint32(np.int32(n) + 127) << np.uint32(23))
    if x < np.float32(-87.33654):
        y = np.float32(0.0)
    if x != x:
        y = x
    return y


@njit(inline="always", **_JIT)
def _decode_task(q, k_pages, v_pages, page_table, kv, group, scale, row_lo, row_hi,
          qs, scores, acc, m, l, head_dim):
    """Attend rows row_lo .. row_hi-1 of kv head `kv` for its `group` query heads;
    fills acc [group, head_dim], m, l [group]. Rows outside the range are never read."""
    page_size = k_pages.shape[2]
    for g in range(group):
        qbase = (kv * group + g) * head_dim
        for i in range(head_dim):
            qs[g, i] = q[0, qbase + i] * scale
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
            # prefetch the same rows of the next page, one page ahead
            for b in range(t0 * head_dim * 2, min(t0 + n, n_next) * head_dim * 2, 64):
                _prefetch(kn, b)
                _prefetch(vn, b)
            # scores
            if group == 3:     # the default model: each K row converted once
                for j in range(n):
                    krow = kp[t0 + j]
                    s0 = np.float32(0.0)
                    s1 = np.float32(0.0)
                    s2 = np.float32(0.0)
                    for i in range(head_dim):
                        k = _bf16_to_f32(krow[i])
                        s0 += qs[0, i] * k
                        s1 += qs[1, i] * k
                        s2 += qs[2, i] * k
                    scores[0, j] = s0
                    scores[1, j] = s1
                    scores[2, j] = s2
            else:
                for g in range(group):
                    for j in range(n):
                        krow = kp[t0 + j]
                        s = np.float32(0.0)
                        for i in range(head_dim):
                            s += qs[g, i] * _bf16_to_f32(krow[i])
                        scores[g, j] = s
            # online softmax
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
            # values, 4 rows per pass over acc
            n4 = n - n % 4
            if group == 3:     # each V row converted once for the 3 heads
                for j in range(0, n4, 4):
                    v0 = vp[t0 + j]
                    v1 = vp[t0 + j + 1]
                    v2 = vp[t0 + j + 2]
                    v3 = vp[t0 + j + 3]
                    p00 = scores[0, j]
                    p01 = scores[0, j + 1]
                    p02 = scores[0, j + 2]
                    p03 = scores[0, j + 3]
                    p10 = scores[1, j]
                    p11 = scores[1, j + 1]
                    p12 = scores[1, j + 2]
                    p13 = scores[1, j + 3]
                    p20 = scores[2, j]
                    p21 = scores[2, j + 1]
                    p22 = scores[2, j + 2]
                    p23 = scores[2, j + 3]
                    for i in range(head_dim):
                        x0 = _bf16_to_f32(v0[i])
                        x1 = _bf16_to_f32(v1[i])
                        x2 = _bf16_to_f32(v2[i])
                        x3 = _bf16_to_f32(v3[i])
                        acc[0, i] += (p00 * x0 + p01 * x1) + (p02 * x2 + p03 * x3)
                        acc[1, i] += (p10 * x0 + p11 * x1) + (p12 * x2 + p13 * x3)
                        acc[2, i] += (p20 * x0 + p21 * x1) + (p22 * x2 + p23 * x3)
            else:
                for j in range(0, n4, 4):
                    v0 = vp[t0 + j]
                    v1 = vp[t0 + j + 1]
                    v2 = vp[t0 + j + 2]
                    v3 = vp[t0 + j + 3]
                    for g in range(group):
                        p0 = scores[g, j]
                        p1 = scores[g, j + 1]
                        p2 = scores[g, j + 2]
                        p3 = scores[g, j + 3]
                        for i in range(head_dim):
                            acc[g, i] += ((p0 * _bf16_to_f32(v0[i]) + p1 * _bf16_to_f32(v1[i]))
                                          + (p2 * _bf16_to_f32(v2[i]) + p3 * _bf16_to_f32(v3[i])))
            for j in range(n4, n):
                vrow = vp[t0 + j]
                for g in range(group):
                    p = scores[g, j]
                    for i in range(head_dim):
                        acc[g, i] += p * _bf16_to_f32(vrow[i])


@njit(**_JIT)
def _decode_serial(q, k_pages, v_pages, page_table, row_lo, n_rows, n_q_heads, scale, out):
    n_kv_heads, head_dim = k_pages.shape[1], k_pages.shape[3]
    group = n_q_heads // n_kv_heads
    qs = np.empty((group, head_dim), dtype=np.float32)
    scores = np.empty((group, _TILE), dtype=np.float32)
    acc = np.empty((group, head_dim), dtype=np.float32)
    m = np.empty(group, dtype=np.float32)
    l = np.empty(group, dtype=np.float32)
    for kv in range(n_kv_heads):
        if head_dim == 64:   # constant trip counts: fully unrolled zmm code
            _decode_task(q, k_pages, v_pages, page_table, kv, group, scale, row_lo, n_rows,
                         qs, scores, acc, m, l, 64)
        else:
            _decode_task(q, k_pages, v_pages, page_table, kv, group, scale, row_lo, n_rows,
                         qs, scores, acc, m, l, head_dim)
        for g in range(group):
            inv = np.float32(1.0) / l[g]
            obase = (kv * group + g) * head_dim
            for i in range(head_dim):
                out[0, obase + i] = acc[g, i] * inv


@njit(parallel=True, **_JIT)
def _decode_parallel(q, k_pages, v_pages, page_table, row_lo, n_rows, n_q_heads, scale, out,
                     chunk_rows):
    """Chunks are the chunk_rows-aligned (whole-page) row ranges, the first one clipped
    to start at row_lo."""
    n_kv_heads, head_dim = k_pages.shape[1], k_pages.shape[3]
    group = n_q_heads // n_kv_heads
    chunk0 = row_lo // chunk_rows
    n_chunks = (n_rows + chunk_rows - 1) // chunk_rows - chunk0
    n_tasks = n_kv_heads * n_chunks
    part_acc = np.empty((n_tasks, group, head_dim), dtype=np.float32)
    part_max = np.empty((n_tasks, group), dtype=np.float32)
    part_sum = np.empty((n_tasks, group), dtype=np.float32)
    for task in prange(n_tasks):
        kv = task // n_chunks
        chunk = chunk0 + task % n_chunks
        qs = np.empty((group, head_dim), dtype=np.float32)
        scores = np.empty((group, _TILE), dtype=np.float32)
        lo = max(row_lo, chunk * chunk_rows)
        hi = min(n_rows, (chunk + 1) * chunk_rows)
        if head_dim == 64:
            _decode_task(q, k_pages, v_pages, page_table, kv, group, scale, lo, hi,
                         qs, scores, part_acc[task], part_max[task], part_sum[task], 64)
        else:
            _decode_task(q, k_pages, v_pages, page_table, kv, group, scale, lo, hi,
                         qs, scores, part_acc[task], part_max[task], part_sum[task], head_dim)
    for h in range(n_q_heads):
        kv = h // group
        g = h % group
        base = kv * n_chunks
        gm = np.float32(_NEG_INF)
        for c in range(n_chunks):
            gm = max(gm, part_max[base + c, g])
        total = np.float32(0.0)
        for c in range(n_chunks):
            total += part_sum[base + c, g] * _exp_f32(part_max[base + c, g] - gm)
        inv = np.float32(1.0) / total
        o = out[0, h * head_dim:(h + 1) * head_dim]
        for i in range(head_dim):
            o[i] = 0.0
        for c in range(n_chunks):
            w = _exp_f32(part_max[base + c, g] - gm) * inv
            pa = part_acc[base + c, g]
            for i in range(head_dim):
                o[i] += w * pa[i]


def attention_decode(q, k_pages, v_pages, page_table, n_rows, n_q_heads, scale, out, window=0):
    """q, out: f32 [1, n_q_heads*head_dim]; attends physical rows 0 .. n_rows-1, or with
    window > 0 only rows max(0, n_rows-window) .. n_rows-1 (the rest are never read,
    so a token costs O(window), not O(n_rows))."""
    row_lo = max(0, n_rows - window) if window > 0 else 0
    if n_rows - row_lo <= _SERIAL_MAX_ROWS:
        _decode_serial(q, k_pages, v_pages, page_table, row_lo, n_rows, n_q_heads, scale, out)
    else:
        page_size = k_pages.shape[2]
        chunk_rows = max(1, _CHUNK_ROWS // page_size) * page_size
        _decode_parallel(q, k_pages, v_pages, page_table, row_lo, n_rows, n_q_heads, scale, out,
                         chunk_rows)


# -- attention_prefill -------------------------------------------------------
# Tasks = (kv head, block of queries). A task holds the group's queries of its
# block ([group*QB, head_dim]), converts K/V tiles of TILE rows to f32 once
# (K transposed so scores vectorise over rows) and runs an online softmax.
# With a sliding window the tiles start at the block's first query's first
# visible row: rows below it are never read, so a block costs O(QB + window).
_PREFILL_QB = 16
_PREFILL_TILE = 64


@njit(parallel=True, **_JIT)
def _attention_prefill(q, k_pages, v_pages, page_table, start_row, n_q_heads, scale, out,
                       window):
    n = q.shape[0]
    n_kv_heads, page_size, head_dim = k_pages.shape[1], k_pages.shape[2], k_pages.shape[3]
    group = n_q_heads // n_kv_heads
    n_blocks = (n + _PREFILL_QB - 1) // _PREFILL_QB
    for task in prange(n_kv_heads * n_blocks):
        kv = task // n_blocks
        blk = task % n_blocks
        t0 = blk * _PREFILL_QB
        nq = min(_PREFILL_QB, n - t0)
        nv = group * nq                       # query vectors: index a = g * nq + t
        qs = np.empty((nv, head_dim), dtype=np.float32)
        last = np.empty(nv, dtype=np.int64)   # last visible row of each query vector
        for g in range(group):
            qbase = (kv * group + g) * head_dim
            for t in range(nq):
                a = g * nq + t
                last[a] = start_row + t0 + t
                for i in range(head_dim):
                    qs[a, i] = q[t0 + t, qbase + i] * scale
        kt = np.empty((head_dim, _PREFILL_TILE), dtype=np.float32)   # K tile, transposed
        vt = np.empty((_PREFILL_TILE, head_dim), dtype=np.float32)
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
                krow = k_pages[page, kv, off]
                vrow = v_pages[page, kv, off]
                for i in range(head_dim):
                    kt[i, j] = _bf16_to_f32(krow[i])
                for i in range(head_dim):
                    vt[j, i] = _bf16_to_f32(vrow[i])
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
            obase = (kv * group + g) * head_dim
            for t in range(nq):
                a = g * nq + t
                inv = np.float32(1.0) / l[a]
                for i in range(head_dim):
                    out[t0 + t, obase + i] = acc[a, i] * inv


def attention_prefill(q, k_pages, v_pages, page_table, start_row, n_q_heads, scale, out,
                      window=0):
    """q, out: f32 [n, n_q_heads*head_dim]; query i sees rows 0 .. start_row+i, or with
    window > 0 rows max(0, start_row+i-window+1) .. start_row+i."""
    _attention_prefill(q, k_pages, v_pages, page_table, start_row, n_q_heads, scale, out,
                       int(window))


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
    """out = a + b, f32 [n, d]; out may alias a."""
    if a.shape[0] > 1 and a.size >= _PARALLEL_MIN:
        _add_parallel(a, b, out)
    else:
        _add_serial(a, b, out)


# -- snapkv_votes ------------------------------------------------------------
_VOTE_CHUNK_ROWS = 256


@njit(parallel=True, **_JIT)
def _snapkv_votes(q_window, k_pages, page_table, n_rows, scale, votes):
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
        for r in range(r0, r1):
            page = page_table[r // page_size]
            off = r % page_size
            for i in range(head_dim):
                kf[i] = _bf16_to_f32(k_pages[page, kv, off, i])
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


def snapkv_votes(q_window, k_pages, page_table, n_rows, scale):
    """q_window: f32 [n_q_heads, W, head_dim] -> host f32 [n_kv_heads, n_rows - W]."""
    votes = np.empty((k_pages.shape[1], n_rows - q_window.shape[1]), dtype=np.float32)
    _snapkv_votes(q_window, k_pages, page_table, n_rows, scale, votes)
    return votes


# -- kv_gather ---------------------------------------------------------------
@njit(parallel=True, **_JIT)
def _kv_gather(k_pages, v_pages, page_table, keep):
    page_size, head_dim = k_pages.shape[2], k_pages.shape[3]
    for h in prange(keep.shape[0]):          # heads are independent
        for j in range(keep.shape[1]):       # in order: rows only move down
            src = keep[h, j]
            if src == j:
                continue
            sp = page_table[src // page_size]
            so = src % page_size
            dp = page_table[j // page_size]
            do = j % page_size
            for i in range(head_dim):
                k_pages[dp, h, do, i] = k_pages[sp, h, so, i]
                v_pages[dp, h, do, i] = v_pages[sp, h, so, i]


def kv_gather(k_pages, v_pages, page_table, keep):
    """keep: int64 [n_kv_heads, n_keep] sorted rows per KV head (host)."""
    _kv_gather(k_pages, v_pages, page_table, keep)
