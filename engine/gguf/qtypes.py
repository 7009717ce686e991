"""The GGUF tensor types we support and their block geometry."""
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
