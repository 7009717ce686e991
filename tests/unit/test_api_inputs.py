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
    (lambda m: m.generate("hi", max_tokens=1, presence_penalty=2.5), "presence_penalty must be"),
    (lambda m: m.generate("hi", max_tokens=1, frequency_penalty=float("nan")), "frequency_penalty must be"),
    (lambda m: m.generate("hi", max_tokens=1, logit_bias={10**6: 1.0}), "not a token id"),
    (lambda m: m.generate("hi", max_tokens=1, logit_bias={"x": 1.0}), "not a token id"),
    (lambda m: m.generate("hi", max_tokens=1, logit_bias={"9" * 5000: 1.0}), "not a token id"),   # not int()'s 500
    (lambda m: m.generate("hi", max_tokens=1, logit_bias={"5": 100, "05": 100}), "given more than once"),
    (lambda m: m.generate("hi", max_tokens=1, logit_bias={5: 101}), "in \\[-100, 100\\]"),
    (lambda m: m.generate("hi", max_tokens=1, logit_bias=[(5, 1.0)]), "mapping of token id"),
])
def test_bad_arguments(model, call, needle):
    with pytest.raises(ConfigError, match=needle) as e:
        call(model)
    assert "\n" not in str(e.value)


def test_the_earliest_stop_in_the_text_cuts_whatever_the_list_order():
    """OpenAI: the text never holds a stop sequence; with stop=["\n", "."] and one piece
    "Hello.\n", the cut is at "." (llama.cpp cuts at the earliest too)."""
    from engine.generate import StopMatcher
    assert StopMatcher(["\n", "."]).feed("Hello.\n") == ("Hello", True)
    assert StopMatcher(["cd", "b"]).feed("abcd") == ("a", True)


def test_stop_forms(model):
    ids = [65, 66, 67]
    full = model.generate(ids, max_tokens=6, ignore_eos=True).text
    assert model.generate(ids, max_tokens=6, stop=None, ignore_eos=True).text == full
    if len(full) > 2:
        cut = full[2:4]
        assert model.generate(ids, max_tokens=6, stop=cut, ignore_eos=True).text == \
            model.generate(ids, max_tokens=6, stop=[cut], ignore_eos=True).text


def test_logit_bias_and_penalties(model):
    """logit_bias moves a token's logit (100: greedy picks it every time, -100: never);
    a frequency penalty makes greedy decoding avoid what it already said; presence and
    frequency penalties act only on generated tokens, and the defaults change nothing."""
    from engine.generate import Sampler, SamplingParams
    ids = [65, 66, 67]
    plain = model.generate(ids, max_tokens=12, ignore_eos=True)
    assert model.generate(ids, max_tokens=12, ignore_eos=True, logit_bias={}, presence_penalty=0.0).tokens == \
        plain.tokens
    assert model.generate(ids, max_tokens=5, ignore_eos=True, logit_bias={"70": 100}).tokens == [70] * 5
    banned = plain.tokens[0]
    assert banned not in model.generate(ids, max_tokens=12, ignore_eos=True, logit_bias={banned: -100}).tokens
    logits = np.zeros(8, dtype=np.float32)
    logits[3], logits[5] = 1.0, 0.9
    s = Sampler(SamplingParams(frequency_penalty=0.06))
    assert [s(logits) for _ in range(4)] == [3, 3, 5, 3]       # 1 - 0.06k vs 0.9 - 0.06j
    s = Sampler(SamplingParams(presence_penalty=0.2))
    assert [s(logits) for _ in range(3)] == [3, 5, 3]          # both seen: 0.8 vs 0.7
    assert s.counts == {3: 2, 5: 1}


def test_a_tiny_temperature_samples_the_argmax():
    """A temperature just above 0 (down to the smallest double) is as greedy as 0, not a
    crash on inf - inf: a client may send 1e-308."""
    from engine.generate import Sampler, SamplingParams
    logits = np.array([0.5, -3.0, 2.0, 1.99, 2.0 - 1e-3], dtype=np.float32)
    for t in (5e-324, 1e-308, 1e-30):
        for extra in ({}, {"top_k": 2}, {"top_p": 0.5}):
            s = Sampler(SamplingParams(temperature=t, seed=1, **extra))
            assert [s(logits) for _ in range(5)] == [2] * 5, (t, extra)


def test_sampling_params_take_numpy_scalars_and_refuse_bools():
    from engine.generate import SamplingParams
    p = SamplingParams(max_tokens=np.int64(5), temperature=np.float32(0.5), top_k=np.int32(3), stop="###")
    assert (p.max_tokens, p.temperature, p.top_k, p.stop) == (5, 0.5, 3, ("###",))
    assert type(p.max_tokens) is int and type(p.temperature) is float
    for bad in ({"max_tokens": True}, {"temperature": True}, {"seed": False}, {"ignore_eos": "no"}):
        with pytest.raises(ConfigError):
            SamplingParams(**bad)


def test_a_new_prompt_does_not_hold_the_last_cache_while_it_allocates(tiny_llama):
    """The previous call's cache (a whole context's pool, allocated up front on a GPU) is
    let go before the next call's is made: two are never held at once."""
    import gc
    import weakref
    m = engine.load(tiny_llama, snapkv_budget=0)
    m.generate([5, 6, 7], max_tokens=2)
    last, real, seen = weakref.ref(m.last_cache), m.new_cache, []

    def new_cache(*a, **k):
        gc.collect()
        seen.append(last() is None)
        return real(*a, **k)
    m.new_cache = new_cache
    m.generate([5, 6, 7], max_tokens=2)
    assert seen == [True]


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
