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
