#!/usr/bin/env python3
"""Cross-check the full-cache baseline of `engine eval` with llama.cpp.

Rebuilds the retrieval prompts of an eval run (same task generator, seed and
token ids: llama.cpp is fed our ids, so tokenization cannot differ), answers
them greedily with llama.cpp under the same stopping rule (every expected
number finished, an end-of-text token, or the token limit), scores them the
same way, and compares with our full-cache answers prompt by prompt.

    .venv/bin/python tools/eval_llamacpp.py results/eval8k_big/results.json \\
        --per-cell 4 --out results/llamacpp_8k.json

Input: a results.json or a samples.partial.jsonl from `engine eval`.
--per-cell N takes the first N prompts of every (task, length); --tasks limits
the tasks, --lengths the lengths. --cache-type q8_0 (or q4_0, or KEYS/VALUES like
q8_0/q4_0) runs llama.cpp with its own quantized KV cache (with its flash attention,
which llama.cpp needs for a quantized V cache), and --ours full+q4_0 compares with
that policy of the run instead of our bf16 full cache. Needs llama-cpp-python (`pip install .[bench]`, builds llama.cpp
from source). Run it on an idle machine: an 8K prompt takes about 40 s with the f16
cache, and more than 15 minutes on one thread with q4_0 (llama.cpp's CPU flash attention
dequantizes every K/V row for every query). Each answer is appended to OUT.partial.jsonl
as it comes; --resume skips the prompts already there, so a long run can go in pieces.

--fidelity compares quantized caches instead: on the run's fidelity prompts, llama.cpp
teacher-forces the continuation with its f16 cache and with --cache-type, and the mean
KL(f16 || quantized) of its next-token distributions is set beside our KL of each
quantized policy of the run against our bf16 full cache (each engine against its own
full-precision cache; prompt by prompt, paired). With --resume, llama.cpp's KL of the
prompts already in OUT (same cache type) is kept and only ours is read again, so a
new policy of the run can be set beside llama.cpp without running it again.

    .venv/bin/python tools/eval_llamacpp.py docs/eval2k_kvquant_fidelity/results.json \
        --fidelity --cache-type q4_0 --out docs/eval2k_kvquant_fidelity/llamacpp_q4_0.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from engine.bench import LLAMA_CPP_CACHE_TYPES, llama_cpp_cache_types  # noqa: E402
from engine.errors import EngineError                  # noqa: E402
from engine.eval import tasks as T                     # noqa: E402
from engine.eval.runner import EvalPlan, greedy_numbers  # noqa: E402
from engine.gguf import GgufFile, model_config          # noqa: E402
from engine.model_path import model_path_or_default    # noqa: E402
from engine.tokenizer import Tokenizer                 # noqa: E402


def load_rows(path: str) -> tuple[dict, list[dict]]:
    with open(path) as f:
        if path.endswith(".jsonl"):
            return {}, [json.loads(line) for line in f if line.strip()]
        doc = json.load(f)
    return doc["meta"], doc["samples"]


def llama_answer(llm, tok: Tokenizer, ids: list[int], max_new: int, expected: list[str]) -> tuple[str, float]:
    """Greedy answer with the stopping rule of the eval (engine.eval.runner.greedy_numbers)."""
    logits = lambda: np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),))  # noqa: E731

    def step(token: int) -> np.ndarray:
        llm.eval([token])
        return logits()

    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids)
    text, _ = greedy_numbers(logits(), step, tok.decode, set(tok.eot_ids) | {tok.eos_id}, max_new, expected)
    return text, time.perf_counter() - t0


def llama_teacher(llm, prompt: list[int], cont: list[int]) -> np.ndarray:
    """f32 [len(cont), vocab]: llama.cpp's logits after each continuation token, the
    prompt evaluated first (what the eval's fidelity task reads from our engine)."""
    llm.reset()
    llm.eval(list(prompt) + list(cont))
    return np.array(llm.scores[len(prompt):len(prompt) + len(cont)], dtype=np.float32)


def fidelity(args, rows: list[dict], path: str, tok: Tokenizer, ctx: int) -> int:
    """--fidelity: llama.cpp's KL(f16 || --cache-type) beside ours, prompt by prompt."""
    from llama_cpp import Llama

    from engine.eval.runner import fidelity_metrics

    by_prompt: dict = defaultdict(dict)
    for r in rows:
        if r["task"] == "fidelity":
            by_prompt[(r["length"], r["index"])][r["policy"]] = r
    prompts = sorted(by_prompt)[:args.per_cell or None]
    if not prompts:
        print("no fidelity rows in the run", file=sys.stderr)
        return 1
    type_k, type_v = llama_cpp_cache_types(args.cache_type)
    kw = dict(model_path=path, n_ctx=ctx, n_threads=args.threads, n_threads_batch=args.threads, n_batch=512,
              logits_all=True, verbose=False)
    llms = []                                        # (f16, quantized), made when a prompt needs them
    done = {}                                        # --resume: llama.cpp's side of an earlier OUT
    if args.resume and os.path.exists(args.out):
        with open(args.out) as f:
            prev = json.load(f)
        if prev.get("fidelity") and prev.get("cache_type") == args.cache_type:
            done = {(o["length"], o["index"]): o for o in prev["rows"]}
    ours = [p for p in by_prompt[prompts[0]] if p != "full"]
    out = []
    for k, (length, index) in enumerate(prompts):
        r = by_prompt[(length, index)]["full"]
        target = min(length, ctx - r["continuation_tokens"] - 1)       # as the run's Runner.target_for
        s = T.make_sample("fidelity", tok, target, r["depth"], r["seed"], index, r["continuation_tokens"])
        if len(s.ids) != r["prompt_tokens"]:
            print(f"cannot rebuild fidelity {length} #{index}: prompt differs from the run", file=sys.stderr)
            return 1
        t0 = time.perf_counter()
        if (length, index) in done and done[(length, index)]["prompt_tokens"] == len(s.ids):
            m = {"kl": done[(length, index)]["llama_cpp_kl"], "top1": done[(length, index)]["llama_cpp_top1"]}
            t0 -= done[(length, index)]["seconds"]
        else:
            if not llms:
                # both with flash attention (a quantized V needs it): they differ in the cache type alone
                llms = [Llama(**kw, type_k=LLAMA_CPP_CACHE_TYPES["f16"], type_v=LLAMA_CPP_CACHE_TYPES["f16"],
                              flash_attn=True),
                        Llama(**kw, type_k=type_k, type_v=type_v, flash_attn=True)]
            m = fidelity_metrics(*(llama_teacher(llm, s.ids, s.continuation) for llm in llms))
        o = {"length": length, "index": index, "prompt_tokens": len(s.ids), "cache_type": args.cache_type,
             "llama_cpp_kl": m["kl"], "llama_cpp_top1": m["top1"], "seconds": time.perf_counter() - t0,
             "ours": {p: {"kl": by_prompt[(length, index)][p]["kl"], "top1": by_prompt[(length, index)][p]["top1"]}
                      for p in ours if p in by_prompt[(length, index)]}}
        out.append(o)
        print(f"[{k + 1}/{len(prompts)}] {length} #{index}: llama.cpp {args.cache_type} KL {m['kl']:.4f}  "
              + "  ".join(f"{p} {v['kl']:.4f}" for p, v in o["ours"].items()) + f" ({o['seconds']:.0f} s)", flush=True)
    n = len(out)
    base = np.array([o["llama_cpp_kl"] for o in out])
    print(f"\n| cache | prompts | mean KL vs its own full-precision cache | top-1 agreement | "
          f"paired KL ratio vs llama.cpp {args.cache_type} (geometric mean) | lower on |")
    print("|---|---|---|---|---|---|")
    print(f"| llama.cpp {args.cache_type} | {n} | {base.mean():.4f} | {np.mean([o['llama_cpp_top1'] for o in out]):.3f} | 1 | |")
    for p in ours:
        kl = np.array([o["ours"][p]["kl"] for o in out])
        ratio = float(np.exp(np.mean(np.log(kl / base))))
        print(f"| ours {p} | {n} | {kl.mean():.4f} | {np.mean([o['ours'][p]['top1'] for o in out]):.3f} | "
              f"{ratio:.2f} | {int((kl < base).sum())}/{n} |")
    with open(args.out, "w") as f:
        json.dump({"source": args.results, "model": os.path.basename(path), "ctx": ctx, "fidelity": True,
                   "cache_type": args.cache_type, "rows": out}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", help="results.json or samples.partial.jsonl of an engine eval run")
    ap.add_argument("--model", help="GGUF path (default: the default model)")
    ap.add_argument("--tasks", help="comma-separated subset of the run's retrieval tasks")
    ap.add_argument("--lengths", help="comma-separated subset of the run's prompt lengths")
    ap.add_argument("--per-cell", type=int, default=0, help="first N prompts per (task, length); 0 = all")
    ap.add_argument("--max-new-tokens", type=int, default=12, help="as the run's --max-new-tokens (default 12)")
    ap.add_argument("--cache-type", default="f16",
                    help="llama.cpp KV cache type: f16 (default), q8_0, q4_0, or KEYS/VALUES like q8_0/q4_0")
    ap.add_argument("--ours", default="full", help="the run's policy to compare with (default full)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="results/llamacpp_check.json")
    ap.add_argument("--resume", action="store_true", help="skip the prompts OUT.partial.jsonl already answers "
                    "(--fidelity: the prompts OUT already has)")
    ap.add_argument("--fidelity", action="store_true",
                    help="compare quantized caches by teacher-forced KL on the run's fidelity prompts (see above)")
    args = ap.parse_args()

    from llama_cpp import Llama

    meta, rows = load_rows(args.results)
    if args.fidelity:
        path = str(model_path_or_default(args.model))
        g = GgufFile(path)
        plan = EvalPlan(tasks=["fidelity"], lengths=sorted({r["length"] for r in rows}), policies=())
        ctx = int(meta.get("ctx") or plan.context(model_config(g).context_length))
        return fidelity(args, rows, path, Tokenizer(g.metadata), ctx)
    want = set(args.tasks.split(",")) if args.tasks else set(T.RETRIEVAL_TASKS)
    lengths = {int(x) for x in args.lengths.split(",")} if args.lengths else None
    try:
        type_k, type_v = llama_cpp_cache_types(args.cache_type)
    except EngineError as e:
        print(f"--cache-type: {e}", file=sys.stderr)
        return 1
    full = [r for r in rows if r["policy"] == args.ours and r["task"] in want and r["task"] in T.RETRIEVAL_TASKS
            and (lengths is None or r["length"] in lengths)]
    full.sort(key=lambda r: (r["length"], r["index"], r["task"]))
    if args.per_cell:
        taken: dict = defaultdict(int)
        keep = []
        for r in full:
            if taken[(r["task"], r["length"])] < args.per_cell:
                taken[(r["task"], r["length"])] += 1
                keep.append(r)
        full = keep
    if not full:
        print(f"no retrieval rows of policy {args.ours!r} to check", file=sys.stderr)
        return 1
    path = str(model_path_or_default(args.model))
    g = GgufFile(path)
    tok = Tokenizer(g.metadata)
    # the run's plan, for its context and answer margins (the policies do not matter here)
    plan = EvalPlan(tasks=sorted(want), lengths=sorted({r["length"] for r in rows}), policies=(),
                    max_new_tokens=args.max_new_tokens)
    ctx = int(meta.get("ctx") or plan.context(model_config(g).context_length))
    llm = Llama(model_path=path, n_ctx=ctx, n_threads=args.threads, n_threads_batch=args.threads,
                n_batch=512, logits_all=False, verbose=False, type_k=type_k, type_v=type_v,
                flash_attn=type_v != LLAMA_CPP_CACHE_TYPES["f16"])

    partial = args.out + ".partial.jsonl"
    done = {}
    if args.resume and os.path.exists(partial):
        with open(partial) as f:
            for line in f:
                o = json.loads(line)
                if o.get("cache_type") == args.cache_type:
                    done[(o["task"], o["length"], o["index"])] = o
    elif os.path.exists(partial):
        os.remove(partial)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    out = []
    for k, r in enumerate(full):
        if (r["task"], r["length"], r["index"]) in done:      # llama.cpp's answer; ours from this run
            out.append(dict(done[(r["task"], r["length"], r["index"])], ours=r["generated"],
                            ours_correct=bool(r["correct"])))
            continue
        target = min(r["length"], ctx - plan.margin(r["task"]) - 1)
        s = T.make_sample(r["task"], tok, target, r["depth"], r["seed"], r["index"])
        if len(s.ids) != r["prompt_tokens"] or list(s.expected) != list(r["expected"]):
            print(f"cannot rebuild {r['task']} {r['length']} #{r['index']}: prompt differs from the run", file=sys.stderr)
            return 1
        text, secs = llama_answer(llm, tok, s.ids, args.max_new_tokens * len(s.expected), s.expected)
        score = T.score(s, text)
        out.append({"task": r["task"], "length": r["length"], "index": r["index"], "seed": r["seed"],
                    "depth": r["depth"], "prompt_tokens": len(s.ids), "expected": s.expected,
                    "llama_cpp": text, "llama_cpp_correct": score == 1.0,
                    "ours": r["generated"], "ours_correct": bool(r["correct"]), "seconds": secs,
                    "cache_type": args.cache_type})
        with open(partial, "a") as f:
            f.write(json.dumps(out[-1]) + "\n")
        print(f"[{k + 1}/{len(full)}] {r['task']:<16} {r['length']:>5} #{r['index']:<3} "
              f"llama.cpp {'ok ' if score == 1.0 else 'no '} ours {'ok ' if r['correct'] else 'no '} "
              f"{text!r} | {r['generated']!r} ({secs:.0f} s)", flush=True)

    cells = defaultdict(list)
    for o in out:
        cells[(o["task"], o["length"])].append(o)
    print(f"\n| task | length | prompts | llama.cpp ({args.cache_type} cache) | ours ({args.ours}) | same answer text |")
    print("|---|---|---|---|---|---|")
    for (task, length), os_ in sorted(cells.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        n = len(os_)
        print(f"| {task} | {length} | {n} | {sum(o['llama_cpp_correct'] for o in os_)}/{n} | "
              f"{sum(o['ours_correct'] for o in os_)}/{n} | {sum(o['llama_cpp'] == o['ours'] for o in os_)}/{n} |")
    n = len(out)
    print(f"| all | | {n} | {sum(o['llama_cpp_correct'] for o in out)}/{n} | {sum(o['ours_correct'] for o in out)}/{n} "
          f"| {sum(o['llama_cpp'] == o['ours'] for o in out)}/{n} |")
    with open(args.out, "w") as f:
        json.dump({"source": args.results, "model": os.path.basename(path), "ctx": ctx,
                   "cache_type": args.cache_type, "ours": args.ours, "rows": out}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
