"""Numba kernels over the row-tiled weight layouts built by `quant_repack`.

Tiled layouts (R = 16 rows per tile; the last tile is zero-padded), codes unsigned
and grouped by 4 so that one 64-byte load holds 4 codes of each of the 16 rows:
    nibble: qs u8 [T, nb, 4, R, 4]  byte (g, r, i) = code 4g+i | code 16+4g+i << 4
            d, m f32 [T, nb, R]     value = d * code + m          (Q4_0, Q4_1, Q4_K)
                 (or uint16 f16 bits where f16 holds every scale exactly: half the bytes)
    five:   qs u8 [T, nb, 5, R, 4]  the nibble layout + a load of fifth bits (vnni._block_codes)
            d, m                    value = d * (code - 16) (Q5_0) or d * code + m (Q5_1, Q5_K)
    six:    qs u8 [T, nb, 3, R, 4]  16 codes + 32 in 6 bits (vnni._block_codes), Q6_K
    int8:   qs u8 [T, nb, 8, R, 4]  byte (g, r, i) = code 4g+i + 128, Q8_0
K-quants (Q4_K, Q5_K, Q6_K): d, m are uint8/int8 sub-block scales, times the super-block
scales dsup, msup [T, nb / (256 / L), R]; other types pass quant_repack.ABSENT there
(as for m without offsets).
Float tensors (F32, F16, BF16) stay in their file layout [rows, cols].

Mat-vec (decode) quantizes the activation per weight block to ACT_PLANES int8 planes
(x ~ dx1*q1 + dx2*q2: the second plane quantizes the residual of the first, so the
activation keeps ~15 bits and results stay within ~1e-5 of float activations) and
takes integer dot products in `vnni.make_tile_dot`: AVX-512 VNNI `vpdpbusd`, AVX2
`vpmaddubsw`/`vpmaddwd`, or elsewhere the same sums in portable LLVM vector IR
(widening multiplies and pairwise adds, which any LLVM target vectorizes).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from .vnni import AUTO_KERNELS, KERNELS, R, make_quant_row, make_tile_dot

# numba's cache keys on the target CPU, not on which tile kernel got inlined: with the portable
# kernels forced, a cached VNNI or AVX2 build would be loaded, so compile afresh instead.
_opts = dict(cache=KERNELS == AUTO_KERNELS, fastmath=True, nogil=True)


# -- mat-vec (decode) --------------------------------------------------------------

_PLANE_STEP = 254.0   # residual |r| <= 0.5 step of plane p -> codes <= 127 in plane p + 1
ACT_PLANES = 3     # int8 planes per activation block: 3 ~ fp32 activations (2 moves the tiny-model
                   # decode-vs-prefill logits ~1e-2, 1 = llama.cpp Q8 activations ~1 logit off HF)
MM_PLANES = 2      # mat-mat (prefill): ~15-bit activations (error ~2e-5 of a block's largest value)
MM_TOKENS = 8      # activations a mat-mat tile kernel dots each unpacked block with
MM_ACT_BYTES = 1 << 20   # quantized activations a mat-mat pass keeps in L2 (tokens per pass)


# Activation quantizers (vnni.make_quant_row) by block length: 32 codes, or 16 (Q6_K);
# mat-vecs take one activation at a time, mat-mats groups of MM_TOKENS
_quant32, _quant16 = (make_quant_row(L, ACT_PLANES, _PLANE_STEP) for L in (32, 16))
_quant32_mm, _quant16_mm = (make_quant_row(L, MM_PLANES, _PLANE_STEP, MM_TOKENS) for L in (32, 16))


@njit(inline="always", **_opts)
def _quant_acts(x, L, code_off, c0):
    """x f32 [n, nb*L] (rows of unit stride) -> xq, xs for the mat-vec tiles
    (vnni.act_sizes with ACT_PLANES planes, groups of 1), on the calling thread."""
    n, cols = x.shape
    xq = np.empty(n * ACT_PLANES * cols, np.int8)
    xs = np.empty(n * (ACT_PLANES + 2) * (cols // L), np.float32)
    for i in range(n):
        if L == 16:
            _quant16(x, i, code_off, c0, xq, xs)
        else:
            _quant32(x, i, code_off, c0, xq, xs)
    return xq, xs


@njit(inline="always", **_opts)
def _quant_acts_mm(x, L, code_off, c0):
    """_quant_acts for mat-mat: MM_PLANES planes in groups of MM_TOKENS activations, the
    rows in parallel; a last group's missing rows are zeros (read, never stored)."""
    n, cols = x.shape
    groups = (n + MM_TOKENS - 1) // MM_TOKENS
    q_group, s_group = MM_TOKENS * MM_PLANES * cols, MM_TOKENS * (MM_PLANES + 2) * (cols // L)
    xq = np.empty(groups * q_group, np.int8)
    xs = np.empty(groups * s_group, np.float32)
    xq[(groups - 1) * q_group:] = 0         # the last group, whose rows past n stay zero
    xs[(groups - 1) * s_group:] = 0
    for i in prange(n):
        if L == 16:
            _quant16_mm(x, i, code_off, c0, xq, xs)
        else:
            _quant32_mm(x, i, code_off, c0, xq, xs)
    return xq, xs


# Layout kinds (quant_repack.KIND_OF)
NIBBLE, FIVE, SIX, INT8 = 0, 1, 2, 3

# AVX-512 VNNI or AVX2 where the target has it, else the same sums in portable vector IR;
# mat-vec tiles take one activation, mat-mat tiles MM_TOKENS of them
_tile_nibble = make_tile_dot("nibble", 4, ACT_PLANES, True, KERNELS)
_tile_five = make_tile_dot("five", 5, ACT_PLANES, False, KERNELS)
_tile_five_m = make_tile_dot("five", 5, ACT_PLANES, True, KERNELS)
_tile_six = make_tile_dot("six", 3, ACT_PLANES, False, KERNELS)
_tile_int8 = make_tile_dot("int8", 8, ACT_PLANES, False, KERNELS)
_mm_nibble = make_tile_dot("nibble", 4, MM_PLANES, True, KERNELS, MM_TOKENS)
_mm_five = make_tile_dot("five", 5, MM_PLANES, False, KERNELS, MM_TOKENS)
_mm_five_m = make_tile_dot("five", 5, MM_PLANES, True, KERNELS, MM_TOKENS)
_mm_six = make_tile_dot("six", 3, MM_PLANES, False, KERNELS, MM_TOKENS)
_mm_int8 = make_tile_dot("int8", 8, MM_PLANES, False, KERNELS, MM_TOKENS)


@njit(inline="always", **_opts)
def _n(t, out):
    """Rows of tile t inside an output row of out (16 but in the last tile)."""
    return min(R, out.shape[1] - t * R)


# Mat-vec of n = 1 .. quant.MULTI_MAX activations: decode, one row per request when
# batched. Each activation is quantized once, then each tile is dotted with every
# activation in turn while it sits in L1, so the weight streams from memory once per
# call. Every row runs the same machine code whatever n, so row i is bit-identical to a
# call with x[i] alone (separate kernels for n == 1 would not be: under fastmath the
# backend reassociates the unrolled block sums of _quant_acts by the critical path of
# the code around them).
# One pair of kernels per layout kind (one for all would compile every tile kernel for
# each weight type: 3x the first load's compile time), each with a parallel and a serial
# twin: QuantWeight picks one by size at load (waking the thread pool costs more than it
# saves on a matrix of well under a millisecond).
# qs, d, m, dsup, msup (, has_m): quant_repack.repack's arrays; x: f32 [n, cols]
# C-contiguous; out: f32 [n, rows] with unit stride along a row (its row stride free: out
# may be a column slice of a wider array).

@njit(inline="always", **_opts)
def _check_out(out):
    if out.strides[1] != 4:
        raise ValueError("quantized mat-vec: out rows must have unit stride")


@njit(parallel=True, **_opts)
def mv_nibble(qs, d, m, dsup, msup, x, out):
    _check_out(out)
    xq, xs = _quant_acts(x, 32, 0, 8)
    for t in prange(qs.shape[0]):
        for i in range(x.shape[0]):
            _tile_nibble(qs, d, m, dsup, msup, xq, xs, i, i + 1, t, out, t * R, _n(t, out))


@njit(**_opts)
def mv_nibble_serial(qs, d, m, dsup, msup, x, out):
    _check_out(out)
    xq, xs = _quant_acts(x, 32, 0, 8)
    for t in range(qs.shape[0]):
        for i in range(x.shape[0]):
            _tile_nibble(qs, d, m, dsup, msup, xq, xs, i, i + 1, t, out, t * R, _n(t, out))


@njit(inline="always", **_opts)
def _five_tile(qs, d, m, dsup, msup, has_m, xq, xs, i, t, out):
    if has_m:
        _tile_five_m(qs, d, m, dsup, msup, xq, xs, i, i + 1, t, out, t * R, _n(t, out))
    else:
        _tile_five(qs, d, m, dsup, msup, xq, xs, i, i + 1, t, out, t * R, _n(t, out))


@njit(parallel=True, **_opts)
def mv_five(qs, d, m, dsup, msup, has_m, x, out):
    _check_out(out)
    xq, xs = _quant_acts(x, 32, 0 if has_m else 16, 16 if has_m else 0)
    for t in prange(qs.shape[0]):
        for i in range(x.shape[0]):
            _five_tile(qs, d, m, dsup, msup, has_m, xq, xs, i, t, out)


@njit(**_opts)
def mv_five_serial(qs, d, m, dsup, msup, has_m, x, out):
    _check_out(out)
    xq, xs = _quant_acts(x, 32, 0 if has_m else 16, 16 if has_m else 0)
    for t in range(qs.shape[0]):
        for i in range(x.shape[0]):
            _five_tile(qs, d, m, dsup, msup, has_m, xq, xs, i, t, out)


@njit(parallel=True, **_opts)
def mv_six(qs, d, m, dsup, msup, x, out):
    _check_out(out)
    xq, xs = _quant_acts(x, 16, 32, 0)
    for t in prange(qs.shape[0]):
        for i in range(x.shape[0]):
            _tile_six(qs, d, m, dsup, msup, xq, xs, i, i + 1, t, out, t * R, _n(t, out))


@njit(**_opts)
def mv_six_serial(qs, d, m, dsup, msup, x, out):
    _check_out(out)
    xq, xs = _quant_acts(x, 16, 32, 0)
    for t in range(qs.shape[0]):
        for i in range(x.shape[0]):
            _tile_six(qs, d, m, dsup, msup, xq, xs, i, i + 1, t, out, t * R, _n(t, out))


@njit(parallel=True, **_opts)
def mv_int8(qs, d, m, dsup, msup, x, out):
    _check_out(out)
    xq, xs = _quant_acts(x, 32, 128, 0)
    for t in prange(qs.shape[0]):
        for i in range(x.shape[0]):
            _tile_int8(qs, d, m, dsup, msup, xq, xs, i, i + 1, t, out, t * R, _n(t, out))


@njit(**_opts)
def mv_int8_serial(qs, d, m, dsup, msup, x, out):
    _check_out(out)
    xq, xs = _quant_acts(x, 32, 128, 0)
    for t in range(qs.shape[0]):
        for i in range(x.shape[0]):
            _tile_int8(qs, d, m, dsup, msup, xq, xs, i, i + 1, t, out, t * R, _n(t, out))


# kind -> (parallel, serial) mat-vec; the five kind takes has_m after msup
MAT_VEC = {NIBBLE: (mv_nibble, mv_nibble_serial), FIVE: (mv_five, mv_five_serial),
           SIX: (mv_six, mv_six_serial), INT8: (mv_int8, mv_int8_serial)}


# Mat-mat (prefill, n > quant.MULTI_MAX): the activations quantized to MM_PLANES int8
# planes, then each tile's blocks unpacked once for MM_TOKENS activations at a time
# (the int8 dot products replace dequantizing to f32 and a BLAS sgemm). Tokens go in
# passes whose quantized activations (~MM_ACT_BYTES) stay in L2 while every tile, in
# parallel, is dotted with them. Arguments as the kind's mat-vec; x may be strided.

@njit(inline="always", **_opts)
def _mm_pass(x):
    """Tokens per mat-mat pass, a multiple of MM_TOKENS."""
    return max(MM_TOKENS, MM_ACT_BYTES // (MM_PLANES * x.shape[1]) // MM_TOKENS * MM_TOKENS)


@njit(parallel=True, **_opts)
def mm_nibble(qs, d, m, dsup, msup, x, out):
    _check_out(out)
    xq, xs = _quant_acts_mm(x, 32, 0, 8)
    n, step = x.shape[0], _mm_pass(x)
    for c0 in range(0, n, step):
        for t in prange(qs.shape[0]):
            for j in range(c0, min(n, c0 + step), MM_TOKENS):
                _mm_nibble(qs, d, m, dsup, msup, xq, xs, j, n, t, out, t * R, _n(t, out))


@njit(parallel=True, **_opts)
def mm_five(qs, d, m, dsup, msup, has_m, x, out):
    _check_out(out)
    xq, xs = _quant_acts_mm(x, 32, 0 if has_m else 16, 16 if has_m else 0)
    n, step = x.shape[0], _mm_pass(x)
    for c0 in range(0, n, step):
        for t in prange(qs.shape[0]):
            for j in range(c0, min(n, c0 + step), MM_TOKENS):
                if has_m:
                    _mm_five_m(qs, d, m, dsup, msup, xq, xs, j, n, t, out, t * R, _n(t, out))
                else:
                    _mm_five(qs, d, m, dsup, msup, xq, xs, j, n, t, out, t * R, _n(t, out))


@njit(parallel=True, **_opts)
def mm_six(qs, d, m, dsup, msup, x, out):
    _check_out(out)
    xq, xs = _quant_acts_mm(x, 16, 32, 0)
    n, step = x.shape[0], _mm_pass(x)
    for c0 in range(0, n, step):
        for t in prange(qs.shape[0]):
            for j in range(c0, min(n, c0 + step), MM_TOKENS):
                _mm_six(qs, d, m, dsup, msup, xq, xs, j, n, t, out, t * R, _n(t, out))


@njit(parallel=True, **_opts)
def mm_int8(qs, d, m, dsup, msup, x, out):
    _check_out(out)
    xq, xs = _quant_acts_mm(x, 32, 128, 0)
    n, step = x.shape[0], _mm_pass(x)
    for c0 in range(0, n, step):
        for t in prange(qs.shape[0]):
            for j in range(c0, min(n, c0 + step), MM_TOKENS):
                _mm_int8(qs, d, m, dsup, msup, xq, xs, j, n, t, out, t * R, _n(t, out))


# kind -> mat-mat
MAT_MAT = {NIBBLE: mm_nibble, FIVE: mm_five, SIX: mm_six, INT8: mm_int8}


@njit(**_opts)
def _f16_to_f32(h):
    """h: uint16 bits -> float32 (handles subnormals, inf, nan)."""
    h = np.uint32(h)
    sign = (h & np.uint32(0x8000)) << np.uint32(16)
    em = h & np.uint32(0x7FFF)
    if em >= np.uint32(0x7C00):                        # inf / nan
        return np.uint32(sign | (em << np.uint32(13)) | np.uint32(0x7F800000)).view(np.float32)
    # exponent/mantissa bits into f32 position, rebias by 2**112 (handles subnormals)
    mag = np.uint32(em << np.uint32(13)).view(np.float32) * np.float32(5.192296858534828e+33)
    return -mag if sign else mag


def _sc(v):
    """A scale read from a d/m array: f32 as is, uint16 as f16 bits."""
    return np.float32(v)


@overload(_sc, jit_options=dict(nogil=True))   # not cached alone: see jit._OVERLOAD
def _sc_impl(v):
    if v == types.uint16:
        return lambda v: _f16_to_f32(v)
    return lambda v: np.float32(v)


@njit(parallel=True, **_opts)
def mv_float(w, kind, x, out):
    """w [rows, cols] f32 (kind 0), uint16 f16 bits (kind 1) or uint16 bf16 bits (kind 2);
    x f32 [n, cols]; out f32 [n, rows]. Each weight row is dotted with every activation
    while in L1, by the same code for every row of x (as mv_nibble)."""
    rows, cols = w.shape
    for r in prange(rows):
        for i in range(x.shape[0]):
            acc = np.float32(0)
            if kind == 0:
                for k in range(cols):
                    acc += np.float32(w[r, k]) * x[i, k]
            elif kind == 1:
                for k in range(cols):
                    acc += _f16_to_f32(w[r, k]) * x[i, k]
            else:
                for k in range(cols):
                    acc += np.uint32(np.uint32(w[r, k]) << np.uint32(16)).view(np.float32) * x[i, k]
            out[i, r] = acc


# -- dequantize selected rows (embedding, prefill tiles) ---------------------------------
# Serial on purpose: the mat-mat path runs these between BLAS calls, and waking the
# numba thread pool there leaves its workers spinning while BLAS wants the cores.

def _row_scales(sc, sup, t, r, out):
    """out f32 [nb] = the block scales of row r of tile t: sc's, or K-quant sub-block x
    super-block scales."""


@overload(_row_scales, jit_options=dict(nogil=True))   # not cached alone: see jit._OVERLOAD
def _row_scales_impl(sc, sup, t, r, out):
    if sc.dtype in (types.uint8, types.int8):
        def sub(sc, sup, t, r, out):
            ksub = sc.shape[1] // sup.shape[1]
            for s in range(sup.shape[1]):
                base = _sc(sup[t, s, r])
                for k in range(s * ksub, (s + 1) * ksub):
                    out[k] = base * np.float32(sc[t, k, r])
        return sub

    def plain(sc, sup, t, r, out):
        for b in range(sc.shape[1]):
            out[b] = _sc(sc[t, b, r])
    return plain


# Dequantize selected rows (prefill's mat-mat tiles, embedding): ids int [k] row numbers;
# out f32 [k, cols]; the other arguments as the kind's mat-vec takes them.

@njit(**_opts)
def deq_nibble(qs, d, m, dsup, msup, ids, out):
    nb = qs.shape[1]
    ds, ms = np.empty(nb, np.float32), np.empty(nb, np.float32)
    for i in range(ids.shape[0]):
        t, r = ids[i] // R, ids[i] % R
        _row_scales(d, dsup, t, r, ds)
        _row_scales(m, msup, t, r, ms)
        for b in range(nb):
            db, mb = ds[b], ms[b]
            for g in range(4):
                for j in range(4):
                    q = qs[t, b, g, r, j]
                    out[i, b * 32 + 4 * g + j] = db * np.float32(q & 15) + mb
                    out[i, b * 32 + 16 + 4 * g + j] = db * np.float32(q >> 4) + mb


@njit(**_opts)
def deq_five(qs, d, m, dsup, msup, has_m, ids, out):
    """Codes of 5 bits: the nibbles and, in load 4, bit 2g / 2g+1 of byte j for the
    low / high nibble of load g's byte j; Q5_0 (no m) codes are stored + 16."""
    nb = qs.shape[1]
    ds, ms = np.empty(nb, np.float32), np.zeros(nb, np.float32)
    off = np.float32(0) if has_m else np.float32(16)
    for i in range(ids.shape[0]):
        t, r = ids[i] // R, ids[i] % R
        _row_scales(d, dsup, t, r, ds)
        if has_m:
            _row_scales(m, msup, t, r, ms)
        for b in range(nb):
            db, mb = ds[b], ms[b] - ds[b] * off
            for g in range(4):
                for j in range(4):
                    q, h = np.int32(qs[t, b, g, r, j]), np.int32(qs[t, b, 4, r, j]) >> (2 * g)
                    out[i, b * 32 + 4 * g + j] = db * np.float32((q & 15) | ((h & 1) << 4)) + mb
                    out[i, b * 32 + 16 + 4 * g + j] = db * np.float32((q >> 4) | ((h & 2) << 3)) + mb


@njit(**_opts)
def deq_six(qs, d, m, dsup, msup, ids, out):
    """16 codes + 32 of 6 bits from 3 loads (vnni._block_codes)."""
    nb = qs.shape[1]
    ds = np.empty(nb, np.float32)
    for i in range(ids.shape[0]):
        t, r = ids[i] // R, ids[i] % R
        _row_scales(d, dsup, t, r, ds)
        for b in range(nb):
            db, o = ds[b], b * 16
            for j in range(4):
                l0, l1, h = np.int32(qs[t, b, 0, r, j]), np.int32(qs[t, b, 1, r, j]), np.int32(qs[t, b, 2, r, j])
                out[i, o + j] = db * np.float32(((l0 & 15) | ((h & 3) << 4)) - 32)
                out[i, o + 4 + j] = db * np.float32(((l1 & 15) | (h & 0x30)) - 32)
                out[i, o + 8 + j] = db * np.float32(((l0 >> 4) | ((h << 2) & 0x30)) - 32)
                out[i, o + 12 + j] = db * np.float32(((l1 >> 4) | ((h >> 2) & 0x30)) - 32)


@njit(**_opts)
def deq_int8(qs, d, m, dsup, msup, ids, out):
    """Codes stored + 128, no offset (Q8_0)."""
    nb = qs.shape[1]
    ds = np.empty(nb, np.float32)
    for i in range(ids.shape[0]):
        t, r = ids[i] // R, ids[i] % R
        _row_scales(d, dsup, t, r, ds)
        for b in range(nb):
            db = ds[b]
            for g in range(8):
                for j in range(4):
                    out[i, b * 32 + 4 * g + j] = db * np.float32(np.int32(qs[t, b, g, r, j]) - 128)


# kind -> dequantizer (the same arguments as the kind's mat-vec)
DEQUANTIZE = {NIBBLE: deq_nibble, FIVE: deq_five, SIX: deq_six, INT8: deq_int8}


@njit(**_opts)
def deq_float(w, kind, ids, out):
    """w [rows, cols] as in mv_float; ids int [k]; out f32 [k, cols]."""
    cols = w.shape[1]
    for i in range(ids.shape[0]):
        r = ids[i]
        for k in range(cols):
            if kind == 0:
                out[i, k] = np.float32(w[r, k])
            elif kind == 1:
                out[i, k] = _f16_to_f32(w[r, k])
            else:
                out[i, k] = np.uint32(np.uint32(w[r, k]) << np.uint32(16)).view(np.float32)
