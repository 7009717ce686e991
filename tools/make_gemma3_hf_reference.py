#!/usr/bin/env python3
"""Write tests/fixtures/gemma3_hf_reference.json: fp32 logits from HF transformers for
Gemma 3 270M (the second model), on the prompts of gemma3_logits_llamacpp.json.

transformers dequantizes every GGUF tensor to fp32 and runs its own PyTorch Gemma 3
(eager attention, sliding-window mask, fp32 throughout): an implementation-
independent reference beside llama.cpp's quantized-activation one. torch and
transformers are not in the project venv; use a separate one, as for
tools/make_reference.py:

    python3 -m venv /tmp/refvenv
    /tmp/refvenv/bin/pip install torch==2.13.0 transformers gguf numpy sentencepiece accelerate
    /tmp/refvenv/bin/python tools/make_gemma3_hf_reference.py [MODEL.gguf]

(default model path: .venv/share/snapkv-engine/models/gemma-3-270m-q4_k_m.gguf, from `make setup`).
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
DEFAULT = os.path.join(ROOT, ".venv", "share", "snapkv-engine", "models", "gemma-3-270m-q4_k_m.gguf")


def main() -> int:
    path = sys.argv[1] if len(sys.argv) > 1 else DEFAULT
    torch.set_num_threads(os.cpu_count() or 2)
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32, attn_implementation="eager").eval()
    with open(os.path.join(FIXTURES, "gemma3_logits_llamacpp.json")) as f:
        prompts = json.load(f)["prompts"]
    out = []
    for p in prompts:
        with torch.no_grad():
            logits = model(torch.tensor([p["ids"]])).logits[0, -1].numpy().astype(np.float64)
        top = np.argsort(-logits)[:64]
        out.append({"name": p["name"], "ids": p["ids"], "top64_ids": top.tolist(),
                    "top64_logits": [float(logits[i]) for i in top]})
    with open(os.path.join(FIXTURES, "gemma3_hf_reference.json"), "w") as f:
        json.dump({"model": os.path.basename(path), "reference": f"transformers {transformers.__version__}, "
                   f"torch {torch.__version__}, fp32, eager attention", "prompts": out}, f, indent=1)
    print(f"wrote {len(out)} prompts to {FIXTURES}/gemma3_hf_reference.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
