"""GGUF blocks -> the row-tiled layouts of `quant_kernels` (numpy, once at load).

Every quantized type is reduced to codes + per-block f32 scale d and offset m
(value = d * code + m; kept as f16 bits when exact), then tiled 16 rows at a time with codes grouped by 4 per
row (the `vpdpbusd` operand layout; int8-family codes are stored + 128, unsigned):
    nibble family: Q4_0 (m = -8d), Q4_1, Q4_K (32-element sub-blocks, d = d*sc, m = -dmin*min)
    int8 family:   Q8_0, Q5_0 (code - 16), Q5_1, Q5_K (sub-blocks of 32), Q6_K (code - 32,
                   sub-blocks of 16). 5- and 6-bit codes take one byte each.
Layouts follow ggml-common.h; the formulas mirror gguf/quants.py `dequantize_blocks`.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q

from .quant_kernels import R
from .vnni import F16_SCALES

NIBBLE = (Q.Q4_0, Q.Q4_1, Q.Q4_K)
INT8 = (Q.Q8_0, Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q6_K)


def _f16(b: np.ndarray) -> np.ndarray:
    """b: uint8 [..., 2] -> f32 [...]."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _tile(a: np.ndarray, rows: int) -> np.ndarray:
    """a [rows, nb, *inner] -> [T, nb, *inner, R]: rows grouped by 16, row index innermost."""
    T = -(-rows // R)
    pad = T * R - rows
    if pad:
        a = np.concatenate([a, np.zeros((pad,) + a.shape[1:], a.dtype)])
    a = a.reshape((T, R) + a.shape[1:])
    axes = (0,) + tuple(range(2, a.ndim)) + (1,)
    return np.ascontiguousarray(a.transpose(axes))


def _q4k_scale_min(sc12: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """sc12 uint8 [rows, nb, 12] -> (sc, mn) uint8 [rows, nb, 8] (6-bit K-quant scales)."""
    s = sc12.reshape(sc12.shape[:-1] + (3, 4))
    d, m, md = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K qs uint8 [rows, nb, 128] -> codes uint8 [rows, nb*8, 32] (sub-block order)."""
    q = qs.reshape(qs.shape[0], qs.shape[1], 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
    return (q & 0x0F).reshape(qs.shape[0], -1, 32)


def _nibble_pack(codes: np.ndarray) -> np.ndarray:
    """codes uint8 [rows, nb, 32] -> bytes [rows, nb, 16]: code j | code j+16 << 4."""
    return codes[..., :16] | (codes[..., 16:] << 4)


def _fivebit(qs: np.ndarray, qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1 qs uint8 [rows, nb, 16], qh uint8 [rows, nb, 4] -> codes uint8 [rows, nb, 32]."""
    lo = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    hbit = np.unpackbits(qh, axis=-1, bitorder="little")
    return lo | (hbit << 4)


CHUNK_BYTES = 16 << 20        # GGUF bytes repacked at a time (the temporaries are a few times this)


def repack(raw: np.ndarray, qtype: Q, rows: int, cols: int) -> dict:
    """raw uint8 [rows, row_bytes] -> dict(kind='nibble'|'int8', qs, d, m, has_m).
    Large tensors go CHUNK_BYTES of rows at a time into the final arrays, so loading
    a 262144-row embedding does not hold several full-size temporaries at once."""
    raw = np.asarray(raw, np.uint8).reshape(rows, -1)
    step = max(R, CHUNK_BYTES // raw.shape[1] // R * R)
    if rows <= step:
        return _repack(raw, qtype, rows, cols)
    out = None
    for r0 in range(0, rows, step):
        p = _repack(raw[r0:r0 + step], qtype, min(step, rows - r0), cols)
        if out is None:
            tiles = -(-rows // R)
            out = dict(p, **{k: np.empty((tiles,) + p[k].shape[1:], p[k].dtype) for k in _TILED[p["has_m"]]})
        t0 = r0 // R
        for k in _TILED[p["has_m"]]:
            part = p[k]
            if part.dtype != out[k].dtype:              # f16 bits in one chunk, f32 in another: f32
                out[k] = _f32(out[k])
                part = _f32(part)
            out[k][t0:t0 + part.shape[0]] = part
    return out


_TILED = {True: ("qs", "d", "m"), False: ("qs", "d")}


def _f32(scales: np.ndarray) -> np.ndarray:
    """Tiled scales as f32 (from f16 bits if that is what `_scales` chose)."""
    return scales.view(np.float16).astype(np.float32) if scales.dtype == np.uint16 else scales


def _repack(raw: np.ndarray, qtype: Q, rows: int, cols: int) -> dict:
    """`repack` of one piece: raw uint8 [rows, row_bytes]."""
    if qtype in (Q.Q4_0, Q.Q4_1):
        bs = 18 if qtype == Q.Q4_0 else 20
        blk = raw.reshape(rows, cols // 32, bs)
        d = _f16(blk[..., 0:2])
        m = -8.0 * d if qtype == Q.Q4_0 else _f16(blk[..., 2:4])
        qs = blk[..., bs - 16:]
        return _pack("nibble", qs, d, m)
    if qtype in (Q.Q4_K, Q.Q5_K):
        nb = cols // 256
        blk = raw.reshape(rows, nb, -1)
        d, dmin = _f16(blk[..., 0:2]), _f16(blk[..., 2:4])
        sc, mn = _q4k_scale_min(blk[..., 4:16])
        dsub = (d[..., None] * sc).reshape(rows, -1)
        msub = (-dmin[..., None] * mn).reshape(rows, -1)
        if qtype == Q.Q4_K:
            codes = _k_low_nibbles(blk[..., 16:144])
            return _pack("nibble", _nibble_pack(codes), dsub, msub)
        qh = blk[..., 16:48]                               # bit i of qh[j]: sub-block i, elem j
        hb = (qh[:, :, None, :] >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1
        codes = _k_low_nibbles(blk[..., 48:176]) | (hb.reshape(rows, -1, 32) << 4)
        return _pack("int8", codes.view(np.int8), dsub, msub)
    if qtype == Q.Q8_0:
        blk = raw.reshape(rows, cols // 32, 34)
        return _pack("int8", blk[..., 2:].view(np.int8), _f16(blk[..., 0:2]), None)
    if qtype in (Q.Q5_0, Q.Q5_1):
        bs = 22 if qtype == Q.Q5_0 else 24
        blk = raw.reshape(rows, cols // 32, bs)
        d = _f16(blk[..., 0:2])
        off = 2 if qtype == Q.Q5_0 else 4
        codes = _fivebit(blk[..., off + 4:], blk[..., off:off + 4])
        if qtype == Q.Q5_0:
            return _pack("int8", (codes.astype(np.int16) - 16).astype(np.int8), d, None)
        return _pack("int8", codes.view(np.int8), d, _f16(blk[..., 2:4]))
    if qtype == Q.Q6_K:
        nb = cols // 256
        blk = raw.reshape(rows, nb, 210)
        ql, qh = blk[..., :128], blk[..., 128:192]
        sc = blk[..., 192:208].view(np.int8).astype(np.float32)
        d = _f16(blk[..., 208:210])
        lo = ql.reshape(rows, nb, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
        lo = (lo & 0x0F).reshape(rows, nb, 8, 32)
        hi = qh.reshape(rows, nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)
        hi = (hi & 0x03).reshape(rows, nb, 8, 32)
        codes = ((lo | (hi << 4)).astype(np.int16) - 32).astype(np.int8).reshape(rows, nb * 16, 16)
        return _pack("int8", codes, (d[..., None] * sc).reshape(rows, -1), None)
    raise ValueError(f"repack: unsupported quantized type {Q(qtype).name}")


def _pack(kind: str, qs: np.ndarray, d: np.ndarray, m) -> dict:
    """qs [rows, nb, L] (nibble: L = 16 packed bytes); d, m f32 [rows, nb] (m None = no
    offset) -> tiled arrays; codes grouped by 4 per row (quant_kernels layouts)."""
    rows, nb, L = qs.shape
    if kind == "int8":
        qs = qs.view(np.uint8) ^ np.uint8(0x80)           # signed code + 128
    q4 = _tile(qs.reshape(rows, nb, L // 4, 4), rows)        # [T, nb, G, 4, R]
    has_m = m is not None
    return dict(kind=kind, qs=np.ascontiguousarray(q4.transpose(0, 1, 2, 4, 3)),
                d=_tile(_scales(d), rows),
                m=_tile(_scales(m), rows) if has_m else np.zeros((1, 1, R), np.float32),
                has_m=has_m)


def _scales(a: np.ndarray) -> np.ndarray:
    """f32 [rows, nb] -> uint16 f16 bits when f16 holds every value exactly (scales read
    straight from the file) and the kernels can widen f16, else f32 (K-quant products d * sc)."""
    a = a.astype(np.float32)
    if not F16_SCALES:
        return a
    h = a.astype(np.float16)
    return h.view(np.uint16) if np.array_equal(h.astype(np.float32), a) else a
