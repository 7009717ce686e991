"""Evaluation output: results.json (every sample), summary.md, and PNG plots."""
from __future__ import annotations

import json
import math
import os
from collections import defaultdict

import numpy as np

from .tasks import SCORED_TASKS

SCHEMA_VERSION = 1
SAMPLE_KEYS = ("task", "length", "prompt_tokens", "index", "seed", "depth", "depth_actual", "key",
               "expected", "policy", "budget", "compacted", "generated", "score", "correct",
               "kv_rows", "kv_bytes", "kv_bytes_full", "prefill_s", "evict_s")


# -- aggregation ----------------------------------------------------------------------
def _mean(xs) -> float | None:
    xs = [float(x) for x in xs if x is not None]
    return float(np.mean(xs)) if xs else None


def summarize(rows: list[dict], policies: list[str]) -> dict:
    """policy -> {"tasks": {task: {length: {...}}}, "retrieval_acc", "kv_bytes", "kv_ratio", ...}."""
    by = defaultdict(list)
    for r in rows:
        by[(r["policy"], r["task"], r["length"])].append(r)
    out = {}
    for p in policies:
        tasks: dict = defaultdict(dict)
        for (pol, task, length), rs in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][2])):
            if pol != p:
                continue
            cell = {"n": len(rs), "kv_bytes": _mean(r["kv_bytes"] for r in rs),
                    "kv_ratio": _mean(r["kv_bytes_full"] / max(r["kv_bytes"], 1) for r in rs),
                    "compacted": sum(bool(r["compacted"]) for r in rs)}
            if task == "fidelity":
                cell.update(kl=_mean(r["kl"] for r in rs), top1=_mean(r["top1"] for r in rs))
            else:
                cell.update(accuracy=_mean(r["correct"] for r in rs), score=_mean(r["score"] for r in rs))
            tasks[task][length] = cell
        mine = [r for r in rows if r["policy"] == p]
        retr = [r for r in mine if r["task"] in SCORED_TASKS]
        fid = [r for r in mine if r["task"] == "fidelity"]
        out[p] = {"tasks": dict(tasks),
                  "retrieval_acc": _mean(r["correct"] for r in retr),
                  "kl": _mean(r["kl"] for r in fid), "top1": _mean(r["top1"] for r in fid),
                  "kv_bytes": _mean(r["kv_bytes"] for r in mine),
                  "kv_ratio": _mean(r["kv_bytes_full"] / max(r["kv_bytes"], 1) for r in mine)}
    return out


# -- paired comparison with the full cache --------------------------------------------
Z95 = 1.959963984540054


def _bisect(inside, a: float, b: float) -> float:
    """The boundary between a (inside(a) holds) and b (it does not), to float precision."""
    for _ in range(100):
        m = 0.5 * (a + b)
        if inside(m):
            a = m
        else:
            b = m
    return 0.5 * (a + b)


def _constrained_p21(n12: int, n21: int, n: int, delta: float) -> float:
    """Maximum-likelihood P(only the policy right) given P(only full right) - it = delta."""
    lo, hi = max(0.0, -delta), (1.0 - delta) / 2.0
    if hi - lo < 1e-15:
        return lo
    n_conc = n - n12 - n21

    def dlogl(p21: float) -> float:                 # derivative of the multinomial log-likelihood
        d = 0.0
        if n12:
            d += n12 / (p21 + delta)
        if n21:
            d += n21 / p21
        if n_conc:
            d -= 2.0 * n_conc / (1.0 - 2.0 * p21 - delta)
        return d

    a, b = lo + 1e-15, hi - 1e-15
    if dlogl(a) <= 0:
        return lo
    if dlogl(b) >= 0:
        return hi
    return _bisect(lambda p: dlogl(p) > 0, a, b)    # the log-likelihood is concave: its slope's zero


def tango_interval(n12: int, n21: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Tango's score interval for the paired difference (n12 - n21) / n, where n12 counts
    pairs only the first of two answers gets right and n21 only the second. Unlike a
    Wald interval it stays honest with no discordant pairs: (0, 0, n) -> +-z^2/(n+z^2)."""
    if n <= 0:
        return (float("nan"), float("nan"))

    def score(delta: float) -> float:
        p21 = _constrained_p21(n12, n21, n, delta)
        var = n * (2.0 * p21 + delta - delta * delta)
        return (n12 - n21 - n * delta) / math.sqrt(var) if var > 0 else math.copysign(math.inf, n12 - n21 - n * delta)

    est = (n12 - n21) / n

    def edge(outer: float) -> float:                # |score| = z between the estimate and -1 or 1
        if abs(score(outer)) <= z:
            return outer
        return _bisect(lambda d: abs(score(d)) <= z, est, outer)

    return (edge(-1.0), edge(1.0))


def paired_against(rows: list[dict], policies: list[str], reference: str = "full") -> dict:
    """Retrieval answers of each policy against the reference on the same prompts:
    policy -> {n, acc, acc_full, lost, gained, same_text, diff, ci} (diff and ci are
    policy minus the reference, as fractions; a loss is negative; acc_full is the
    reference's accuracy). With a reference other than the full cache, and fidelity
    prompts, also n_fidelity, kl_lower (the prompts where the policy's KL from the full
    cache is the lower; a KL of 0, a cache that was not compacted, counts), and kl_ratio
    (the geometric mean of the policy's KL over the reference's, over the n_kl_ratio
    prompts where both are above 0; None when there are none)."""
    key = lambda r: (r["task"], r["length"], r["index"], r["seed"])          # noqa: E731
    ref = {key(r): r for r in rows if r["policy"] == reference}
    out = {}
    for p in policies:
        if p == reference:
            continue
        pairs = [(ref[key(r)], r) for r in rows if r["policy"] == p and key(r) in ref]
        retr = [(f, r) for f, r in pairs if r["task"] in SCORED_TASKS]
        n = len(retr)
        if n:
            lost = sum(bool(f["correct"]) and not bool(r["correct"]) for f, r in retr)
            gained = sum(bool(r["correct"]) and not bool(f["correct"]) for f, r in retr)
            lo, hi = tango_interval(gained, lost, n)
            out[p] = {"n": n, "acc": _mean(r["correct"] for _, r in retr),
                      "acc_full": _mean(f["correct"] for f, _ in retr), "lost": lost, "gained": gained,
                      "same_text": sum(f["generated"] == r["generated"] for f, r in retr) / n,
                      "diff": (gained - lost) / n, "ci": (lo, hi)}
        fid = [(f["kl"], r["kl"]) for f, r in pairs if r["task"] == "fidelity"]
        both = [(a, b) for a, b in fid if a > 0 and b > 0]      # a ratio needs two KLs above 0
        if any(a > 0 for a, _ in fid):                           # not against the full cache itself
            out.setdefault(p, {}).update(
                n_fidelity=len(fid), kl_lower=sum(b < a for a, b in fid), n_kl_ratio=len(both),
                kl_ratio=float(np.exp(np.mean([np.log(b / a) for a, b in both]))) if both else None)
    return out


# -- JSON -----------------------------------------------------------------------------
def write_doc(path: str, doc: dict) -> None:
    """`doc` as JSON at `path`, whole or not at all (a temporary file renamed over it)."""
    _dump(path + ".tmp", doc)
    os.replace(path + ".tmp", path)


def _dump(path: str, doc: dict) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, default=_jsonable)


def _jsonable(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)


# -- markdown -------------------------------------------------------------------------
def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _mib(x) -> str:
    return "-" if x is None else f"{x / 2**20:.1f}"


def markdown(meta: dict, summary: dict, lengths: list[int], tasks: list[str]) -> str:
    lines = [f"# Long-context evaluation: {meta.get('model', '?')}", ""]
    t = meta.get("timings", {})
    wall = f", wall {t['wall_s']:.0f} s" if t.get("wall_s") else ""      # none for rows of several runs
    lines.append(f"{meta.get('n_samples', '?')} prompts x {len(summary)} policies, backend "
                 f"{meta.get('backend', '?')}, seed {meta.get('seed')}{wall} "
                 f"(prefill {t.get('prefill_s', 0):.0f} s for {t.get('prefill_tokens', 0)} tokens). "
                 "Accuracy: every expected number appears in the greedy answer (code questions: the answer "
                 "gives exactly the expected path, value or function). A policy whose budget "
                 "is at least the prompt length does not compact and repeats the full-cache answer.")
    lines.append("")
    retrieval = [x for x in tasks if x in SCORED_TASKS]
    head = ["policy", "retrieval acc", "KV MiB", "KV ratio"]
    if "fidelity" in tasks:
        head += ["fidelity KL", "top-1 agree"]
    lines += ["## Overview", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p, s in summary.items():
        row = [f"`{p}`", _pct(s["retrieval_acc"]), _mib(s["kv_bytes"]),
               "-" if s["kv_ratio"] is None else f"{s['kv_ratio']:.1f}x"]
        if "fidelity" in tasks:
            row += ["-" if s["kl"] is None else f"{s['kl']:.4f}", _pct(s["top1"])]
        lines.append("| " + " | ".join(row) + " |")
    paired = {p: s["vs_full"] for p, s in summary.items() if s.get("vs_full")}
    if paired:
        lines += _paired_section("the full cache", "full", paired)
    for base in meta.get("baselines", []):
        paired = {p: s["vs"][base] for p, s in summary.items() if base in s.get("vs", {})}
        lines += _paired_section(f"`{base}`", "baseline", paired)
    for task in retrieval:
        several = task == "niah_multivalue"          # partial credit: the share of the numbers recalled
        lines += ["", f"## {task}: accuracy by prompt length" + (" (and share of the numbers recalled)"
                                                                  if several else ""), "",
                  "| policy | " + " | ".join(str(n) for n in lengths) + " |", "|---|" + "---|" * len(lengths)]
        for p, s in summary.items():
            cells = [s["tasks"].get(task, {}).get(n) for n in lengths]
            lines.append(f"| `{p}` | " + " | ".join(
                "-" if c is None else f"{_pct(c['accuracy'])} ({c['n']})"
                + (f", {_pct(c['score'])} recalled" if several else "") for c in cells) + " |")
    if "fidelity" in tasks:
        lines += ["", "## fidelity: mean KL(full || policy) nats / top-1 agreement, by prompt length", "",
                  "| policy | " + " | ".join(str(n) for n in lengths) + " |", "|---|" + "---|" * len(lengths)]
        for p, s in summary.items():
            cells = [s["tasks"].get("fidelity", {}).get(n) for n in lengths]
            lines.append(f"| `{p}` | " + " | ".join(
                "-" if c is None else f"{c['kl']:.4f} / {_pct(c['top1'])}" for c in cells) + " |")
    return "\n".join(lines) + "\n"


# -- plots ----------------------------------------------------------------------------
def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_heatmaps(path: str, rows: list[dict], policies: list[str], lengths: list[int]) -> None:
    """Retrieval accuracy, needle depth (rows) x prompt length (columns), one panel per policy."""
    plt = _plt()
    retr = [r for r in rows if r["task"] in SCORED_TASKS]
    depths = sorted({r["depth"] for r in retr}) or [50.0]
    n = len(policies)
    cols = min(4, n)
    nrows = math.ceil(n / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(3.2 * cols + 1, 2.8 * nrows + 0.6), squeeze=False)
    im = None
    for k, p in enumerate(policies):
        ax = axes[k // cols][k % cols]
        grid = np.full((len(depths), len(lengths)), np.nan)
        for i, d in enumerate(depths):
            for j, length in enumerate(lengths):
                v = _mean(r["correct"] for r in retr if r["policy"] == p and r["depth"] == d and r["length"] == length)
                if v is not None:
                    grid[i, j] = v
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="upper")
        for i, j in zip(*np.nonzero(~np.isnan(grid))):
            ax.text(j, i, f"{100 * grid[i, j]:.0f}", ha="center", va="center", fontsize=5)
        ax.set_title(p, fontsize=7)
        ax.set_xticks(range(len(lengths)), [str(x) for x in lengths], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:g}%" for d in depths], fontsize=6)
        ax.set_xlabel("prompt tokens", fontsize=7)
        if k % cols == 0:
            ax.set_ylabel("needle depth", fontsize=7)
    for k in range(n, nrows * cols):
        axes[k // cols][k % cols].axis("off")
    fig.subplots_adjust(hspace=0.6, wspace=0.45, top=0.9)   # titles clear of the x labels above
    if im is not None:
        fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8, label="accuracy")
    fig.suptitle("Retrieval accuracy by needle depth and prompt length", fontsize=10)
    fig.savefig(path, dpi=110, format="png")   # (a .tmp path first: write_all)
    plt.close(fig)


def budget_sweep(policy_meta: dict) -> dict:
    """The policies at fixed budgets with every other setting the default: the SnapKvConfig
    defaults, uniform budgets, no merged rows, bf16 rows (one policy per budget)."""
    default = policy_meta.get("defaults", {})
    plain = {"merge": (0, None), "allocation": ("uniform", None), "kv_dtype": ("bf16", None)}
    return {name: m for name, m in policy_meta["policies"].items()
            if m["budget"] is not None and all(m[k] == v for k, v in default.items())
            and all(m.get(k) in ok for k, ok in plain.items())}


def plot_accuracy_vs_budget(path: str, rows: list[dict], policy_meta: dict, lengths: list[int]) -> None:
    """SnapKV at default settings: accuracy against the fixed row budget, one line per length,
    one panel per retrieval task; the full cache as a dashed line."""
    plt = _plt()
    sweep = budget_sweep(policy_meta)
    tasks = [t for t in SCORED_TASKS if any(r["task"] == t for r in rows)]
    fig, axes = plt.subplots(1, max(len(tasks), 1), figsize=(4 * max(len(tasks), 1), 3.4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for j, length in enumerate(lengths):
            pts = [(m["budget"], _mean(r["correct"] for r in rows if r["policy"] == name
                                       and r["task"] == task and r["length"] == length))
                   for name, m in sweep.items()]
            pts = sorted((b, a) for b, a in pts if a is not None)
            color = f"C{j}"
            if pts:
                ax.plot([b for b, _ in pts], [a for _, a in pts], "o-", color=color, label=f"{length} tok")
            full = _mean(r["correct"] for r in rows if r["policy"] == "full" and r["task"] == task
                         and r["length"] == length)
            if full is not None:
                ax.axhline(full, color=color, ls="--", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_ylim(-0.05, 1.05)
        ax.set_title(task, fontsize=9)
        ax.set_xlabel("KV budget (rows per head)")
        ax.set_ylabel("accuracy")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle("Accuracy vs SnapKV budget (dashed: full cache)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")   # (a .tmp path first: write_all)
    plt.close(fig)


def plot_bytes_vs_accuracy(path: str, summary: dict) -> None:
    """One point per policy: mean KV bytes against retrieval accuracy."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k, (p, s) in enumerate(summary.items()):
        if s["retrieval_acc"] is None or s["kv_bytes"] is None:
            continue
        x, y = s["kv_bytes"] / 2**20, s["retrieval_acc"]
        ax.scatter([x], [y], color="k" if p == "full" else f"C{k % 10}", marker="*" if p == "full" else "o")
        ax.annotate(p.replace("snapkv-", ""), (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("mean KV cache after eviction (MiB, as stored)")
    ax.set_ylabel("retrieval accuracy (all tasks, lengths)")
    ax.set_title("KV bytes vs accuracy")
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")   # (a .tmp path first: write_all)
    plt.close(fig)


def _kl_ratio(d: dict) -> str:
    """The KL ratio cell: the ratio, and over how many prompts where a KL of 0 left some out."""
    text = "-" if d["kl_ratio"] is None else f"{d['kl_ratio']:.2f}x"
    return text if d["n_kl_ratio"] == d["n_fidelity"] else f"{text} ({d['n_kl_ratio']} of {d['n_fidelity']})"


def _paired_section(title: str, short: str, paired: dict) -> list[str]:
    """The markdown of a prompt-by-prompt comparison (paired_against's dicts) with a reference:
    retrieval columns where there are retrieval prompts, fidelity columns where KL ratios are."""
    retrieval = any("n" in d for d in paired.values())
    fidelity = any("kl_ratio" in d for d in paired.values())
    text, head = [], ["policy"]
    if retrieval:
        text.append(f"Retrieval: lost: prompts {title} answers and the policy does not; gained: the reverse; "
                    "same text: the greedy answers are identical. The difference is in points with Tango's 95% "
                    "score interval for paired proportions.")
        head += ["prompts", f"accuracy ({short})", "lost", "gained", "same text", "difference, 95% CI"]
    if fidelity:
        text.append("Fidelity: the geometric mean over the fidelity prompts of the policy's KL from the full "
                    "cache over the reference's, and the prompts where the policy's is the lower.")
        head += ["KL ratio", "KL lower on"]
    lines = ["", f"## Against {title}, prompt by prompt", "", " ".join(text), "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p, d in paired.items():
        row = [f"`{p}`"]
        if retrieval and "n" in d:
            lo, hi = d["ci"]
            row += [str(d["n"]), f"{_pct(d['acc'])} ({_pct(d['acc_full'])})", str(d["lost"]), str(d["gained"]),
                    _pct(d["same_text"]), f"{100 * d['diff']:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}]"]
        elif retrieval:
            row += ["0"] + ["-"] * 5
        if fidelity:
            row += [_kl_ratio(d), f"{d['kl_lower']}/{d['n_fidelity']}"] if "kl_ratio" in d else ["-", "-"]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def write_all(out_dir: str, meta: dict, rows: list[dict], lengths: list[int], tasks: list[str]) -> dict:
    """Write results.json, summary.md and the plots into out_dir. Returns {kind: path}."""
    os.makedirs(out_dir, exist_ok=True)
    names = list(meta["policies"])
    summary = summarize(rows, names)
    for p, d in paired_against(rows, names).items():
        summary[p]["vs_full"] = d
    for base in meta.get("baselines", []):
        for p, d in paired_against(rows, names, reference=base).items():
            summary[p].setdefault("vs", {})[base] = d
    paths = {"json": os.path.join(out_dir, "results.json"), "markdown": os.path.join(out_dir, "summary.md"),
             "heatmap": os.path.join(out_dir, "accuracy_heatmap.png"),
             "budget": os.path.join(out_dir, "accuracy_vs_budget.png"),
             "bytes": os.path.join(out_dir, "kv_bytes_vs_accuracy.png")}
    # every output is made as a temporary file first and renamed over its path only once all
    # of them are made: a failure leaves the folder as it was
    tmp = {k: f"{path}.tmp" for k, path in paths.items()}
    try:
        text = markdown(meta, summary, lengths, tasks)
        _dump(tmp["json"], {"schema": SCHEMA_VERSION, "meta": meta, "summary": summary, "samples": rows})
        with open(tmp["markdown"], "w") as f:
            f.write(text)
        plot_heatmaps(tmp["heatmap"], rows, names, lengths)
        plot_accuracy_vs_budget(tmp["budget"], rows, meta, lengths)
        plot_bytes_vs_accuracy(tmp["bytes"], summary)
    except BaseException:
        for path in tmp.values():
            if os.path.exists(path):
                os.remove(path)
        raise
    for k, path in paths.items():
        os.replace(tmp[k], path)
    return paths
