#!/usr/bin/env python3
"""Write llama.cpp's reference for the Qwen2.5-Coder models (the default, 0.5B, and the
1.5B) into tests/fixtures/, two files per model NAME:

  NAME_tokenizer_llamacpp.json  token ids of strings chosen to stress the qwen2 BPE
                                tokenizer: code with indentation and tabs, runs of
                                spaces and newlines, numbers, Latin with accents,
                                Cyrillic, Greek, Arabic, Devanagari, Chinese,
                                Japanese, Korean, emoji, and the chat, tool-call and
                                fill-in-the-middle special tokens; `cases` are
                                tokenized with special tokens matched (what a
                                rendered chat prompt gets), `plain_cases` without
                                (what message content gets: markup stays text)
  NAME_logits_llamacpp.json     for a short code prompt, a chat-formatted question
                                (our chat template) and a longer code completion: our
                                token ids (llama.cpp is fed the same ids), the last
                                position's top-64 logits, and 32 greedy tokens with
                                each step's top-1 minus top-2 margin

The same shape as tools/make_gemma3_reference.py's. llama.cpp runs with its default
f16 KV cache and its plain CPU kernels: extra weight buffer types (repacking, AMX) are
off, because its AMX matmul segfaults where the CPU reports AMX but the kernel does not
grant the tile state (the sandbox these were made on); the repacked kernels do the same
arithmetic in another layout. Needs llama-cpp-python (`pip install -e '.[bench]'`,
builds llama.cpp from source) and the models (`make setup` installs the 0.5B, `engine
pull qwen2.5-coder-1.5b` the 1.5B). About 20 s on 2 cores, bit-for-bit repeatable:

    .venv/bin/python tools/make_qwen_reference.py [NAME ...]    # default: both
"""
from __future__ import annotations

import importlib.metadata as md
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from engine.gguf import GgufFile                     # noqa: E402
from engine.model_path import named_model_path       # noqa: E402
from engine.tokenizer import Tokenizer               # noqa: E402
from make_gemma3_reference import greedy_reference   # noqa: E402  (tools/, this script's folder)

FIXTURES = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures"))
MODELS = ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")

CHAT_MARKUP = [
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
    "<|im_start|>assistant\n",
    "done.<|endoftext|>Next document",
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
    "<|fim_prefix|>def f(x):\n    <|fim_suffix|>\n    return y<|fim_middle|>",
    "<|repo_name|>snapkv<|file_sep|>engine/model.py\nimport os",
    "<|im_start|><|im_end|><|endoftext|>",
]
TOKENIZER_TEXTS = [
    "Hello, world!", "hello world", " Hello", "I'm sure it's fine, we'll see, they've gone",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "class Stack:\n\tdef push(self, x):\n\t\tself.items.append(x)  # tab-indented\n",
    "#include <vector>\nint main() {\n    std::vector<int> v{1, 2, 3};\n    for (auto& x : v) x *= 2;\n"
    "    return v.size() > 2 ? 0 : -1;\n}\n",
    "const f = async (a) => { await fetch(`/api/${a}?q=1&r=2`); };",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name;",
    "<div class=\"box\">&nbsp;</div>", "https://example.com/path/to?x=1&y=two#frag",
    "a  b   c    d     e", "                deep", "x\n\n\ny\n\n\n\nz", "\n", "\n\n\n", "   \n\t \n  ",
    "trailing spaces   ", "line one\r\nline two\r\n", "\t\t\tthree tabs",
    "Numbers: 0 1 12 123 1234 12345 123456 3.14159 -42 1,000,000 0xFF 1e-10 2024-06-13",
    "Grüße aus Köln — naïve café, señor, Ångström, œuvre", "Привет, мир! Как дела?", "Καλημέρα κόσμε",
    "مرحبا بالعالم", "नमस्ते दुनिया", "你好，世界。机器学习很有趣！", "こんにちは世界、カタカナとひらがな",
    "안녕하세요 세계", "Emoji: 😀👍🏽🇫🇷 🙂 👨‍👩‍👧", "変数 x = 42  # コメント, Привет",
    "MiXeD CaSe and UPPER", "a\u00a0b\u2003c\u200bd",
] + CHAT_MARKUP

SHORT = "def add(a, b):\n    return"
CHAT = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]
CODE = ("import math\n\n\ndef quicksort(items):\n    \"\"\"Sort a list with quicksort.\"\"\"\n"
        "    if len(items) <= 1:\n        return items\n    pivot = items[len(items) // 2]\n")
N_GREEDY = 32


def plain_llama(path):
    """llama_cpp.Llama on `path` with use_extra_bufts off (no repacked or AMX weights)."""
    import llama_cpp.llama_cpp as lib
    from llama_cpp import Llama

    defaults = lib.llama_model_default_params

    def plain_params():
        params = defaults()
        params.use_extra_bufts = False
        return params
    lib.llama_model_default_params = plain_params      # read by Llama.__init__
    try:
        return Llama(model_path=str(path), n_ctx=1024, n_threads=os.cpu_count() or 2, n_batch=512,
                     logits_all=False, verbose=False)
    finally:
        lib.llama_model_default_params = defaults


def reference(name: str, version: str) -> None:
    path = named_model_path(name)
    if path is None:
        raise SystemExit(f"{name} is not installed: run `engine pull {name}`")
    tok = Tokenizer.from_metadata(GgufFile(path).metadata)
    llm = plain_llama(path)
    how = f"llama-cpp-python {version}, Llama.tokenize(text, add_bos=False, special=%s)"
    cases = [{"text": t, "ids": llm.tokenize(t.encode(), add_bos=False, special=True)} for t in TOKENIZER_TEXTS]
    plain = [{"text": t, "ids": llm.tokenize(t.encode(), add_bos=False, special=False)} for t in CHAT_MARKUP]
    with open(os.path.join(FIXTURES, f"{name}_tokenizer_llamacpp.json"), "w", encoding="utf-8") as f:
        json.dump({"model": path.name, "reference": how % "True", "cases": cases,
                   "plain_reference": how % "False", "plain_cases": plain}, f, indent=1, ensure_ascii=False)

    prompts = []
    texts = (("short", SHORT), ("chat", tok.apply_chat_template(CHAT, add_generation_prompt=True)), ("code", CODE))
    for label, text in texts:
        ids = tok.encode(text, add_bos=False, special=True)
        logits, greedy, margins = greedy_reference(llm, ids, N_GREEDY)
        top = np.argsort(-logits)[:64]
        prompts.append({"name": label, "text": text, "ids": [int(i) for i in ids], "top64_ids": top.tolist(),
                        "top64_logits": [float(logits[i]) for i in top], "greedy": greedy,
                        "greedy_text": tok.decode(greedy), "greedy_margins": margins})
        print(f"{name} {label}: {len(ids)} tokens -> {tok.decode(greedy)!r}, smallest margin "
              f"{min(margins):.3f} at step {int(np.argmin(margins))}")
    with open(os.path.join(FIXTURES, f"{name}_logits_llamacpp.json"), "w", encoding="utf-8") as f:
        json.dump({"model": path.name, "reference": f"llama-cpp-python {version}, default f16 KV cache, "
                   "use_extra_bufts=False, fed our token ids", "prompts": prompts}, f, indent=1, ensure_ascii=False)
    print(f"{name}: wrote {len(cases)} + {len(plain)} tokenizer cases and {len(prompts)} logit prompts to {FIXTURES}")


def main(argv: list[str]) -> int:
    names = argv or list(MODELS)
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        raise SystemExit(f"unknown model {unknown[0]!r}: choose from {', '.join(MODELS)}")
    version = md.version("llama_cpp_python")
    for name in names:
        reference(name, version)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
