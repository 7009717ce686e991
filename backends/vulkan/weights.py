"""Quantized weights on the device: the raw GGUF blocks, uploaded once, unchanged.

The shaders dequantize in place (shaders/quant.glsl), one #define variant per type.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from engine.errors import UnsupportedError

from .arrays import Buffer, to_words
from .shaders import QTYPES

SUPPORTED = tuple(Q[name] for name in QTYPES)


@dataclass(frozen=True)
class VulkanWeight:
    qtype: int               # gguf.GGMLQuantizationType value
    shape: tuple[int, int]   # (rows, cols); matmul computes x @ W.T
    buffer: Buffer           # raw blocks, uint32 words [ceil(rows * row_bytes / 4)]
    row_bytes: int
    define: str              # QTYPE_* of the shader variant

    @property
    def nbytes(self) -> int:
        return self.buffer.n_words * 4


def load_weight(backend, raw, qtype, shape) -> VulkanWeight:
    """raw: uint8 [rows, row_bytes] GGUF blocks (may be a read-only memory map)."""
    qtype = Q(int(qtype))
    if qtype not in SUPPORTED:
        raise UnsupportedError(f"backend 'vulkan' does not support tensor type {qtype.name}; "
                               f"supported: {', '.join(q.name for q in SUPPORTED)}")
    rows, cols = int(shape[0]), int(shape[1])
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    if cols % block or (block > 1 and cols % 32):
        raise UnsupportedError(f"{qtype.name} weight of {cols} columns: not a multiple of the block size {block}")
    row_bytes = cols // block * block_bytes
    data = np.ascontiguousarray(np.asarray(raw).view(np.uint8).reshape(-1))
    if data.size != rows * row_bytes:
        raise ValueError(f"{qtype.name} weight {rows}x{cols}: {data.size} bytes, expected {rows * row_bytes}")
    words, _ = to_words(np.concatenate([data, np.zeros(4, np.uint8)]))   # + 1 word: READ_WORDS reads ahead
    backend.bytes_to_device += words.nbytes
    return VulkanWeight(int(qtype), (rows, cols), backend._buffer(words), row_bytes, f"QTYPE_{qtype.name}")
