"""Numba kernels over the row-tiled weight layouts built by `quant_repack`.

Tiled layouts (R = 16 rows per tile; the last tile is zero-padded):
    nibble: qs u8 [T, nb, 16, R]   byte (j, r) = code j | code j+16 << 4 of block b, row r
            d, m f32 [T, nb, R]    value = d * code + m         (Q4_0, Q4_1, Q4_K)
    int8:   qs i8 [T, nb, L, R]    one code per element, L = block length (32 or 16)
            d, m f32 [T, nb, R]    value = d * code (+ m)       (Q8_0, Q5_*, Q6_K)
The inner loops run across the R rows of a tile (one SIMD lane per row), so the
block scales are per-lane vectors and no horizontal sum happens until a tile ends.
Float tensors (F32, F16, BF16) stay in their file layout [rows, cols].
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

R = 16  # rows per tile

_opts = dict(cache=True, fastmath=True, nogil=True)


# -- mat-vec (decode) --------------------------------------------------------------

@njit(parallel=True, **_opts)
def mv_nibble(qs, d, m, x, out):
    """qs u8 [T, nb, 16, R]; d, m f32 [T, nb, R]; x f32 [nb*32]; out f32 [rows]."""
    T, nb = qs.shape[0], qs.shape[1]
    rows = out.shape[0]
    xs = np.empty(nb, np.float32)          # per-block sums of x (for the m term)
    for b in range(nb):
        acc = np.float32(0)
        for j in range(32):
            acc += x[b * 32 + j]
        xs[b] = acc
    for t in prange(T):
        acc = np.zeros(R, np.float32)
        s = np.zeros(R, np.float32)
        for b in range(nb):
            for r in range(R):
                s[r] = 0
            for j in range(16):
                xl = x[b * 32 + j]
                x2 = x[b * 32 + 16 + j] - np.float32(16) * xl
                for r in range(R):
                    # q = lo + 16 hi  =>  lo*xl + hi*xh = q*xl + hi*(xh - 16 xl)
                    fq = np.float32(qs[t, b, j, r])
                    s[r] += fq * xl + np.floor(fq * np.float32(0.0625)) * x2
            xsb = xs[b]
            for r in range(R):
                acc[r] += d[t, b, r] * s[r] + m[t, b, r] * xsb
        for r in range(R):
            row = t * R + r
            if row < rows:
                out[row] = acc[r]


@njit(parallel=True, **_opts)
def mv_int8(qs, d, m, has_m, x, out):
    """qs i8 [T, nb, L, R]; d, m f32 [T, nb, R]; x f32 [nb*L]; out f32 [rows]."""
    T, nb, L = qs.shape[0], qs.shape[1], qs.shape[2]
    rows = out.shape[0]
    xs = np.zeros(nb, np.float32)
    if has_m:
        for b in range(nb):
            acc = np.float32(0)
            for j in range(L):
                acc += x[b * L + j]
            xs[b] = acc
    for t in prange(T):
        acc = np.zeros(R, np.float32)
        s = np.zeros(R, np.float32)
        for b in range(nb):
            for r in range(R):
                s[r] = 0
            for j in range(L):
                xj = x[b * L + j]
                for r in range(R):
                    s[r] += np.float32(qs[t, b, j, r]) * xj
            if has_m:
                xsb = xs[b]
                for r in range(R):
                    acc[r] += d[t, b, r] * s[r] + m[t, b, r] * xsb
            else:
                for r in range(R):
                    acc[r] += d[t, b, r] * s[r]
        for r in range(R):
            row = t * R + r
            if row < rows:
                out[row] = acc[r]


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


@njit(parallel=True, **_opts)
def mv_float(w, kind, x, out):
    """w [rows, cols] f32 (kind 0), uint16 f16 bits (kind 1) or uint16 bf16 bits (kind 2)."""
    rows, cols = w.shape
    for r in prange(rows):
        acc = np.float32(0)
        if kind == 0:
            for k in range(cols):
                acc += np.float32(w[r, k]) * x[k]
        elif kind == 1:
            for k in range(cols):
                acc += _f16_to_f32(w[r, k]) * x[k]
        else:
            for k in range(cols):
                acc += np.uint32(np.uint32(w[r, k]) << np.uint32(16)).view(np.float32) * x[k]
        out[r] = acc


# -- dequantize selected rows (embedding, prefill tiles) ---------------------------------
# Serial on purpose: the mat-mat path runs these between BLAS calls, and waking the
# numba thread pool there leaves its workers spinning while BLAS wants the cores.

@njit(**_opts)
def deq_nibble(qs, d, m, ids, out):
    """ids int [k] row numbers; out f32 [k, nb*32]."""
    nb = qs.shape[1]
    for i in range(ids.shape[0]):
        t, r = ids[i] // R, ids[i] % R
        for b in range(nb):
            db, mb = d[t, b, r], m[t, b, r]
            for j in range(16):
                q = qs[t, b, j, r]
                out[i, b * 32 + j] = db * np.float32(q & 15) + mb
                out[i, b * 32 + 16 + j] = db * np.float32(q >> 4) + mb


@njit(**_opts)
def deq_int8(qs, d, m, has_m, ids, out):
    """ids int [k]; out f32 [k, nb*L]."""
    nb, L = qs.shape[1], qs.shape[2]
    for i in range(ids.shape[0]):
        t, r = ids[i] // R, ids[i] % R
        for b in range(nb):
            db = d[t, b, r]
            mb = m[t, b, r] if has_m else np.float32(0)
            for j in range(L):
                out[i, b * L + j] = db * np.float32(qs[t, b, j, r]) + mb


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
