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


# byte offsets of the f16 scales (d, and m / dmin) in a block of each scaled type
SCALE_OFFSETS = {Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2),
                 Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def with_subnormal_scales(raw: np.ndarray, qtype: Q, seed: int = 0) -> np.ndarray:
    """raw (make_raw) with every f16 scale replaced by a random f16 subnormal
    (bits 0x0001..0x03ff, either sign), the smallest and largest among them."""
    rng = np.random.default_rng(seed)
    _, bs = GGML_QUANT_SIZES[qtype]
    out = raw.copy().reshape(raw.shape[0], -1, bs)
    for off in SCALE_OFFSETS[qtype]:
        bits = rng.integers(1, 0x400, out.shape[:2]).astype(np.uint16)
        bits.flat[:2] = (0x0001, 0x03FF)
        bits |= rng.integers(0, 2, out.shape[:2]).astype(np.uint16) << 15
        out[..., off:off + 2] = bits.view(np.uint8).reshape(out.shape[:2] + (2,))
    return out.reshape(raw.shape)


def nan_output(n: int, rows: int) -> np.ndarray:
    """f32 [n, rows + 5] of NaN: a matmul writes the view [:, 2:2 + rows], so a write
    outside it shows up (check_matmul_output)."""
    return np.full((n, rows + 5), np.nan, np.float32)


def check_matmul_output(got: np.ndarray, x: np.ndarray, W: np.ndarray, bias=None) -> None:
    """got: the nan_output buffer after the matmul; x f32 [n, cols]; W f32 [rows, cols]
    (reference dequantized). Per output |ours - ref64| <= 2e-5 * ||x_t|| * ||w_row|| + 1e-6
    and NMSE <= 1e-9; the padding is still NaN."""
    rows = W.shape[0]
    ref = x.astype(np.float64) @ W.astype(np.float64).T
    if bias is not None:
        ref += bias
    out = got[:, 2:2 + rows]
    tol = 2e-5 * np.linalg.norm(x, axis=1)[:, None] * np.linalg.norm(W, axis=1)[None, :] + 1e-6
    err = np.abs(out - ref)
    assert np.all(err <= tol), f"n={x.shape[0]}: max err/tol {np.max(err / tol):.3g}"
    assert np.sum(err ** 2) / max(np.sum(ref ** 2), 1e-30) <= 1e-9
    assert np.all(np.isnan(got[:, :2])) and np.all(np.isnan(got[:, 2 + rows:]))


def gated_input(n: int, cols: int, seed: int = 0) -> np.ndarray:
    """f32 [n, 2 * cols + 5]: each row's gate and up values (gated_matmul's input) at
    columns 3 .. 3 + 2 * cols, gates spread over -8 .. 8 so both tails of the activations
    are used."""
    rng = np.random.default_rng(seed)
    rows = rng.standard_normal((n, 2 * cols + 5)).astype(np.float32)
    rows[:, 3:3 + cols] *= 3.0
    rows[0, 3:8] = [-8.0, 8.0, 0.0, -0.5, 3.0]
    return rows


def gate_reference(gate_up: np.ndarray, act: str) -> np.ndarray:
    """act(gate) * up in float64, rounded to f32: gate_up f32 [n, 2 * cols] -> [n, cols]."""
    cols = gate_up.shape[1] // 2
    g, up = gate_up[:, :cols].astype(np.float64), gate_up[:, cols:].astype(np.float64)
    if act == "silu":
        a = g / (1.0 + np.exp(-g))
    else:
        a = 0.5 * g * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (g + 0.044715 * g ** 3)))
    return (a * up).astype(np.float32)
