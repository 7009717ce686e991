"""Vulkan quantized embedding and matmul for every supported GGUF type, against
the independent `gguf` package dequantizer (float64 reference).

Tolerances (f32 activations, f32 accumulation in the shader):
    embedding: |ours - gguf.dequantize| <= 1e-6 * max|w|
    matmul:    per output |ours - ref64| <= 2e-5 * ||x_t|| * ||w_row|| + 1e-6, NMSE <= 1e-9
Outputs are written into column slices of a NaN-filled buffer, so a write outside
the view shows up.
"""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from _backends import available_backends, make_backend
from _quant_blocks import (ALL, K_QUANTS, SCALE_OFFSETS, check_matmul_output, gate_reference, gated_input,
                           make_raw, nan_output, with_subnormal_scales)

pytestmark = pytest.mark.skipif("vulkan" not in available_backends(), reason="no Vulkan device / kp")



@pytest.fixture(scope="module")
def vk():
    return make_backend("vulkan")


def check_matmul(vk, w, W, x, bias=None):
    big = vk.upload(nan_output(x.shape[0], W.shape[0]))
    vk.matmul(w, vk.upload(x), big[:, 2:2 + W.shape[0]], None if bias is None else vk.upload(bias))
    check_matmul_output(vk.download(big), x, W, bias)


@pytest.mark.parametrize("qtype", ALL, ids=lambda q: q.name)
@pytest.mark.parametrize("rows,cols", [(7, 256), (70, 576)])
def test_embedding_and_matmul(vk, qtype, rows, cols):
    if qtype in K_QUANTS and cols % 256:
        cols = 512
    raw = make_raw(qtype, rows, cols, seed=rows + cols)
    W = np.asarray(dequantize(raw, qtype), np.float32).reshape(rows, cols)
    w = vk.load_weight(raw, qtype, (rows, cols))
    assert w.shape == (rows, cols) and w.qtype == qtype
    ids = np.array([0, rows - 1, rows // 2, 0], np.int32)
    for sel in (ids, ids[1:2]):                      # prefill (ids buffer) and decode (push constant)
        out = vk.alloc((len(sel), cols))
        vk.embedding(w, sel, out)
        np.testing.assert_allclose(vk.download(out), W[sel], rtol=0, atol=1e-6 * np.abs(W).max())
    rng = np.random.default_rng(1)
    xbig = rng.standard_normal((9, cols + 3)).astype(np.float32)
    for n in (1, 9):
        check_matmul(vk, w, W, xbig[:n, 1:1 + cols])
    bias = rng.standard_normal(rows).astype(np.float32)
    check_matmul(vk, w, W, xbig[:1, :cols], bias)
    check_matmul(vk, w, W, xbig[:3, :cols], bias)


@pytest.mark.parametrize("width,c0", [(74, 4), (74, 3), (75, 4)])
def test_matmul_device_views(vk, width, c0):
    """x and out as column views of device activations, bias as a 1-D slice (the forward pass's
    `matmul(w, h, qkv[:, lo:hi], bias[lo:hi])`); x's rows at even offsets, odd ones, and
    alternating (the padded layout loads activations 64 bits at a time where it can)."""
    rng = np.random.default_rng(3)
    rows, cols, n = 40, 64, 5
    raw = make_raw(Q.Q8_0, rows, cols, seed=3)
    W = np.asarray(dequantize(raw, Q.Q8_0), np.float64).reshape(rows, cols)
    w = vk.load_weight(raw, Q.Q8_0, (rows, cols))
    xh = rng.standard_normal((n + 2, width)).astype(np.float32)
    bias = rng.standard_normal(rows + 30).astype(np.float32)
    out = vk.upload(np.full((n + 2, 100), 7.0, np.float32))
    x = vk.upload(xh)
    vk.matmul(w, x[1:1 + n][:, c0:c0 + cols], out[1:1 + n][:, 30:70], vk.upload(bias)[10:50])
    got = vk.download(out)
    ref = xh[1:1 + n, c0:c0 + cols] @ W.T + bias[10:50]
    np.testing.assert_allclose(got[1:1 + n, 30:70], ref, rtol=1e-5, atol=1e-5)
    got[1:1 + n, 30:70] = 7.0
    assert np.all(got == 7.0)


def test_f16_specials(vk):
    vals = np.array([0.0, -0.0, 1.0, -2.5, 6e-8, -3e-5, 65504.0, np.inf, -np.inf] * 32, np.float16)[:256]
    w = vk.load_weight(vals.view(np.uint8).reshape(1, -1), Q.F16, (1, 256))
    out = vk.alloc((1, 256))
    vk.embedding(w, np.array([0], np.int32), out)
    np.testing.assert_array_equal(vk.download(out)[0], vals.astype(np.float32))


def test_f16_every_value(vk):
    """All 65536 f16 bit patterns (subnormals 0x0001..0x03ff included, which
    unpackHalf2x16 may flush to zero) decode to numpy's f32, bit for bit."""
    vals = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    w = vk.load_weight(vals.view(np.uint8).reshape(1, -1), Q.F16, (1, vals.size))
    out = vk.alloc((1, vals.size))
    vk.embedding(w, np.array([0], np.int32), out)
    np.testing.assert_array_equal(vk.download(out)[0].view(np.uint32), vals.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("qtype", list(SCALE_OFFSETS), ids=lambda q: q.name)
def test_subnormal_scales(vk, qtype):
    """Blocks whose f16 scales are subnormal dequantize as gguf does (not to zero)."""
    rows, cols = 6, 512
    raw = with_subnormal_scales(make_raw(qtype, rows, cols, seed=5), qtype, seed=6)
    W = np.asarray(dequantize(raw, qtype), np.float32).reshape(rows, cols)
    assert np.count_nonzero(W) > W.size // 2
    w = vk.load_weight(raw, qtype, (rows, cols))
    out = vk.alloc((rows, cols))
    vk.embedding(w, np.arange(rows, dtype=np.int32), out)
    np.testing.assert_allclose(vk.download(out), W, rtol=0, atol=1e-6 * np.abs(W).max())
    x = np.random.default_rng(7).standard_normal((3, cols)).astype(np.float32)
    check_matmul(vk, w, W, x[:1])
    check_matmul(vk, w, W, x)


def test_unsupported_type_is_named(vk):
    from engine.errors import UnsupportedError
    with pytest.raises(UnsupportedError, match="IQ2_XXS.*supported: F32"):
        vk.load_weight(np.zeros((1, 66), np.uint8), Q.IQ2_XXS, (1, 256))


def weight_layouts(vk):
    """(matmul_cpu_layout, shader_int64) pairs this device can run: the GPU layout, then
    ROW_PER_LANE with 32-bit loads, then (where the device has 64-bit integers) with
    q4_0/q4_1/q8_0 blocks padded for 64-bit loads."""
    return [(False, False), (True, False)] + [(True, True)] * vk.shader_int64


@pytest.mark.parametrize("qtype", ALL, ids=lambda q: q.name)
@pytest.mark.parametrize("rows,cols", [(70, 576), (300, 1056)])
def test_matmul_both_layouts(vk, qtype, rows, cols):
    """matmul.comp's two layouts on this device whatever its type: the GPU one (lanes
    along a row, a shared-memory reduction; 18 and 33 sub-blocks per row leave lanes
    idle on the last pass) and ROW_PER_LANE (CPU devices), whose block-quantized weights
    are stored block-major (300 rows: a group of 256 and a partial one), q4_0/q4_1/q8_0
    also padded for 64-bit loads where the device has them: mat-vec, mat-mat
    with a partial token tile, bias, and embedding rows from each weight layout. A
    block-major weight in the GPU layout is refused."""
    if qtype in K_QUANTS and cols % 256:
        cols = 1280
    raw = make_raw(qtype, rows, cols, seed=rows + cols + 1)
    W = np.asarray(dequantize(raw, qtype), np.float32).reshape(rows, cols)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((7, cols)).astype(np.float32)
    bias = rng.standard_normal(rows).astype(np.float32)
    ids = np.array([rows - 1, 0, 255 % rows, 256 % rows], np.int32)
    layout = vk.matmul_cpu_layout, vk.shader_int64
    try:
        for vk.matmul_cpu_layout, vk.shader_int64 in weight_layouts(vk):
            w = vk.load_weight(raw, qtype, (rows, cols))
            assert w.block_major == (vk.matmul_cpu_layout and qtype not in (Q.F32, Q.F16, Q.BF16))
            assert w.padded == (vk.shader_int64 and qtype in (Q.Q4_0, Q.Q4_1, Q.Q8_0))
            check_matmul(vk, w, W, x[:1])
            check_matmul(vk, w, W, x, bias)
            out = vk.alloc((len(ids), cols))
            vk.embedding(w, ids, out)
            np.testing.assert_allclose(vk.download(out), W[ids], rtol=0, atol=1e-6 * np.abs(W).max())
        if w.block_major:
            vk.matmul_cpu_layout = False
            with pytest.raises(ValueError, match="block-major weight"):
                check_matmul(vk, w, W, x[:1])
    finally:
        vk.matmul_cpu_layout, vk.shader_int64 = layout


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.F32], ids=lambda q: q.name)
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_gated_matmul(vk, qtype, act):
    """gated_matmul (the FFN's down projection over [gate | up] rows) on each weight layout
    of this device: one token in one dispatch, the activation applied as matmul.comp loads
    its input; more tokens through the gate op into the scratch, then matmul; both against
    the float64 reference and close to matmul over the gate op's output."""
    rows, cols = 300, 512
    raw = make_raw(qtype, rows, cols, seed=11)
    W = np.asarray(dequantize(raw, qtype), np.float32).reshape(rows, cols)
    host = gated_input(3, cols, seed=12)
    layout = vk.matmul_cpu_layout, vk.shader_int64
    try:
        for vk.matmul_cpu_layout, vk.shader_int64 in weight_layouts(vk):
            w = vk.load_weight(raw, qtype, (rows, cols))
            for n in (1, 3):
                gate_up = vk.upload(host[:n])[:, 3:3 + 2 * cols]
                big, scratch = vk.upload(nan_output(n, rows)), vk.alloc((n, cols))
                launches = vk.launches
                vk.gated_matmul(w, gate_up, big[:, 2:2 + rows], act, scratch)
                assert vk.launches - launches == (1 if n == 1 else 2)
                got = vk.download(big)
                check_matmul_output(got, gate_reference(host[:n, 3:3 + 2 * cols], act), W)
                gate = vk.silu_gate if act == "silu" else vk.gelu_gate
                gate(gate_up[:, :cols], gate_up[:, cols:], scratch)
                apart = vk.alloc((n, rows))
                vk.matmul(w, scratch, apart)
                np.testing.assert_allclose(got[:, 2:2 + rows], vk.download(apart), rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match="unknown activation"):
            vk.gated_matmul(w, gate_up, big[:, 2:2 + rows], "relu", scratch)
    finally:
        vk.matmul_cpu_layout, vk.shader_int64 = layout


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.F16], ids=lambda q: q.name)
def test_weights_larger_than_one_buffer_are_split_by_rows(qtype):
    """A device whose storage buffers cover fewer bytes than a table (Gemma 3's 178 MB
    embedding on lavapipe's 128 MiB maxStorageBufferRange) gets it in row ranges; embedding
    and matmul (with bias, into a column view) match the unsplit weight's references."""
    vk = make_backend("vulkan")
    rows, cols = 45, 512
    raw = make_raw(qtype, rows, cols, seed=7)
    row_bytes = vk.load_weight(raw, qtype, (rows, cols)).row_bytes       # as stored (padded or not)
    vk.max_buffer_bytes = 16 * row_bytes + 4                    # 16 rows a buffer: parts of 16, 16, 13
    w = vk.load_weight(raw, qtype, (rows, cols))
    assert [(r0, n) for r0, n, _ in w.parts] == [(0, 16), (16, 16), (32, 13)]
    W = np.asarray(dequantize(raw, qtype), np.float32).reshape(rows, cols)
    for sel in (np.array([44, 0, 16, 15, 31, 32], np.int32), np.array([40], np.int32)):
        out = vk.alloc((len(sel), cols))
        vk.embedding(w, sel, out)
        np.testing.assert_allclose(vk.download(out), W[sel], rtol=0, atol=1e-6 * np.abs(W).max())
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, cols)).astype(np.float32)
    bias = rng.standard_normal(rows).astype(np.float32)
    for n in (1, 3):
        check_matmul(vk, w, W, x[:n])
        check_matmul(vk, w, W, x[:n], bias)


def test_check_fits_refuses_what_the_device_cannot_run():
    """Before anything is allocated: a prefill chunk past the dispatch limit along y or
    whose largest buffer passes one binding is one line naming --prefill-chunk; on a GPU
    (a device-local heap: here lavapipe's, posing as a GPU) a model plus KV cache plus a
    chunk's buffers larger than the heap is refused with the numbers; a CPU device
    leaves memory to the host check (False)."""
    from engine.errors import EngineError
    vk = make_backend("vulkan")
    assert vk.check_fits(10, 10, 512, 10, 256, 1024) is False             # lavapipe: a CPU device
    with pytest.raises(EngineError, match=r"prefill chunk of 65536 tokens is more than .*\(65535 workgroups"):
        vk.check_fits(10, 10, 65536, 10, 65536, 1024)
    with pytest.raises(EngineError, match=r"needs a 256 MiB buffer, more than one shader binding .*--prefill-chunk"):
        vk.check_fits(10, 10, 4096, 10, 4096, 2 ** 28)                  # lavapipe's range: 128 MiB
    vk.device = dict(vk.device, device_local_bytes=2 ** 30)
    vk._cpu_device = False
    assert vk.check_fits(2 ** 29, 2 ** 28, 4096, 2 ** 20, 256, 1024) is True
    with pytest.raises(EngineError, match=r"model does not fit on .*= 1025 MiB, but its memory is 1024 MiB"):
        vk.check_fits(2 ** 29, 2 ** 29, 4096, 2 ** 20, 256, 1024)


@pytest.mark.parametrize("vk_error,kind", [("ErrorDeviceLost", "DeviceFault"),
                                           ("ErrorOutOfDeviceMemory", "DeviceOutOfMemory"),
                                           ("ErrorInitializationFailed", "BackendUnavailable")])
def test_vulkan_errors_are_the_engines_device_errors(vk_error, kind):
    """A failed Vulkan call (kp raises it, patched) is one line naming the device, of the
    kind a server acts on: a lost device is a fault (the process must restart), running
    out of memory is recoverable (503, retry), anything else is the backend failing."""
    import engine.errors as errors
    vk = make_backend("vulkan")
    with pytest.raises(getattr(errors, kind), match=rf"backend 'vulkan': .*{vk_error}") as e:
        with vk._device_errors():
            raise RuntimeError(f"Kompute: vkQueueSubmit failed: {vk_error}")
    assert "\n" not in str(e.value)
