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
from .shaders import BLOCK_MAJOR_ROWS, PADDED_QTYPES, QTYPES

SUPPORTED = tuple(Q[name] for name in QTYPES)


@dataclass(frozen=True)
class VulkanWeight:
    qtype: int               # gguf.GGMLQuantizationType value
    shape: tuple[int, int]   # (rows, cols); matmul computes x @ W.T
    parts: tuple             # ((first row, rows, Buffer of their raw blocks as uint32 words), ...)
    row_bytes: int
    define: str              # QTYPE_* of the shader variant
    block_major: bool = False  # blocks stored block-major per BLOCK_MAJOR_ROWS rows (quant.glsl)
    padded: bool = False       # and padded for 64-bit loads (padded_blocks; row_bytes: padded)

    @property
    def defines(self) -> tuple[str, ...]:
        return (self.define,) + ("BLOCK_MAJOR",) * self.block_major + ("PADDED_BLOCKS",) * self.padded

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


# padded blocks (quant.glsl PADDED_BLOCKS): type -> (block bytes, scale bytes leading it, padded bytes)
PADDING = {Q.Q4_0: (18, 2, 24), Q.Q4_1: (20, 4, 24), Q.Q8_0: (34, 2, 40)}


def padded_blocks(blocks: np.ndarray, qtype: Q) -> np.ndarray:
    """uint8 GGUF blocks of a q4_0 / q4_1 / q8_0 matrix -> each block padded for 64-bit
    loads: its scale bytes, zeros to byte 8, its codes (quant.glsl PADDED_BLOCKS)."""
    size, head, padded = PADDING[qtype]
    src = blocks.reshape(-1, size)
    out = np.zeros((len(src), padded), np.uint8)
    out[:, :head] = src[:, :head]
    out[:, 8:8 + size - head] = src[:, head:]
    return out.reshape(-1)


def load_weight(backend, raw, qtype, shape) -> VulkanWeight:
    """raw: uint8 [rows, row_bytes] GGUF blocks (may be a read-only memory map). A table larger
    than one storage buffer may be (a 262144-row embedding: 178 MB, where the guaranteed range
    is 128 MiB) goes up as row ranges in several buffers; matmul and embedding run per part.
    With the ROW_PER_LANE mat-vec layout (CPU devices) block-quantized weights are stored
    block-major (the blocks a workgroup reads together are contiguous: the default model's
    mat-vecs 1.5x faster on lavapipe), and q4_0 / q4_1 / q8_0 blocks padded for 64-bit loads
    where the device has shaderInt64 (lavapipe: the default model's per-token mat-vecs 1.43x
    faster)."""
    qtype, rows, row_bytes, data = raw_blocks(raw, qtype, shape, "vulkan", SUPPORTED)
    block_bytes = GGML_QUANT_SIZES[qtype][1]
    by_blocks = backend.matmul_cpu_layout and GGML_QUANT_SIZES[qtype][0] > 1
    padded = by_blocks and backend.shader_int64 and qtype.name in PADDED_QTYPES
    stored_row_bytes = row_bytes // block_bytes * PADDING[qtype][2] if padded else row_bytes
    step = part_rows(rows, stored_row_bytes, backend.max_buffer_bytes)
    parts = []
    for r0 in range(0, rows, step):
        n = min(step, rows - r0)
        blocks = data[r0 * row_bytes:(r0 + n) * row_bytes]
        if by_blocks:
            blocks = block_major(blocks, n, row_bytes, block_bytes)
        if padded:
            blocks = padded_blocks(blocks, qtype)
        words, _ = to_words(np.concatenate([blocks, np.zeros(4, np.uint8)]))   # + 1 word: READ_WORDS reads ahead
        backend.bytes_to_device += words.nbytes
        parts.append((r0, n, backend._buffer(words)))
    return VulkanWeight(int(qtype), (rows, int(shape[1])), tuple(parts), stored_row_bytes,
                        f"QTYPE_{qtype.name}", by_blocks, padded)
