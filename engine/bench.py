"""`engine bench`: prefill and decode throughput at several prompt lengths, with
llama.cpp (llama-cpp-python, optional extra `bench`) measured in the same run."""
from __future__ import annotations

import json
import os
import platform
import time
from datetime import datetime, timezone

import numpy as np

from .errors import EngineError

FILLER = ("The quick brown fox jumps over the lazy dog while the river runs past the old mill. "
          "Numbers like 1234 and 5678 appear in ledgers, and names such as Alice, Bob and Carol "
          "show up in stories about travel, cooking, weather and music. ")


def bench_prompt(tokenizer, n: int) -> list[int]:
    """n token ids of plain English filler (the same ids for every engine)."""
    ids = tokenizer.encode(FILLER * 8, add_bos=False)
    reps = -(-n // len(ids))
    return (ids * reps)[:n]


def _engine_case(model, ids, n_decode: int, snapkv=None) -> dict:
    """snapkv: None = the model's policy, False = full cache."""
    cache = model.new_cache()
    t0 = time.perf_counter()
    cache, logits = model.prefill(ids, cache, snapkv=snapkv)
    prefill_s = time.perf_counter() - t0
    snap = cache.eviction
    token = int(np.argmax(logits))
    t0 = time.perf_counter()
    for _ in range(n_decode):
        token = int(np.argmax(model.forward.decode(token, cache)))
    decode_s = time.perf_counter() - t0
    return {"prefill_tok_s": len(ids) / prefill_s, "decode_tok_s": n_decode / decode_s,
            "prefill_s": prefill_s, "kv_bytes": cache.bytes, "kv_rows": cache.length,
            "snapkv": snap}


def _llama_cpp_case(llm, ids, n_decode: int) -> dict:
    llm.reset()
    llm._ctx.kv_cache_clear() if hasattr(llm._ctx, "kv_cache_clear") else None
    t0 = time.perf_counter()
    llm.eval(ids)
    prefill_s = time.perf_counter() - t0
    token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    t0 = time.perf_counter()
    for _ in range(n_decode):
        llm.eval([token])
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    decode_s = time.perf_counter() - t0
    return {"prefill_tok_s": len(ids) / prefill_s, "decode_tok_s": n_decode / decode_s, "prefill_s": prefill_s}


def _open_llama_cpp(path: str, ctx: int, threads: int):
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    return Llama(model_path=str(path), n_ctx=ctx, n_threads=threads, n_threads_batch=threads,
                 n_batch=512, logits_all=False, verbose=False)


def run_bench(args, settings) -> int:
    from .model import Model, peak_rss_mib
    from .model_path import default_model_path

    try:
        lengths = [int(x) for x in str(args.lengths).split(",") if x.strip()]
    except ValueError:
        raise EngineError(f"--lengths must be comma-separated integers, got {args.lengths!r}") from None
    if not lengths or min(lengths) < 1:
        raise EngineError("--lengths needs at least one positive length")
    path = args.model or default_model_path()
    if path is None:
        raise EngineError("default model not installed: run `make setup` or pass a .gguf path")
    threads = settings.threads or os.cpu_count() or 1
    settings = settings.with_overrides(threads=threads)
    need_ctx = max(lengths) + args.decode_tokens + 1
    if settings.ctx is None:
        settings = settings.with_overrides(ctx=need_ctx)
    model = Model(path, settings)
    if need_ctx > model.ctx:
        raise EngineError(f"longest case needs {need_ctx} positions but --ctx is {model.ctx}")
    llm = _open_llama_cpp(path, model.ctx, threads) if args.llama_cpp else None
    warm = bench_prompt(model.tokenizer, 64)
    _engine_case(model, warm, 4)     # compile / warm caches once
    rows = []
    evicting = model.snapkv is not None
    print(f"{'prompt':>7} | {'engine prefill':>14} {'decode':>8} {'KV MiB':>7} |"
          + (f" {'SnapKV prefill':>14} {'decode':>8} {'KV MiB':>7} |" if evicting else "")
          + (f" {'llama.cpp prefill':>17} {'decode':>8} | {'ratio p':>7} {'ratio d':>7}" if llm else ""))
    for n in lengths:
        ids = bench_prompt(model.tokenizer, n)
        row = {"prompt_tokens": n, "engine": _engine_case(model, ids, args.decode_tokens, snapkv=False)}
        e = row["engine"]
        line = f"{n:>7} | {e['prefill_tok_s']:>10.1f} t/s {e['decode_tok_s']:>6.1f} t/s {e['kv_bytes'] / 2**20:>7.1f} |"
        if evicting:
            row["engine_snapkv"] = k = _engine_case(model, ids, args.decode_tokens)
            row["snapkv_decode_speedup"] = k["decode_tok_s"] / e["decode_tok_s"]
            row["snapkv_kv_ratio"] = e["kv_bytes"] / k["kv_bytes"]
            if k["snapkv"]:
                row["snapkv_overhead"] = k["snapkv"]["seconds"] / k["prefill_s"]   # share of prefill time
            line += (f" {k['prefill_tok_s']:>10.1f} t/s {k['decode_tok_s']:>6.1f} t/s "
                     f"{k['kv_bytes'] / 2**20:>7.1f} |")
        if llm is not None:
            row["llama_cpp"] = l = _llama_cpp_case(llm, ids, args.decode_tokens)
            row["ratio_prefill"] = e["prefill_tok_s"] / l["prefill_tok_s"]
            row["ratio_decode"] = e["decode_tok_s"] / l["decode_tok_s"]
            line += (f" {l['prefill_tok_s']:>13.1f} t/s {l['decode_tok_s']:>6.1f} t/s |"
                     f" {row['ratio_prefill']:>6.2f}x {row['ratio_decode']:>6.2f}x")
        print(line, flush=True)
        rows.append(row)
    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": os.path.basename(str(path)), "backend": model.backend.name, "threads": threads,
        "machine": platform.processor() or platform.machine(), "decode_tokens": args.decode_tokens,
        "settings": {k: v for k, v in vars(settings).items()}, "peak_rss_mib": peak_rss_mib(),
        "snapkv": model.snapkv.summary() if evicting else None,
        "llama_cpp": llm is not None, "cases": rows,
    }
    os.makedirs(args.out, exist_ok=True)
    out = os.path.join(args.out, f"bench-{model.backend.name}.json")
    with open(out + ".tmp", "w") as f:
        json.dump(report, f, indent=1, default=str)
    os.replace(out + ".tmp", out)
    print(f"peak RSS {report['peak_rss_mib']:.0f} MiB; wrote {out}")
    return 0
