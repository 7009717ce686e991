#!/usr/bin/env python3
"""Write tests/fixtures/rope_freqs_llamacpp.json: llama.cpp logits of a small random
llama model that carries Llama 3.1-style `rope_freqs.weight` factors, and of the
same model with linear RoPE scaling, so tests/e2e/test_rope_scaling.py can check
our frequency-scaled RoPE against an independent implementation.

    .venv/bin/python tools/make_rope_reference.py      # needs llama-cpp-python (.[bench])

The model is rebuilt bit for bit by the test from tests/tiny_gguf.py (seeded), so
only the settings, token ids and logits are stored. Positions run to 480 so that
the long-wavelength pairs, which the factors slow down 8x, turn by several radians.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)

from tiny_gguf import ROPE_VARIANTS, llama3_rope_factors, rope_variant, write_tiny_gguf  # noqa: E402

OUT = os.path.join(ROOT, "tests", "fixtures", "rope_freqs_llamacpp.json")
# A model whose RoPE matters: 2 layers, head_dim 32, base 10000, context 512.
MODEL = dict(n_layers=2, dim=128, n_heads=4, n_kv_heads=2, ffn_dim=256, ctx=512, seed=11)
N_TOKENS = 480
CHECK_LAST = 16          # logits of the last positions are stored


def factors(rot_dim: int) -> list[float]:
    """Llama 3.1's ramp with a small original context (64), so that a 512-token model
    has pairs on both sides of it."""
    return [float(v) for v in llama3_rope_factors(rot_dim, old_ctx=64)]


def token_ids(vocab: int) -> list[int]:
    rng = np.random.default_rng(5)
    return [int(t) for t in rng.integers(0, 256, N_TOKENS)]     # byte tokens only


def llama_cpp_logits(path: str, ids: list[int]) -> np.ndarray:
    from llama_cpp import Llama
    llm = Llama(model_path=path, n_ctx=MODEL["ctx"], n_batch=512, n_threads=2, logits_all=True, verbose=False)
    llm.eval(ids)
    return np.asarray(llm.scores[:len(ids)], np.float64)          # [n, vocab]


def main() -> int:
    head_dim = MODEL["dim"] // MODEL["n_heads"]
    out = {"model": MODEL, "factors": factors(head_dim), "check_last": CHECK_LAST, "variants": {}}
    with tempfile.TemporaryDirectory() as d:
        for name in ROPE_VARIANTS:
            path = os.path.join(d, f"{name}.gguf")
            write_tiny_gguf(path, **MODEL, **rope_variant(name, out["factors"]))
            ids = token_ids(0)
            logits = llama_cpp_logits(path, ids)
            out["variants"][name] = {"ids": ids, "logits": logits[-CHECK_LAST:].round(5).tolist()}
            print(f"{name}: llama.cpp logits [{len(ids)}, {logits.shape[1]}], last argmax "
                  f"{int(logits[-1].argmax())}")
    with open(OUT, "w") as f:
        json.dump(out, f)
    print(f"wrote {OUT} ({os.path.getsize(OUT) // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
