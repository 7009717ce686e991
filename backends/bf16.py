"""bfloat16 <-> float32 conversion on the host (numpy).

The KV pages hold bf16 as raw uint16 bits: the top half of an IEEE float32.
Rounding is to nearest, ties to even, as in every GPU/CPU bf16 conversion
instruction; NaN stays a (quiet) NaN and never rounds to infinity.
The numba kernels do the same arithmetic inline (backends/cpu/ops.py).
"""
from __future__ import annotations

import numpy as np

BF16_QNAN = np.uint16(0x7FC0)  # the quiet NaN tests use to poison unused page slots


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """f32 (any shape) -> uint16 bf16 bits, round to nearest even."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    lsb = (bits >> np.uint32(16)) & np.uint32(1)
    rounded = ((bits + np.uint32(0x7FFF) + lsb) >> np.uint32(16)).astype(np.uint16)
    is_nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    quiet = ((bits >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return np.where(is_nan, quiet, rounded)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """uint16 bf16 bits (any shape) -> f32, exact."""
    wide = np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)
    return wide.view(np.float32)


def round_to_bf16(x: np.ndarray) -> np.ndarray:
    """f32 values as they read back after a bf16 store."""
    return bf16_to_f32(f32_to_bf16(x))
