"""Quantized weights on the device: the raw GGUF blocks, uploaded once, unchanged.

The shaders dequantize in place (shaders/quant.glsl), one #define variant per type.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as Q

from engine.errors import BackendUnavailable
from engine.gguf.qtypes import raw_blocks

from .arrays import Buffer, to_words
from .shaders import QTYPES

SUPPORTED = tuple(Q[name] for name in QTYPES)


@dataclass(frozen=True)
class VulkanWeight:
    qtype: int               # gguf.GGMLQuantizationType value
    shape: tuple[int, int]   # (rows, cols); matmul computes x @ W.T
    parts: tuple             # ((first row, rows, Buffer of their raw blocks as uint32 words), ...)
    row_bytes: int
    define: str              # QTYPE_* of the shader variant

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


def load_weight(backend, raw, qtype, shape) -> VulkanWeight:
    """raw: uint8 [rows, row_bytes] GGUF blocks (may be a read-only memory map). A table larger
    than one storage buffer may be (a 262144-row embedding: 178 MB, where the guaranteed range
    is 128 MiB) goes up as row ranges in several buffers; matmul and embedding run per part."""
    qtype, rows, row_bytes, data = raw_blocks(raw, qtype, shape, "vulkan", SUPPORTED)
    step = part_rows(rows, row_bytes, backend.max_buffer_bytes)
    parts = []
    for r0 in range(0, rows, step):
        n = min(step, rows - r0)
        blocks = data[r0 * row_bytes:(r0 + n) * row_bytes]
        words, _ = to_words(np.concatenate([blocks, np.zeros(4, np.uint8)]))   # + 1 word: READ_WORDS reads ahead
        backend.bytes_to_device += words.nbytes
        parts.append((r0, n, backend._buffer(words)))
    return VulkanWeight(int(qtype), (rows, int(shape[1])), tuple(parts), row_bytes, f"QTYPE_{qtype.name}")
