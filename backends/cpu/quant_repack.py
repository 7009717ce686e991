"""GGUF blocks -> the row-tiled layouts of `quant_kernels` (numpy, once at load).

Every quantized type is reduced to codes + per-block scale d and offset m
(value = d * code + m), then tiled 16 rows at a time with codes grouped by 4 per
row (the `vpdpbusd` operand layout; codes unsigned: Q8_0's stored + 128):
    nibble: Q4_0 (m = -8d), Q4_1, Q4_K (32-element sub-blocks)
    five:   Q5_0 (code - 16), Q5_1, Q5_K (sub-blocks of 32): nibbles + a plane of fifth bits
    six:    Q6_K (code + 32 in 6 bits: a nibble plane and a 2-bit plane, sub-blocks of 16)
    int8:   Q8_0
Scales d, m are f32, or f16 bits where f16 holds them exactly (those read from the file).
K-quants keep the file's factors: d, m are the 8-bit sub-block scales (Q4_K/Q5_K: d = sc,
m = min, unsigned 6-bit; Q6_K: d = sc, signed) and dsup, msup the super-block's f16 d and
-dmin, so value = dsup * d * code + msup * m, as many bytes as the file within 3%.
Layouts follow ggml-common.h; the formulas mirror gguf/quants.py `dequantize_blocks`.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q

from . import quant_kernels as K
from .quant_kernels import R
from .vnni import F16_SCALES

KIND_OF = {Q.Q4_0: K.NIBBLE, Q.Q4_1: K.NIBBLE, Q.Q4_K: K.NIBBLE, Q.Q5_0: K.FIVE, Q.Q5_1: K.FIVE,
           Q.Q5_K: K.FIVE, Q.Q6_K: K.SIX, Q.Q8_0: K.INT8}     # the kernels' layout of each type
ABSENT = np.zeros((1, 1, R), np.float32)   # m, dsup, msup of a type without offsets or super-blocks


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


def _five_pack(codes: np.ndarray) -> np.ndarray:
    """5-bit codes uint8 [rows, nb, 32] -> the five layout's loads [rows, nb, 5, 4]: four of
    nibbles (_nibble_pack) and one of fifth bits, bit 2g / 2g+1 of byte i = code 4g+i / 16+4g+i."""
    top = (codes >> 4).reshape(codes.shape[:2] + (2, 4, 4))            # [.., half, g, i]
    shift = (2 * np.arange(4, dtype=np.uint8).reshape(1, 1, 1, 4, 1)          # bit 2g + half
             + np.arange(2, dtype=np.uint8).reshape(1, 1, 2, 1, 1))
    bits = np.bitwise_or.reduce((top << shift).reshape(codes.shape[:2] + (8, 4)), axis=2)
    return np.concatenate([_nibble_pack(codes & 0x0F).reshape(codes.shape[:2] + (4, 4)),
                           bits[:, :, None, :]], axis=2)


def _fivebit(qs: np.ndarray, qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1 qs uint8 [rows, nb, 16], qh uint8 [rows, nb, 4] -> codes uint8 [rows, nb, 32]."""
    lo = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    hbit = np.unpackbits(qh, axis=-1, bitorder="little")
    return lo | (hbit << 4)


CHUNK_BYTES = 16 << 20        # GGUF bytes repacked at a time (the temporaries are a few times this)


def repack(raw: np.ndarray, qtype: Q, rows: int, cols: int) -> dict:
    """raw uint8 [rows, row_bytes] -> dict(kind (KIND_OF), qs, d, m, dsup, msup, has_m).
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
            out = dict(p, **{k: np.empty((tiles,) + p[k].shape[1:], p[k].dtype) for k in _tiled(p)})
        t0 = r0 // R
        for k in _tiled(p):
            part = p[k]
            if part.dtype != out[k].dtype:              # f16 bits in one chunk, f32 in another: f32
                out[k] = _f32(out[k])
                part = _f32(part)
            out[k][t0:t0 + part.shape[0]] = part
    return out


def _tiled(p: dict) -> tuple:
    """The arrays of a repack result that are tiled by rows (the others are ABSENT)."""
    return tuple(k for k in ("qs", "d", "m", "dsup", "msup") if p[k] is not ABSENT)


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
        return _pack(K.NIBBLE, qs, d, m)
    if qtype in (Q.Q4_K, Q.Q5_K):
        nb = cols // 256
        blk = raw.reshape(rows, nb, -1)
        d, dmin = _f16(blk[..., 0:2]), _f16(blk[..., 2:4])
        sc, mn = _q4k_scale_min(blk[..., 4:16])
        sub = (sc.reshape(rows, -1), mn.reshape(rows, -1), d, -dmin)
        if qtype == Q.Q4_K:
            codes = _k_low_nibbles(blk[..., 16:144])
            return _pack(K.NIBBLE, _nibble_pack(codes), *sub)
        qh = blk[..., 16:48]                               # bit i of qh[j]: sub-block i, elem j
        hb = (qh[:, :, None, :] >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1
        codes = _k_low_nibbles(blk[..., 48:176]) | (hb.reshape(rows, -1, 32) << 4)
        return _pack(K.FIVE, _five_pack(codes), *sub)
    if qtype == Q.Q8_0:
        blk = raw.reshape(rows, cols // 32, 34)
        return _pack(K.INT8, blk[..., 2:].view(np.int8), _f16(blk[..., 0:2]), None)
    if qtype in (Q.Q5_0, Q.Q5_1):
        bs = 22 if qtype == Q.Q5_0 else 24
        blk = raw.reshape(rows, cols // 32, bs)
        d = _f16(blk[..., 0:2])
        off = 2 if qtype == Q.Q5_0 else 4
        codes = _five_pack(_fivebit(blk[..., off + 4:], blk[..., off:off + 4]))
        return _pack(K.FIVE, codes, d, None if qtype == Q.Q5_0 else _f16(blk[..., 2:4]))
    if qtype == Q.Q6_K:
        nb = cols // 256
        blk = raw.reshape(rows, nb, 210)
        ql, qh = blk[..., :128], blk[..., 128:192]
        sc = blk[..., 192:208].view(np.int8).reshape(rows, -1)
        d = _f16(blk[..., 208:210])
        lo = ql.reshape(rows, nb, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
        lo = (lo & 0x0F).reshape(rows, nb * 16, 4, 4)      # [rows, block, quarter, i]: code 4q+i
        hi = qh.reshape(rows, nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)
        hi = (hi & 0x03).reshape(rows, nb * 16, 4, 4)
        planes = np.stack([lo[:, :, 0] | lo[:, :, 2] << 4, lo[:, :, 1] | lo[:, :, 3] << 4,
                           hi[:, :, 0] | hi[:, :, 2] << 2 | hi[:, :, 1] << 4 | hi[:, :, 3] << 6], axis=2)
        return _pack(K.SIX, planes, sc, None, d, None)
    raise ValueError(f"repack: unsupported quantized type {Q(qtype).name}")


def _pack(kind: int, qs: np.ndarray, d: np.ndarray, m, dsup=None, msup=None) -> dict:
    """qs [rows, nb, L] codes (nibble: L = 16 packed bytes), or [rows, nb, G, 4] loads (five, six);
    d, m f32 [rows, nb] (m None = no offset), or the uint8/int8 sub-block scales of dsup,
    msup f32 [rows, nb_super] -> tiled arrays; codes grouped by 4 per row (quant_kernels layouts)."""
    rows, nb = qs.shape[:2]
    if kind == K.INT8:
        qs = qs.view(np.uint8) ^ np.uint8(0x80)           # signed code + 128
    q4 = _tile(qs.reshape(rows, nb, -1, 4), rows)          # [T, nb, G, 4, R]
    has_m = m is not None

    def scales(a):
        return a if a.dtype in (np.uint8, np.int8) else _scales(a)
    return dict(kind=kind, qs=np.ascontiguousarray(q4.transpose(0, 1, 2, 4, 3)),
                d=_tile(scales(d), rows),
                m=_tile(scales(m), rows) if has_m else ABSENT,
                dsup=ABSENT if dsup is None else _tile(_scales(dsup), rows),
                msup=ABSENT if msup is None else _tile(_scales(msup), rows),
                has_m=has_m)


def _scales(a: np.ndarray) -> np.ndarray:
    """f32 [rows, nb] -> uint16 f16 bits when f16 holds every value exactly (scales read
    straight from the file) and the kernels can widen f16, else f32 (K-quant products d * sc)."""
    a = a.astype(np.float32)
    if not F16_SCALES:
        return a
    with np.errstate(over="ignore"):
        h = a.astype(np.float16)
    return h.view(np.uint16) if np.array_equal(h.astype(np.float32), a) else a
