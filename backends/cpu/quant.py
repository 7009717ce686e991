"""Quantized weights for the CPU backend: load (repack), matmul and embedding.

A `QuantWeight` keeps the weight quantized (see `quant_repack` for the tiled
layouts); F32/F16/BF16 stay in their file layout. The kernels to call are bound at
load, so `matmul` for a decode step is one dict-free call into numba.

    n <= MULTI_MAX  mat-vec (decode; batched decode: one row per request), numba, over
            16-row tiles (in parallel only for matrices of at least PARALLEL_MIN_WEIGHTS:
            the tied head; on a shared 2-core machine a thread-pool wake-up per small
            mat-vec cost more than it saved, 2-thread decode ~140 -> ~160 tok/s). Each
            activation is quantized per block to ACT_PLANES = 3 int8 planes (~22 bits,
            results within fp32-level error of float activations) and dotted with the
            unsigned codes by AVX-512 VNNI `vpdpbusd` (quant_kernels, vnni.py; a
            plain-numba twin elsewhere). Each tile is dotted with all n activations while
            in L1, so the weight streams once per call, and every row runs the same code:
            row i is bit-identical to matmul of x[i:i+1] alone.
    n > MULTI_MAX  mat-mat (prefill): the activations quantized to MM_PLANES = 2 int8 planes
            (~15 bits: error ~2e-5 of each block's largest value), then the same integer
            dot products with each tile's blocks unpacked once for MM_TOKENS activations
            (quant_kernels.MAT_MAT); ~2x a BLAS sgemm over dequantized rows, which
            F32/F16/BF16 weights still take: a chunk of rows (~4 MB of f32) dequantized
            into a scratch buffer, then one sgemm of all n tokens against it.
"""
from __future__ import annotations

import threading

import numpy as np
from gguf import GGMLQuantizationType as Q

from . import quant_kernels as K
from .quant_repack import KIND_OF, repack

FLOAT_KIND = {Q.F32: 0, Q.F16: 1, Q.BF16: 2}   # kind code used by mv_float / deq_float
CHUNK_BYTES = 4 << 20                          # f32 scratch per mat-mat chunk
PARALLEL_MIN_WEIGHTS = 1 << 22                 # smaller mat-vecs run on the calling thread
MULTI_MAX = 8                                  # n up to this: batched mat-vec; more: mat-mat


class QuantWeight:
    """What CpuBackend.load_weight returns. shape = (rows, cols); out = x @ W.T."""

    __slots__ = ("qtype", "shape", "arrays", "_mv", "_mv_args", "_mm", "_deq", "_deq_args",
                 "_rowids", "_chunk")

    def __init__(self, qtype, shape, arrays: dict, mv, mv_args: tuple, deq, deq_args: tuple,
                 mm=None):
        self.qtype = int(qtype)
        self.shape = (int(shape[0]), int(shape[1]))
        self.arrays = arrays                  # the (tiled) quantized arrays, by name
        self._mv, self._mv_args = mv, mv_args
        self._mm = mm                         # quantized mat-mat (same arguments), or None
        self._deq, self._deq_args = deq, deq_args
        rows, cols = self.shape
        self._rowids = np.arange(rows, dtype=np.int64)                     # [rows]
        self._chunk = max(K.R, CHUNK_BYTES // (4 * cols) // K.R * K.R)     # rows per chunk

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values() if isinstance(a, np.ndarray))


def load_weight(raw: np.ndarray, qtype, shape) -> QuantWeight:
    """raw: uint8 [rows, row_bytes] GGUF blocks (may be a read-only memmap)."""
    qtype = Q(int(qtype))
    rows, cols = int(shape[0]), int(shape[1])
    if qtype in FLOAT_KIND:
        kind = FLOAT_KIND[qtype]
        dt = np.float32 if qtype == Q.F32 else np.uint16
        w = np.asarray(raw).reshape(rows, -1).view(dt)              # [rows, cols], no copy
        if not w.flags.c_contiguous:
            w = np.ascontiguousarray(w)
        return QuantWeight(qtype, (rows, cols), {"w": w}, K.mv_float, (w, kind),
                           K.deq_float, (w, kind))
    if qtype not in KIND_OF:
        raise ValueError(f"unsupported weight type {qtype.name}")
    p = repack(raw, qtype, rows, cols)
    arrays = {k: p[k] for k in ("qs", "d", "m", "dsup", "msup")}
    kind = p["kind"]
    args = (p["qs"], p["d"], p["m"], p["dsup"], p["msup"]) + ((p["has_m"],) if kind == K.FIVE else ())
    mv = K.MAT_VEC[kind][0 if rows * cols >= PARALLEL_MIN_WEIGHTS else 1]
    return QuantWeight(qtype, (rows, cols), arrays, mv, args, K.DEQUANTIZE[kind], args, K.MAT_MAT[kind])


_local = threading.local()           # each thread's mat-mat scratch (a server's worker and a caller
                                     # may prefill at once; the dequantization and sgemm drop the GIL)


def matmul(w: QuantWeight, x: np.ndarray, out: np.ndarray, bias=None) -> None:
    """x f32 [n, cols] (rows may be strided); out f32 [n, rows] (may be a column view);
    bias f32 [rows] or None. out = x @ W.T (+ bias)."""
    n = x.shape[0]
    if n <= MULTI_MAX:
        w._mv(*w._mv_args, np.ascontiguousarray(x), out)
    elif w._mm is not None:
        w._mm(*w._mv_args, x if x.strides[1] == 4 else np.ascontiguousarray(x), out)
    else:
        _matmat(w, x, out)
    if bias is not None:
        out += bias


def _matmat(w: QuantWeight, x: np.ndarray, out: np.ndarray) -> None:
    rows, cols = w.shape
    ch = min(w._chunk, rows)
    scratch = getattr(_local, "scratch", None)
    if scratch is None or scratch.size < ch * cols:
        scratch = _local.scratch = np.empty(ch * cols, np.float32)
    for r0 in range(0, rows, ch):
        r1 = min(rows, r0 + ch)
        tile = scratch[:(r1 - r0) * cols].reshape(r1 - r0, cols)     # f32 [r1-r0, cols]
        w._deq(*w._deq_args, w._rowids[r0:r1], tile)
        out[:, r0:r1] = x @ tile.T


def embedding(table: QuantWeight, ids: np.ndarray, out: np.ndarray) -> None:
    """ids int [n]; out f32 [n, cols] = dequantized rows ids of table."""
    table._deq(*table._deq_args, np.asarray(ids), out)
