"""The two-question eval (issue 13): after eviction, can a conversation go on?

Each sample is one document with two needles (keys A and B, half a document
apart). Turn 1 asks for A's number; turn 2 is A's number (teacher-forced, so every
mode sees the same conversation) and a question for B. B's answer is scored for:

- `full`: no eviction, the conversation continues on the full cache;
- `<policy>@reprefill`: the whole conversation (document, question A, answer,
  question B) prefilled afresh and evicted by the policy, whose observation
  window is then question B;
- `<policy>@reuse`: the cache compacted after turn 1 (window: question A) and
  continued with turn 2, without a second eviction (what a server that keeps
  compacted caches would do; it saves the second prefill);
- `<policy>@continue`: turn 1's whole cache, kept before its eviction, continued
  with turn 2 and evicted as a whole with question B as the window (what
  `engine serve` does: the rows of a re-prefill for the cost of turn 2's tokens,
  plus the window's when turn 2 is shorter than it; the server also keeps turn 1's
  window queries, which spares it even those).

Answers are paired against `full` per prompt (engine/eval/report.py), and the
rows go to <out>/samples.jsonl as each sample finishes (`--resume` skips them).

    python tools/eval_followup.py smollm2 --length 4096 --samples 40 \\
        --policies snapkv-bL/8-head-avg-k31-w32-s4,snapkv-bL/8-head-avg-k31-w32-s4-m64 [--modes reprefill,reuse]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import engine                                           # noqa: E402
from engine.eval import tasks as T                      # noqa: E402
from engine.eval.policies import parse_policy           # noqa: E402
from engine.eval.report import paired_against           # noqa: E402
from engine.eval.runner import EvalPlan, Runner         # noqa: E402

MODES = ("reprefill", "reuse", "continue")


def run_sample(runner: Runner, policies, target: int, index: int, depth: float, seed: int,
               modes=MODES) -> list[dict]:
    m = runner.model
    fu = T.make_followup(m.tokenizer, target, depth, seed, index)
    first = fu.first
    second = dataclasses.replace(first, ids=first.ids + fu.turn2, expected=fu.expected, key=fu.key,
                                 needle_token_pos=fu.needle_token_pos)
    base = {"task": "niah", "length": target, "index": index, "seed": seed, "depth": depth,
            "prompt_tokens": first.n_tokens, "conversation_tokens": second.n_tokens, "expected": fu.expected}
    out = {}
    # turn 1 prefilled once; each policy evicts a copy, which then runs turn 2
    cache, capture, _, prefill1_s = runner._prefill(first, "bf16", policies)
    for p in policies if "reuse" in modes else ():
        branch = cache.copy()
        ev = runner._evict(branch, capture, p, first.n_tokens)
        t0 = time.perf_counter()
        logits = m.forward.prefill(fu.turn2, branch)
        out[f"{p.name}@reuse"] = {**runner._answer(second, branch, logits), "kv_bytes": ev["kv_bytes"],
                                  "turn2_s": time.perf_counter() - t0}
        branch.release()
    for p in policies if "continue" in modes else ():
        branch = cache.copy()
        t0 = time.perf_counter()
        n = min(first.n_tokens, second.n_tokens - p.window)     # the observation window runs again
        branch.truncate(n)
        logits = m.forward.prefill(second.ids[n:], branch, snapkv=p.config(second.n_tokens),
                                   compact_continued=True)
        out[f"{p.name}@continue"] = {**runner._answer(second, branch, logits), "kv_bytes": branch.bytes,
                                     "turn2_s": time.perf_counter() - t0}
        branch.release()
    t0 = time.perf_counter()
    logits = m.forward.prefill(fu.turn2, cache)
    out["full"] = {**runner._answer(second, cache, logits), "kv_bytes": cache.bytes,
                   "turn2_s": time.perf_counter() - t0}
    cache.release()
    if "reprefill" not in modes:
        return [{**base, "policy": name, **r, "prefill1_s": prefill1_s} for name, r in out.items()]
    # the whole conversation prefilled afresh, evicted with question B as the window
    cache, capture, logits, prefill2_s = runner._prefill(second, "bf16", policies)
    for p in policies:
        branch = cache.copy()
        ev = runner._evict(branch, capture, p, second.n_tokens)
        out[f"{p.name}@reprefill"] = {**runner._answer(second, branch, logits), "kv_bytes": ev["kv_bytes"],
                                      "turn2_s": prefill2_s + ev["evict_s"]}
        branch.release()
    cache.release()
    return [{**base, "policy": name, **r, "prefill1_s": prefill1_s} for name, r in out.items()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="smollm2")
    ap.add_argument("--length", type=int, default=4096, help="turn-1 prompt tokens")
    ap.add_argument("--samples", type=int, default=40)
    ap.add_argument("--seed", type=int, default=13)
    ap.add_argument("--depths", default="10,30,50,70,90", help="needle A depths, percent")
    ap.add_argument("--policies", default="snapkv-bL/8-head-avg-k31-w32-s4,snapkv-bL/8-head-avg-k31-w32-s4-m64")
    ap.add_argument("--out", default="docs/eval_followup")
    ap.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(MODES)}")
    ap.add_argument("--resume", action="store_true")
    a = ap.parse_args(argv)
    modes = [x for x in a.modes.split(",") if x]
    if not modes or set(modes) - set(MODES):
        ap.error(f"--modes: choose from {', '.join(MODES)}")
    policies = [parse_policy(n) for n in a.policies.split(",") if n and n != "full"]
    depths = [float(d) for d in a.depths.split(",")]
    plan = EvalPlan(tasks=["niah"], lengths=[a.length], policies=policies, samples=a.samples, seed=a.seed,
                    depths=depths)
    m = engine.load(a.model, ctx=a.length + 256, snapkv=False)
    runner = Runner(m, plan)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "samples.jsonl"
    rows = [json.loads(line) for line in path.open()] if a.resume and path.exists() else []
    if not a.resume:
        path.write_text("")
    done = {r["index"] for r in rows}
    for i in range(a.samples):
        if i in done:
            continue
        new = run_sample(runner, policies, a.length, i, T.sample_depth(depths, i, a.samples), a.seed, modes)
        with path.open("a") as f:
            f.writelines(json.dumps(r, default=str) + "\n" for r in new)
        rows += new
        print(f"sample {i}: " + ", ".join(f"{r['policy']} {'ok' if r['correct'] else 'x'}" for r in new),
              flush=True)
    names = [f"{p.name}@{mode}" for p in policies for mode in modes]
    paired = paired_against(rows, names)
    full = [r for r in rows if r["policy"] == "full"]
    lines = [f"# Two-question eval: {a.model}, turn 1 of {a.length} tokens, {len(full)} conversations, seed {a.seed}",
             "", f"full cache, question B: {sum(r['correct'] for r in full)}/{len(full)}", "",
             "| policy @ mode | question B | vs full, paired (95% CI) | KV MiB | turn-2 seconds |",
             "|---|---|---|---|---|"]
    for name in names:
        mine = [r for r in rows if r["policy"] == name]
        s = paired[name]
        lines.append(f"| {name} | {sum(r['correct'] for r in mine)}/{len(mine)} | {s['lost']} lost, "
                     f"{s['gained']} gained: {100 * s['diff']:+.1f} [{100 * s['ci'][0]:+.1f}, "
                     f"{100 * s['ci'][1]:+.1f}] points | {sum(r['kv_bytes'] for r in mine) / len(mine) / 2**20:.1f} | "
                     f"{sum(r['turn2_s'] for r in mine) / len(mine):.2f} |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
