"""Test blocks of every supported GGUF type, shared by the per-backend quant tests."""
from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf.quants import quantize

QUANTIZABLE = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1)   # gguf.quants can make these
K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
ALL = QUANTIZABLE + K_QUANTS


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).view(np.uint8).reshape(v.shape + (2,))


def make_raw(qtype: Q, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, row_bytes] blocks of qtype with finite, sane scales."""
    rng = np.random.default_rng(seed)
    if qtype in QUANTIZABLE:
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        return np.ascontiguousarray(quantize(w, qtype)).view(np.uint8).reshape(rows, -1)
    # K-quants: random code bytes, hand-set small positive fp16 super-block scales
    _, bs = GGML_QUANT_SIZES[qtype]
    nb = cols // 256
    raw = rng.integers(0, 256, (rows, nb, bs), dtype=np.uint8)
    d = rng.uniform(1e-3, 2e-2, (rows, nb))
    if qtype == Q.Q6_K:
        raw[..., 208:210] = _f16_bytes(d)
    else:
        raw[..., 0:2] = _f16_bytes(d)
        raw[..., 2:4] = _f16_bytes(rng.uniform(1e-3, 2e-2, (rows, nb)))
    return raw.reshape(rows, -1)
