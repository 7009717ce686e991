"""Frequency-scaled RoPE (Llama 3.1+ `rope_freqs.weight`, linear `rope.scaling`)
against llama.cpp: tests/fixtures/rope_freqs_llamacpp.json holds its logits for a
seeded random model (tools/make_rope_reference.py), rebuilt here bit for bit.

Tolerance: logits NMSE <= 1e-6 over the last 16 positions of a 480-token prompt
(measured ~1e-7: f32 weights, but llama.cpp keeps K/V in f16 and we keep bf16) and
the same argmax everywhere, while the three variants differ from one another by
an NMSE of 7e-3 to 1e-2."""
import json
import os

import numpy as np
import pytest

import engine
from engine.errors import BackendUnavailable
from tiny_gguf import ROPE_VARIANTS, rope_variant, write_tiny_gguf

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "rope_freqs_llamacpp.json")
REF = json.load(open(FIXTURE))
TOL = 1e-6


def nmse(a, b):
    return float(np.sum((np.asarray(a, np.float64) - b) ** 2) / np.sum(np.asarray(b, np.float64) ** 2))


def build(tmp_path, name):
    return write_tiny_gguf(tmp_path / f"{name}.gguf", **REF["model"], **rope_variant(name, REF["factors"]))


@pytest.mark.parametrize("name", ROPE_VARIANTS)
@pytest.mark.parametrize("backend", ["cpu", "reference", "vulkan"])
def test_logits_match_llama_cpp(tmp_path, name, backend):
    v = REF["variants"][name]
    try:
        model = engine.load(build(tmp_path, name), backend=backend, snapkv_budget=0)
    except BackendUnavailable as e:
        pytest.skip(str(e))
    factors = model.config.rope_freq_factors
    if name == "plain":
        assert factors is None
    elif name == "linear4":
        assert factors == (4.0,) * (model.config.rot_dim // 2)
    else:
        assert np.allclose(factors, REF["factors"]) and min(factors) == 1.0 and max(factors) > 7.9
    logits = model.forward.prefill(v["ids"], model.new_cache(), all_logits=True)[-REF["check_last"]:]
    want = np.asarray(v["logits"])
    assert nmse(logits, want) <= TOL
    assert np.array_equal(logits.argmax(axis=1), want.argmax(axis=1))
    for other, o in REF["variants"].items():       # the fixture tells the variants apart
        if other != name:
            assert nmse(np.asarray(o["logits"]), want) > 1000 * TOL


def test_rope_freqs_of_one_change_nothing(tmp_path):
    kw = dict(REF["model"])
    plain = engine.load(write_tiny_gguf(tmp_path / "p.gguf", **kw), snapkv_budget=0)
    half = plain.config.rot_dim // 2
    ones = engine.load(write_tiny_gguf(tmp_path / "o.gguf", **kw,
                                       extra_tensors={"rope_freqs.weight": np.ones(half, np.float32)}),
                       snapkv_budget=0)
    ids = REF["variants"]["plain"]["ids"][:200]
    np.testing.assert_array_equal(plain.logits(ids), ones.logits(ids))


def test_gemma3_scales_only_its_global_layers_rope(tmp_path):
    """Gemma 3 4B+ files carry a linear x8 RoPE scaling that applies to the global layers
    only (llama.cpp, HF): the sliding-window layers keep their own unscaled RoPE. A
    one-layer model (its layer is local) gives the same logits with and without it; in a
    six-layer one only layer 5 (global) is scaled."""
    kw = dict(arch="gemma3", sliding_window=16, seed=5)
    plain = engine.load(write_tiny_gguf(tmp_path / "p.gguf", n_layers=1, **kw), snapkv_budget=0)
    scaled = engine.load(write_tiny_gguf(tmp_path / "s.gguf", n_layers=1, rope_scaling=("linear", 8.0), **kw),
                         snapkv_budget=0)
    ids = list(range(3, 60))
    np.testing.assert_array_equal(plain.logits(ids), scaled.logits(ids))
    six = engine.load(write_tiny_gguf(tmp_path / "6.gguf", n_layers=6, rope_scaling=("linear", 8.0), **kw),
                      snapkv_budget=0).config
    half = six.rot_dim // 2
    assert [six.layer_rope_factors(i) for i in range(6)] == [None] * 5 + [(8.0,) * half]


def test_gemma3_27b_attention_scale(tmp_path):
    """Gemma 3 27B scales attention by 1/sqrt(dim / n_heads) (HF's query_pre_attn_scalar
    168, not in GGUF; llama.cpp tells the 27B by its 62 layers); other models by
    1/sqrt(head_dim)."""
    import dataclasses
    import math
    cfg = engine.load(write_tiny_gguf(tmp_path / "g.gguf", arch="gemma3", n_layers=2), snapkv_budget=0).config
    assert cfg.attention_scale == 1 / math.sqrt(cfg.head_dim)
    big = dataclasses.replace(cfg, n_layers=62, dim=5376, n_heads=32, head_dim=128)
    assert big.attention_scale == 1 / math.sqrt(168)


def test_a_scaling_factor_without_a_type_is_linear(tmp_path):
    """As llama.cpp reads them: rope.scaling.factor with no type, or the older
    rope.scale_linear, scale linearly (they were ignored)."""
    from gguf import GGUFValueType as T
    kw = dict(REF["model"])
    for key in ("{arch}.rope.scaling.factor", "{arch}.rope.scale_linear"):
        cfg = engine.load(write_tiny_gguf(tmp_path / "f.gguf", **kw, metadata={key: (4.0, T.FLOAT32)}),
                          snapkv_budget=0).config
        assert cfg.rope_freq_factors == (4.0,) * (cfg.rot_dim // 2), key


@pytest.mark.parametrize("factor", [1e39, 1e-300])
def test_a_factor_the_kernels_f32_cannot_hold_is_refused_at_load(tmp_path, factor):
    """1e39 is inf in f32 (RoPE silently off: finite garbage), 1e-300 is 0 (NaN logits at
    the first prompt): one line at load instead."""
    from gguf import GGUFValueType as T
    from engine.errors import ModelFileError
    from engine.gguf import GgufFile, model_config
    path = write_tiny_gguf(tmp_path / "f.gguf", metadata={"{arch}.rope.scaling.factor": (factor, T.FLOAT64)})
    with pytest.raises(ModelFileError, match=r"RoPE frequency factors .* must lie in \[1/1.04858e\+06"):
        model_config(GgufFile(path))
