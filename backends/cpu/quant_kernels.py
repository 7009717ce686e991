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
scales dsup, msup [T, nb / (256 / L), R]; other types pass NO_SUPER there.
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

from .vnni import AUTO_KERNELS, KERNELS, R, make_tile_dot

# numba's cache keys on the target CPU, not on which tile kernel got inlined: with the portable
# kernels forced, a cached VNNI or AVX2 build would be loaded, so compile afresh instead.
_opts = dict(cache=KERNELS == AUTO_KERNELS, fastmath=True, nogil=True)


# -- mat-vec (decode) --------------------------------------------------------------

_PLANE_STEP = 254.0   # residual |r| <= 0.5 step of plane p -> codes <= 127 in plane p + 1
ACT_PLANES = 3     # int8 planes per activation block: 3 ~ fp32 activations (2 moves the tiny-model
                   # decode-vs-prefill logits ~1e-2, 1 = llama.cpp Q8 activations ~1 logit off HF)


@njit(inline="always", **_opts)
def _quant_acts(x, L, code_off, c0):
    """x f32 [n, nb*L] -> xq i8 [n, ACT_PLANES, nb*L], xs f32 [n, ACT_PLANES + 2, nb]: per
    activation and block the scale of each plane, corr, and the exact block sum sx.
    Plane p + 1 codes the rounding residual of plane p in steps _PLANE_STEP times finer.
    With codes stored as c + code_off (c ~ c0 on average), d * (dot_q + corr) + m * sx
    is the dot of d * c + m with x up to d * sum (c - c0) * (x - xhat): the rounding
    error of the activation only meets centred codes."""
    n, cols = x.shape
    nb = cols // L
    xq = np.empty((n, ACT_PLANES, cols), np.int8)
    xs = np.empty((n, ACT_PLANES + 2, nb), np.float32)
    res = np.empty(L, np.float32)
    step = np.float32(_PLANE_STEP)
    for i in range(n):
        for b in range(nb):
            o = b * L
            sx = np.float32(0)
            amax = np.float32(0)
            for j in range(L):
                v = x[i, o + j]
                sx += v
                amax = max(amax, abs(v))
            dx = amax / np.float32(127)
            inv = np.float32(1) / dx if dx > 0 else np.float32(0)
            for j in range(L):
                res[j] = x[i, o + j] * inv       # in units of dx, |res| <= 127
            qsum = np.float32(0)                 # sum of the dequantized codes, in units of dx
            unit = np.float32(1)
            for p in range(ACT_PLANES):
                psum = np.int32(0)
                for j in range(L):
                    q = np.rint(res[j])
                    xq[i, p, o + j] = np.int8(q)
                    psum += np.int32(q)
                    res[j] = (res[j] - q) * step     # |res| <= step / 2 = 127
                xs[i, p, b] = dx * unit
                qsum += np.float32(psum) * unit
                unit /= step
            sx_hat = qsum * dx
            xs[i, ACT_PLANES, b] = -np.float32(code_off) * sx_hat + np.float32(c0) * (sx - sx_hat)
            xs[i, ACT_PLANES + 1, b] = sx
    return xq, xs


# Layout kinds (quant_repack.KIND_OF)
NIBBLE, FIVE, SIX, INT8 = 0, 1, 2, 3

# AVX-512 VNNI or AVX2 where the target has it, else the same sums in portable vector IR
_tile_nibble = make_tile_dot("nibble", 4, ACT_PLANES, True, KERNELS)
_tile_five = make_tile_dot("five", 5, ACT_PLANES, False, KERNELS)
_tile_five_m = make_tile_dot("five", 5, ACT_PLANES, True, KERNELS)
_tile_six = make_tile_dot("six", 3, ACT_PLANES, False, KERNELS)
_tile_int8 = make_tile_dot("int8", 8, ACT_PLANES, False, KERNELS)


@njit(inline="always", **_opts)
def _n(t, out):
    """Rows of tile t inside the output row out (16 but in the last tile)."""
    return min(R, out.shape[0] - t * R)


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
            _tile_nibble(qs, d, m, dsup, msup, xq[i], xs[i], t, out[i], t * R, _n(t, out[i]))


@njit(**_opts)
def mv_nibble_serial(qs, d, m, dsup, msup, x, out):
    _check_out(out)
    xq, xs = _quant_acts(x, 32, 0, 8)
    for t in range(qs.shape[0]):
        for i in range(x.shape[0]):
            _tile_nibble(qs, d, m, dsup, msup, xq[i], xs[i], t, out[i], t * R, _n(t, out[i]))


@njit(inline="always", **_opts)
def _five_tile(qs, d, m, dsup, msup, has_m, xq, xs, t, out):
    if has_m:
        _tile_five_m(qs, d, m, dsup, msup, xq, xs, t, out, t * R, _n(t, out))
    else:
        _tile_five(qs, d, m, dsup, msup, xq, xs, t, out, t * R, _n(t, out))


@njit(parallel=True, **_opts)
def mv_five(qs, d, m, dsup, msup, has_m, x, out):
    _check_out(out)
    xq, xs = _quant_acts(x, 32, 0, 16) if has_m else _quant_acts(x, 32, 16, 0)
    for t in prange(qs.shape[0]):
        for i in range(x.shape[0]):
            _five_tile(qs, d, m, dsup, msup, has_m, xq[i], xs[i], t, out[i])


@njit(**_opts)
def mv_five_serial(qs, d, m, dsup, msup, has_m, x, out):
    _check_out(out)
    xq, xs = _quant_acts(x, 32, 0, 16) if has_m else _quant_acts(x, 32, 16, 0)
    for t in range(qs.shape[0]):
        for i in range(x.shape[0]):
            _five_tile(qs, d, m, dsup, msup, has_m, xq[i], xs[i], t, out[i])


@njit(parallel=True, **_opts)
def mv_six(qs, d, m, dsup, msup, x, out):
    _check_out(out)
    xq, xs = _quant_acts(x, 16, 32, 0)
    for t in prange(qs.shape[0]):
        for i in range(x.shape[0]):
            _tile_six(qs, d, m, dsup, msup, xq[i], xs[i], t, out[i], t * R, _n(t, out[i]))


@njit(**_opts)
def mv_six_serial(qs, d, m, dsup, msup, x, out):
    _check_out(out)
    xq, xs = _quant_acts(x, 16, 32, 0)
    for t in range(qs.shape[0]):
        for i in range(x.shape[0]):
            _tile_six(qs, d, m, dsup, msup, xq[i], xs[i], t, out[i], t * R, _n(t, out[i]))


@njit(parallel=True, **_opts)
def mv_int8(qs, d, m, dsup, msup, x, out):
    _check_out(out)
    xq, xs = _quant_acts(x, 32, 128, 0)
    for t in prange(qs.shape[0]):
        for i in range(x.shape[0]):
            _tile_int8(qs, d, m, dsup, msup, xq[i], xs[i], t, out[i], t * R, _n(t, out[i]))


@njit(**_opts)
def mv_int8_serial(qs, d, m, dsup, msup, x, out):
    _check_out(out)
    xq, xs = _quant_acts(x, 32, 128, 0)
    for t in range(qs.shape[0]):
        for i in range(x.shape[0]):
            _tile_int8(qs, d, m, dsup, msup, xq[i], xs[i], t, out[i], t * R, _n(t, out[i]))


# kind -> (parallel, serial) mat-vec; the five kind takes has_m after msup
MAT_VEC = {NIBBLE: (mv_nibble, mv_nibble_serial), FIVE: (mv_five, mv_five_serial),
           SIX: (mv_six, mv_six_serial), INT8: (mv_int8, mv_int8_serial)}


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


@overload(_sc, jit_options=dict(cache=True))
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

def _block_scale(sc, sup, t, b, r):
    """Scale of block b, row r of tile t: sc itself, or K-quant sub-block x super-block."""


@overload(_block_scale, jit_options=dict(cache=True))
def _block_scale_impl(sc, sup, t, b, r):
    if sc.dtype in (types.uint8, types.int8):
        return lambda sc, sup, t, b, r: _sc(sup[t, b // (sc.shape[1] // sup.shape[1]), r]) * np.float32(sc[t, b, r])
    return lambda sc, sup, t, b, r: _sc(sc[t, b, r])


@njit(**_opts)
def deq(qs, d, m, dsup, msup, kind, has_m, ids, out):
    """The rows ids (int [k]) of one layout above, dequantized: out f32 [k, cols]."""
    nb = qs.shape[1]
    L = out.shape[1] // nb
    for i in range(ids.shape[0]):
        t, r = ids[i] // R, ids[i] % R
        for b in range(nb):
            db = _block_scale(d, dsup, t, b, r)
            mb = _block_scale(m, msup, t, b, r) if has_m else np.float32(0)
            o = b * L
            if kind == INT8:
                for g in range(8):
                    for j in range(4):
                        out[i, o + 4 * g + j] = db * np.float32(np.int32(qs[t, b, g, r, j]) - 128) + mb
            elif kind == SIX:
                for j in range(4):
                    l0, l1, h = np.int32(qs[t, b, 0, r, j]), np.int32(qs[t, b, 1, r, j]), np.int32(qs[t, b, 2, r, j])
                    out[i, o + j] = db * np.float32(((l0 & 15) | ((h & 3) << 4)) - 32)
                    out[i, o + 4 + j] = db * np.float32(((l1 & 15) | (h & 0x30)) - 32)
                    out[i, o + 8 + j] = db * np.float32(((l0 >> 4) | ((h << 2) & 0x30)) - 32)
                    out[i, o + 12 + j] = db * np.float32(((l1 >> 4) | ((h >> 2) & 0x30)) - 32)
            else:               # nibbles, and for FIVE their fifth bits (bit 2g / 2g+1 of load 4)
                off = np.int32(16) if kind == FIVE and not has_m else np.int32(0)
                for g in range(4):
                    for j in range(4):
                        q = np.int32(qs[t, b, g, r, j])
                        lo, hi = q & 15, q >> 4
                        if kind == FIVE:
                            h = np.int32(qs[t, b, 4, r, j])
                            lo |= ((h >> (2 * g)) & 1) << 4
                            hi |= ((h >> (2 * g + 1)) & 1) << 4
                        out[i, o + 4 * g + j] = db * np.float32(lo - off) + mb
                        out[i, o + 16 + 4 * g + j] = db * np.float32(hi - off) + mb


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
