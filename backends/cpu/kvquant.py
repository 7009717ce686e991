"""The KV row formats of backends/kvformat.py in numba: quantize rows into pages
(kv_write) and read them back a few rows at a time (attention, votes).

A format reaches the kernels as a type, so that each format compiles its own
specialisation (as head_dim 64 does in the decode kernel): the wrapper passes
`RowFormat.tag`, an empty uint8 array whose ndim is the format's code + 1. The
format-specific helpers (dequant_rows, quantize_row) are picked by `overload`s
keyed on that type, so only the format in use is typed and compiled, and a
kernel's small format checks (`fmt_of_tag(tag) == BF16`) fold to constants. (A
runtime int would compile every format into every kernel; numba.literally costs
a re-typing on every call.)

rq4_0 rows are q4_0 rows of the Walsh-Hadamard-rotated row: written by rotating and
then quantizing as q4_0, read as q4_0 rows in the rotated basis (storage order is
the identity; rot = H).

tq4 / tq3 rows are read in the rotated basis and in *storage order*: position p
of a dequantized row is rotated coordinate perm[p], the order in which the codes
unpack with contiguous loads (tq4: the low nibbles, then the high nibbles; tq3:
bit field k of every 24-bit group, k = 0..7). `RowFormat.rot` is the rotation with
its rows in that order (rot = R[perm]), so a kernel works with
    q' = rot @ q   (once per query head)       q . x^ = q' . y
    out = acc @ rot (once per output head)     sum_j p_j x^_j = (sum_j p_j y_j) @ rot
where y = s * c[codes] in storage order: no row is ever rotated back.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import njit, prange
from numba.extending import overload

from backends.kvformat import KV_DTYPES, QK, TQ_BITS, KvFormat, boundaries, codebook

from . import kvsimd
from .jit import _JIT, _JIT_EXACT, _OVERLOAD, _OVERLOAD_EXACT, _bf16_to_f32, _f16_to_f32, _f32_to_bf16, _f32_to_f16

BF16, Q8_0, Q4_0, TQ4, TQ3, RQ4_0 = (KV_DTYPES.index(n) for n in ("bf16", "q8_0", "q4_0", "tq4", "tq3", "rq4_0"))
_Q8_BLOCK = 2 + QK          # bytes per q8_0 block: f16 d, 32 x int8
_Q4_BLOCK = 2 + QK // 2     # bytes per q4_0 block: f16 d, 16 bytes of nibbles


def storage_order(name: str, head_dim: int) -> np.ndarray:
    """int64 [head_dim]: the rotated coordinate at each position of a tq row as the
    kernels unpack it (identity for the other formats)."""
    if name == "tq4":
        return np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])
    if name == "tq3":
        g = head_dim // 8
        return (8 * np.arange(g)[None, :] + np.arange(8)[:, None]).reshape(-1)   # [k*g + i] = 8i + k
    return np.arange(head_dim)


@dataclass(frozen=True)
class RowFormat:
    """What the kernels take for one KV dtype at one head_dim."""
    name: str
    head_dim: int
    tag: np.ndarray        # uint8, empty, ndim = format code + 1
    rot: np.ndarray        # f32 [head_dim, head_dim] R[perm] (rotated formats); [1, 1] zeros otherwise
    rot_t: np.ndarray      # f32 [head_dim, head_dim] rot.T, contiguous (rotating outputs back)
    codebook: np.ndarray   # f32 [16]: tq levels, zero-padded
    bounds: np.ndarray     # f32 [2^bits - 1] level midpoints (tq); [1] otherwise

    @property
    def code(self) -> int:
        return self.tag.ndim - 1

    @property
    def rotated(self) -> bool:
        return KvFormat.get(self.name, self.head_dim).rotated

    @staticmethod
    @lru_cache(maxsize=None)
    def get(name: str, head_dim: int) -> "RowFormat":
        kf = KvFormat.get(name, head_dim)                     # validates name and head_dim
        code = KV_DTYPES.index(name)
        tag = np.empty((0,) * (code + 1), dtype=np.uint8)
        cb = np.zeros(16, dtype=np.float32)
        bounds = np.zeros(1, dtype=np.float32)
        rot = np.zeros((1, 1), dtype=np.float32)
        if kf.rotated:
            rot = np.ascontiguousarray(kf.rotation[storage_order(name, head_dim)])
        if name in TQ_BITS:
            bits = TQ_BITS[name]
            cb[:1 << bits] = codebook(bits)
            bounds = np.array(boundaries(bits), dtype=np.float32)
        rot_t = np.ascontiguousarray(rot.T)
        for a in (tag, rot, rot_t, cb, bounds):
            a.setflags(write=False)
        return RowFormat(name, head_dim, tag, rot, rot_t, cb, bounds)

    def key_args(self):
        """(tag, rot, codebook): a reading kernel's arguments for keys of this format
        (queries rotate by rot: rows of a matrix-vector product vectorise)."""
        return self.tag, self.rot, self.codebook

    def value_args(self):
        """(tag, rot_t, codebook): a reading kernel's arguments for values of this format
        (outputs rotate back by rot.T, again row by row)."""
        return self.tag, self.rot_t, self.codebook


# -- format dispatch ---------------------------------------------------------
# The per-format helpers below are chosen while numba types the caller (an
# `overload` keyed on the tag's ndim): only the format in use is typed and
# compiled, which keeps a kernel's compile time near the bf16 one. They are
# called, not inlined (one call per few rows costs nothing, and numba's inliner
# mishandles inline overloads that inline further helpers).
def fmt_of(tag_type) -> int:
    """The format code of a tag's numba type (at typing time)."""
    return tag_type.ndim - 1


@njit(inline="always", **_JIT)
def fmt_of_tag(tag):
    """The format code of a tag, in a kernel (a compile-time constant)."""
    return tag.ndim - 1


@njit(inline="always", **_JIT)
def is_rotated(fmt):
    """Whether rows of format code `fmt` read back in the rotated basis (tq4, tq3, rq4_0)."""
    return fmt == TQ4 or fmt == TQ3 or fmt == RQ4_0


# -- reading -----------------------------------------------------------------
@njit(inline="always", **_JIT)
def _f16_at_soft(row, at):
    return _f16_to_f32(row[at], row[at + 1])


# a row's f16 scale at byte `at`, as f32: one vcvtph2ps where the CPU has F16C
_f16_at = kvsimd.f16_at if kvsimd.HAVE_F16C else _f16_at_soft


def dequant_rows(rows, r0, n, tag, cb, head_dim, dst):
    """rows: storage [>= r0 + n, row_width] of the tag's format -> dst f32 [>= n,
    >= head_dim]: rows r0 .. r0+n-1 with their scales applied; tq rows in the rotated
    basis, storage order (module docstring)."""


def _dequant_bf16(rows, r0, n, tag, cb, head_dim, dst):
    for j in range(n):
        row = rows[r0 + j]
        out = dst[j]
        for i in range(head_dim):
            out[i] = _bf16_to_f32(row[i])


def _dequant_q8_0(rows, r0, n, tag, cb, head_dim, dst):
    for j in range(n):
        row = rows[r0 + j]
        out = dst[j]
        for b in range(head_dim // QK):
            base = b * _Q8_BLOCK
            kvsimd.q8_block(row, base, _f16_at(row, base), out, b * QK)


def _dequant_q4_0(rows, r0, n, tag, cb, head_dim, dst):
    for j in range(n):
        row = rows[r0 + j]
        out = dst[j]
        for b in range(head_dim // QK):
            base = b * _Q4_BLOCK
            kvsimd.q4_block(row, base, _f16_at(row, base), out, b * QK)


def _dequant_tq4(rows, r0, n, tag, cb, head_dim, dst):
    half = head_dim // 2
    h16 = half - half % 16
    for j in range(n):
        row = rows[r0 + j]
        out = dst[j]
        s = _f16_at(row, 0)
        for i in range(0, h16, 16):
            kvsimd.tq4_16(row, 2 + i, s, cb, out, i, half + i)
        for i in range(h16, half):
            byte = row[2 + i]
            out[i] = s * cb[byte & np.uint8(15)]
            out[half + i] = s * cb[byte >> np.uint8(4)]


def _dequant_tq3(rows, r0, n, tag, cb, head_dim, dst):
    g = head_dim // 8
    g8 = g - g % 8
    for j in range(n):
        row = rows[r0 + j]
        out = dst[j]
        s = _f16_at(row, 0)
        for i in range(0, g8, 8):
            kvsimd.tq3_8(row, 2 + 3 * i, s, cb, out, i, g)
        for i in range(g8, g):
            word = (np.uint32(row[2 + 3 * i]) | (np.uint32(row[3 + 3 * i]) << np.uint32(8))
                    | (np.uint32(row[4 + 3 * i]) << np.uint32(16)))
            for k in range(8):
                out[k * g + i] = s * cb[(word >> np.uint32(3 * k)) & np.uint32(7)]


@overload(dequant_rows, jit_options=_OVERLOAD)
def _dequant_rows_impl(rows, r0, n, tag, cb, head_dim, dst):
    return (_dequant_bf16, _dequant_q8_0, _dequant_q4_0, _dequant_tq4, _dequant_tq3, _dequant_q4_0)[fmt_of(tag)]


# -- writing (kv_write) --------------------------------------------------------
# No fastmath here (_JIT_EXACT): q8_0 / q4_0 must hold the bytes ggml's reference
# quantizers write, which takes the same f32 operations in the same order.
_WRITE_PARALLEL_MIN = 8    # rows per kv_write from which the rows go over threads


@njit(inline="always", **_JIT_EXACT)
def _put_f16(dst, at, x):
    h = _f32_to_f16(x)
    dst[at] = np.uint8(h & np.uint16(0xFF))
    dst[at + 1] = np.uint8(h >> np.uint16(8))


@njit(inline="always", **_JIT_EXACT)
def _roundf(v):
    """C roundf: halves away from zero (v - trunc(v) is exact in f32)."""
    t = np.trunc(v)
    if abs(v - t) >= np.float32(0.5):
        t += np.float32(1.0) if v > 0 else np.float32(-1.0)
    return t


def quantize_row(x, dst, tag, rot, cb, bounds, y, codes):
    """x f32 [head_dim] -> dst storage [row_width] in the tag's format, as
    KvFormat.quantize. y f32, codes uint8 [head_dim]: scratch (tq)."""


def _quantize_bf16(x, dst, tag, rot, cb, bounds, y, codes):
    for i in range(x.shape[0]):
        dst[i] = _f32_to_bf16(x[i])


def _quantize_q8_0(x, dst, tag, rot, cb, bounds, y, codes):   # quantize_row_q8_0_ref
    for b in range(x.shape[0] // QK):
        base = b * _Q8_BLOCK
        amax = np.float32(0.0)
        for i in range(QK):
            amax = max(amax, abs(x[b * QK + i]))
        d = amax / np.float32(127.0)
        inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
        _put_f16(dst, base, d)
        for i in range(QK):
            dst[base + 2 + i] = np.uint8(np.int32(_roundf(x[b * QK + i] * inv)) & 0xFF)


def _quantize_q4_0(x, dst, tag, rot, cb, bounds, y, codes):   # quantize_row_q4_0_ref
    for b in range(x.shape[0] // QK):
        base = b * _Q4_BLOCK
        amax = np.float32(0.0)
        mx = np.float32(0.0)
        for i in range(QK):                         # the first value of largest |x|
            v = x[b * QK + i]
            if amax < abs(v):
                amax = abs(v)
                mx = v
        d = mx / np.float32(-8.0)
        inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
        _put_f16(dst, base, d)
        for i in range(QK // 2):
            q0 = min(15, np.int32(x[b * QK + i] * inv + np.float32(8.5)))
            q1 = min(15, np.int32(x[b * QK + QK // 2 + i] * inv + np.float32(8.5)))
            dst[base + 2 + i] = np.uint8(q0 | (q1 << 4))


@njit(**_JIT)
def _tq_encode(y, dst, cb, bounds, codes):
    """The rotated row y f32 [head_dim] (storage order) -> dst: KvFormat._tq after its
    rotation. fastmath (unlike the ggml formats): the f64 sums vectorise, so the scale
    may differ from numpy's by an ulp at a tie."""
    head_dim = y.shape[0]
    ss = 0.0
    for p in range(head_dim):
        ss += np.float64(y[p]) * np.float64(y[p])
    sigma = np.float32(math.sqrt(ss / head_dim))
    inv = np.float32(1.0) / sigma if sigma > 0 else np.float32(0.0)
    for p in range(head_dim):                       # nearest level: count of boundaries below
        codes[p] = 0
    for t in range(bounds.shape[0]):
        bt = bounds[t]
        for p in range(head_dim):
            codes[p] += y[p] * inv > bt
    num = 0.0
    den = 0.0
    for p in range(head_dim):
        level = cb[codes[p]]
        num += np.float64(y[p] * level)
        den += np.float64(level * level)
    _put_f16(dst, 0, np.float32(num / max(den, 1e-30)))
    if bounds.shape[0] == 15:                       # tq4: low nibbles, then high nibbles
        half = head_dim // 2
        for i in range(half):
            dst[2 + i] = codes[i] | (codes[half + i] << np.uint8(4))
    else:                                           # tq3: bit field k of each 24-bit group
        g = head_dim // 8
        for i in range(g):
            word = np.uint32(0)
            for k in range(8):
                word |= np.uint32(codes[k * g + i]) << np.uint32(3 * k)
            dst[2 + 3 * i] = np.uint8(word & np.uint32(0xFF))
            dst[3 + 3 * i] = np.uint8((word >> np.uint32(8)) & np.uint32(0xFF))
            dst[4 + 3 * i] = np.uint8(word >> np.uint32(16))


@njit(inline="always", **_JIT)
def _rotate_row(x, rot, y):
    """y = rot @ x (rows of rot as dot products: the column-update form measured 7x
    slower). The summation order differs from numpy's sgemm, so a code may go to the
    neighbouring level where a rotated value sits on a boundary."""
    head_dim = x.shape[0]
    for p in range(head_dim):
        s = np.float32(0.0)
        for k in range(head_dim):
            s += rot[p, k] * x[k]
        y[p] = s


@njit(**_JIT)
def _quantize_tq(x, dst, rot, cb, bounds, y, codes):
    _rotate_row(x, rot, y)
    _tq_encode(y, dst, cb, bounds, codes)


def _quantize_tq_call(x, dst, tag, rot, cb, bounds, y, codes):
    _quantize_tq(x, dst, rot, cb, bounds, y, codes)


@njit(**_JIT)
def _rotate_row_call(x, rot, y):
    _rotate_row(x, rot, y)


_quantize_q4_0_exact = njit(**_JIT_EXACT)(_quantize_q4_0)


def _quantize_rq4_0(x, dst, tag, rot, cb, bounds, y, codes):
    _rotate_row_call(x, rot, y)
    _quantize_q4_0_exact(y, dst, tag, rot, cb, bounds, y, codes)


@overload(quantize_row, jit_options=_OVERLOAD_EXACT)
def _quantize_row_impl(x, dst, tag, rot, cb, bounds, y, codes):
    return (_quantize_bf16, _quantize_q8_0, _quantize_q4_0, _quantize_tq_call, _quantize_tq_call,
            _quantize_rq4_0)[fmt_of(tag)]


@njit(inline="always", **_JIT_EXACT)
def _write_row(pages, page_table, x, start_row, t, tag, rot, cb, bounds, y, codes):
    n_kv_heads, page_size = pages.shape[1], pages.shape[2]
    head_dim = x.shape[1] // n_kv_heads
    r = start_row + t
    page = page_table[r // page_size]
    off = r % page_size
    for h in range(n_kv_heads):
        quantize_row(x[t, h * head_dim:(h + 1) * head_dim], pages[page, h, off], tag,
                     rot, cb, bounds, y, codes)


@njit(**_JIT_EXACT)
def _write_serial(pages, page_table, x, start_row, tag, rot, cb, bounds):
    head_dim = x.shape[1] // pages.shape[1]
    y = np.empty(head_dim, dtype=np.float32)
    codes = np.empty(head_dim, dtype=np.uint8)
    for t in range(x.shape[0]):
        _write_row(pages, page_table, x, start_row, t, tag, rot, cb, bounds, y, codes)


@njit(parallel=True, **_JIT_EXACT)
def _write_parallel(pages, page_table, x, start_row, tag, rot, cb, bounds):
    head_dim = x.shape[1] // pages.shape[1]
    for t in prange(x.shape[0]):
        y = np.empty(head_dim, dtype=np.float32)
        codes = np.empty(head_dim, dtype=np.uint8)
        _write_row(pages, page_table, x, start_row, t, tag, rot, cb, bounds, y, codes)


def write_rows(pages, page_table, x, start_row, fmt: RowFormat):
    """x: f32 [n, n_kv_heads*head_dim] -> rows start_row .. start_row+n-1 of `pages`
    (storage [n_pages, n_kv_heads, page_size, row_width]) in format `fmt`. (tq rows
    rotate inside the kernel: a numpy sgemm per chunk was no faster single-threaded,
    and OpenBLAS's threads stall on a busy machine.)"""
    kernel = _write_parallel if x.shape[0] >= _WRITE_PARALLEL_MIN else _write_serial
    kernel(pages, page_table, x, start_row, fmt.tag, fmt.rot, fmt.codebook, fmt.bounds)
