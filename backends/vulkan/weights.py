"""Quantized weights on the device: the raw GGUF blocks, uploaded once, unchanged.

The shaders dequantize in place (shaders/quant.glsl), one #define variant per type.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as Q

from engine.gguf.qtypes import raw_blocks

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
    qtype, rows, row_bytes, data = raw_blocks(raw, qtype, shape, "vulkan", SUPPORTED)
    words, _ = to_words(np.concatenate([data, np.zeros(4, np.uint8)]))   # + 1 word: READ_WORDS reads ahead
    backend.bytes_to_device += words.nbytes
    return VulkanWeight(int(qtype), (rows, int(shape[1])), backend._buffer(words), row_bytes, f"QTYPE_{qtype.name}")
