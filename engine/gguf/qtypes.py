"""The GGUF tensor types we support and their block geometry."""
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

SUPPORTED = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1,
             Q.Q4_K, Q.Q5_K, Q.Q6_K)
SUPPORTED_NAMES = ", ".join(t.name for t in SUPPORTED)


def block_geometry(qtype: Q) -> tuple[int, int]:
    """(elements per block, bytes per block)."""
    return GGML_QUANT_SIZES[Q(qtype)]


def row_bytes(qtype: Q, n_cols: int) -> int:
    elems, nbytes = block_geometry(qtype)
    return n_cols // elems * nbytes


def raw_blocks(raw, qtype, shape, backend: str, supported=SUPPORTED) -> tuple[Q, int, int, np.ndarray]:
    """A device backend's load_weight input checked: (qtype, rows, row_bytes, the
    blocks as flat uint8 [rows * row_bytes]). raw: uint8 [rows, row_bytes] (may be a
    read-only memory map); UnsupportedError for a type or width the kernels lack."""
    from ..errors import UnsupportedError
    qtype = Q(int(qtype))
    if qtype not in supported:
        raise UnsupportedError(f"backend '{backend}' does not support tensor type {qtype.name}; "
                               f"supported: {', '.join(q.name for q in supported)}")
    rows, cols = int(shape[0]), int(shape[1])
    block, block_bytes = block_geometry(qtype)
    if cols % block or (block > 1 and cols % 32):
        raise UnsupportedError(f"{qtype.name} weight of {cols} columns: not a multiple of the block size {block}")
    row_bytes = cols // block * block_bytes
    data = np.ascontiguousarray(np.asarray(raw).view(np.uint8).reshape(-1))
    if data.size != rows * row_bytes:
        raise ValueError(f"{qtype.name} weight {rows}x{cols}: {data.size} bytes, expected {rows * row_bytes}")
    return qtype, rows, row_bytes, data
