"""Paired decode benchmark: the same prompt prefilled once per variant (KV type, and
with --allocations the SnapKV allocation too), then decode timed in alternating
rounds (bf16, tq4 | tq4, bf16 | ..., after one untimed warm-up round), so machine noise that
moves 10-20% between runs falls on every variant alike. Reports per round tok/s and the median of the
per-round ratios against the first variant. --replays off,on: each variant also with
decode replay off and on (engine/replay.py; a copy of the one prefilled cache each).

    .venv/bin/python tools/bench_decode_ab.py [--model smollm2] [--backend cpu] [--length 8000]
        [--kv-budget 1024] [--kv-dtypes bf16,tq4] [--allocations uniform,adaptive]
        [--replays on] [--rounds 8] [--tokens 16]

--kv-budget 0: the full cache. Not a test: numbers go to stdout (and --json FILE).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine  # noqa: E402
from engine.bench import bench_prompt  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--length", type=int, default=8000)
    p.add_argument("--kv-budget", type=int, default=1024)
    p.add_argument("--kv-dtypes", default="bf16,tq4")
    p.add_argument("--allocations", default="uniform", help="SnapKV allocations (variants: every dtype x each)")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--tokens", type=int, default=16, help="decode tokens per round")
    p.add_argument("--replays", default="on", help="decode replay modes (variants: each of the others x each)")
    p.add_argument("--backend", default=None)
    p.add_argument("--threads", type=int)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    allocations = [x.strip() for x in a.allocations.split(",") if x.strip()]
    replays = [x.strip() for x in a.replays.split(",") if x.strip()]
    variants = [(d.strip(), x) for d in a.kv_dtypes.split(",") if d.strip() for x in allocations]
    names = [d if len(allocations) == 1 else f"{d}/{x}" for d, x in variants]   # the prefilled variants
    dtypes = [n if len(replays) == 1 else f"{n} replay {r}" for n in names for r in replays]
    ctx = a.length + (a.rounds + 1) * a.tokens + 1          # (+1: the warm-up round)
    model = engine.load(a.model, backend=a.backend, ctx=ctx, threads=a.threads, snapkv_budget=a.kv_budget,
                        decode_replay="on")
    ids = bench_prompt(model.tokenizer, a.length)
    state = {}
    for name, (kv_dtype, allocation) in zip(names, variants):
        snapkv = model.snapkv and dataclasses.replace(model.snapkv, allocation=allocation)
        t0 = time.perf_counter()
        cache, logits = model.prefill(ids, kv_dtype=kv_dtype, snapkv=snapkv if snapkv else False)
        print(f"{name}: prefill {time.perf_counter() - t0:.1f} s, {cache.length} rows, "
              f"{cache.bytes / 2**20:.1f} MiB", flush=True)
        for i, r in enumerate(replays):
            d = name if len(replays) == 1 else f"{name} replay {r}"
            state[d] = [cache if i == 0 else cache.copy(), int(np.argmax(logits)), r]
    rates = {d: [] for d in dtypes}
    for r in range(-1, a.rounds):              # round -1: untimed warm-up (first decodes compile, record)
        order = dtypes if r % 2 == 0 else dtypes[::-1]   # alternate which variant runs first
        for d in order:
            cache, token, replay = state[d]
            with model.forward.without_replay() if replay == "off" else contextlib.nullcontext():
                t0 = time.perf_counter()
                for _ in range(a.tokens):
                    token = int(np.argmax(model.forward.decode(token, cache)))
                if r >= 0:
                    rates[d].append(a.tokens / (time.perf_counter() - t0))
            state[d][1] = token
        if r >= 0:
            print(f"round {r}: " + "  ".join(f"{d} {rates[d][-1]:.1f} tok/s" for d in dtypes), flush=True)
    base = dtypes[0]
    report = {"length": a.length, "kv_budget": a.kv_budget, "tokens_per_round": a.tokens,
              "rounds": a.rounds, "tok_s": rates,
              "median_tok_s": {d: statistics.median(rates[d]) for d in dtypes},
              "median_ratio_vs_" + base: {d: statistics.median(x / y for x, y in zip(rates[d], rates[base]))
                                          for d in dtypes[1:]}}
    for d in dtypes:
        line = f"{d:>10}: median {report['median_tok_s'][d]:.1f} tok/s"
        if d != base:
            ratios = sorted(x / y for x, y in zip(rates[d], rates[base]))
            line += (f", paired ratio vs {base}: median {report['median_ratio_vs_' + base][d]:.3f}"
                     f" (range {ratios[0]:.3f}-{ratios[-1]:.3f})")
        print(line)
    if a.json:
        a.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
