"""CUDA quantized embedding and matmul (backends/cuda/quant.py, kernels/matmul.cu,
dequant.cu) for every supported GGUF type, on the tests' executor (conftest.py `ex`: the
CPU harness unless SHARPI_CUDA_EXECUTOR names another), against the
independent `gguf` package dequantizer (float64 reference).

Tolerances as tests/backends/test_vulkan_quant.py:
    embedding: |ours - gguf.dequantize| <= 1e-6 * max|w|
    matmul:    per output |ours - ref64| <= 2e-5 * ||x_t|| * ||w_row|| + 1e-6, NMSE <= 1e-9
x is a non-contiguous column slice; outputs go into column slices of a NaN-filled
buffer, so a write outside the view shows up. n = 1, 7, 8 take the mat-vec kernel,
9 and 40 the dequantize + GEMM path.
"""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from _quant_blocks import ALL, K_QUANTS, check_matmul_output, gate_reference, gated_input, make_raw, nan_output
from backends.base import GATE_DEFINES
from backends.cuda import elementwise, quant
from engine.errors import UnsupportedError

FLOATS = (Q.F32, Q.F16, Q.BF16)


def weight(ex, qtype, rows, cols, seed=0):
    """(CudaWeight, f32 [rows, cols] reference values)."""
    raw = make_raw(qtype, rows, cols, seed=seed)
    W = np.asarray(dequantize(raw, qtype), np.float32).reshape(rows, cols)
    w = quant.load_weight(ex, raw, qtype, (rows, cols))
    assert w.shape == (rows, cols) and w.qtype == qtype and w.nbytes >= raw.nbytes
    return w, W


def check_embedding(ex, w, W, ids):
    out = ex.empty((len(ids), W.shape[1]), np.float32)
    quant.embedding(ex, w, ids, out)
    np.testing.assert_allclose(ex.to_host(out), W[ids], rtol=0, atol=1e-6 * np.abs(W).max())


def check_matmul(ex, w, W, x, bias=None):
    """x: f32 [n, cols] host view (any row stride)."""
    rows = W.shape[0]
    xbig = ex.asarray(np.pad(x, ((0, 0), (1, 2)), constant_values=np.nan))   # x = xbig[:, 1:-2]
    big = ex.asarray(nan_output(x.shape[0], rows))
    quant.matmul(ex, w, xbig[:, 1:1 + x.shape[1]], big[:, 2:2 + rows],
                 None if bias is None else ex.asarray(bias))
    check_matmul_output(ex.to_host(big), x, W, bias)


@pytest.mark.parametrize("qtype", ALL, ids=lambda q: q.name)
@pytest.mark.parametrize("rows,cols", [(7, 256), (70, 576)])
def test_embedding_and_matmul(ex, qtype, rows, cols):
    if qtype in K_QUANTS and cols % 256:
        cols = 512
    w, W = weight(ex, qtype, rows, cols, seed=rows + cols)
    ids = np.array([0, rows - 1, rows // 2, 0], np.int32)
    check_embedding(ex, w, W, ids)                   # ids uploaded (prefill)
    check_embedding(ex, w, W, ids[1:2])              # one id as a kernel argument (decode)
    rng = np.random.default_rng(1)
    xbig = rng.standard_normal((40, cols + 3)).astype(np.float32)
    bias = rng.standard_normal(rows).astype(np.float32)
    for n, b in ((1, bias), (7, None), (8, bias), (9, None), (40, bias)):
        check_matmul(ex, w, W, xbig[:n, 1:1 + cols], b)


@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.F32], ids=lambda q: q.name)
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_gated_matmul(ex, qtype, act):
    """gated_matmul (the FFN's down projection over [gate | up] rows): up to 8 tokens in one
    launch, the activation applied as the mat-vec stages x; 9 through the gate kernel into
    the scratch and the GEMM path; against the float64 reference and close to matmul over
    the gate kernel's output. Inputs are column views, outputs go into a NaN-filled buffer."""
    rows, cols = 70, 512
    w, W = weight(ex, qtype, rows, cols, seed=13)
    host = gated_input(9, cols, seed=14)
    gate = elementwise.silu_gate if act == "silu" else elementwise.gelu_gate
    for n in (1, 8, 9):
        gate_up = ex.asarray(host[:n])[:, 3:3 + 2 * cols]
        big, scratch = ex.asarray(nan_output(n, rows)), ex.zeros((n, cols), np.float32)
        launches = ex.launches
        quant.gated_matmul(ex, w, gate_up, big[:, 2:2 + rows], act, scratch)
        if n <= quant.MV_MAX_TOKENS:
            assert ex.launches - launches == 1
        got = ex.to_host(big)
        check_matmul_output(got, gate_reference(host[:n, 3:3 + 2 * cols], act), W)
        gate(ex, gate_up[:, :cols], gate_up[:, cols:], scratch)
        apart = ex.zeros((n, rows), np.float32)
        quant.matmul(ex, w, scratch, apart)
        np.testing.assert_allclose(got[:, 2:2 + rows], ex.to_host(apart), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="unknown activation"):
        quant.gated_matmul(ex, w, gate_up, big[:, 2:2 + rows], "relu", scratch)


@pytest.mark.parametrize("qtype", FLOATS, ids=lambda q: q.name)
def test_float_rows_end_mid_sub_block(ex, qtype):
    """cols % 32 != 0 (unaligned rows: the kernels' scalar, masked loads)."""
    rows, cols = 5, 77
    w, W = weight(ex, qtype, rows, cols, seed=5)
    check_embedding(ex, w, W, np.array([4, 0, 2], np.int32))
    check_embedding(ex, w, W, np.array([3], np.int32))
    x = np.random.default_rng(2).standard_normal((10, cols)).astype(np.float32)
    check_matmul(ex, w, W, x[:3], np.arange(rows, dtype=np.float32))
    check_matmul(ex, w, W, x, None)


def test_gemm_path_in_row_chunks(ex, monkeypatch):
    """Several dequantized row chunks through one scratch, which is reused, not reallocated."""
    monkeypatch.setattr(quant, "GEMM_CHUNK_ELEMENTS", 16 * 256)
    w, W = weight(ex, Q.Q8_0, 70, 256, seed=9)
    rng = np.random.default_rng(3)
    bias = rng.standard_normal(70).astype(np.float32)
    check_matmul(ex, w, W, rng.standard_normal((12, 256)).astype(np.float32), bias)
    scratch = ex.cache["quant"].scratch
    check_matmul(ex, w, W, rng.standard_normal((10, 256)).astype(np.float32))
    assert ex.cache["quant"].scratch is scratch


def test_f16_specials(ex):
    vals = np.array([0.0, -0.0, 1.0, -2.5, 6e-8, -3e-5, 65504.0, np.inf, -np.inf] * 32, np.float16)[:256]
    w = quant.load_weight(ex, vals.view(np.uint8).reshape(1, -1), Q.F16, (1, 256))
    out = ex.empty((1, 256), np.float32)
    quant.embedding(ex, w, np.array([0], np.int32), out)
    got = ex.to_host(out)[0]
    np.testing.assert_array_equal(got, vals.astype(np.float32))
    assert np.array_equal(np.signbit(got), np.signbit(vals))          # -0 stays negative


def test_unsupported_type_is_named(ex):
    with pytest.raises(UnsupportedError, match="IQ2_XXS.*supported: F32"):
        quant.load_weight(ex, np.zeros((1, 66), np.uint8), Q.IQ2_XXS, (1, 256))
    with pytest.raises(UnsupportedError, match="Q4_K weight of 576 columns"):
        quant.load_weight(ex, np.zeros((1, 324), np.uint8), Q.Q4_K, (1, 576))


def test_variants_cover_every_type():
    types = {f"QTYPE_{q.name}" for q in ALL}
    assert {(f, d[0]) for f, d in quant.VARIANTS if len(d) == 1} == {(f, t) for f in ("matmul.cu", "dequant.cu")
                                                                     for t in types}
    gated = {(d[0], d[1]) for f, d in quant.VARIANTS if len(d) == 2 and f == "matmul.cu"}
    assert gated == {(t, g) for t in types for g in GATE_DEFINES.values()}
    assert all(len(d) <= 2 for _, d in quant.VARIANTS)
