"""Qwen2.5-Coder 0.5B (the default model) and 1.5B against llama.cpp: the tokenizer,
the last position's logits and greedy tokens, on the CPU backend, with Vulkan and the
CUDA harness checked against the CPU backend on a short prompt.

Fixtures, per model NAME (tools/make_qwen_reference.py, llama.cpp fed our token ids):
NAME_tokenizer_llamacpp.json (code, whitespace runs, numbers, eight scripts, emoji, the
chat / tool-call / fill-in-the-middle special tokens, matched as special tokens and,
for the markup, as plain text) and NAME_logits_llamacpp.json (an 8-token code prompt,
a 41-token chat question, a 41-token code completion). Tolerances:
  - tokenizer: the same ids as llama.cpp, and decoding gives the text back;
  - the last position's argmax equals llama.cpp's;
  - |ours - llama.cpp| <= 0.5 on llama.cpp's top-64 logits (measured on the CPU
    backend: 0.15-0.20 for the 0.5B, 0.17-0.34 for the 1.5B, on logits up to 24;
    llama.cpp quantizes activations to 8 bits for its quantized matmuls and keeps an
    f16 cache, we keep bf16 rows and f32 activations);
  - greedy tokens equal llama.cpp's up to the first step whose llama.cpp top-1 vs
    top-2 margin is below 0.25 (a near-tie either engine may break either way; measured:
    all 32 equal on the code prompts; on the chat one the 0.5B first differs at step 19,
    margin 0.024, the 1.5B at step 6, margin 0.078, both llama.cpp's first near-tie);
  - device backends against the CPU backend: logits NMSE < 1e-5 at every step and the
    same greedy tokens (DEVICE_TOKENS of them: the CUDA harness runs the kernels on
    the CPU, about 5 s a token for the 0.5B; the 1.5B is not run there).
"""
from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

import engine
from _backends import available_backends, nmse
from engine.gguf import GgufFile
from engine.model_path import named_model_path
from engine.tokenizer import Tokenizer

MODELS = ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")
FIXTURES = pathlib.Path(__file__).parent.parent / "fixtures"
TOKENIZER = {m: json.loads((FIXTURES / f"{m}_tokenizer_llamacpp.json").read_text(encoding="utf-8")) for m in MODELS}
LOGITS = {m: {p["name"]: p for p in json.loads((FIXTURES / f"{m}_logits_llamacpp.json").read_text())["prompts"]}
          for m in MODELS}
PROMPTS = ("short", "chat", "code")
MAX_ABS = 0.5
MARGIN = 0.25
DEVICE_TOKENS = 3


def installed(name: str):
    path = named_model_path(name)
    if path is None:
        pytest.skip(f"{name} not installed (engine pull {name})")
    return path


@pytest.fixture(scope="module", params=MODELS)
def name(request):
    installed(request.param)
    return request.param


@pytest.fixture(scope="module")
def cpu(name):
    return engine.load(name, backend="cpu", ctx=1024, snapkv_budget=0)


@pytest.fixture(scope="module")
def tokenizers():
    """Model name -> its Tokenizer, read from the GGUF's metadata on first use."""
    loaded = {}

    def get(name):
        if name not in loaded:
            loaded[name] = Tokenizer.from_metadata(GgufFile(installed(name)).metadata)
        return loaded[name]
    return get


def sure_steps(prompt) -> int:
    """Greedy steps before llama.cpp's first near-tie."""
    margins = prompt["greedy_margins"]
    return next((i for i, m in enumerate(margins) if m < MARGIN), len(margins))


def greedy_rows(model, ids, n):
    """Prefill, then n greedy tokens: (f32 [n, vocab] logits each token was picked from, tokens)."""
    cache, logits = model.prefill(ids, snapkv=False)
    rows, tokens = [], []
    for i in range(n):
        rows.append(logits)
        tokens.append(int(np.argmax(logits)))
        if i + 1 < n:
            logits = model.forward.decode(tokens[-1], cache)
    return np.stack(rows), tokens


TOKENIZER_CASES = [(m, special, case) for m in MODELS
                   for special, key in ((True, "cases"), (False, "plain_cases")) for case in TOKENIZER[m][key]]


@pytest.mark.parametrize("model_name,special,case", TOKENIZER_CASES,
                         ids=[f"{m}-{'special' if s else 'plain'}-{c['text']!r:.40}" for m, s, c in TOKENIZER_CASES])
def test_tokenizer_matches_llamacpp_and_round_trips(tokenizers, model_name, special, case):
    tok = tokenizers(model_name)
    ids = tok.encode(case["text"], add_bos=False, special=special)
    assert ids == case["ids"]
    assert tok.decode(ids) == case["text"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_cpu_matches_llamacpp(name, cpu, prompt):
    p = LOGITS[name][prompt]
    rows, tokens = greedy_rows(cpu, p["ids"], len(p["greedy"]))
    top = np.array(p["top64_ids"])
    assert int(np.argmax(rows[0])) == top[0]
    assert np.max(np.abs(rows[0][top] - np.array(p["top64_logits"]))) <= MAX_ABS
    n = sure_steps(p)
    assert n >= 4
    assert tokens[:n] == p["greedy"][:n]


DEVICES = [b for b in ("vulkan", "cuda-harness") if b in available_backends()]


@pytest.mark.parametrize("device", DEVICES)
def test_device_backends_match_cpu(name, cpu, device, monkeypatch):
    """The real model's graph and tensor types on the device, at the 8-token prompt."""
    if device == "cuda-harness":
        if name != MODELS[0]:
            pytest.skip("the CUDA harness takes about 35 s to prefill the 1.5B's 8 tokens and 12 s a token "
                        "after; the 0.5B covers its graph, head_dim 128 is in tests/cuda/test_cuda_attention.py")
        monkeypatch.setenv("SHARPI_CUDA_EXECUTOR", "cpu-harness")
    dev = engine.load(name, backend=device.split("-")[0], ctx=1024, snapkv_budget=0)
    p = LOGITS[name]["short"]
    lc, tc = greedy_rows(cpu, p["ids"], DEVICE_TOKENS)
    ld, td = greedy_rows(dev, p["ids"], DEVICE_TOKENS)
    for got, want in zip(ld, lc):
        assert nmse(got, want) < 1e-5
    assert td == tc
    sure = min(DEVICE_TOKENS, sure_steps(p))
    assert td[:sure] == p["greedy"][:sure]
