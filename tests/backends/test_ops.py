"""Per-op parity: every available backend against the numpy reference, by NMSE.

Tolerances (NMSE = sum((a-b)^2) / sum(b^2)):
  elementwise / norm / rope (f32 kernel vs f64 reference)      1e-10
  attention and SnapKV votes (both read identical KV pages)     1e-8
  kv_write / kv_gather / kv_copy_pages                          bit-exact (tq4 / tq3
      writes: codes equal but at near-ties of the rotated row, scales within 1 ulp)
The KV ops run for every KV row format (backends/kvformat.py) in KV_CASES; a
backend whose `kv_dtypes` lacks one skips those cases with the reason.
Unused page slots hold NaN (bf16 0x7FC0; quantized rows all 0xFF bytes, an f16
NaN scale), page tables are permuted, and row counts are not multiples of the page
size, so a read through the wrong page or beyond the valid rows shows up as NaN
or a mismatch.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from _backends import assert_rows_written, available_backends, backend_class, make_backend, nmse
from backends.bf16 import BF16_QNAN, bf16_to_f32, f32_to_bf16
from backends.kvformat import KvFormat
from backends.reference import ReferenceBackend
from tiny_gguf import llama3_rope_factors

BACKENDS = available_backends()
REF = ReferenceBackend()

TOL_F32 = 1e-10
TOL_ATTN = 1e-8


@pytest.fixture(params=BACKENDS, scope="module")
def backend(request):
    return make_backend(request.param)


# (k_dtype, v_dtype) pairs the KV ops run with; q8_0/tq4: keys and values differ
KV_CASES = [("bf16", "bf16"), ("q8_0", "q8_0"), ("q4_0", "q4_0"), ("tq4", "tq4"), ("tq3", "tq3"),
            ("rq4_0", "rq4_0"), ("q8_0", "tq4")]
KV_IDS = ["/".join(dict.fromkeys(c)) for c in KV_CASES]
# the windowed variants without rq4_0: its rows are q4_0's, read after tq's rotations (both tested)
QUANT_CASES = [c for c in KV_CASES[1:] if c[0] != "rq4_0"]
QUANT_IDS = ["/".join(dict.fromkeys(c)) for c in QUANT_CASES]


@pytest.fixture(params=KV_CASES, ids=KV_IDS)
def kv(request, backend):
    """(k_dtype, v_dtype), skipped where the backend lacks one of them."""
    require_kv(backend, request.param)
    return request.param


def require_kv(backend, kv):
    missing = [d for d in kv if d not in getattr(backend, "kv_dtypes", ("bf16",))]
    if missing:
        pytest.skip(f"{backend.name} backend has no {missing[0]} KV rows")


def run_op(be, op, *args, outputs=()):
    """Upload the numpy args, run `op`, download the args at positions `outputs`."""
    dev = [be.upload(a) if isinstance(a, np.ndarray) else a for a in args]
    ret = getattr(be, op)(*dev)
    be.synchronize()
    return ret, [be.download(dev[i]) for i in outputs]


# -- paged KV helpers --------------------------------------------------------
def poison(pages):
    """The NaN fill of a pool: bf16 NaN, or 0xFF bytes (a quantized row's f16 scale NaN)."""
    return BF16_QNAN if pages.dtype == np.uint16 else np.uint8(0xFF)


def make_pool(rng, n_rows, n_kv, page_size, head_dim, spare_pages=3, kv=("bf16", "bf16")):
    """NaN-poisoned pools of the KV dtypes kv = (k_dtype, v_dtype) and a permuted page
    table covering n_rows (+ spare pages)."""
    n_used = -(-n_rows // page_size)
    n_pages = n_used + spare_pages
    k_pages, v_pages = (np.full(f.page_shape(n_pages, n_kv, page_size), 0, dtype=f.storage)
                        for f in (KvFormat.get(d, head_dim) for d in kv))
    k_pages[...] = poison(k_pages)
    v_pages[...] = poison(v_pages)
    page_table = rng.permutation(n_pages).astype(np.int32)[:n_used + 1]   # one spare entry
    return k_pages, v_pages, page_table


def filled_pool(rng, n_rows, n_kv, page_size, head_dim, kscale=1.0, kv=("bf16", "bf16")):
    """Pools with rows 0..n_rows-1 written (by the reference), the rest NaN."""
    k_pages, v_pages, page_table = make_pool(rng, n_rows, n_kv, page_size, head_dim, kv=kv)
    k = (rng.standard_normal((n_rows, n_kv * head_dim)) * kscale).astype(np.float32)
    v = rng.standard_normal((n_rows, n_kv * head_dim)).astype(np.float32)
    REF.kv_write(k_pages, v_pages, page_table, k, v, 0, *kv)
    return k_pages, v_pages, page_table


# -- bf16 ----------------------------------------------------------------------
# f32 bits -> bf16 bits, round to nearest even (hand computed)
BF16_TABLE = [
    (0x3F800000, 0x3F80),  # 1.0 exact
    (0x3F807FFF, 0x3F80),  # just below the tie: down
    (0x3F808000, 0x3F80),  # tie, even lsb: stays
    (0x3F808001, 0x3F81),  # just above the tie: up
    (0x3F818000, 0x3F82),  # tie, odd lsb: up to even
    (0x3F81FFFF, 0x3F82),
    (0xBF808000, 0xBF80),  # negative tie, even: stays
    (0xBF818000, 0xBF82),  # negative tie, odd: away to even
    (0x00000000, 0x0000),
    (0x80000000, 0x8000),  # -0
    (0x00008000, 0x0000),  # subnormal tie to even (zero)
    (0x00018000, 0x0002),  # subnormal tie, odd: up
    (0x7F7FFFFF, 0x7F80),  # FLT_MAX rounds to +inf
    (0x7F800000, 0x7F80),  # +inf
    (0xFF800000, 0xFF80),  # -inf
    (0x7FC00000, 0x7FC0),  # quiet NaN
    (0x7F800001, 0x7FC0),  # signalling NaN -> quiet, never inf
    (0x7FFFFFFF, 0x7FFF),  # NaN with all bits: no carry into the sign
    (0x40490FDB, 0x4049),  # pi -> 3.140625
    (0x3EAAAAAB, 0x3EAB),  # 1/3 -> up
]


def test_bf16_numpy_rounding_table():
    f32 = np.array([a for a, _ in BF16_TABLE], dtype=np.uint32).view(np.float32)
    want = np.array([b for _, b in BF16_TABLE], dtype=np.uint16)
    np.testing.assert_array_equal(f32_to_bf16(f32), want)
    back = bf16_to_f32(want)
    np.testing.assert_array_equal(back.view(np.uint32), want.astype(np.uint32) << 16)


def test_bf16_kernel_rounding_table(backend):
    """The backend's own f32->bf16 (inside kv_write) matches the table bit for bit."""
    f32 = np.array([a for a, _ in BF16_TABLE], dtype=np.uint32).view(np.float32)
    want = np.array([b for _, b in BF16_TABLE], dtype=np.uint16)
    head_dim = len(f32)
    k_pages, v_pages, page_table = make_pool(np.random.default_rng(0), 1, 1, 4, head_dim)
    k = f32[None, :].copy()
    _, (kp, vp) = run_op(backend, "kv_write", k_pages, v_pages, page_table, k, -k, 0,
                         outputs=(0, 1))
    row = kp[page_table[0], 0, 0]
    np.testing.assert_array_equal(row, want)
    np.testing.assert_array_equal(vp[page_table[0], 0, 0], want ^ np.uint16(0x8000))


# -- elementwise ---------------------------------------------------------------
@pytest.mark.parametrize("n,d", [(1, 64), (7, 576), (33, 1536)])
def test_rms_norm(backend, n, d):
    rng = np.random.default_rng(n * d)
    x = (rng.standard_normal((n, d)) * 3).astype(np.float32)
    w = rng.standard_normal(d).astype(np.float32)
    want = np.empty_like(x)
    REF.rms_norm(x, w, 1e-5, want)
    _, (got,) = run_op(backend, "rms_norm", x, w, 1e-5, np.zeros_like(x), outputs=(3,))
    assert nmse(got, want) < TOL_F32


@pytest.mark.parametrize("n,d", [(1, 576), (7, 1536)])
def test_add_rms_norm(backend, n, d):
    """The optional fused residual add and norm (x += r, out = rms_norm(x) * w) equals the
    reference, and the backend's own add then rms_norm bit for bit, on views: x and r
    column slices of wider rows, out a slice elsewhere."""
    if not hasattr(backend, "add_rms_norm"):
        pytest.skip(f"{backend.name} has no add_rms_norm (the engine calls add, then rms_norm)")
    rng = np.random.default_rng(n + d)
    xh = (rng.standard_normal((n, d + 8)) * 3).astype(np.float32)
    rh = rng.standard_normal((n, d + 5)).astype(np.float32)
    w = rng.standard_normal(d).astype(np.float32)
    want_x = xh[:, 8:] + rh[:, 5:]
    want = np.empty((n, d), np.float32)
    REF.rms_norm(want_x, w, 1e-5, want)
    x, r, out = backend.upload(xh), backend.upload(rh), backend.upload(np.full((n, d + 3), 7.0, np.float32))
    backend.add_rms_norm(x[:, 8:], r[:, 5:], backend.upload(w), 1e-5, out[:, 3:])
    backend.synchronize()
    got_x, got = backend.download(x), backend.download(out)
    np.testing.assert_array_equal(got_x[:, 8:], want_x)
    np.testing.assert_array_equal(got_x[:, :8], xh[:, :8])
    assert nmse(got[:, 3:], want) < TOL_F32 and np.all(got[:, :3] == 7.0)
    x2, out2 = backend.upload(xh), backend.upload(np.zeros((n, d), np.float32))   # unfused, on this backend
    backend.add(x2[:, 8:], r[:, 5:], x2[:, 8:])
    backend.rms_norm(x2[:, 8:], backend.upload(w), 1e-5, out2)
    backend.synchronize()
    np.testing.assert_array_equal(got[:, 3:], backend.download(out2))     # fusing changes no bit


def test_rms_norm_column_slice(backend):
    """Column slices of a 2-D activation are valid inputs and outputs."""
    rng = np.random.default_rng(1)
    if backend.name != "cpu":
        pytest.skip("column-slice views are a host-array case")
    x = rng.standard_normal((7, 200)).astype(np.float32)
    w = rng.standard_normal(64).astype(np.float32)
    out = np.full((7, 200), 5.0, dtype=np.float32)
    want = np.empty((7, 64), dtype=np.float32)
    REF.rms_norm(x[:, 64:128], w, 1e-6, want)
    backend.rms_norm(x[:, 64:128], w, 1e-6, out[:, 100:164])
    assert nmse(out[:, 100:164], want) < TOL_F32
    assert np.all(out[:, :100] == 5.0) and np.all(out[:, 164:] == 5.0)


@pytest.mark.parametrize("n,d,g", [
    (1, 64, 64),          # g == d: the usual row norm
    (7, 576, 576),
    (1, 9 * 64, 64),      # per-head norm, head_dim 64 (decode)
    (7, 4 * 64, 64),
    (33, 8 * 128, 128),   # head_dim 128, parallel path
    (1, 32 * 128, 128),
])
def test_rms_norm_grouped(backend, n, d, g):
    """Each g-wide group of a row normalised on its own, out separate and in place."""
    rng = np.random.default_rng(n * d + g)
    x = (rng.standard_normal((n, d)) * 3).astype(np.float32)
    x[:, :g] *= 50.0                                  # groups of very different scale
    w = rng.standard_normal(g).astype(np.float32)
    want = np.empty_like(x)
    REF.rms_norm(x, w, 1e-6, want)
    for j in range(d // g):                           # the reference: g == d per group
        part = np.empty((n, g), dtype=np.float32)
        REF.rms_norm(x[:, j * g:(j + 1) * g], w, 1e-6, part)
        np.testing.assert_array_equal(want[:, j * g:(j + 1) * g], part)
    _, (got,) = run_op(backend, "rms_norm", x, w, 1e-6, np.zeros_like(x), outputs=(3,))
    assert nmse(got, want) < TOL_F32
    dx = backend.upload(x)                            # in place: out aliases x
    backend.rms_norm(dx, backend.upload(w), 1e-6, dx)
    backend.synchronize()
    assert nmse(backend.download(dx), want) < TOL_F32


def test_rms_norm_grouped_in_place_column_slice(backend):
    """Gemma 3's Q norm: the q columns of a qkv activation, per head, in place."""
    if backend.name != "cpu":
        pytest.skip("column-slice views are a host-array case")
    rng = np.random.default_rng(3)
    qkv = rng.standard_normal((7, 4 * 128 + 2 * 128)).astype(np.float32)
    w = rng.standard_normal(128).astype(np.float32)
    want = qkv.copy()
    REF.rms_norm(qkv[:, :512], w, 1e-6, want[:, :512])
    backend.rms_norm(qkv[:, :512], w, 1e-6, qkv[:, :512])
    assert nmse(qkv[:, :512], want[:, :512]) < TOL_F32
    np.testing.assert_array_equal(qkv[:, 512:], want[:, 512:])


@pytest.mark.parametrize("n,d", [(1, 640), (7, 100), (40, 1152)])
def test_scale(backend, n, d):
    rng = np.random.default_rng(n + d)
    x = (rng.standard_normal((n, d)) * 4).astype(np.float32)
    s = math.sqrt(d)
    want = (x.astype(np.float64) * s).astype(np.float32)
    got = np.empty_like(x)
    REF.scale(x, s, got)
    np.testing.assert_array_equal(got, want)
    _, (got,) = run_op(backend, "scale", x, s, np.zeros_like(x), outputs=(2,))
    assert nmse(got, want) < TOL_F32
    dx = backend.upload(x)                            # in place: out aliases x
    backend.scale(dx, s, dx)
    backend.synchronize()
    assert nmse(backend.download(dx), want) < TOL_F32


def gelu_tanh_f64(g: np.ndarray) -> np.ndarray:
    g = np.asarray(g, dtype=np.float64)
    return 0.5 * g * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g ** 3)))


@pytest.mark.parametrize("n,f", [(1, 2001), (7, 100), (40, 1536)])
def test_gelu_gate(backend, n, f):
    """Against the tanh-approximation formula in float64, gate values -10 .. 10."""
    rng = np.random.default_rng(n * f)
    gate = np.linspace(-10.0, 10.0, n * f).reshape(n, f)
    gate = rng.permuted(gate, axis=1).astype(np.float32)
    gate[0, :5] = [-10.0, 10.0, 0.0, -0.5, 3.0]
    up = rng.standard_normal((n, f)).astype(np.float32)
    want = gelu_tanh_f64(gate) * up.astype(np.float64)
    # spot values of gelu_tanh itself
    np.testing.assert_allclose(gelu_tanh_f64([0.0, 1.0, -1.0]), [0.0, 0.8411919906, -0.1588080094],
                               rtol=1e-9)
    ref = np.empty_like(gate)
    REF.gelu_gate(gate, up, ref)
    assert nmse(ref, want) < 1e-14
    _, (got,) = run_op(backend, "gelu_gate", gate, up, np.zeros_like(gate), outputs=(2,))
    assert nmse(got, want) < TOL_F32
    # the far negative tail is (almost) zero, never a large or non-finite value
    assert np.all(np.abs(got[gate < -6.0]) < 1e-6)


@pytest.mark.parametrize("n,f", [(1, 1536), (7, 100), (40, 1536)])
def test_silu_gate(backend, n, f):
    rng = np.random.default_rng(n + f)
    gate = (rng.standard_normal((n, f)) * 4).astype(np.float32)
    gate[0, :3] = [-100.0, 100.0, 0.0]
    up = rng.standard_normal((n, f)).astype(np.float32)
    want = np.empty_like(gate)
    REF.silu_gate(gate, up, want)
    _, (got,) = run_op(backend, "silu_gate", gate, up, np.zeros_like(gate), outputs=(2,))
    assert nmse(got, want) < TOL_F32


@pytest.mark.parametrize("d", [1000, 49152])
def test_argmax_rows(backend, d):
    """The optional argmax_rows (greedy decoding on the device) on a view of wider rows:
    np.argmax's index, the first of equal maxima (ties between positions one thread or
    lane walks, between threads, at the row's ends, a row all equal); -1 for a row holding
    a NaN, +inf or -inf, the others unaffected."""
    if not hasattr(backend, "argmax_rows"):
        pytest.skip(f"{backend.name} has no argmax_rows (the engine takes the argmax of downloaded logits)")
    rng = np.random.default_rng(d)
    host = rng.standard_normal((9, d + 7)).astype(np.float32)
    x = host[:, 4:4 + d]                                 # the view the op gets
    x[0, [300, 17]] = 9.0                                # tie between threads: the first, 17
    x[1, [3 + 256, 3]] = 9.0                             # tie within a thread's stride: 3
    x[2, [d - 1, d - 2]] = 9.0                           # at the end: d - 2
    x[3, 0] = 9.0                                        # the first element
    x[4] = 0.5                                           # all equal: 0
    x[5, d // 2] = -3e38                                 # finite extremes are values like others
    x[6, d // 3] = np.nan
    x[7, d - 1] = np.inf
    x[8, 5] = -np.inf
    want = [int(np.argmax(r)) for r in x[:6]] + [-1, -1, -1]
    assert want[:5] == [17, 3, d - 2, 0, 0]
    dev = backend.upload(host)
    out = backend.alloc((9,), np.int32)
    backend.argmax_rows(dev[:, 4:4 + d], out)
    backend.synchronize()
    assert backend.download(out).tolist() == want
    with pytest.raises(ValueError):
        backend.argmax_rows(dev[:, 4:4 + d], backend.alloc((8,), np.int32))


@pytest.mark.parametrize("n,d", [(1, 576), (40, 1000)])
def test_add(backend, n, d):
    rng = np.random.default_rng(d)
    a = rng.standard_normal((n, d)).astype(np.float32)
    b = rng.standard_normal((n, d)).astype(np.float32)
    want = (a.astype(np.float64) + b).astype(np.float32)
    _, (got,) = run_op(backend, "add", a, b, np.zeros_like(a), outputs=(2,))
    np.testing.assert_array_equal(got, want)
    # out aliases a
    da, db = backend.upload(a), backend.upload(b)
    backend.add(da, db, da)
    np.testing.assert_array_equal(backend.download(da), want)


@pytest.mark.parametrize("n", [1, 40])
def test_add_one_row_to_every_row(backend, n):
    """b [1, d] is added to every row of a strided column view, in place: how a layer's
    key centre reaches the keys of a fused QKV row (ForwardPass._key_centre)."""
    rng = np.random.default_rng(n)
    qkv = rng.standard_normal((n, 96)).astype(np.float32)
    row = rng.standard_normal((1, 32)).astype(np.float32)
    want = qkv.copy()
    want[:, 48:80] = (qkv[:, 48:80].astype(np.float64) + row).astype(np.float32)
    dev = backend.upload(qkv)
    backend.add(dev[:, 48:80], backend.upload(row), dev[:, 48:80])
    np.testing.assert_array_equal(backend.download(dev), want)
    with pytest.raises(ValueError):
        backend.add(dev[:, 48:80], backend.upload(np.zeros((2, 32), np.float32)), dev[:, 48:80])


# -- rope ------------------------------------------------------------------------
def test_rope_reference_modes_by_hand():
    """Adjacent pairs (0,1),(2,3) vs NEOX pairs (0,2),(1,3) on head_dim 4, base 100."""
    p = 3
    f1 = 100.0 ** (-2 * 1 / 4)                       # pair 1 frequency = 0.1
    x = np.array([[1.0, 0.0, 1.0, 0.0]], dtype=np.float32)
    REF.rope(x, np.array([p], np.int32), 1, 4, 4, 100.0, neox=False)
    want = [math.cos(p), math.sin(p), math.cos(p * f1), math.sin(p * f1)]
    np.testing.assert_allclose(x[0], want, rtol=1e-6, atol=1e-7)
    x = np.array([[1.0, 1.0, 0.0, 0.0]], dtype=np.float32)
    REF.rope(x, np.array([p], np.int32), 1, 4, 4, 100.0, neox=True)
    want = [math.cos(p), math.cos(p * f1), math.sin(p), math.sin(p * f1)]
    np.testing.assert_allclose(x[0], want, rtol=1e-6, atol=1e-7)
    x = np.array([[1.0, 0.0, 1.0, 0.0]], dtype=np.float32)       # frequency factors divide each pair's angle
    REF.rope(x, np.array([p], np.int32), 1, 4, 4, 100.0, neox=False, freq_factors=np.array([2.0, 8.0], np.float32))
    want = [math.cos(p / 2), math.sin(p / 2), math.cos(p * f1 / 8), math.sin(p * f1 / 8)]
    np.testing.assert_allclose(x[0], want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("factors", [False, True], ids=["plain", "freq_factors"])
@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("n,n_heads,head_dim,rot_dim,base", [
    (1, 9, 64, 64, 10000.0),
    (7, 3, 64, 32, 10000.0),        # partial rotary
    (7, 32, 128, 128, 1000000.0),
    (40, 8, 128, 128, 500000.0),
])
def test_rope(backend, neox, n, n_heads, head_dim, rot_dim, base, factors):
    rng = np.random.default_rng(n * head_dim + rot_dim)
    width = n_heads * head_dim + 17                  # trailing columns stay untouched
    x = rng.standard_normal((n, width)).astype(np.float32)
    positions = rng.permutation(np.arange(20000))[:n].astype(np.int32)
    ff = llama3_rope_factors(rot_dim, base) if factors else None
    if factors:
        assert ff.min() == 1.0 and ff.max() == pytest.approx(8.0)   # both ends of the ramp are exercised
    want = x.copy()
    REF.rope(want, positions, n_heads, head_dim, rot_dim, base, neox, ff)
    dx = backend.upload(x)
    backend.rope(dx, positions, n_heads, head_dim, rot_dim, base, neox, ff)
    got = backend.download(dx)
    assert nmse(got, want) < TOL_F32
    np.testing.assert_array_equal(got[:, n_heads * head_dim:], x[:, n_heads * head_dim:])


# -- kv_write ----------------------------------------------------------------------
@pytest.mark.parametrize("n_kv,head_dim,page_size,start_row,n", [
    (3, 64, 16, 0, 7), (8, 128, 16, 13, 7), (3, 64, 256, 250, 9), (3, 64, 16, 40, 1),
    (1, 256, 16, 3, 40)])
def test_kv_write(backend, kv, n_kv, head_dim, page_size, start_row, n):
    rng = np.random.default_rng(start_row + n)
    k_pages, v_pages, page_table = make_pool(rng, start_row + n, n_kv, page_size, head_dim, kv=kv)
    k = rng.standard_normal((n, n_kv * head_dim)).astype(np.float32)
    v = rng.standard_normal((n, n_kv * head_dim)).astype(np.float32)
    want_k, want_v = k_pages.copy(), v_pages.copy()
    REF.kv_write(want_k, want_v, page_table, k, v, start_row, *kv)
    _, (got_k, got_v) = run_op(backend, "kv_write", k_pages, v_pages, page_table, k, v,
                               start_row, *kv, outputs=(0, 1))
    assert_rows_written(got_k, want_k, kv[0], head_dim)
    assert_rows_written(got_v, want_v, kv[1], head_dim)
    # reference check of the addressing itself
    r = start_row + n - 1
    np.testing.assert_array_equal(
        want_k[page_table[r // page_size], :, r % page_size],
        KvFormat.get(kv[0], head_dim).quantize(k[-1].reshape(n_kv, head_dim)))
    if kv[0] == "bf16":
        np.testing.assert_array_equal(
            want_k[page_table[r // page_size], :, r % page_size].reshape(-1), f32_to_bf16(k[-1]))


@pytest.mark.parametrize("kv", [("bf16", "bf16"), ("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "tq4"),
                                ("q8_0", "rq4_0")], ids=lambda kv: "/".join(dict.fromkeys(kv)))
@pytest.mark.parametrize("centred", [False, True])
@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("n_q,n_kv,head_dim,rot_dim,page_size,start_row,n", [
    (6, 2, 64, 64, 16, 15, 1), (14, 2, 64, 32, 16, 40, 3), (8, 4, 128, 128, 256, 255, 2)])
def test_rope_kv_write_is_rope_then_write(backend, kv, centred, neox, n_q, n_kv, head_dim, rot_dim, page_size,
                                          start_row, n):
    """A decode step's fused RoPE + key centre + K/V write (ForwardPass on backends with
    rope_kv_write) leaves the same queries and pages, bit for bit, as rope, add and
    kv_write one after another on the same backend (which the tests above hold to the
    reference): over rows of q | k | v at positions out of order, a partial rotary width,
    both pair layouts, a write across a page boundary, the key formats it fuses (values of
    a rotated format are written on their own)."""
    require_kv(backend, kv)
    if kv[0] not in getattr(backend, "rope_write_keys", ()):
        pytest.skip(f"{backend.name} backend does not fuse RoPE into {kv[0]} key writes")
    rng = np.random.default_rng(start_row + n + head_dim)
    q_dim, kv_dim = n_q * head_dim, n_kv * head_dim
    qkv = (rng.standard_normal((n, q_dim + 2 * kv_dim)) * 3).astype(np.float32)
    positions = rng.permutation(np.arange(5000))[:n].astype(np.int32)
    centre = (rng.standard_normal((1, kv_dim)) * 20).astype(np.float32) if centred else None
    k_pages, v_pages, page_table = make_pool(rng, start_row + n, n_kv, page_size, head_dim, kv=kv)

    def pools():
        return backend.upload(k_pages), backend.upload(v_pages), backend.upload(page_table)

    sep, (ks, vs, ts) = backend.upload(qkv), pools()
    backend.rope(sep[:, :q_dim + kv_dim], positions, n_q + n_kv, head_dim, rot_dim, 1e6, neox)
    if centred:
        backend.add(sep[:, q_dim:q_dim + kv_dim], backend.upload(centre), sep[:, q_dim:q_dim + kv_dim])
    backend.kv_write(ks, vs, ts, sep[:, q_dim:q_dim + kv_dim], sep[:, q_dim + kv_dim:], start_row, *kv)
    fused, (kf, vf, tf) = backend.upload(qkv), pools()
    backend.rope_kv_write(fused, positions, n_q, rot_dim, 1e6, neox, None, kf, vf, tf, start_row, *kv,
                          centre=None if centre is None else backend.upload(centre))
    backend.synchronize()
    np.testing.assert_array_equal(backend.download(fused)[:, :q_dim], backend.download(sep)[:, :q_dim])
    np.testing.assert_array_equal(backend.download(fused)[:, q_dim + kv_dim:], qkv[:, q_dim + kv_dim:])
    assert_rows_written(backend.download(kf), backend.download(ks), kv[0], head_dim)
    assert_rows_written(backend.download(vf), backend.download(vs), kv[1], head_dim)
    written = backend.download(kf)[page_table[(start_row + n - 1) // page_size], :, (start_row + n - 1) % page_size]
    assert not np.array_equal(written, k_pages[0, :, 0])          # the row was written (not the poison)


# -- attention ---------------------------------------------------------------------
ATTN_SHAPES = [  # (n_q_heads, n_kv_heads, head_dim, page_size)
    (9, 3, 64, 16),
    (32, 8, 128, 16),
    (9, 3, 64, 256),
]


@pytest.mark.parametrize("n_q,n_kv,head_dim,page_size", ATTN_SHAPES)
@pytest.mark.parametrize("start_row,n", [(0, 1), (0, 7), (37, 7), (250, 1), (5, 40), (300, 64)])
def test_attention_prefill(backend, kv, n_q, n_kv, head_dim, page_size, start_row, n):
    rng = np.random.default_rng(start_row * 31 + n + head_dim)
    n_rows = start_row + n
    k_pages, v_pages, page_table = filled_pool(rng, n_rows, n_kv, page_size, head_dim, kscale=2.0,
                                               kv=kv)
    q = rng.standard_normal((n, n_q * head_dim)).astype(np.float32)
    scale = 1.0 / math.sqrt(head_dim)
    want = np.empty_like(q)
    REF.attention_prefill(q, k_pages, v_pages, page_table, start_row, n_q, scale, want, 0, *kv)
    _, (got,) = run_op(backend, "attention_prefill", q, k_pages, v_pages, page_table,
                       start_row, n_q, scale, np.zeros_like(q), 0, *kv, outputs=(7,))
    assert nmse(got, want) < TOL_ATTN


@pytest.mark.parametrize("kv_pair", [("bf16", "bf16"), ("q8_0", "tq4")])
@pytest.mark.parametrize("window", [0, 37])
@pytest.mark.parametrize("start_row,n", [(5, 40), (300, 64), (0, 100)])
def test_cpu_prefill_attention_in_flash_tiles(monkeypatch, kv_pair, window, start_row, n):
    """The CPU's BLAS path runs blocks of queries over tiles of rows with a running
    softmax, blocks on threads: forced down to blocks of 16 queries and tiles of 48 rows
    (tiles wholly after or, with a window, wholly before some of a block's queries, a
    last tile of a few rows), it equals the reference, with 1 and 2 threads."""
    import numba

    from backends.cpu import attention_blas
    monkeypatch.setattr(attention_blas, "FLASH_VECTORS", 1)
    monkeypatch.setattr(attention_blas, "tile_rows", lambda nv, head_dim: 48)
    rng = np.random.default_rng(start_row + n)
    k_pages, v_pages, page_table = filled_pool(rng, start_row + n, 3, 16, 64, kscale=2.0, kv=kv_pair)
    q = rng.standard_normal((n, 9 * 64)).astype(np.float32)
    want = np.empty_like(q)
    REF.attention_prefill(q, k_pages, v_pages, page_table, start_row, 9, 0.125, want, window, *kv_pair)
    saved = numba.get_num_threads()
    try:
        for threads in sorted({1, min(2, numba.config.NUMBA_NUM_THREADS)}):
            numba.set_num_threads(threads)
            got = np.full_like(q, np.nan)
            attention_blas.attention_prefill(q, k_pages, v_pages, page_table, start_row, 9, 0.125, got,
                                             window, *kv_pair)
            assert nmse(got, want) < TOL_ATTN, threads
    finally:
        numba.set_num_threads(saved)
    assert attention_blas.FLASH_MIN_QUERIES < n


def test_attention_prefill_first_query_sees_only_row_zero():
    """Causality by hand: at start_row 0 query 0 returns V row 0 exactly (through bf16)."""
    rng = np.random.default_rng(5)
    k_pages, v_pages, page_table = filled_pool(rng, 7, 3, 16, 64)
    q = rng.standard_normal((7, 9 * 64)).astype(np.float32)
    out = np.empty_like(q)
    REF.attention_prefill(q, k_pages, v_pages, page_table, 0, 9, 0.125, out)
    v0 = bf16_to_f32(v_pages[page_table[0], :, 0, :])          # [3, 64]
    np.testing.assert_allclose(out[0].reshape(9, 64), np.repeat(v0, 3, axis=0), rtol=1e-6)


@pytest.mark.parametrize("n_q,n_kv,head_dim,page_size", ATTN_SHAPES)
@pytest.mark.parametrize("n_rows", [1, 7, 16, 17, 300, 1000, 2500])
def test_attention_decode(backend, kv, n_q, n_kv, head_dim, page_size, n_rows):
    rng = np.random.default_rng(n_rows + head_dim + page_size)
    k_pages, v_pages, page_table = filled_pool(rng, n_rows, n_kv, page_size, head_dim, kscale=2.0,
                                               kv=kv)
    q = rng.standard_normal((1, n_q * head_dim)).astype(np.float32)
    scale = 1.0 / math.sqrt(head_dim)
    want = np.empty_like(q)
    REF.attention_decode(q, k_pages, v_pages, page_table, n_rows, n_q, scale, want, 0, *kv)
    _, (got,) = run_op(backend, "attention_decode", q, k_pages, v_pages, page_table,
                       n_rows, n_q, scale, np.zeros_like(q), 0, *kv, outputs=(7,))
    assert nmse(got, want) < TOL_ATTN


def test_attention_decode_matches_prefill_last_row():
    """Decode at n_rows equals the last query of a prefill over the same rows."""
    rng = np.random.default_rng(9)
    k_pages, v_pages, page_table = filled_pool(rng, 45, 3, 16, 64)
    q = rng.standard_normal((5, 9 * 64)).astype(np.float32)
    pre = np.empty_like(q)
    REF.attention_prefill(q, k_pages, v_pages, page_table, 40, 9, 0.125, pre)
    dec = np.empty_like(q[:1])
    REF.attention_decode(q[4:5], k_pages, v_pages, page_table, 45, 9, 0.125, dec)
    np.testing.assert_allclose(dec[0], pre[4], rtol=1e-12, atol=1e-12)


# -- sliding-window attention -----------------------------------------------------
WINDOWS = [1, 7, 64, 512]
WINDOW_SHAPES = ATTN_SHAPES + [(4, 1, 256, 16)]     # + Gemma 3 1B: 4 query heads on 1 KV head, head_dim 256


def poison_below(k_pages, v_pages, page_table, lo):
    """Copies in which rows 0 .. lo-1 are gone, as after a sliding-window layer returned
    them: their slots hold NaN, and the table entries of pages wholly below row lo point
    at an all-NaN page (one the table does not hold). Any read of them gives NaN."""
    k_pages, v_pages, page_table = k_pages.copy(), v_pages.copy(), page_table.copy()
    ps = k_pages.shape[2]
    rows = np.arange(lo)
    for pages in (k_pages, v_pages):
        pages[page_table[rows // ps], :, rows % ps] = poison(pages)
    nan_page = np.setdiff1d(np.arange(k_pages.shape[0]), page_table)[0]
    assert np.all(k_pages[nan_page] == poison(k_pages)) and np.all(v_pages[nan_page] == poison(v_pages))
    page_table[:lo // ps] = nan_page
    return k_pages, v_pages, page_table


def windowed_attention_f64(q, k_pages, v_pages, page_table, query_rows, n_q, scale, window):
    """Independent oracle: f64 softmax over each query's window rows, read one by one."""
    from backends.reference import read_rows
    n, hd = q.shape[0], k_pages.shape[3]
    group = n_q // k_pages.shape[1]
    out = np.empty((n, n_q, hd))
    for t, r in enumerate(query_rows):
        rows = np.arange(max(0, r - window + 1) if window else 0, r + 1)
        keys, values = read_rows(k_pages, page_table, rows), read_rows(v_pages, page_table, rows)
        for h in range(n_q):
            logits = keys[h // group] @ q[t, h * hd:(h + 1) * hd].astype(np.float64) * scale
            p = np.exp(logits - logits.max())
            out[t, h] = (p / p.sum()) @ values[h // group]
    return out.reshape(n, n_q * hd)


@pytest.mark.parametrize("window", [0, 1, 3, 20])
@pytest.mark.parametrize("start_row,n", [(0, 9), (30, 5)])
def test_reference_window_attention_by_hand(window, start_row, n):
    """The reference's window mask against a per-query loop; window 1 returns V of the
    query's own row; decode equals the last prefill query; NaN below the window is unread."""
    rng = np.random.default_rng(window + n)
    n_rows = start_row + n
    k_pages, v_pages, page_table = filled_pool(rng, n_rows, 3, 4, 64, kscale=2.0)
    lo = max(0, start_row - window + 1) if window else 0
    k_pages, v_pages, page_table = poison_below(k_pages, v_pages, page_table, lo)
    q = rng.standard_normal((n, 9 * 64)).astype(np.float32)
    got = np.empty_like(q)
    REF.attention_prefill(q, k_pages, v_pages, page_table, start_row, 9, 0.125, got, window=window)
    want = windowed_attention_f64(q, k_pages, v_pages, page_table, start_row + np.arange(n), 9,
                                  0.125, window)
    assert nmse(got, want) < 1e-12
    if window == 1:
        rows = start_row + np.arange(n)
        v_own = bf16_to_f32(v_pages[page_table[rows // 4], :, rows % 4, :])       # [n, 3, 64]
        np.testing.assert_allclose(got.reshape(n, 9, 64), np.repeat(v_own, 3, axis=1), rtol=1e-6)
    dec = np.empty_like(q[:1])
    REF.attention_decode(q[-1:], k_pages, v_pages, page_table, n_rows, 9, 0.125, dec, window=window)
    np.testing.assert_allclose(dec[0], got[-1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n_q,n_kv,head_dim,page_size", WINDOW_SHAPES)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("start_row,n", [(0, 7), (0, 40), (37, 7), (5, 40), (300, 64),
                                         (600, 1), (700, 300)])
def test_attention_prefill_window(backend, n_q, n_kv, head_dim, page_size, window, start_row, n):
    """Sliding window over chunks shorter and longer than the window (n >= 32: the CPU's
    BLAS path, in several query blocks for n > window); rows below the first query's
    window are poisoned."""
    check_prefill_window(backend, ("bf16", "bf16"), n_q, n_kv, head_dim, page_size, window,
                         start_row, n)


def check_prefill_window(backend, kv, n_q, n_kv, head_dim, page_size, window, start_row, n):
    rng = np.random.default_rng(start_row * 31 + n + head_dim + window)
    n_rows = start_row + n
    k_pages, v_pages, page_table = filled_pool(rng, n_rows, n_kv, page_size, head_dim, kscale=2.0,
                                               kv=kv)
    k_pages, v_pages, page_table = poison_below(k_pages, v_pages, page_table,
                                                max(0, start_row - window + 1))
    q = rng.standard_normal((n, n_q * head_dim)).astype(np.float32)
    scale = 1.0 / math.sqrt(head_dim)
    want = np.empty_like(q)
    REF.attention_prefill(q, k_pages, v_pages, page_table, start_row, n_q, scale, want, window, *kv)
    _, (got,) = run_op(backend, "attention_prefill", q, k_pages, v_pages, page_table,
                       start_row, n_q, scale, np.zeros_like(q), window, *kv, outputs=(7,))
    assert nmse(got, want) < TOL_ATTN


# Quantized rows on a thinner grid: the window logic does not depend on the row format
# (the bf16 grid covers its edge cases); these cover each format's reads through it.
QUANT_WINDOW_SHAPES = [(9, 3, 64, 16), (4, 1, 256, 16)]


@pytest.mark.parametrize("kvq", QUANT_CASES, ids=QUANT_IDS)
@pytest.mark.parametrize("n_q,n_kv,head_dim,page_size", QUANT_WINDOW_SHAPES)
@pytest.mark.parametrize("window,start_row,n", [(7, 37, 7), (1, 600, 1), (64, 5, 40),
                                                (64, 700, 300), (512, 700, 300)])
def test_attention_prefill_window_quantized(backend, kvq, n_q, n_kv, head_dim, page_size, window,
                                            start_row, n):
    require_kv(backend, kvq)
    check_prefill_window(backend, kvq, n_q, n_kv, head_dim, page_size, window, start_row, n)


@pytest.mark.parametrize("n_q,n_kv,head_dim,page_size", WINDOW_SHAPES)
@pytest.mark.parametrize("window,n_rows", [(w, r) for w in WINDOWS for r in (1, 7, 17, 300, 1000, 2000)]
                         + [(1500, 3000), (1030, 5000)])      # > 1024 rows: the CPU's parallel path
def test_attention_decode_window(backend, n_q, n_kv, head_dim, page_size, window, n_rows):
    check_decode_window(backend, ("bf16", "bf16"), n_q, n_kv, head_dim, page_size, window, n_rows)


def check_decode_window(backend, kv, n_q, n_kv, head_dim, page_size, window, n_rows):
    rng = np.random.default_rng(n_rows + head_dim + page_size + window)
    k_pages, v_pages, page_table = filled_pool(rng, n_rows, n_kv, page_size, head_dim, kscale=2.0,
                                               kv=kv)
    k_pages, v_pages, page_table = poison_below(k_pages, v_pages, page_table,
                                                max(0, n_rows - window))
    q = rng.standard_normal((1, n_q * head_dim)).astype(np.float32)
    scale = 1.0 / math.sqrt(head_dim)
    want = np.empty_like(q)
    REF.attention_decode(q, k_pages, v_pages, page_table, n_rows, n_q, scale, want, window, *kv)
    _, (got,) = run_op(backend, "attention_decode", q, k_pages, v_pages, page_table,
                       n_rows, n_q, scale, np.zeros_like(q), window, *kv, outputs=(7,))
    assert nmse(got, want) < TOL_ATTN


@pytest.mark.parametrize("kvq", QUANT_CASES, ids=QUANT_IDS)
@pytest.mark.parametrize("n_q,n_kv,head_dim,page_size", QUANT_WINDOW_SHAPES)
@pytest.mark.parametrize("window,n_rows", [(7, 300), (64, 17), (512, 2000), (1500, 3000),
                                           (1030, 5000)])
def test_attention_decode_window_quantized(backend, kvq, n_q, n_kv, head_dim, page_size, window,
                                           n_rows):
    require_kv(backend, kvq)
    check_decode_window(backend, kvq, n_q, n_kv, head_dim, page_size, window, n_rows)


@pytest.mark.parametrize("op,start_row,n", [("prefill", 0, 40), ("prefill", 290, 10),
                                            ("decode", 0, 300)])
def test_attention_window_zero_or_covering_is_full(backend, op, start_row, n):
    """window=0 (the default) and a window covering every row both give full causal attention."""
    rng = np.random.default_rng(n + start_row)
    n_rows = start_row + n
    k_pages, v_pages, page_table = filled_pool(rng, n_rows, 3, 16, 64, kscale=2.0)
    n_q = 1 if op == "decode" else n
    q = rng.standard_normal((n_q, 9 * 64)).astype(np.float32)
    name, pos = ("attention_decode", n_rows) if op == "decode" else ("attention_prefill", start_row)
    want = np.empty_like(q)
    getattr(REF, name)(q, k_pages, v_pages, page_table, pos, 9, 0.125, want)
    for window in (0, n_rows, n_rows + 100):
        ref = np.empty_like(q)
        getattr(REF, name)(q, k_pages, v_pages, page_table, pos, 9, 0.125, ref, window=window)
        np.testing.assert_array_equal(ref, want)
        _, (got,) = run_op(backend, name, q, k_pages, v_pages, page_table, pos, 9, 0.125,
                           np.zeros_like(q), window, outputs=(7,))
        assert nmse(got, want) < TOL_ATTN


# -- snapkv_votes ------------------------------------------------------------------
def write_keys(keys: np.ndarray, page_size=4):
    """keys f32 [L, n_kv*head_dim] -> NaN-poisoned pools (permuted pages) holding them."""
    n_rows, width = keys.shape
    rng = np.random.default_rng(0)
    k_pages, v_pages, page_table = make_pool(rng, n_rows, 1, page_size, width)
    REF.kv_write(k_pages, v_pages, page_table, keys, np.zeros_like(keys), 0)
    return k_pages, page_table


def votes_on(name, q_window, k_pages, page_table, n_rows, scale):
    be = REF if name == "reference" else make_backend(name)
    got = be.snapkv_votes(be.upload(q_window), be.upload(k_pages), be.upload(page_table),
                          n_rows, scale)
    return np.asarray(got)


@pytest.mark.parametrize("name", ["reference"] + BACKENDS)
def test_snapkv_seed004_worked_example(name):
    """Seed 004: L=8, W=2, D=2, exp-weights rows (1 2 10 8 1 1 2 -) and (1 1 8 12 1 1 1 1)."""
    a = np.array([1, 2, 10, 8, 1, 1, 2, 1], dtype=np.float64)
    b = np.array([1, 1, 8, 12, 1, 1, 1, 1], dtype=np.float64)
    keys = np.stack([np.log(a), np.log(b)], axis=1).astype(np.float32)    # [8, 2]
    q_window = np.array([[[math.sqrt(2), 0.0], [0.0, math.sqrt(2)]]], dtype=np.float32)
    k_pages, page_table = write_keys(keys, page_size=3)
    votes = votes_on(name, q_window, k_pages, page_table, 8, 1 / math.sqrt(2))
    want = a[:6] / 25 + b[:6] / 26          # full causal rows sum to 25 and 26
    assert votes.shape == (1, 6)
    np.testing.assert_allclose(votes[0], want, rtol=1e-2)  # keys pass through bf16
    assert int(np.argmax(votes[0])) == 3
    # the seed's avg pooling (width 3, zero padding, divide by 3) then picks [2, 3, 4]
    pooled = np.convolve(np.pad(votes[0].astype(np.float64), 1), np.ones(3) / 3, "valid")
    assert sorted(np.argsort(-pooled, kind="stable")[:3].tolist()) == [2, 3, 4]


@pytest.mark.parametrize("name", ["reference"] + BACKENDS)
def test_snapkv_votes_never_renormalise_over_prefix(name):
    """Seed 004 counter-example: full softmax votes A=0.315, B=0.685 (prefix-only would pick A)."""
    w1 = np.array([9, 1, 90, 1], dtype=np.float64)    # query at row 2; row 3 masked
    w2 = np.array([9, 27, 2, 2], dtype=np.float64)    # query at row 3
    keys = np.stack([np.log(w1), np.log(w2)], axis=1).astype(np.float32)
    q_window = np.array([[[math.sqrt(2), 0.0], [0.0, math.sqrt(2)]]], dtype=np.float32)
    k_pages, page_table = write_keys(keys, page_size=2)
    votes = votes_on(name, q_window, k_pages, page_table, 4, 1 / math.sqrt(2))[0]
    np.testing.assert_allclose(votes, [0.315, 0.685], rtol=1e-2)
    assert votes[1] > votes[0]


@pytest.mark.parametrize("n_q,n_kv,head_dim,page_size,n_rows,window", [
    (9, 3, 64, 16, 300, 8),
    (32, 8, 128, 16, 37, 4),
    (9, 3, 64, 256, 700, 64),
    (9, 3, 64, 16, 7, 7),        # window == prompt: empty prefix
    (9, 3, 64, 16, 20, 1),
])
@pytest.mark.parametrize("k_dtype", [k for k, _ in KV_CASES[:-1]])
def test_snapkv_votes(backend, k_dtype, n_q, n_kv, head_dim, page_size, n_rows, window):
    require_kv(backend, (k_dtype,))
    rng = np.random.default_rng(n_rows + window)
    k_pages, _, page_table = filled_pool(rng, n_rows, n_kv, page_size, head_dim, kscale=2.0,
                                         kv=(k_dtype, "bf16"))
    q_window = rng.standard_normal((n_q, window, head_dim)).astype(np.float32)
    scale = 1.0 / math.sqrt(head_dim)
    want = REF.snapkv_votes(q_window, k_pages, page_table, n_rows, scale, k_dtype)
    got = np.asarray(backend.snapkv_votes(backend.upload(q_window), backend.upload(k_pages),
                                          backend.upload(page_table), n_rows, scale, k_dtype))
    assert got.shape == want.shape == (n_kv, n_rows - window)
    assert got.dtype == np.float32
    if want.size:
        assert nmse(got, want) < TOL_ATTN
        # each window query gives at most 1 per query head of the group
        assert want.sum(axis=1).max() <= window * (n_q // n_kv) * (1 + 1e-6)


# -- kv_gather -------------------------------------------------------------------
def random_keep(rng, n_kv, n_rows, n_keep, window):
    """Sorted unique keep sets per head, always containing the last `window` rows."""
    keep = []
    for _ in range(n_kv):
        prefix = np.sort(rng.choice(n_rows - window, n_keep - window, replace=False))
        keep.append(np.concatenate([prefix, np.arange(n_rows - window, n_rows)]))
    return np.array(keep, dtype=np.int64)


@pytest.mark.parametrize("n_kv,head_dim,page_size,n_rows,n_keep", [
    (3, 64, 16, 100, 37), (8, 128, 16, 45, 44), (3, 64, 256, 600, 300), (3, 64, 16, 9, 9)])
def test_kv_gather(backend, kv, n_kv, head_dim, page_size, n_rows, n_keep):
    """Whole rows move (a quantized row with its scales), K and V rows of their own widths."""
    rng = np.random.default_rng(n_rows + n_keep)
    k_pages, v_pages, page_table = filled_pool(rng, n_rows, n_kv, page_size, head_dim, kv=kv)
    keep = random_keep(rng, n_kv, n_rows, n_keep, window=min(4, n_keep))
    # plain Python model: row j of head h becomes old row keep[h, j]
    ps = page_size
    model_k = [[k_pages[page_table[r // ps], h, r % ps].copy() for r in keep[h]] for h in range(n_kv)]
    want_k, want_v = k_pages.copy(), v_pages.copy()
    REF.kv_gather(want_k, want_v, page_table, keep)
    for h in range(n_kv):
        for j in range(n_keep):
            np.testing.assert_array_equal(want_k[page_table[j // ps], h, j % ps], model_k[h][j])
    dk, dv = backend.upload(k_pages), backend.upload(v_pages)
    backend.kv_gather(dk, dv, backend.upload(page_table), keep)
    np.testing.assert_array_equal(backend.download(dk), want_k)
    np.testing.assert_array_equal(backend.download(dv), want_v)


def test_kv_gather_in_fewer_workgroups_than_rows(backend, monkeypatch):
    """Vulkan: a workgroup moves every GATHER_GROUPS-th kept row (maxComputeWorkGroupCount
    is 65535 along x on some devices; a budget may keep more rows), here 7 for 300 rows."""
    if backend.name != "vulkan":
        pytest.skip("the Vulkan backend's dispatch")
    import backends.vulkan.backend as vk
    monkeypatch.setattr(vk, "GATHER_GROUPS", 7)
    rng = np.random.default_rng(11)
    for kv in (("bf16", "bf16"), ("q4_0", "tq4")):
        k_pages, v_pages, page_table = filled_pool(rng, 600, 3, 64, 64, kv=kv)
        keep = random_keep(rng, 3, 600, 300, window=4)
        want_k, want_v = k_pages.copy(), v_pages.copy()
        REF.kv_gather(want_k, want_v, page_table, keep)
        dk, dv = backend.upload(k_pages), backend.upload(v_pages)
        backend.kv_gather(dk, dv, backend.upload(page_table), keep)
        np.testing.assert_array_equal(backend.download(dk), want_k)
        np.testing.assert_array_equal(backend.download(dv), want_v)


def test_kv_copy_pages(backend, kv):
    """A branch of a cache: the listed pages copied whole, every other page untouched."""
    rng = np.random.default_rng(3)
    k_pages, v_pages, page_table = filled_pool(rng, 100, 3, 16, 64, kv=kv)
    dst_k, dst_v = make_pool(rng, 100, 3, 16, 64, kv=kv)[:2]
    pages = np.sort(page_table[[0, 2, 3, 6]]).astype(np.int32)
    want_k, want_v = dst_k.copy(), dst_v.copy()
    REF.kv_copy_pages(k_pages, v_pages, want_k, want_v, pages)
    np.testing.assert_array_equal(want_k[pages], k_pages[pages])
    dk, dv = backend.upload(dst_k), backend.upload(dst_v)
    backend.kv_copy_pages(backend.upload(k_pages), backend.upload(v_pages), dk, dv, pages)
    backend.synchronize()
    np.testing.assert_array_equal(backend.download(dk), want_k)
    np.testing.assert_array_equal(backend.download(dv), want_v)


def test_decode_over_compacted_cache_equals_masked_full_attention(backend, kv):
    """The invariant eviction relies on: attention over the gathered rows equals
    f64 attention over the full cache with the evicted rows masked."""
    rng = np.random.default_rng(11)
    n_q, n_kv, hd, ps, n_rows, n_keep = 9, 3, 64, 16, 90, 41
    k_pages, v_pages, page_table = filled_pool(rng, n_rows, n_kv, ps, hd, kscale=2.0, kv=kv)
    keep = random_keep(rng, n_kv, n_rows, n_keep, window=8)
    q = rng.standard_normal((1, n_q * hd)).astype(np.float32)
    from backends.reference import read_rows
    keys = read_rows(k_pages, page_table, n_rows, kv[0], hd)
    values = read_rows(v_pages, page_table, n_rows, kv[1], hd)
    want = np.empty((n_q, hd))
    for h in range(n_q):
        head = h // (n_q // n_kv)
        logits = keys[head] @ q[0, h * hd:(h + 1) * hd].astype(np.float64) / 8.0
        mask = np.full(n_rows, -np.inf)
        mask[keep[head]] = 0.0
        p = np.exp(logits + mask - np.max(logits + mask))
        want[h] = (p / p.sum()) @ values[head]
    dk, dv, dpt = backend.upload(k_pages), backend.upload(v_pages), backend.upload(page_table)
    backend.kv_gather(dk, dv, dpt, keep)
    out = backend.alloc((1, n_q * hd))
    backend.attention_decode(backend.upload(q), dk, dv, dpt, n_keep, n_q, 1 / 8.0, out, 0, *kv)
    assert nmse(backend.download(out).reshape(n_q, hd), want) < TOL_ATTN


# -- merged rows: a log-count bias on the first rows ---------------------------------
def test_reference_row_bias_by_hand():
    """A bias of log(c) on a row weighs it as c copies of itself: two rows, the first
    biased by log 3, give softmax weights proportional to 3 e^s0 and e^s1."""
    rng = np.random.default_rng(21)
    k_pages, v_pages, page_table = filled_pool(rng, 2, 1, 16, 64)
    q = rng.standard_normal((1, 64)).astype(np.float32)
    from backends.reference import read_rows
    keys, values = read_rows(k_pages, page_table, 2)[0], read_rows(v_pages, page_table, 2)[0]
    w = np.exp(keys @ q[0].astype(np.float64) * 0.125) * np.array([3.0, 1.0])
    out = np.empty_like(q)
    REF.attention_decode(q, k_pages, v_pages, page_table, 2, 1, 0.125, out,
                         row_bias=np.array([[math.log(3.0)]], dtype=np.float32))
    np.testing.assert_allclose(out[0], (w / w.sum()) @ values, rtol=1e-5, atol=1e-6)   # out is f32


BIAS_KV = [("bf16", "bf16"), ("q8_0", "tq4")]


@pytest.mark.parametrize("kv", BIAS_KV, ids=["/".join(dict.fromkeys(c)) for c in BIAS_KV])
@pytest.mark.parametrize("n_q,n_kv,head_dim,page_size", ATTN_SHAPES[:2])
@pytest.mark.parametrize("n_rows,n_bias", [(2, 1), (40, 17), (300, 64), (2500, 300)])
def test_attention_decode_row_bias(backend, kv, n_q, n_kv, head_dim, page_size, n_rows, n_bias):
    """Merged rows' log-counts (0 .. 9, and a few negative) on the first n_bias rows of
    each KV head, in short (serial) and long (split) decodes."""
    require_kv(backend, kv)
    rng = np.random.default_rng(n_rows + n_bias + head_dim)
    k_pages, v_pages, page_table = filled_pool(rng, n_rows, n_kv, page_size, head_dim, kscale=2.0, kv=kv)
    q = rng.standard_normal((1, n_q * head_dim)).astype(np.float32)
    bias = rng.uniform(-2.0, 9.0, (n_kv, n_bias)).astype(np.float32)
    scale = 1.0 / math.sqrt(head_dim)
    want, plain = np.empty_like(q), np.empty_like(q)
    REF.attention_decode(q, k_pages, v_pages, page_table, n_rows, n_q, scale, want, 0, *kv, row_bias=bias)
    REF.attention_decode(q, k_pages, v_pages, page_table, n_rows, n_q, scale, plain, 0, *kv)
    _, (got,) = run_op(backend, "attention_decode", q, k_pages, v_pages, page_table, n_rows, n_q, scale,
                       np.zeros_like(q), 0, *kv, bias, outputs=(7,))
    assert nmse(got, want) < TOL_ATTN
    assert nmse(plain, want) > 1e-3                # the bias matters at these sizes


@pytest.mark.parametrize("kv", BIAS_KV, ids=["/".join(dict.fromkeys(c)) for c in BIAS_KV])
@pytest.mark.parametrize("n_q,n_kv,head_dim,page_size", ATTN_SHAPES[:2])
@pytest.mark.parametrize("start_row,n,n_bias", [(17, 7, 17), (300, 64, 100), (60, 300, 60)])
def test_attention_prefill_row_bias(backend, kv, n_q, n_kv, head_dim, page_size, start_row, n, n_bias):
    """A chunk prefilled after a compaction with merged rows: every query adds the bias
    of the merged rows it sees (the chunk's own rows are unbiased)."""
    require_kv(backend, kv)
    rng = np.random.default_rng(start_row + n + n_bias)
    k_pages, v_pages, page_table = filled_pool(rng, start_row + n, n_kv, page_size, head_dim, kscale=2.0,
                                               kv=kv)
    q = rng.standard_normal((n, n_q * head_dim)).astype(np.float32)
    bias = rng.uniform(-2.0, 9.0, (n_kv, n_bias)).astype(np.float32)
    scale = 1.0 / math.sqrt(head_dim)
    want = np.empty_like(q)
    REF.attention_prefill(q, k_pages, v_pages, page_table, start_row, n_q, scale, want, 0, *kv, row_bias=bias)
    _, (got,) = run_op(backend, "attention_prefill", q, k_pages, v_pages, page_table, start_row, n_q, scale,
                       np.zeros_like(q), 0, *kv, bias, outputs=(7,))
    assert nmse(got, want) < TOL_ATTN


# -- ragged heads: the optional one-call decode ops --------------------------------
def ragged_pool(rng, rows, page_size, head_dim, kv):
    """A pool seen with one head per page (PageSegment.head_view), NaN-poisoned, with a
    permuted table of its own per KV head covering rows[h] rows, one spare entry each."""
    used = [-(-n // page_size) for n in rows]
    n_pages = sum(used) + 3
    k_pages, v_pages = (np.full(f.page_shape(n_pages, 1, page_size), poison(np.zeros(1, f.storage)), f.storage)
                        for f in (KvFormat.get(d, head_dim) for d in kv))
    ids = rng.permutation(n_pages).astype(np.int32)
    tables = np.zeros((len(rows), max(used) + 1), dtype=np.int32)
    at = 0
    for h, u in enumerate(used):
        tables[h, :u + 1] = ids[at:at + u + 1]
        at += u
    return k_pages, v_pages, tables


ONE_CALL_BACKENDS = [n for n in BACKENDS if hasattr(backend_class(n), "attention_decode_heads")]


@pytest.mark.parametrize("name", ONE_CALL_BACKENDS)
@pytest.mark.parametrize("kv", KV_CASES, ids=KV_IDS)
@pytest.mark.parametrize("n_q,n_kv,head_dim,page_size", ATTN_SHAPES[:2])
@pytest.mark.parametrize("rows", [(1, 17, 300), (1000, 40, 2500), (64, 1100, 7)])
@pytest.mark.parametrize("bias", [False, True])
def test_ragged_head_decode_in_one_call(name, kv, n_q, n_kv, head_dim, page_size, rows, bias):
    """kv_write_heads and attention_decode_heads (the backends that have them; the
    others run the engine's one call per head) equal the per-head calls of the
    reference: each head written at its own row through its own table (bit for bit),
    and attending only its own rows (serial and parallel paths)."""
    backend = make_backend(name)
    require_kv(backend, kv)
    rng = np.random.default_rng(sum(rows) + head_dim)
    rows = (list(rows) * n_kv)[:n_kv]
    k_pages, v_pages, tables = ragged_pool(rng, [n + 1 for n in rows], page_size, head_dim, kv)
    for h, n in enumerate(rows):                       # each head's rows, by the reference
        k, v = (rng.standard_normal((n, head_dim)).astype(np.float32) * s for s in (2.0, 1.0))
        REF.kv_write(k_pages, v_pages, tables[h], k, v, 0, *kv)
    k_new, v_new = (rng.standard_normal((1, n_kv * head_dim)).astype(np.float32) for _ in range(2))
    starts = np.array(rows, dtype=np.int64)
    want_k, want_v = k_pages.copy(), v_pages.copy()
    for h in range(n_kv):
        cols = slice(h * head_dim, (h + 1) * head_dim)
        REF.kv_write(want_k, want_v, tables[h], k_new[:, cols], v_new[:, cols], int(starts[h]), *kv)
    _, (got_k, got_v) = run_op(backend, "kv_write_heads", k_pages, v_pages, tables, k_new, v_new, starts, *kv,
                               outputs=(0, 1))
    np.testing.assert_array_equal(got_k, want_k)
    np.testing.assert_array_equal(got_v, want_v)
    q = rng.standard_normal((1, n_q * head_dim)).astype(np.float32)
    scale, group = 1.0 / math.sqrt(head_dim), n_q // n_kv
    row_bias = rng.standard_normal((n_kv, 5)).astype(np.float32) if bias else None
    want = np.empty_like(q)
    for h in range(n_kv):
        cols = slice(h * group * head_dim, (h + 1) * group * head_dim)
        out = np.empty((1, group * head_dim), np.float32)
        REF.attention_decode(np.ascontiguousarray(q[:, cols]), want_k, want_v, tables[h], int(starts[h]) + 1, group,
                             scale, out, 0, *kv, row_bias=None if row_bias is None else row_bias[h:h + 1])
        want[:, cols] = out
    dev = [backend.upload(a) for a in (q, want_k, want_v, tables)]
    out = backend.upload(np.zeros_like(q))
    backend.attention_decode_heads(*dev, starts + 1, n_q, scale, out, *kv,
                                   row_bias=None if row_bias is None else backend.upload(row_bias))
    assert nmse(backend.download(out), want) < TOL_ATTN
