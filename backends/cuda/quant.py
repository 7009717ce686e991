"""Quantized weights of the CUDA backend and the ops that read them: embedding and
matmul. Argument lists and launch geometry of kernels/matmul.cu and dequant.cu.

A weight is the GGUF file's blocks unchanged, uploaded once; the kernels
dequantize in registers (kernels/quant.cuh, one QTYPE_* variant per type).
matmul has two paths:
  n <= MV_MAX_TOKENS  `matvec`: one warp per output row, every weight read once
                      for all n tokens (decode and short prompts);
  n >  MV_MAX_TOKENS  `dequant_rows` into an f32 scratch, row chunks of at most
                      GEMM_CHUNK_ELEMENTS, each followed by ex.gemm (cuBLAS on a
                      GPU), then `add_bias`.
gated_matmul (the FFN's down projection over [gate | up]) runs the gate inside the
mat-vec's staging of x (`matvec` GATE_* variants) up to MV_MAX_TOKENS tokens; above,
the gate kernel and the GEMM path.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.gguf.qtypes import SUPPORTED, raw_blocks

from ..base import GATE_DEFINES

from . import elementwise
from .elementwise import check_grid, row_stride

VARIANTS = [(file, (f"QTYPE_{q.name}",)) for file in ("matmul.cu", "dequant.cu") for q in SUPPORTED]
VARIANTS += [("matmul.cu", (f"QTYPE_{q.name}", gate)) for q in SUPPORTED for gate in GATE_DEFINES.values()]

PAD_BYTES = 16                 # after the last block: the kernels' aligned loads may read a few bytes past it
MV_MAX_TOKENS = 8              # matmul.cu MV_MAX_TOKENS
MV_XS_SUB = 36                 # matmul.cu MV_XS_SUB: floats per staged 32-column sub-block of x
DQ_THREADS = 128               # dequant.cu DQ_THREADS
BIAS_THREADS = 256
GEMM_CHUNK_ELEMENTS = 1 << 24  # f32 scratch of the GEMM path: 64 MiB at most

_i32 = np.int32


@dataclass(frozen=True)
class CudaWeight:
    qtype: int               # gguf.GGMLQuantizationType value
    shape: tuple[int, int]   # (rows, cols); matmul computes x @ W.T
    raw: Any                 # uint8 [rows * row_bytes + PAD_BYTES] executor array: the file's blocks
    row_bytes: int
    define: str              # QTYPE_* of the kernel variants

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)


class _QuantState:
    """Per-executor buffers of this module (ex.cache["quant"]): the GEMM path's f32
    scratch, allocated on first use and grown, never per call; placeholders for
    pointer arguments a launch does not read."""

    def __init__(self, ex):
        self.ex = ex
        self.scratch = None                          # f32 [capacity]
        self.no_ids = ex.zeros((1,), np.int32)
        self.no_bias = ex.zeros((1,), np.float32)

    def scratch_rows(self, rows: int, cols: int):
        """f32 [rows, cols] view of the scratch."""
        need = rows * cols
        if self.scratch is None or self.scratch.size < need:
            self.scratch = None                      # free the old one before growing
            self.scratch = self.ex.empty((need,), np.float32)
        return self.scratch[:need].reshape(rows, cols)


def _state(ex) -> _QuantState:
    st = ex.cache.get("quant")
    if st is None:
        st = ex.cache["quant"] = _QuantState(ex)
    return st


def load_weight(ex, raw, qtype, shape) -> CudaWeight:
    """raw: uint8 [rows, row_bytes] GGUF blocks (may be a read-only memory map)."""
    qtype, rows, row_bytes, data = raw_blocks(raw, qtype, shape, "cuda")
    padded = np.concatenate([data, np.zeros(PAD_BYTES, np.uint8)])
    return CudaWeight(int(qtype), (rows, int(shape[1])), ex.asarray(padded), row_bytes, f"QTYPE_{qtype.name}")


def _dequant_rows(ex, w: CudaWeight, n: int, ids, first_row: int, out) -> None:
    """out[i, :] = W[ids[i]] (ids: int32 [n] executor array) or W[first_row + i] (ids None)."""
    nsub = -(-w.shape[1] // 32)
    blocks = -(-nsub // DQ_THREADS)
    grid = check_grid("dequant_rows", (n, blocks), f"{blocks} blocks of {DQ_THREADS * 32} columns for rows of "
                                                   f"{w.shape[1]}")
    block = (min(DQ_THREADS, -(-nsub // 32) * 32),)
    use_ids = ids is not None
    ex.function("dequant.cu", "dequant_rows", (w.define,))(
        grid, block, (w.raw, _i32(w.row_bytes), _i32(w.shape[1]),
                      ids if use_ids else _state(ex).no_ids, _i32(use_ids), _i32(first_row),
                      out, row_stride(out)))


def embedding(ex, w: CudaWeight, ids: np.ndarray, out, step: tuple | None = None) -> None:
    """ids: int32 [n] (host); out: f32 [n, cols]. One id travels as a kernel argument, or,
    with step (step buffer, slot), the ids are read from its slots slot .. slot+n-1 (a
    recorded step)."""
    ids = np.asarray(ids, dtype=np.int32).reshape(-1)
    rows, cols = w.shape
    n = ids.size
    if out.shape != (n, cols):
        raise ValueError(f"cuda embedding: out {out.shape} != ({n}, {cols})")
    if n == 0:
        return
    if ids.min() < 0 or ids.max() >= rows:
        raise ValueError(f"cuda embedding: token ids must lie in [0, {rows}), got {ids.min()}..{ids.max()}")
    if step is not None:
        buf, slot = step
        _dequant_rows(ex, w, n, buf[slot:slot + n], 0, out)
    elif n == 1:
        _dequant_rows(ex, w, 1, None, int(ids[0]), out)
    else:
        _dequant_rows(ex, w, n, ex.asarray(ids), 0, out)


def matmul(ex, w: CudaWeight, x, out, bias=None) -> None:
    """x: f32 [n, cols]; out: f32 [n, rows] (row-strided views allowed); bias: f32 [rows] or None."""
    rows, cols = w.shape
    n = x.shape[0]
    if x.shape != (n, cols) or out.shape != (n, rows):
        raise ValueError(f"cuda matmul: x {x.shape}, W {w.shape}, out {out.shape}")
    if bias is not None and (bias.shape != (rows,) or bias.strides[0] != bias.itemsize):
        raise ValueError(f"cuda matmul: bias {bias.shape} (strides {bias.strides}), expected contiguous ({rows},)")
    if n == 0 or rows == 0:
        return
    if n <= MV_MAX_TOKENS:
        _matvec(ex, w, x, out, bias)
        return
    st = _state(ex)
    chunk = max(1, min(rows, GEMM_CHUNK_ELEMENTS // max(cols, 1)))
    for lo in range(0, rows, chunk):
        r = min(chunk, rows - lo)
        scratch = st.scratch_rows(r, cols)                 # f32 [r, cols]
        _dequant_rows(ex, w, r, None, lo, scratch)
        ex.gemm(x, scratch, out[:, lo:lo + r])
    if bias is not None:
        blocks = -(-rows // BIAS_THREADS)
        grid = check_grid("matmul", (n, blocks), f"{blocks} blocks of {BIAS_THREADS} bias rows for {rows} rows")
        ex.function("matmul.cu", "add_bias", (w.define,))(
            grid, (BIAS_THREADS,), (out, row_stride(out), bias, _i32(rows)))


def gated_matmul(ex, w: CudaWeight, gate_up, out, act: str, scratch) -> None:
    """out = (act(gate) * up) @ W.T: gate_up f32 [n, 2 * cols] ([gate | up] per token), act
    "silu" or "gelu_tanh", out f32 [n, rows]; scratch f32 [n, cols], which only the GEMM
    path (n > MV_MAX_TOKENS) writes (the activation)."""
    rows, cols = w.shape
    n = gate_up.shape[0]
    if act not in GATE_DEFINES:
        raise ValueError(f"cuda gated_matmul: unknown activation {act!r} ({', '.join(GATE_DEFINES)})")
    if gate_up.shape != (n, 2 * cols) or out.shape != (n, rows):
        raise ValueError(f"cuda gated_matmul: gate_up {gate_up.shape}, W {w.shape}, out {out.shape}")
    if n == 0 or rows == 0:
        return
    if n <= MV_MAX_TOKENS:
        _matvec(ex, w, gate_up, out, None, GATE_DEFINES[act])
        return
    gate = elementwise.silu_gate if act == "silu" else elementwise.gelu_gate
    gate(ex, gate_up[:, :cols], gate_up[:, cols:], scratch)
    matmul(ex, w, scratch, out)


def _matvec(ex, w: CudaWeight, x, out, bias, gate: str | None = None) -> None:
    """x f32 [n, cols], or with `gate` (a GATE_DEFINES define) [n, 2 * cols] of [gate | up]."""
    rows, cols = w.shape
    n = x.shape[0]
    warps = 8 if rows >= 4096 else 4                       # small matrices: more blocks for the SMs
    grid, block = (-(-rows // warps),), (warps * 32,)
    shared = n * 32 * MV_XS_SUB * 4                        # x of one warp step, every token
    has_bias = bias is not None
    ex.function("matmul.cu", "matvec", (w.define,) if gate is None else (w.define, gate))(
        grid, block, (w.raw, _i32(w.row_bytes), _i32(rows), _i32(cols),
                      x, row_stride(x), _i32(n),
                      bias if has_bias else _state(ex).no_bias, _i32(has_bias),
                      out, row_stride(out)), shared_mem=shared)
