#!/usr/bin/env python3
"""Write llama.cpp's reference for Gemma 3 270M (the second model) into tests/fixtures/:

  gemma3_tokenizer_llamacpp.json  token ids of strings chosen to stress the
                                  SentencePiece tokenizer (code, numbers, runs of
                                  whitespace, non-Latin scripts, emoji, markup)
  gemma3_logits_llamacpp.json     for a short prompt and one longer than the
                                  sliding window (512): our token ids (llama.cpp is
                                  fed the same ids), the last position's top-64
                                  logits, and 16 greedy tokens with each step's
                                  top-1 minus top-2 margin

llama.cpp runs with its default f16 KV cache and its own sliding-window cache.
Needs llama-cpp-python (`pip install -e '.[bench]'`, builds llama.cpp from source)
and the model (`make setup`):

    .venv/bin/python tools/make_gemma3_reference.py
"""
from __future__ import annotations

import importlib.metadata as md
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from engine.gguf import GgufFile                     # noqa: E402
from engine.model_path import gemma3_model_path      # noqa: E402
from engine.tokenizer import Tokenizer               # noqa: E402

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures")

TOKENIZER_TEXTS = [
    "Hello, world!", "hello world", " Hello", "  two  spaces", "\tTabbed\tline\n\nnew paragraph",
    "Numbers: 0 1 12 123 1234 12345 3.5e-10 -42 1,000,000",
    "def f(x):\n    return x ** 2  # square\n", "if (a != b && c <= d) { return; }",
    "<html><body class=\"x\">Text</body></html>", "https://example.com/path?q=1&r=two",
    "Grüße aus Köln — naïve café", "Привет, мир!", "你好，世界。机器学习", "こんにちは世界",
    "مرحبا بالعالم", "नमस्ते दुनिया", "Emoji: 😀👍🏽🇫🇷 🙂", "    leading spaces", "trailing spaces   ",
    "MiXeD CaSe and UPPER", "a\u00a0b\u2003c", "<start_of_turn>user\nHi<end_of_turn>",
]

SHORT = "The capital of France is"
LONG_PARAGRAPH = ("The history of the lighthouse at Alexandria is told in many sources. Built in the third "
                  "century BC on the island of Pharos, it guided ships into the harbour for centuries, and "
                  "travellers wrote that its fire could be seen far out at sea. ")
N_GREEDY = 16


def logits_row(llm) -> np.ndarray:
    """f32 [vocab]: llama.cpp's logits at the last evaluated position."""
    return np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),)).copy()


def greedy_reference(llm, ids, n_greedy: int) -> tuple[np.ndarray, list[int], list[float]]:
    """llama.cpp fed `ids` from a fresh context, then n_greedy greedy tokens: (the last
    prompt position's logits, the greedy ids, each step's top-1 minus top-2 margin).
    Also tools/make_qwen_reference.py's."""
    llm.reset()
    llm.eval(ids)
    logits = logits_row(llm)
    greedy, margins = [], []
    step = logits
    for _ in range(n_greedy):
        order = np.argsort(-step)[:2]
        greedy.append(int(order[0]))
        margins.append(float(step[order[0]] - step[order[1]]))
        llm.eval([greedy[-1]])
        step = logits_row(llm)
    return logits, greedy, margins


def main() -> int:
    from llama_cpp import Llama

    path = gemma3_model_path()
    if path is None:
        raise SystemExit("Gemma 3 270M is not installed: run `make setup`")
    tok = Tokenizer.from_metadata(GgufFile(path).metadata)
    llm = Llama(model_path=str(path), n_ctx=2048, n_threads=os.cpu_count() or 2, n_batch=512,
                logits_all=False, verbose=False)
    version = md.version("llama_cpp_python")
    cases = [{"text": t, "ids": llm.tokenize(t.encode(), add_bos=False, special=True)} for t in TOKENIZER_TEXTS]
    with open(os.path.join(FIXTURES, "gemma3_tokenizer_llamacpp.json"), "w", encoding="utf-8") as f:
        json.dump({"model": path.name, "reference": f"llama-cpp-python {version}, "
                   "Llama.tokenize(text, add_bos=False, special=True)", "cases": cases}, f, indent=1,
                  ensure_ascii=False)

    prompts = []
    long_ids = tok.encode(LONG_PARAGRAPH * 16)[:700]
    for name, ids in (("short", tok.encode(SHORT)), ("long", long_ids)):
        logits, greedy, margins = greedy_reference(llm, ids, N_GREEDY)
        top = np.argsort(-logits)[:64]
        prompts.append({"name": name, "ids": [int(i) for i in ids], "top64_ids": top.tolist(),
                        "top64_logits": [float(logits[i]) for i in top], "greedy": greedy,
                        "greedy_margins": margins})
    with open(os.path.join(FIXTURES, "gemma3_logits_llamacpp.json"), "w") as f:
        json.dump({"model": path.name, "reference": f"llama-cpp-python {version}, default f16 KV cache, "
                   "fed our token ids", "prompts": prompts}, f, indent=1)
    print(f"wrote {len(cases)} tokenizer cases and {len(prompts)} logit prompts to {FIXTURES}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
