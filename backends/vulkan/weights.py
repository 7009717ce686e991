"""Quantized weights on the device: the raw GGUF blocks, uploaded once, unchanged.

The shaders dequantize in place (shaders/quant.glsl), one #define variant per type.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from engine.errors import BackendUnavailable
from engine.gguf.qtypes import raw_blocks

from .arrays import Buffer, to_words
from .shaders import BLOCK_MAJOR_ROWS, QTYPES

SUPPORTED = tuple(Q[name] for name in QTYPES)


@dataclass(frozen=True)
class VulkanWeight:
    qtype: int               # gguf.GGMLQuantizationType value
    shape: tuple[int, int]   # (rows, cols); matmul computes x @ W.T
    parts: tuple             # ((first row, rows, Buffer of their raw blocks as uint32 words), ...)
    row_bytes: int
    define: str              # QTYPE_* of the shader variant
    block_major: bool = False  # blocks stored block-major per BLOCK_MAJOR_ROWS rows (quant.glsl)

    @property
    def defines(self) -> tuple[str, ...]:
        return (self.define, "BLOCK_MAJOR") if self.block_major else (self.define,)

    @property
    def nbytes(self) -> int:
        return sum(buf.n_words * 4 for _, _, buf in self.parts)


def part_rows(rows: int, row_bytes: int, max_bytes: int | None) -> int:
    """Rows per buffer: all of them, or as many as fit in `max_bytes` (the device's
    maxStorageBufferRange / allocation limit) with the read-ahead word."""
    if max_bytes is None or rows * row_bytes + 4 <= max_bytes:
        return rows
    per = (max_bytes - 4) // row_bytes
    if per < 1:
        raise BackendUnavailable(f"backend 'vulkan': one weight row of {row_bytes} bytes exceeds the "
                                 f"device's largest storage buffer ({max_bytes} bytes)")
    return per


def block_major(blocks: np.ndarray, rows: int, row_bytes: int, block_bytes: int) -> np.ndarray:
    """uint8 [rows * row_bytes] row-major GGUF blocks -> the same bytes block-major per group
    of BLOCK_MAJOR_ROWS rows (block 0 of the group's rows, then block 1, ...;
    shaders/quant.glsl block_major_base)."""
    out = np.empty(rows * row_bytes, np.uint8)
    for g0 in range(0, rows, BLOCK_MAJOR_ROWS):
        n = min(BLOCK_MAJOR_ROWS, rows - g0)
        group = blocks[g0 * row_bytes:(g0 + n) * row_bytes].reshape(n, row_bytes // block_bytes, block_bytes)
        out[g0 * row_bytes:(g0 + n) * row_bytes] = group.transpose(1, 0, 2).reshape(-1)
    return out


def load_weight(backend, raw, qtype, shape) -> VulkanWeight:
    """raw: uint8 [rows, row_bytes] GGUF blocks (may be a read-only memory map). A table larger
    than one storage buffer may be (a 262144-row embedding: 178 MB, where the guaranteed range
    is 128 MiB) goes up as row ranges in several buffers; matmul and embedding run per part.
    With the ROW_PER_LANE mat-vec layout (CPU devices) block-quantized weights are stored
    block-major (the blocks a workgroup reads together are contiguous: the default model's
    mat-vecs 1.5x faster on lavapipe)."""
    qtype, rows, row_bytes, data = raw_blocks(raw, qtype, shape, "vulkan", SUPPORTED)
    step = part_rows(rows, row_bytes, backend.max_buffer_bytes)
    block_bytes = GGML_QUANT_SIZES[qtype][1]
    by_blocks = backend.matmul_cpu_layout and GGML_QUANT_SIZES[qtype][0] > 1
    parts = []
    for r0 in range(0, rows, step):
        n = min(step, rows - r0)
        blocks = data[r0 * row_bytes:(r0 + n) * row_bytes]
        if by_blocks:
            blocks = block_major(blocks, n, row_bytes, block_bytes)
        words, _ = to_words(np.concatenate([blocks, np.zeros(4, np.uint8)]))   # + 1 word: READ_WORDS reads ahead
        backend.bytes_to_device += words.nbytes
        parts.append((r0, n, backend._buffer(words)))
    return VulkanWeight(int(qtype), (rows, int(shape[1])), tuple(parts), row_bytes, f"QTYPE_{qtype.name}",
                        by_blocks)
