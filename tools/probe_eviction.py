"""Why did eviction lose a prompt? Re-runs chosen samples of an `engine eval` run
(same task generator, seed and sample index) through one full prefill each, then
answers from copies of the cache compacted in different ways:

- `--budgets`: SnapKV at the default settings with each budget (every global layer);
- `--layer-budgets`: a budget per full-attention layer, `;`-separated sets of
  comma-separated budgets in layer order (0: that layer not compacted),
  e.g. "2048,0,0;0,2048,0;4096,1024,1024";
- `--merge M`: every variant again with M of its budget's rows merged
  (engine/kv/merge.py), named "... merge M".

For each variant it prints the greedy answer, how many of the needle's first 30
token rows every compacted layer kept, and per head the share of the last prompt
token's attention mass that lies on the rows kept. The full cache's answer comes last.

    python tools/probe_eviction.py gemma3 --task passkey --length 16384 --samples 50 \\
        --seed 16 --index 5,23 --budgets 2048,8192 --layer-budgets "2048,0,0;0,2048,0"
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import engine                                          # noqa: E402
from backends.reference import read_rows               # noqa: E402
from engine.eval.policies import parse_policy          # noqa: E402
from engine.eval.runner import EvalPlan, Runner        # noqa: E402
from engine.snapkv import SnapKvConfig, SnapKvSelector  # noqa: E402

NEEDLE_ROWS = 30


def last_query_mass(cache, capture, li: int, keep: np.ndarray, scale: float, n_rows: int) -> list[float]:
    """Per query head: attention mass of the last prompt query on the kept rows."""
    pool = cache.pool
    k = read_rows(pool.backend.download(cache.layers[li].pool.k_pages), cache.layers[li].host_table, n_rows,
                  cache.layers[li].pool.k_dtype, pool.head_dim)   # f64 [n_kv, n_rows, head_dim]
    q = capture.q[li, :, -1]                                       # [n_heads, head_dim]
    group = q.shape[0] // pool.n_kv_heads
    out = []
    for h in range(q.shape[0]):
        s = (k[h // group] @ q[h]) * scale
        p = np.exp(s - s.max())
        out.append(float(p[keep[h // group]].sum() / p.sum()))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="gemma3")
    ap.add_argument("--task", default="passkey")
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--samples", type=int, default=50, help="samples per task of the eval run (sets the depths)")
    ap.add_argument("--seed", type=int, default=16)
    ap.add_argument("--index", required=True, help="sample indices, comma separated")
    ap.add_argument("--budgets", default="2048", help="SnapKV budgets, comma separated")
    ap.add_argument("--layer-budgets", dest="layer_budgets", default="",
                    help="';'-separated budget sets, one budget per full-attention layer (0: not compacted)")
    ap.add_argument("--merge", type=int, default=0, help="also run each variant with this many merged rows")
    a = ap.parse_args(argv)
    base = parse_policy("snapkv-b2048-head-avg-k31-w32-s4")
    plan = EvalPlan(tasks=[a.task], lengths=[a.length], policies=[base], samples=a.samples, seed=a.seed)
    m = engine.load(a.model, ctx=plan.context(1 << 30), snapkv=False)
    runner, fw = Runner(m, plan), m.forward
    variants = {f"budget {b}": [int(b)] for b in a.budgets.split(",") if b}
    for spec in filter(None, a.layer_budgets.split(";")):
        variants[f"layers {spec}"] = [int(b) for b in spec.split(",")]
    runs = [(name, budgets, 0) for name, budgets in variants.items()]
    if a.merge:
        runs += [(f"{name} merge {a.merge}", budgets, a.merge) for name, budgets in variants.items()]
    depths = {c[2]: c[3] for c in plan.cases()}
    for index in (int(i) for i in a.index.split(",")):
        sample = runner.make_sample(a.task, a.length, index, depths[index])
        L = sample.n_tokens
        cache, capture, logits, seconds = runner._prefill(sample, "bf16", [base])
        scored = cache.full_layers
        print(f"# {a.task} sample {index}: depth {depths[index]:.0f}%, {L} tokens, needle at row "
              f"{sample.needle_token_pos}, expected {sample.expected}, prefill {seconds:.0f} s", flush=True)
        q = np.ascontiguousarray(capture.q[:, :, capture.window - base.window:])
        votes = {li: fw.backend.snapkv_votes(q[li], cache.layers[li].pool.k_pages, cache.layers[li].page_table(), L,
                                             fw.scale, k_dtype=cache.layers[li].pool.k_dtype) for li in scored}
        for name, budgets, merge in runs:
            budgets = budgets * len(scored) if len(budgets) == 1 else budgets
            if len(budgets) != len(scored):
                raise SystemExit(f"{name}: {len(budgets)} budgets for {len(scored)} full-attention layers")
            branch, notes = cache.copy(), []
            for li, budget in zip(scored, budgets):
                if not budget:
                    continue
                keep = SnapKvSelector(SnapKvConfig(budget=budget, merge=merge)).keep_from_votes(votes[li], L)
                pos = sample.needle_token_pos
                needle = int(np.isin(np.arange(pos, pos + NEEDLE_ROWS), keep[0]).sum()) if pos is not None else -1
                mass = last_query_mass(cache, capture, li, keep, fw.scale, L)
                notes.append(f"layer {li}: needle {needle}/{NEEDLE_ROWS}, mass kept "
                             + " ".join(f"{x:.3f}" for x in mass))
                merged = fw.merge_evicted(branch, [li], [keep], merge)[0] if merge else None
                branch.layers[li].compact(keep, window=base.window, merged=merged)
            branch.eviction = {"policy": name}
            answer = runner._answer(sample, branch, logits)
            print(f"  {name}: {answer['generated']!r}  " + "; ".join(notes), flush=True)
            branch.release()
        print(f"  full: {runner._answer(sample, cache, logits)['generated']!r}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
