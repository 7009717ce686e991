"""CUDA norm and elementwise ops (backends/cuda/elementwise.py, kernels/norm.cu and
kernels/eltwise.cu) on the tests' executor (conftest.py `ex`: the CPU harness unless
SHARPI_CUDA_EXECUTOR names another) against the numpy reference (backends/reference.py).

Covers the kernel paths the generic cases of tests/backends/test_ops.py may not pick:
grouped RMSNorm through both kernels (rms_norm_warp for groups up to NORM_WARP_COLS
wide, including widths that are not a multiple of 32 and a partial last block of warps;
rms_norm for wider groups and whole rows), in place on the q columns of a fused qkv
buffer (Gemma 3's per-head Q/K norm) with the k/v columns left untouched; scale in
place on a column slice; gelu_gate at extreme gate values (g^3 and exp overflow f32:
still finite, no NaN).
"""
from __future__ import annotations

import numpy as np
import pytest

from backends.cuda import elementwise
from _backends import nmse
from backends.reference import ReferenceBackend

REF = ReferenceBackend()
TOL = 1e-10


# (n, d, g): g <= 256 -> rms_norm_warp (a warp per group), else rms_norm (a block per group)
@pytest.mark.parametrize("n,d,g", [(1, 2048, 256), (7, 2048, 256), (3, 9 * 64, 64), (5, 3 * 96, 96),
                                   (2, 40, 40), (1, 1024, 512), (3, 900, 300), (2, 2560, 2560), (1, 5, 1)])
def test_rms_norm_groups(ex, n, d, g):
    rng = np.random.default_rng(n * d + g)
    x = (rng.standard_normal((n, d)) * 3).astype(np.float32)
    w = rng.standard_normal(g).astype(np.float32)
    want = np.empty_like(x)
    REF.rms_norm(x, w, 1e-6, want)
    out = ex.asarray(np.full_like(x, np.nan))
    elementwise.rms_norm(ex, ex.asarray(x), ex.asarray(w), 1e-6, out)
    assert nmse(ex.to_host(out), want) < TOL


@pytest.mark.parametrize("n", [1, 9])
@pytest.mark.parametrize("head_dim", [256, 128])
def test_rms_norm_per_head_in_place(ex, n, head_dim):
    """Gemma 3's Q norm: the q columns of a fused qkv buffer, normalised per head in place."""
    rng = np.random.default_rng(n + head_dim)
    n_q, n_kv = 8, 4
    qkv = rng.standard_normal((n, (n_q + 2 * n_kv) * head_dim)).astype(np.float32)
    w = rng.standard_normal(head_dim).astype(np.float32)
    want = qkv.copy()
    REF.rms_norm(qkv[:, :n_q * head_dim], w, 1e-6, want[:, :n_q * head_dim])
    dev = ex.asarray(qkv)
    view = dev[:, :n_q * head_dim]
    elementwise.rms_norm(ex, view, ex.asarray(w), 1e-6, view)
    got = ex.to_host(dev)
    assert nmse(got[:, :n_q * head_dim], want[:, :n_q * head_dim]) < TOL
    assert np.array_equal(got[:, n_q * head_dim:], qkv[:, n_q * head_dim:])


def test_rms_norm_rejects_weight_not_dividing_row(ex):
    with pytest.raises(ValueError, match="divide"):
        elementwise.rms_norm(ex, ex.zeros((2, 100)), ex.zeros((64,)), 1e-6, ex.zeros((2, 100)))


@pytest.mark.parametrize("n,d", [(1, 2048), (5, 300)])
def test_scale_in_place(ex, n, d):
    rng = np.random.default_rng(n + d)
    x = rng.standard_normal((n, d + 7)).astype(np.float32)
    s = float(np.sqrt(np.float32(2304)))                    # Gemma's sqrt(n_embd)
    want = x.copy()
    REF.scale(x[:, 3:3 + d], s, want[:, 3:3 + d])
    dev = ex.asarray(x)
    view = dev[:, 3:3 + d]
    elementwise.scale(ex, view, s, view)
    assert np.array_equal(ex.to_host(dev), want.astype(np.float32))


def test_gelu_gate(ex):
    rng = np.random.default_rng(5)
    n, f = 3, 1000
    gate = (rng.standard_normal((n, f)) * 3).astype(np.float32)
    gate[0, :12] = [0.0, -0.0, 1e-30, -1e-30, 10.0, -10.0, 1e4, -1e4, 1e15, -1e15, 3e38, -3e38]
    up = rng.standard_normal((n, f)).astype(np.float32)
    up[0, :12] = 0.5                                      # gelu(3e38) * up stays below f32 max
    want = np.empty_like(gate)
    REF.gelu_gate(gate, up, want)
    out = ex.asarray(np.full_like(gate, np.nan))
    elementwise.gelu_gate(ex, ex.asarray(gate), ex.asarray(up), out)
    got = ex.to_host(out)
    assert np.all(np.isfinite(got))
    assert nmse(got, want) < TOL
    np.testing.assert_allclose(got[0, :12], want[0, :12], rtol=1e-6, atol=1e-30)


GRID_Y_MAX = 65535          # CUDA's limit on grid y and z (x: 2^31 - 1)


@pytest.mark.parametrize("op", ["add", "scale", "silu_gate", "gelu_gate"])
def test_more_rows_than_grid_y_allows(ex, op):
    """A prefill chunk of more than 65,535 tokens: the rows are on grid x, every one is
    computed (short strided rows keep the harness to a second)."""
    rng = np.random.default_rng(11)
    n, d = GRID_Y_MAX + 37, 3
    a, b = (rng.standard_normal((n, d + 2)).astype(np.float32) for _ in range(2))
    want = np.full((n, d), np.nan, np.float32)
    if op == "scale":
        REF.scale(a[:, 1:1 + d], 0.5, want)
    else:
        getattr(REF, op)(a[:, 1:1 + d], b[:, 2:], want)
    dev_a, dev_b = ex.asarray(a), ex.asarray(b)
    out = ex.asarray(np.full((n, d), np.nan, np.float32))
    if op == "scale":
        elementwise.scale(ex, dev_a[:, 1:1 + d], 0.5, out)
    else:
        getattr(elementwise, op)(ex, dev_a[:, 1:1 + d], dev_b[:, 2:], out)
    assert nmse(ex.to_host(out), want) < TOL


def test_rows_too_wide_for_grid_y_are_refused():
    """Columns go on grid y, ELTWISE_THREADS a block: a row wider than 65,535 blocks is a
    ValueError naming the limit, before any launch (no executor needed)."""
    d = GRID_Y_MAX * elementwise.ELTWISE_THREADS + 1
    a = np.zeros((1, d), np.float32)
    with pytest.raises(ValueError, match=r"cuda add: launch grid \(1, 65536\) is over CUDA's limits "
                                         r"\(x <= 2\^31-1, y and z <= 65535\); y: 65536 blocks of 256 columns"):
        elementwise.add(None, a, a, a)
