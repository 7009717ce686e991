"""KV row formats (backends/kvformat.py): layouts, ggml byte compatibility, round-trip
error bounds, the TurboQuant tables, and dtype parsing."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize as gguf_quantize

from backends.kvformat import (KV_DTYPES, KvFormat, KvSpec, _pack, _unpack, boundaries, codebook, kv_dtype_name,
                               parse_kv_dtype, rotation, walsh_hadamard)
from engine.errors import ConfigError

QUANTIZED = [d for d in KV_DTYPES if d != "bf16"]


def gaussian_rows(n, d, seed=0):
    return np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)


def outlier_rows(n, d, seed=0):
    """Gaussian rows with one channel 30x larger and a common offset (real K rows look so)."""
    x = gaussian_rows(n, d, seed)
    x[:, 5] *= 30
    return x + 3.0


def scales_of(rows: np.ndarray, block_bytes: int) -> np.ndarray:
    """The f16 scale d of every 32-value block of q8_0 / q4_0 rows -> f32 [n, nb]."""
    blocks = np.ascontiguousarray(rows).reshape(rows.shape[0], -1, block_bytes)
    return blocks[:, :, :2].copy().view(np.float16)[..., 0].astype(np.float32)


# -- layout -------------------------------------------------------------------------

@pytest.mark.parametrize("name,bytes_per_row", [("bf16", 128), ("q8_0", 68), ("q4_0", 36), ("tq4", 34), ("tq3", 26),
                                                ("rq4_0", 36)])
def test_layout_at_head_dim_64(name, bytes_per_row):
    f = KvFormat.get(name, 64)
    assert f.row_bytes == bytes_per_row
    assert f.row_width * np.dtype(f.storage).itemsize == f.row_bytes
    assert f.page_shape(5, 3, 16) == (5, 3, 16, f.row_width)
    q = f.quantize(gaussian_rows(7, 64).reshape(7, 1, 64))
    assert q.shape == (7, 1, f.row_width) and q.dtype == f.storage
    assert f.dequantize(q).shape == (7, 1, 64)


@pytest.mark.parametrize("name,head_dim", [("q8_0", 48), ("q4_0", 16), ("tq4", 12), ("tq3", 100), ("rq4_0", 48),
                                           ("fp8", 64)])
def test_bad_head_dim_or_name_is_a_config_error(name, head_dim):
    with pytest.raises(ConfigError, match=name):
        KvFormat.get(name, head_dim)


def test_wrong_row_width_is_refused():
    with pytest.raises(ValueError, match="expected 64"):
        KvFormat.get("tq4", 64).quantize(np.zeros((2, 32), np.float32))


# -- ggml compatibility and block error bounds ----------------------------------------

@pytest.mark.parametrize("name,qtype", [("q8_0", Q.Q8_0), ("q4_0", Q.Q4_0)])
@pytest.mark.parametrize("rows", [gaussian_rows(64, 128), outlier_rows(64, 128), 1e-3 * gaussian_rows(8, 128)])
def test_blocks_are_byte_identical_to_ggml(name, qtype, rows):
    rows = rows.copy()
    rows[0] = 0.0                                          # an all-zero row
    rows[1, :32] = 0.0                                     # an all-zero block
    ours = KvFormat.get(name, 128).quantize(rows)
    theirs = gguf_quantize(rows, qtype).reshape(ours.shape)
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("rows", [gaussian_rows(200, 64), outlier_rows(200, 64)])
def test_q8_0_error_is_half_a_step(rows):
    f = KvFormat.get("q8_0", 64)
    stored = f.quantize(rows)
    d16 = scales_of(stored, 34)                                              # [n, 2]
    d32 = np.abs(rows.reshape(-1, 2, 32)).max(axis=2) / np.float32(127)      # before f16 rounding
    err = np.abs(f.dequantize(stored) - rows).reshape(-1, 2, 32)
    bound = 0.5 * d32 + 127 * np.abs(d16 - d32) + 1e-6 * d32                 # half a step + f16 scale rounding
    assert (err <= bound[..., None]).all()


@pytest.mark.parametrize("rows", [gaussian_rows(200, 64), outlier_rows(200, 64)])
def test_q4_0_error_is_half_a_step_within_range(rows):
    f = KvFormat.get("q4_0", 64)
    stored = f.quantize(rows)
    xb = rows.reshape(-1, 2, 32)
    pick = np.abs(xb).argmax(axis=2)
    d32 = np.take_along_axis(xb, pick[..., None], axis=2)[..., 0] / np.float32(-8)
    d16 = scales_of(stored, 18)
    err = np.abs(f.dequantize(stored) - rows).reshape(-1, 2, 32)
    step = np.abs(d32)[..., None]
    within = xb / np.where(d32 == 0, 1, d32)[..., None] <= 7.5              # levels -8 .. 7 cover [-8, 7.5]
    bound = 0.5 * step + 8 * np.abs(d16 - d32)[..., None] + 1e-6 * step
    assert (err <= bound)[within].all()
    assert (err <= 2 * bound).all()                        # the top half-step is clamped to level 7


@pytest.mark.parametrize("name", QUANTIZED + ["bf16"])
def test_zero_rows_read_back_as_zeros(name):
    f = KvFormat.get(name, 64)
    stored = f.quantize(np.zeros((3, 64), np.float32))
    back = f.dequantize(stored)
    assert np.isfinite(back).all() and (back == 0).all()


# -- TurboQuant -----------------------------------------------------------------------

def test_rq4_0_rows_are_ggml_q4_0_blocks_of_the_hadamard_rotated_row():
    """llama.cpp's rotated q4_0 cache: ggml's q4_0 bytes of x @ H, read back through H."""
    rows = outlier_rows(32, 128)
    f = KvFormat.get("rq4_0", 128)
    assert f.row_bytes == KvFormat.get("q4_0", 128).row_bytes and f.rotated and f.blocks == "q4_0"
    ours = f.quantize(rows)
    h = walsh_hadamard(128)
    np.testing.assert_array_equal(ours, gguf_quantize(rows @ h, Q.Q4_0).reshape(ours.shape))
    np.testing.assert_allclose(f.dequantize(ours), f.dequantize_rotated(ours) @ h, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [gaussian_rows(200, 64), outlier_rows(200, 64)])
def test_rq4_0_beats_q4_0_on_rows_with_outlier_channels(rows):
    """The point of the rotation: an outlier channel no longer sets its block's step."""
    err = {n: np.linalg.norm(KvFormat.get(n, 64).dequantize(KvFormat.get(n, 64).quantize(rows)) - rows)
           for n in ("q4_0", "rq4_0")}
    assert err["rq4_0"] < err["q4_0"] * (0.75 if rows[:, 5].std() > 10 else 1.1)


@pytest.mark.parametrize("head_dim,block", [(32, 32), (64, 64), (96, 32), (256, 64)])
def test_walsh_hadamard_is_ggml_gen_hadamard_per_block(head_dim, block):
    """Sylvester's construction as ggml_gen_hadamard builds it (H[0, 0] = 1/sqrt(n), then
    [[H, H], [H, -H]]), block-diagonal in blocks of at most 64; symmetric, H H = I."""
    g = np.array([[1.0]]) / np.sqrt(block)
    while g.shape[0] < block:
        g = np.block([[g, g], [g, -g]])
    h = walsh_hadamard(head_dim)
    assert h.dtype == np.float32 and not h.flags.writeable
    np.testing.assert_allclose(h, np.kron(np.eye(head_dim // block), g), atol=1e-7)
    np.testing.assert_allclose(h @ h, np.eye(head_dim), atol=1e-6)


@pytest.mark.parametrize("name,limit", [("tq4", 0.013), ("tq3", 0.045)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_tq_relative_mse_near_lloyd_max(name, limit, head_dim):
    """Lloyd-Max distortion of a standard normal: 0.0095 at 4 bits, 0.0345 at 3 bits."""
    f = KvFormat.get(name, head_dim)
    for rows in (gaussian_rows(2000, head_dim, 1), outlier_rows(2000, head_dim, 2)):
        back = f.dequantize(f.quantize(rows))
        rel = ((back - rows) ** 2).sum(axis=1) / (rows ** 2).sum(axis=1)
        assert rel.mean() < limit
        assert rel.max() < 8 * limit                       # no row falls apart


@pytest.mark.parametrize("name", ["tq4", "tq3", "rq4_0"])
def test_rotated_rows_score_in_the_rotated_basis(name):
    """q . x^ == (R q) . dequantize_rotated(x): what a kernel that rotates the query once computes."""
    f = KvFormat.get(name, 64)
    stored = f.quantize(gaussian_rows(10, 64))
    q = gaussian_rows(1, 64, 9)[0]
    direct = f.dequantize(stored) @ q
    rotated = f.dequantize_rotated(stored) @ (f.rotation @ q)
    np.testing.assert_allclose(direct, rotated, rtol=1e-4, atol=1e-4)


def test_tq_scale_is_scale_equivariant():
    f = KvFormat.get("tq4", 64)
    x = gaussian_rows(5, 64)
    a, b = f.dequantize(f.quantize(x)), f.dequantize(f.quantize(4 * x))
    np.testing.assert_allclose(b, 4 * a, rtol=2e-3, atol=1e-5)


@pytest.mark.parametrize("head_dim", [8, 64, 128, 256])
def test_rotation_is_orthogonal_and_fixed(head_dim):
    r = rotation(head_dim)
    assert r.dtype == np.float32 and not r.flags.writeable
    np.testing.assert_allclose(r @ r.T, np.eye(head_dim), atol=2e-5)
    rotation.cache_clear()
    np.testing.assert_array_equal(rotation(head_dim), r)


@pytest.mark.parametrize("bits,distortion", [(3, 0.03455), (4, 0.009497)])
def test_codebook_is_symmetric_ascending_lloyd_max(bits, distortion):
    c = codebook(bits).astype(np.float64)
    assert c.shape == (1 << bits,) and (np.diff(c) > 0).all()
    np.testing.assert_allclose(c, -c[::-1], atol=1e-6)
    np.testing.assert_allclose(boundaries(bits), (c[1:] + c[:-1]) / 2, atol=1e-6)
    x = np.random.default_rng(0).standard_normal(400_000)
    mse = np.mean((x - c[np.searchsorted(boundaries(bits), x)]) ** 2)
    assert abs(mse - distortion) < 0.03 * distortion


@pytest.mark.parametrize("bits", [3, 4])
def test_pack_unpack_are_inverse(bits):
    codes = np.random.default_rng(bits).integers(0, 1 << bits, (9, 64)).astype(np.uint8)
    packed = _pack(codes, bits)
    assert packed.shape == (9, 64 * bits // 8) and packed.dtype == np.uint8
    np.testing.assert_array_equal(_unpack(packed, bits, 64), codes)


def test_pack_layout():
    codes = np.arange(8, dtype=np.uint8)[None]                   # 3 bits: value i at bits 3i..3i+2
    word = sum(i << (3 * i) for i in range(8))
    np.testing.assert_array_equal(_pack(codes, 3)[0], [word & 0xFF, (word >> 8) & 0xFF, word >> 16])
    np.testing.assert_array_equal(_pack(np.array([[1, 2, 3, 4]], np.uint8), 4)[0], [0x21, 0x43])


# -- names ----------------------------------------------------------------------------

@pytest.mark.parametrize("text,want", [("tq4", ("tq4", "tq4")), (" Q8_0/tq4 ", ("q8_0", "tq4")),
                                       ("bf16/q4_0", ("bf16", "q4_0")), ("tq3/tq3", ("tq3", "tq3"))])
def test_parse_kv_dtype(text, want):
    assert parse_kv_dtype(text) == want
    assert parse_kv_dtype(kv_dtype_name(*want)) == want


@pytest.mark.parametrize("text", ["", "fp8", "q8_0/tq4/bf16", "q8_0/", "int4"])
def test_parse_kv_dtype_rejects(text):
    with pytest.raises(ConfigError, match="KV dtype must be one of"):
        parse_kv_dtype(text)


@pytest.mark.parametrize("text,name,layers", [
    ("rq4_0", "rq4_0", ["rq4_0"] * 4),
    (" RQ4_0:0=Q8_0/rq4_0 ", "rq4_0:0=q8_0/rq4_0", [("q8_0", "rq4_0")] + ["rq4_0"] * 3),
    ("tq4:3=q8_0:0-1=bf16/tq4", "tq4:0-1=bf16/tq4:3=q8_0", [("bf16", "tq4")] * 2 + ["tq4", "q8_0"]),
    ("q8_0/tq4:2-2=tq3", "q8_0/tq4:2=tq3", [("q8_0", "tq4")] * 2 + ["tq3", ("q8_0", "tq4")])])
def test_kv_spec_names_each_layers_formats(text, name, layers):
    spec = KvSpec.parse(text)
    assert spec.name == name and KvSpec.parse(name) == spec
    assert [spec.at(i) for i in range(4)] == [(d, d) if isinstance(d, str) else d for d in layers]
    spec.check_layers(4)
    assert set(spec.dtypes) == {d for i in range(4) for d in spec.at(i)}


@pytest.mark.parametrize("text,match", [
    ("rq4_0:0", "a layer exception is LAYER=FORMAT"), ("rq4_0:a=q8_0", "a layer exception is"),
    ("rq4_0:=q8_0", "a layer exception is"), ("rq4_0:0-=q8_0", "a layer exception is"),
    ("rq4_0:3-1=q8_0", "runs backwards"), ("rq4_0:0-2=q8_0:2=bf16", "layer 2 is named twice"),
    ("rq4_0:0=fp8", "must be one of"), ("fp8:0=q8_0", "must be one of"), ("rq4_0:\u00b2=q8_0", "a layer exception is"),
    ("rq4_0:1234567=q8_0", "a layer exception is")])
def test_kv_spec_rejects(text, match):
    with pytest.raises(ConfigError, match=match):
        KvSpec.parse(text)


@pytest.mark.parametrize("text,n,name", [
    ("q8_0/rq4_0:1-23=rq4_0", 24, "rq4_0:0=q8_0/rq4_0"), ("rq4_0:0=rq4_0", 24, "rq4_0"),
    ("rq4_0:0=q8_0:1=q8_0", 5, "rq4_0:0-1=q8_0"), ("rq4_0:0=q8_0:1=q8_0", 4, "q8_0:2-3=rq4_0"),
    ("rq4_0:0-3=q8_0", 4, "q8_0"),
    ("tq4:0=q8_0:2=q8_0", 5, "tq4:0=q8_0:2=q8_0"), ("tq4:1=q8_0", 2, "tq4:1=q8_0"), ("q8_0:0=tq4", 2, "tq4:1=q8_0")])
def test_kv_spec_has_one_name_per_layout(text, n, name):
    spec = KvSpec.parse(text)
    assert spec.for_layers(n).name == name
    assert [spec.at(i) for i in range(n)] == [KvSpec.parse(name).at(i) for i in range(n)]


def test_kv_spec_layers_must_exist():
    KvSpec.parse("tq4:23=q8_0").check_layers(24)
    with pytest.raises(ConfigError, match=r"names layer 24, but the model has 24 layers \(0-23\)"):
        KvSpec.parse("tq4:20-24=q8_0").check_layers(24)
    with pytest.raises(ConfigError, match=r"names layer 99"):      # a typo, though in the default formats
        KvSpec.parse("rq4_0:99=rq4_0").check_layers(24)


def test_kv_spec_spaces_anywhere():
    assert KvSpec.parse(" rq4_0 : 0 = q8_0 / rq4_0 ") == KvSpec.parse("rq4_0:0=q8_0/rq4_0")
    assert KvSpec.parse("q8_0 / tq4").name == "q8_0/tq4"


def test_kv_dtype_name():
    assert kv_dtype_name("tq4", "tq4") == "tq4" and kv_dtype_name("q8_0", "tq4") == "q8_0/tq4"
