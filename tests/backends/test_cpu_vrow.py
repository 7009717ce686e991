"""The softmax row passes as 16-wide vector code (backends/cpu/vrow.py) against the scalar
helpers they replace: every start and end offset around the 16-element vectors, the
values the softmax meets at its edges (masked -inf, NaN, overflow, underflow)."""
import numpy as np
import pytest
from numba import njit

from backends.cpu.jit import _exp_f32
from backends.cpu.vrow import exp_sum_row, scaled_max


@njit(cache=False)
def _vector(x, lo, hi, scale):
    m = scaled_max(x, lo, hi, scale)
    return m, exp_sum_row(x, lo, hi, scale, m)


@njit(cache=False)
def _scalar(x, lo, hi, scale):
    m = np.float32(-np.inf)
    for j in range(lo, hi):
        m = max(m, x[j] * scale)
    total = np.float32(0.0)
    for j in range(lo, hi):
        e = _exp_f32(x[j] * scale - m)
        x[j] = e
        total += e
    return m, total


@pytest.mark.parametrize("lo", [0, 1, 15, 16, 17])
@pytest.mark.parametrize("length", [0, 1, 15, 16, 17, 31, 32, 33, 100])
def test_row_passes_equal_the_scalar_code(lo, length):
    rng = np.random.default_rng(lo * 1000 + length)
    x = (rng.standard_normal(lo + length + 19) * 40).astype(np.float32)
    hi = lo + length
    got, want = x.copy(), x.copy()
    m, total = _vector(got, lo, hi, np.float32(0.125))
    m_ref, total_ref = _scalar(want, lo, hi, np.float32(0.125))
    assert m == m_ref                                        # a max is exact
    np.testing.assert_allclose(got[lo:hi], want[lo:hi], rtol=2e-6, atol=0)
    assert total == pytest.approx(float(total_ref), rel=1e-5) if length else total == 0
    np.testing.assert_array_equal(got[:lo], x[:lo])          # outside [lo, hi) untouched
    np.testing.assert_array_equal(got[hi:], x[hi:])


def test_row_passes_at_the_edges_of_exp():
    """-inf (a masked score) gives 0, an exponent past f32's range saturates as
    jit._exp_f32 does, one below -87.3 flushes to 0, NaN stays NaN: in the vectors and
    in the scalar tail alike."""
    edge = np.array([-np.inf, -200.0, -87.5, -87.0, 0.0, 50.0, 100.0, np.nan], dtype=np.float32)
    x = np.tile(edge, 5)                                     # 40: two vectors and a tail of 8
    got, want = x.copy(), x.copy()
    from backends.cpu.vrow import exp_sum
    _, j = njit(cache=False)(lambda a: exp_sum(a, 0, a.size, np.float32(1.0), np.float32(0.0)))(got)
    assert j == 32
    for k in range(j, x.size):
        got[k] = _exp_f32(np.float32(x[k]))
    for k in range(x.size):
        want[k] = _exp_f32(np.float32(x[k]))
    np.testing.assert_allclose(got[:8], got[32:], rtol=2e-6, equal_nan=True)   # vector = tail
    np.testing.assert_allclose(got, want, rtol=2e-6, equal_nan=True)
    assert got[0] == 0 and got[1] == 0 and got[2] == 0 and np.isnan(got[7])
