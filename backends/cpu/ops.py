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


@njit(inline="always", **_JIT)
def _exp_f32(x):
    """expf that LLVM can vectorise (no SVML here): Cephes polynomial, ~1 ulp.
    Underflows to 0 below -87.3 (so exp(-inf) = 0); NaN stays NaN."""
    xc = min(max(x, np.float32(-87.33654)), np.float32(88.0))
    n = math.floor(xc * np.float32(1.442695040888963) + np.float32(0.5))
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


# -- rms_norm ----------------------------------------------------------------
@njit(inline="always", **_JIT)
def _rms_norm_row(x, weight, eps, out, t):
    d = x.shape[1]
    ss = 0.0
    for i in range(d):
        v = np.float64(x[t, i])
        ss += v * v
    inv = np.float32(1.0 / math.sqrt(ss / d + eps))
    for i in range(d):
        out[t, i] = x[t, i] * inv * weight[i]


@njit(**_JIT)
def _rms_norm_serial(x, weight, eps, out):
    for t in range(x.shape[0]):
        _rms_norm_row(x, weight, eps, out, t)


@njit(parallel=True, **_JIT)
def _rms_norm_parallel(x, weight, eps, out):
    for t in prange(x.shape[0]):
        _rms_norm_row(x, weight, eps, out, t)


def rms_norm(x, weight, eps, out):
    """x, out: f32 [n, d]; weight: f32 [d]."""
    if x.shape[0] > 1 and x.size >= _PARALLEL_MIN:
        _rms_norm_parallel(x, weight, eps, out)
    else:
        _rms_norm_serial(x, weight, eps, out)


# -- rope --------------------------------------------------------------------
@njit(inline="always", **_JIT)
def _rope_row(x, pos, n_heads, head_dim, rot_dim, log_base, neox, t):
    half = rot_dim // 2
    for i in range(half):
        # angle in float64: pos * base^(-2i/rot) reaches thousands of radians
        angle = pos * math.exp(-2.0 * i / rot_dim * log_base)
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
def _rope_serial(x, positions, n_heads, head_dim, rot_dim, log_base, neox):
    for t in range(x.shape[0]):
        _rope_row(x, np.float64(positions[t]), n_heads, head_dim, rot_dim, log_base, neox, t)


@njit(parallel=True, **_JIT)
def _rope_parallel(x, positions, n_heads, head_dim, rot_dim, log_base, neox):
    for t in prange(x.shape[0]):
        _rope_row(x, np.float64(positions[t]), n_heads, head_dim, rot_dim, log_base, neox, t)


def rope(x, positions, n_heads, head_dim, rot_dim, freq_base, neox):
    """x: f32 [n, >= n_heads*head_dim], in place; positions: int32 [n] (host)."""
    args = (x, positions, n_heads, head_dim, rot_dim, math.log(freq_base), bool(neox))
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
# Flash-decoding: tasks = (kv head, chunk of whole pages); each task reads its
# K/V rows once for all query heads of the group and keeps a running
# (max, sum, acc) per query head; a serial merge combines the chunks.
_DECODE_CHUNK_ROWS = 256   # rows per task, rounded to whole pages
_ROW_BLOCK = 32            # rows scored together before one online-softmax rescale


@njit(parallel=True, **_JIT)
def _attention_decode(q, k_pages, v_pages, page_table, n_rows, n_q_heads, scale, out,
                      pages_per_chunk):
    n_kv_heads, page_size, head_dim = k_pages.shape[1], k_pages.shape[2], k_pages.shape[3]
    group = n_q_heads // n_kv_heads
    n_pages = (n_rows + page_size - 1) // page_size
    n_chunks = (n_pages + pages_per_chunk - 1) // pages_per_chunk
    n_tasks = n_kv_heads * n_chunks
    part_acc = np.empty((n_tasks, group, head_dim), dtype=np.float32)
    part_max = np.empty((n_tasks, group), dtype=np.float32)
    part_sum = np.empty((n_tasks, group), dtype=np.float32)
    for task in prange(n_tasks):
        kv = task // n_chunks
        chunk = task % n_chunks
        qs = np.empty((group, head_dim), dtype=np.float32)       # scaled queries of the group
        for g in range(group):
            qbase = (kv * group + g) * head_dim
            for i in range(head_dim):
                qs[g, i] = q[0, qbase + i] * scale
        kf = np.empty(head_dim, dtype=np.float32)
        vf = np.empty(head_dim, dtype=np.float32)
        scores = np.empty((group, _ROW_BLOCK), dtype=np.float32)
        acc = np.zeros((group, head_dim), dtype=np.float32)
        m = np.full(group, _NEG_INF, dtype=np.float32)
        l = np.zeros(group, dtype=np.float32)
        row_lo = chunk * pages_per_chunk * page_size
        row_hi = min(n_rows, row_lo + pages_per_chunk * page_size)
        for blk in range(row_lo, row_hi, _ROW_BLOCK):
            blk_n = min(_ROW_BLOCK, row_hi - blk)
            pidx0 = blk // page_size
            off0 = blk % page_size
            pidx = pidx0
            off = off0
            for j in range(blk_n):
                krow = k_pages[page_table[pidx], kv, off]
                off += 1
                if off == page_size:
                    off = 0
                    pidx += 1
                for i in range(head_dim):
                    kf[i] = _bf16_to_f32(krow[i])
                for g in range(group):
                    qg = qs[g]
                    s = np.float32(0.0)
                    for i in range(head_dim):
                        s += qg[i] * kf[i]
                    scores[g, j] = s
            for g in range(group):
                bm = m[g]
                for j in range(blk_n):
                    bm = max(bm, scores[g, j])
                alpha = _exp_f32(m[g] - bm)
                m[g] = bm
                l[g] *= alpha
                for i in range(head_dim):
                    acc[g, i] *= alpha
                lg = l[g]
                for j in range(blk_n):
                    p = _exp_f32(scores[g, j] - bm)
                    scores[g, j] = p
                    lg += p
                l[g] = lg
            pidx = pidx0
            off = off0
            for j in range(blk_n):
                vrow = v_pages[page_table[pidx], kv, off]
                off += 1
                if off == page_size:
                    off = 0
                    pidx += 1
                for i in range(head_dim):
                    vf[i] = _bf16_to_f32(vrow[i])
                for g in range(group):
                    p = scores[g, j]
                    ag = acc[g]
                    for i in range(head_dim):
                        ag[i] += p * vf[i]
        for g in range(group):
            part_max[task, g] = m[g]
            part_sum[task, g] = l[g]
            for i in range(head_dim):
                part_acc[task, g, i] = acc[g, i]
    # merge the chunks of each query head
    for h in range(n_q_heads):
        kv = h // group
        g = h % group
        gm = np.float32(_NEG_INF)
        for c in range(n_chunks):
            gm = max(gm, part_max[kv * n_chunks + c, g])
        total = np.float32(0.0)
        for c in range(n_chunks):
            total += part_sum[kv * n_chunks + c, g] * np.float32(math.exp(part_max[kv * n_chunks + c, g] - gm))
        for i in range(head_dim):
            out[0, h * head_dim + i] = 0.0
        for c in range(n_chunks):
            w = np.float32(math.exp(part_max[kv * n_chunks + c, g] - gm)) / total
            for i in range(head_dim):
                out[0, h * head_dim + i] += w * part_acc[kv * n_chunks + c, g, i]


def attention_decode(q, k_pages, v_pages, page_table, n_rows, n_q_heads, scale, out):
    """q, out: f32 [1, n_q_heads*head_dim]; attends physical rows 0 .. n_rows-1."""
    pages_per_chunk = max(1, _DECODE_CHUNK_ROWS // k_pages.shape[2])
    _attention_decode(q, k_pages, v_pages, page_table, n_rows, n_q_heads, scale, out,
                      pages_per_chunk)


# -- attention_prefill -------------------------------------------------------
# Tasks = (kv head, block of queries). A task holds the group's queries of its
# block ([group*QB, head_dim]), converts K/V tiles of TILE rows to f32 once
# (K transposed so scores vectorise over rows) and runs an online softmax.
_PREFILL_QB = 16
_PREFILL_TILE = 64


@njit(parallel=True, **_JIT)
def _attention_prefill(q, k_pages, v_pages, page_table, start_row, n_q_heads, scale, out):
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
        for r0 in range(0, rows_end, _PREFILL_TILE):
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
                for j in range(tn):
                    s[a, j] = 0.0
                for i in range(head_dim):
                    qi = qs[a, i]
                    for j in range(tn):
                        s[a, j] += qi * kt[i, j]
                visible = min(tn, last[a] - r0 + 1)
                if visible <= 0:
                    continue
                bm = m[a]
                for j in range(visible):
                    bm = max(bm, s[a, j])
                alpha = _exp_f32(m[a] - bm)
                m[a] = bm
                l[a] *= alpha
                for i in range(head_dim):
                    acc[a, i] *= alpha
                la = l[a]
                aa = acc[a]
                for j in range(visible):
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


def attention_prefill(q, k_pages, v_pages, page_table, start_row, n_q_heads, scale, out):
    """q, out: f32 [n, n_q_heads*head_dim]; query i sees rows 0 .. start_row+i."""
    _attention_prefill(q, k_pages, v_pages, page_table, start_row, n_q_heads, scale, out)


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
