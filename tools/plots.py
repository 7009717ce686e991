"""The documentation's plots, drawn from committed results files (issue 37).

    .venv/bin/python tools/plots.py                      # every plot into docs/img/
    .venv/bin/python tools/plots.py --out DIR            # the same into DIR
    .venv/bin/python tools/plots.py --bench results/bench-cpu.json --out DIR
                                                         # decode and KV against context of a new run

Plots (PNG, fixed size and dpi, no timestamps, so a rerun on the same matplotlib writes
the same bytes):

  accuracy_vs_kv_bytes.png  each policy's retrieval accuracy minus the full cache's on the
                            same prompts (paired, Tango's 95% interval) and its fidelity KL
                            against its median KV bytes: SmolLM2 at 8K (docs/eval8k_kvquant,
                            docs/eval8k_rq4_0_all, docs/eval8k_alloc; three pyramid
                            variants left out, see its summary.md) and Gemma 3 at 16K
                            (docs/eval_gemma3_16k_merge)
  eviction_cost.png         each prompt's SnapKV scoring and compaction time against its
                            prefill time, plain and with 64 merged rows, 1K-32K prompts
                            (docs/eval_short, eval8k, eval8k_alloc, eval_gemma3_16k_merge,
                            eval_gemma3_32k)
  bench_STEM.png            decode tok/s and KV MiB against the prompt length, our full
                            cache and SnapKV (each KV type the run measured) beside
                            llama.cpp, for each docs/bench/STEM.json: the JSON `engine
                            bench --out` writes (the committed ones were transcribed from
                            docs/benchmarks.md; they say so in their "transcribed" field)
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.eval.report import paired_against       # noqa: E402
from engine.eval.tasks import SCORED_TASKS           # noqa: E402

MiB = 2 ** 20
DPI = 110
# Accuracy against bytes: (panel, results file, policies left out: shown by another run of
# the same panel, or pyramid variants between two shown ones; their summary.md has them).
_L8, _L16 = "snapkv-bL/8-head-avg-k31-w32-s4", "snapkv-bL/16-head-avg-k31-w32-s4"
ACCURACY_RUNS = [
    ("smollm2", "docs/eval8k_kvquant/results.json", ()),
    ("smollm2", "docs/eval8k_rq4_0_all/results.json", ("full",)),
    ("smollm2", "docs/eval8k_alloc/results.json",
     ("full", _L8, _L16 + "-pyramid5", _L16 + "-pyramid2", _L16 + "-pyramid-adaptive")),
    ("gemma3", "docs/eval_gemma3_16k_merge/results.json", ()),
]
# where each label sits (offset in points from its point; a negative x puts it on the left)
_LABEL_AT = {
    ("diff", "L/8"): (-4, -10), ("diff", "L/8 pyramid"): (4, -10), ("diff", "L/8 adaptive"): (5, 2),
    ("diff", "L/8 + 64 merged"): (5, 3), ("diff", "L/16"): (-4, -3), ("diff", "L/16 pyramid"): (-4, 6),
    ("diff", "L/16 adaptive"): (5, -9), ("diff", "L/8, tq4"): (5, -3), ("diff", "L/8, rq4_0"): (5, -3),
    ("diff", "full, tq4"): (5, -3), ("diff", "full, rq4_0"): (5, 3), ("diff", "full, q8_0"): (5, -9),
    ("diff", "full"): (-4, 6), ("diff", "2048"): (5, -3), ("diff", "2048 + 64 merged"): (5, -3),
    ("kl", "L/8"): (-4, -3), ("kl", "L/8 + 64 merged"): (5, 3), ("kl", "L/8 pyramid"): (5, 2),
    ("kl", "L/8 adaptive"): (5, -3), ("kl", "L/16"): (-4, -3), ("kl", "L/16 pyramid"): (5, 3),
    ("kl", "L/16 adaptive"): (5, -6), ("kl", "L/8, tq4"): (-4, -10), ("kl", "L/8, rq4_0"): (5, 4),
    ("kl", "full, tq4"): (-4, -3), ("kl", "full, rq4_0"): (5, -6), ("kl", "full, q8_0"): (-4, -3),
}
# Eviction's cost: results files, each with its evicting policies.
EVICTION_RUNS = ["docs/eval_short/results.json", "docs/eval8k/results.json", "docs/eval8k_alloc/results.json",
                 "docs/eval_gemma3_16k_merge/results.json", "docs/eval_gemma3_32k/results.json"]
BENCH_GLOB = "docs/bench/*.json"


# -- helpers --------------------------------------------------------------------------
def _plt():
    import matplotlib
    matplotlib.use("Agg")
    matplotlib.rcdefaults()                          # no user matplotlibrc
    matplotlib.rcParams.update({"font.size": 8})
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path: str) -> None:
    fig.savefig(path, dpi=DPI, metadata={"Software": None})
    import matplotlib.pyplot as plt
    plt.close(fig)


def _load(path: str) -> dict:
    with open(ROOT / path if not os.path.isabs(path) else path) as f:
        return json.load(f)


def short_name(policy: str) -> str:
    """`snapkv-bL/8-head-avg-k31-w32-s4-adaptive+tq4` -> `L/8 adaptive, tq4`; `full+q8_0` -> `full, q8_0`."""
    name, _, dtype = policy.partition("+")
    m = re.fullmatch(r"snapkv-b([^-]+)-head-avg-k31-w32-s4(?:-(.*))?", name)
    if m:
        extra = {"m64": "+ 64 merged", "pyramid": "pyramid", "pyramid5": "pyramid b5", "pyramid2": "pyramid b2",
                 "adaptive": "adaptive", "pyramid-adaptive": "pyramid adaptive"}.get(m.group(2), m.group(2))
        name = m.group(1) + (f" {extra}" if extra else "")
    return name + (f", {dtype}" if dtype else "")


def _median_mib(samples: list[dict]) -> float:
    # the median, not the mean: eval8k_alloc's first 60 prompts were stored with an earlier
    # layout that padded adaptive heads (docs/evaluation.md, "Where the budget goes")
    return statistics.median(s["kv_bytes"] for s in samples) / MiB


# -- 1: accuracy against KV bytes -----------------------------------------------------
def accuracy_points() -> dict:
    """panel -> [{policy, run, mib, diff, lo, hi, kl}]: retrieval accuracy minus the run's
    full cache's (points) with Tango's 95% interval, mean fidelity KL, median KV MiB."""
    out: dict = {}
    for panel, path, skip in ACCURACY_RUNS:
        doc = _load(path)
        rows, names = doc["samples"], list(doc["meta"]["policies"])
        paired = paired_against(rows, names)
        for p in names:
            if p in skip:
                continue
            mine = [r for r in rows if r["policy"] == p]
            retr = [r for r in mine if r["task"] in SCORED_TASKS]
            fid = [r["kl"] for r in mine if r["task"] == "fidelity"]
            d = paired.get(p, {"diff": 0.0, "ci": (0.0, 0.0)})
            out.setdefault(panel, []).append({
                "policy": p, "run": os.path.basename(os.path.dirname(path)), "mib": _median_mib(retr or mine),
                "diff": 100 * d["diff"], "lo": 100 * d["ci"][0], "hi": 100 * d["ci"][1],
                "acc": statistics.fmean(bool(r["correct"]) for r in retr), "n": len(retr),
                "kl": statistics.fmean(fid) if fid else None})
    return out


def plot_accuracy(path: str) -> dict:
    plt = _plt()
    pts = accuracy_points()
    runs = sorted({q["run"] for qs in pts.values() for q in qs}, key=[os.path.basename(os.path.dirname(p))
                                                                      for _, p, _ in ACCURACY_RUNS].index)
    marker = dict(zip(runs, "osD^v"))
    fig, axes = plt.subplots(1, 3, figsize=(15, 5.2), gridspec_kw={"width_ratios": [1.25, 1.25, 0.8]})
    panels = [(axes[0], "smollm2", "diff", "SmolLM2-135M, 8K prompts: retrieval"),
              (axes[1], "smollm2", "kl", "SmolLM2-135M, 8K prompts: fidelity"),
              (axes[2], "gemma3", "diff", "Gemma 3 270M, 16K prompts: retrieval")]
    from matplotlib.ticker import NullFormatter, ScalarFormatter
    for ax, panel, what, title in panels:
        qs = [q for q in pts[panel] if what == "diff" or q["kl"]]
        labelled = set()
        for q in sorted(qs, key=lambda q: (q["mib"], q["policy"])):
            full = q["policy"] == "full"
            color = "k" if full else ("C3" if "+" in q["policy"] else "C0")   # red: 4- or 8-bit rows
            y = q["diff"] if what == "diff" else q["kl"]
            if what == "diff":
                ax.errorbar([q["mib"]], [y], yerr=[[y - q["lo"]], [q["hi"] - y]], fmt="none", ecolor=color,
                            alpha=0.35, lw=1, capsize=2)
            ax.scatter([q["mib"]], [y], color=color, marker="*" if full else marker[q["run"]], s=60 if full else 22,
                       zorder=3)
            if q["policy"] not in labelled:
                labelled.add(q["policy"])
                name = short_name(q["policy"])
                dx, dy = _LABEL_AT.get((what, name), (4, 4))
                ax.annotate(name, (q["mib"], y), fontsize=6.5, xytext=(dx, dy), textcoords="offset points",
                            ha="right" if dx < 0 else "left", va="center")
        ax.set_xscale("log")
        if panel == "gemma3":
            ax.set_xlim(10, 70)
        lo, hi = ax.get_xlim()
        ax.set_xticks([t for t in (5, 10, 20, 50, 100, 200) if lo <= t <= hi])
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("KV cache after prefill, median per prompt (MiB, log scale)")
        ax.set_title(title, fontsize=9)
        if what == "diff":
            ax.axhline(0, color="k", lw=0.6, ls="--")
            ax.set_ylabel("retrieval accuracy minus the full cache's (points, paired 95% CI)")
        else:
            ax.set_yscale("log")
            ax.set_ylabel("fidelity: mean next-token KL from the full cache (nats, log scale)")
    handles = [plt.Line2D([], [], ls="", marker=marker[r], color="0.3", label=f"docs/{r}/") for r in runs]
    handles += [plt.Line2D([], [], ls="", marker="*", color="k", label="full cache (bf16)"),
                plt.Line2D([], [], ls="", marker="o", color="C0", label="SnapKV, bf16 rows"),
                plt.Line2D([], [], ls="", marker="o", color="C3", label="quantized rows (q8_0, tq4, rq4_0)")]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=7, frameon=False)
    fig.suptitle("Accuracy against KV bytes, each policy against the full cache on the same prompts "
                 "(L/8: a budget of 1/8 of the prompt's rows)", fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 0.96))
    _save(fig, path)
    return pts


# -- 2: eviction's cost against prefill -----------------------------------------------
def eviction_points() -> list[dict]:
    """One row per (run, prompt, evicting policy): prefill_s, evict_s, the prompt's nominal
    length, merged or not. Only the default-style policies (uniform, head, avg, k31, w32, s4) and their 64-merged-row
    variants, so every run contributes the same kinds."""
    out = []
    for path in EVICTION_RUNS:
        doc = _load(path)
        run = os.path.basename(os.path.dirname(path))
        for r in doc["samples"]:
            m = re.fullmatch(r"snapkv-b[^-]+-head-avg-k31-w32-s4(-m64)?", r["policy"])
            if m and r["compacted"]:
                out.append({"run": run, "model": doc["meta"]["model"], "threads": doc["meta"]["threads"],
                            "length": r["length"], "prefill_s": r["prefill_s"], "evict_s": r["evict_s"],
                            "merged": bool(m.group(1))})
    return out


def plot_eviction(path: str) -> list[dict]:
    plt = _plt()
    from matplotlib.ticker import NullLocator
    pts = eviction_points()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.8))
    runs = list(dict.fromkeys(p["run"] for p in pts))
    for j, run in enumerate(runs):
        for merged in (False, True):
            qs = [p for p in pts if p["run"] == run and p["merged"] == merged]
            if qs:
                ax.scatter([p["prefill_s"] for p in qs], [p["evict_s"] for p in qs], s=6 if not merged else 9,
                           color=f"C{j}", marker="^" if merged else "o", alpha=0.45, linewidths=0,
                           label=f"docs/{run}/ ({qs[0]['model'].split('-Instruct')[0].split('-q4')[0]}, "
                                 f"{qs[0]['threads']} thr)" + (", 64 merged rows" if merged else ""))
    lo, hi = 1.0, 2000.0
    for share in (0.001, 0.01, 0.1):
        ax.plot([lo, hi], [lo * share, hi * share], color="0.5", lw=0.6, ls=":")
        ax.annotate(f"{100 * share:g}% of prefill", (1.2, 1.2 * share), fontsize=6.5, xytext=(0, 4),
                    textcoords="offset points", color="0.4", rotation=22)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(5e-4, 1e4)                           # room for the legend above the points
    ax.set_xlabel("prefill of the prompt (s, log scale)")
    ax.set_ylabel("SnapKV scoring + compaction (s, log scale)")
    ax.set_title("Each prompt: eviction time against prefill time", fontsize=9)
    ax.legend(fontsize=6, markerscale=2, loc="upper left")
    # median share of prefill by prompt length, plain and merged
    for merged, style in ((False, "o-"), (True, "^--")):
        for model, color in (("SmolLM2", "C0"), ("gemma", "C3")):
            by: dict = {}
            for p in pts:
                if p["merged"] == merged and p["model"].startswith(model):
                    by.setdefault(p["length"], []).append(100 * p["evict_s"] / p["prefill_s"])
            if by:
                xs = sorted(by)
                bx.plot(xs, [statistics.median(by[x]) for x in xs], style, color=color, ms=4,
                        label=("Gemma 3 270M" if model == "gemma" else "SmolLM2-135M")
                        + (", 64 merged rows" if merged else ""))
    bx.set_xscale("log", base=2)
    lengths = sorted({p["length"] for p in pts})
    bx.set_xticks(lengths, [f"{n:,}" for n in lengths])
    bx.xaxis.set_minor_locator(NullLocator())
    bx.set_yscale("log")
    bx.set_xlabel("prompt length (log scale)")
    bx.set_ylabel("eviction time / prefill time, median (%, log scale)")
    bx.set_title("Eviction's share of prefill by prompt length", fontsize=9)
    bx.legend(fontsize=7, loc="center left")
    fig.suptitle("The cost of eviction against prefill (CPU, eval runs 2026-11-29 to 2026-12-04)", fontsize=10)
    fig.tight_layout()
    _save(fig, path)
    return pts


# -- 3: decode and KV bytes against context, from `engine bench --out` ----------------
def bench_series(doc: dict) -> dict:
    """label -> {"tokens": [...], "decode": [...], "mib": [...]} from a bench JSON; None where
    a case lacks the number (a transcribed table, or SnapKV below its budget)."""
    out: dict = {}
    several = len({c.get("kv_dtype") for c in doc["cases"]}) > 1

    def add(label, n, case):
        s = out.setdefault(label, {"tokens": [], "decode": [], "mib": []})
        s["tokens"].append(n)
        s["decode"].append(case.get("decode_tok_s"))
        s["mib"].append(None if case.get("kv_bytes") is None else case["kv_bytes"] / MiB)

    for c in doc["cases"]:
        dtype = c.get("kv_dtype") or "bf16"
        tag = f", {dtype}" if several or dtype != "bf16" else ""
        add(f"ours, full cache{tag}", c["prompt_tokens"], c["engine"])
        if c.get("engine_snapkv"):
            add(f"ours, SnapKV{tag}", c["prompt_tokens"], c["engine_snapkv"])
    fa = doc.get("llama_cpp_flash_attn")          # True / False, or "both" (then llama_cpp_fa is with it)
    for c in doc["cases"]:
        if c.get("llama_cpp") and (not several or c is next(d for d in doc["cases"]
                                                            if d["prompt_tokens"] == c["prompt_tokens"])):
            kv = doc.get("llama_cpp_cache_type") or "f16"
            add(f"llama.cpp ({kv} KV" + (", flash attention" if fa is True else "") + ")",
                c["prompt_tokens"], c["llama_cpp"])
            if c.get("llama_cpp_fa"):
                add(f"llama.cpp ({kv} KV, flash attention)", c["prompt_tokens"], c["llama_cpp_fa"])
    return out


def _style(label: str, k: int) -> dict:
    if label.startswith("llama.cpp"):
        return {"color": "k", "ls": ":" if "flash attention" in label else "--", "marker": "s"}
    return {"color": f"C{k}", "ls": "-", "marker": "o" if "full" in label else "^"}


def plot_bench(path: str, doc: dict) -> dict:
    plt = _plt()
    from matplotlib.ticker import NullLocator
    series = bench_series(doc)
    budget = re.search(r"budget (\d+)", str(doc.get("snapkv") or ""))
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2))
    for k, (label, s) in enumerate(series.items()):
        if budget:
            label = label.replace("SnapKV", f"SnapKV {budget.group(1)}")
        for a, key in ((ax, "decode"), (bx, "mib")):
            xy = [(x, y) for x, y in zip(s["tokens"], s[key]) if y is not None]
            if xy:
                a.plot([x for x, _ in xy], [y for _, y in xy], ms=4, label=label, **_style(label, k))
    lengths = sorted({c["prompt_tokens"] for c in doc["cases"]})
    for a in (ax, bx):
        a.set_xscale("log", base=2)
        a.set_xticks(lengths, [f"{n:,}" for n in lengths])
        a.xaxis.set_minor_locator(NullLocator())
        a.set_xlabel("prompt tokens (log scale)")
        if budget:
            a.axvline(int(budget.group(1)), color="0.6", lw=0.6, ls=":")
    ax.set_ylabel(f"decode tok/s ({doc.get('decode_tokens')} greedy tokens after the prompt)")
    ax.set_ylim(bottom=0)
    ax.set_title("Decode speed", fontsize=9)
    ax.legend(fontsize=7)
    bx.set_ylabel("our KV cache (MiB; llama.cpp's is not measured)")
    bx.set_ylim(bottom=0)
    bx.set_title("KV cache" + (f" (dotted: the SnapKV budget, {budget.group(1)} rows)" if budget else ""),
                 fontsize=9)
    bx.legend(fontsize=7)
    src = " (transcribed from docs/benchmarks.md)" if doc.get("transcribed") else ""
    fig.suptitle(f"engine bench: {doc.get('model')}, {doc.get('backend')}, {doc.get('threads')} threads, "
                 f"{str(doc.get('date'))[:10]}{src}", fontsize=10)
    fig.tight_layout()
    _save(fig, path)
    return series


# -- main -----------------------------------------------------------------------------
def write_all(out_dir: str, bench_files: list[str] | None = None) -> dict:
    """Every plot into out_dir; bench_files default to docs/bench/*.json. Returns {name: path}."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {"accuracy": os.path.join(out_dir, "accuracy_vs_kv_bytes.png"),
             "eviction": os.path.join(out_dir, "eviction_cost.png")}
    plot_accuracy(paths["accuracy"])
    plot_eviction(paths["eviction"])
    for f in bench_files if bench_files is not None else sorted(glob.glob(str(ROOT / BENCH_GLOB))):
        stem = Path(f).stem
        paths[f"bench_{stem}"] = os.path.join(out_dir, f"bench_{stem}.png")
        plot_bench(paths[f"bench_{stem}"], _load(f))
    return paths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "img"), help="folder for the PNGs (default docs/img)")
    ap.add_argument("--bench", nargs="+", metavar="JSON",
                    help="only bench plots, of these `engine bench --out` files (default: all plots, "
                         "bench ones from docs/bench/*.json)")
    args = ap.parse_args(argv)
    if args.bench:
        os.makedirs(args.out, exist_ok=True)
        for f in args.bench:
            p = os.path.join(args.out, f"bench_{Path(f).stem}.png")
            plot_bench(p, _load(f))
            print(p)
        return 0
    for p in write_all(args.out).values():
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
