"""Issue 14, API side: malformed arguments are ConfigError (an EngineError) with one
line, never a bare TypeError / ValueError / AttributeError."""
import numpy as np
import pytest

import engine
from engine.errors import ConfigError, EngineError


@pytest.fixture(scope="module")
def model(tiny_llama):
    return engine.load(tiny_llama)


@pytest.mark.parametrize("call,needle", [
    (lambda m: m.generate(np.array([[1, 2], [3, 4]]), max_tokens=1), "one-dimensional"),
    (lambda m: m.generate([1.0, 2.0], max_tokens=1), "must be integers"),
    (lambda m: m.generate(np.array([1.5]), max_tokens=1), "must be integers"),
    (lambda m: m.generate(b"hi", max_tokens=1), "decode it first"),
    (lambda m: m.generate(None, max_tokens=1), "must be a str"),
    (lambda m: m.generate("a\ud800b", max_tokens=1), "lone surrogate"),
    (lambda m: m.generate([10**6], max_tokens=1), "out of range"),
    (lambda m: m.detokenize([10**6]), "out of range"),
    (lambda m: m.detokenize("abc"), "sequence of integers"),
    (lambda m: m.tokenize(None), "must be a str"),
    (lambda m: m.generate("hi", max_tokens=1, stop=5), "stop must be"),
    (lambda m: m.generate("hi", max_tokens=1, snapkv=1), "snapkv must be"),
    (lambda m: m.generate([1, 2], chat=True, max_tokens=1), "chat message 0"),
])
def test_bad_arguments(model, call, needle):
    with pytest.raises(ConfigError, match=needle) as e:
        call(model)
    assert "\n" not in str(e.value)


def test_stop_forms(model):
    ids = [65, 66, 67]
    full = model.generate(ids, max_tokens=6, ignore_eos=True).text
    assert model.generate(ids, max_tokens=6, stop=None, ignore_eos=True).text == full
    if len(full) > 2:
        cut = full[2:4]
        assert model.generate(ids, max_tokens=6, stop=cut, ignore_eos=True).text == \
            model.generate(ids, max_tokens=6, stop=[cut], ignore_eos=True).text


def test_load_arguments(tiny_llama):
    with pytest.raises(ConfigError, match="model path must be"):
        engine.load(123)
    with pytest.raises(ConfigError, match="snapkv must be"):
        engine.load(tiny_llama, snapkv=True)
    m = engine.load(tiny_llama, snapkv=False, snapkv_budget=100)
    assert m.snapkv is None and m.generate("hi", max_tokens=2).tokens
    with pytest.raises(EngineError, match="GiB bf16 KV cache") as e:
        engine.load(tiny_llama, ctx=10**10)
    assert "\n" not in str(e.value)


def test_engine_error_is_one_line():
    assert str(EngineError("tensor bad\nname\x00")) == "tensor bad\\nname\\x00"
