"""`engine eval`: long-context retrieval and fidelity, full cache vs SnapKV policies.

    engine eval [MODEL] --tasks passkey,niah --lengths 1024,2048 --samples 11 --out results/eval
    engine eval --quick                       # a small subset, minutes on a laptop CPU
    engine eval --tasks code --lengths 4096   # questions about a generated Python project (chat format)
    engine eval --policies full,snapkv-b512-head-avg-k31-w32-s4
    engine eval --render results/eval/results.json   # rewrite summary.md and plots from saved samples
    engine eval --render a/results.json b/results.json --out ab   # the report of one run split in two
    engine eval --render results.json --baseline POLICY          # also every policy against POLICY

`add_parser(subparsers)` registers the subcommand; `cmd_eval(args)` runs it.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
from datetime import datetime, timezone

from ..errors import ConfigError, EngineError
from ..inputs import output_dir
from . import policies as P
from .tasks import DEFAULT_TASKS, TASK_GROUPS, TASKS, sample_depth

# Defaults of a full run and of --quick; an explicit flag always wins.
FULL_RUN = {"tasks": ",".join(DEFAULT_TASKS), "lengths": "1024,2048,4096,8192", "budgets": "256,512,1024,2048",
            "samples": 11, "depths": "0,10,20,30,40,50,60,70,80,90,100", "ablation_budget": 1024,
            "fraction": 8, "policies": None, "kv_dtypes": None}
QUICK_RUN = {"tasks": ",".join(DEFAULT_TASKS), "lengths": "1024", "budgets": "256,512",
             "samples": 3, "depths": "0,10,20,30,40,50,60,70,80,90,100", "ablation_budget": 0,
             "fraction": 8, "policies": None, "kv_dtypes": None}


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("eval", help="long-context quality: full cache vs SnapKV eviction",
                              description="Passkey / needle-in-a-haystack retrieval and teacher-forced "
                                          "fidelity, and questions about a long generated Python project (--tasks code), "
                                      "one prefill per prompt branched into every policy.")
    p.add_argument("model", nargs="?", help="a .gguf path or an installed model's name "
                   "(`engine models`; default: qwen2.5-coder-0.5b)")
    p.add_argument("--backend", help="cpu | vulkan | cuda | auto (env SHARPI_BACKEND)")
    p.add_argument("--threads", help="CPU threads (env SHARPI_THREADS)")
    p.add_argument("--tasks", help=f"comma separated, from {','.join(TASKS)} (default: "
                   f"{','.join(DEFAULT_TASKS)}). The code_* tasks ask about a generated Python project "
                   "(several files, a few thousand lines at 32K) in the model's chat format: code_def, in which "
                   "file a function is defined; code_value, a constant's value or the literal a function returns; "
                   "code_caller, which function calls another (the one caller). `code` selects all three")
    p.add_argument("--lengths", help="prompt lengths in tokens (default 1024,2048,4096,8192; "
                                     "clipped to fit the context with the answer)")
    p.add_argument("--budgets", help="SnapKV budgets swept at default settings (default 256,512,1024,2048)")
    p.add_argument("--budget-fraction", dest="fraction", type=int,
                   help="also a budget of L/N per prompt (default 8; 0 = none)")
    p.add_argument("--ablation-budget", dest="ablation_budget", type=int,
                   help="budget for the granularity/pool/kernel/window/sinks variants (default 1024; 0 = none)")
    p.add_argument("--policies", help="exact policy list instead of the sweep, e.g. "
                                      "full,snapkv-b1024-head-avg-k31-w32-s4,snapkv-bL/8-layer-max-k15-w32-s0")
    p.add_argument("--kv-dtypes", dest="kv_dtypes",
                   help="KV storage types every policy runs with, from bf16,q8_0,q4_0,tq4,tq3,rq4_0 or KEYS/VALUES "
                        "pairs like q8_0/tq4, with layer exceptions like rq4_0:0=q8_0/rq4_0 (default bf16; policies "
                        "over another type are named +<type>)")
    p.add_argument("--samples", type=int, help="prompts per task and length; needle depths spread over them "
                                               "(default 11 = one per depth)")
    p.add_argument("--depths", help="needle depths in percent (default 0,10,...,100)")
    p.add_argument("--seed", type=int, default=0, help="task generator seed (default 0)")
    p.add_argument("--max-new-tokens", dest="max_new_tokens", type=int, default=12,
                   help="greedy answer tokens per expected number (default 12)")
    p.add_argument("--fidelity-tokens", dest="fidelity_tokens", type=int, default=64,
                   help="teacher-forced continuation length for the fidelity task (default 64)")
    p.add_argument("--quick", action="store_true",
                   help="small subset: every task at 1024 tokens, 3 samples (depths 10/50/90%%), full cache and "
                        "SnapKV at 256, 512 and L/8; about 3-5 minutes on 2 CPU cores")
    p.add_argument("--out", help="output folder (default results/eval; with --render, the file's folder)")
    p.add_argument("--render", metavar="FILE", nargs="+",
                   help="run nothing: rewrite summary.md, results.json and the plots from a results.json or "
                        "from the samples.partial.jsonl of a run cut short; several files (with --out): the "
                        "report of their union, for one run split over processes")
    p.add_argument("--baseline", metavar="POLICIES",
                   help="comma-separated policies of the run to compare every other policy with, prompt by "
                        "prompt, as with the full cache (retrieval lost/gained with Tango's interval; fidelity "
                        "KL ratio), for example uniform against adaptive budgets at the same budget")
    p.add_argument("--resume", action="store_true",
                   help="continue a run cut short: keep the rows in OUT/samples.partial.jsonl (the same seed, "
                        "tasks, lengths and depths; policies of this plan) and run only the rest, a policy added "
                        "since included (only its KV type's prefill on the samples done)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.set_defaults(func=cmd_eval)
    return p


def _values(text, flag: str, kind, what: str) -> list:
    try:
        vals = [kind(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise EngineError(f"{flag} must be comma-separated {what}, got {text!r}") from None
    if not vals:
        raise EngineError(f"{flag} needs at least one value")
    return vals


def _ints(text, flag: str) -> list[int]:
    return _values(text, flag, int, "integers")


def _floats(text, flag: str) -> list[float]:
    return _values(text, flag, float, "numbers")


MAX_SAMPLES = 10_000     # prompts per task and length (the plan's cases are listed up front)


def resolve(args) -> dict:
    """Flags over --quick / full-run defaults -> plain values (raises EngineError)."""
    d = dict(QUICK_RUN if args.quick else FULL_RUN)
    for k in d:
        if getattr(args, k, None) is not None:
            d[k] = getattr(args, k)
    tasks = [t.strip() for t in str(d["tasks"]).split(",") if t.strip()]
    tasks = list(dict.fromkeys(x for t in tasks for x in TASK_GROUPS.get(t, (t,))))   # `code` -> its kinds
    bad = [t for t in tasks if t not in TASKS]
    if bad or not tasks:
        raise EngineError(f"unknown task {bad[0] if bad else '(none)'!r}: choose from "
                          f"{', '.join(TASKS + tuple(TASK_GROUPS))}")
    lengths = _ints(d["lengths"], "--lengths")
    if min(lengths) < 64:
        raise EngineError("--lengths must be at least 64 tokens")
    twice = [n for n in dict.fromkeys(lengths) if lengths.count(n) > 1]
    if twice:
        raise EngineError(f"--lengths lists {twice[0]} twice")
    if d["policies"]:
        pols = [P.parse_policy(n) for n in str(d["policies"]).split(",") if n.strip()]
    else:
        budgets = _ints(d["budgets"], "--budgets")
        if min(budgets) < 1:
            raise EngineError("--budgets must be positive")
        if (d["fraction"] or 0) < 0 or (d["ablation_budget"] or 0) < 0:
            raise EngineError("--budget-fraction and --ablation-budget must be >= 0 (0: none)")
        pols = P.default_policies(budgets, d["ablation_budget"] or None, d["fraction"] or None)
    if d["kv_dtypes"] is not None:               # every policy over each listed KV type
        dtypes = [t.strip() for t in str(d["kv_dtypes"]).split(",") if t.strip()]
        if not dtypes:
            raise EngineError("--kv-dtypes needs at least one KV type")
        try:
            pols = [p.with_kv_dtype(t) for t in dtypes for p in pols]
        except ConfigError as e:
            raise EngineError(f"--kv-dtypes: {e}") from None
    if len({p.name for p in pols}) != len(pols):
        raise EngineError("--policies lists a policy twice")
    if not 1 <= int(d["samples"]) <= MAX_SAMPLES:
        raise EngineError(f"--samples must be 1..{MAX_SAMPLES}")
    depths = _floats(d["depths"], "--depths")
    if not all(0 <= x <= 100 for x in depths):       # (NaN too)
        raise EngineError("--depths are percentages in 0..100")
    if args.max_new_tokens < 1 or args.fidelity_tokens < 1:
        raise EngineError("--max-new-tokens and --fidelity-tokens must be >= 1")
    if args.seed < 0:
        raise EngineError(f"--seed must be >= 0, got {args.seed}")
    return {"tasks": tasks, "lengths": lengths, "policies": pols, "samples": int(d["samples"]), "depths": depths}


ROW_KEYS = ("task", "length", "index", "policy", "prompt_tokens", "seed", "depth")   # what every sample row holds


def _load_rows(path: str, flag: str = "--render", empty_ok: bool = False) -> tuple[dict, list[dict]]:
    """(meta, rows) from a results.json, or rows from a samples.partial.jsonl with the
    meta rebuilt from them; errors name `flag`. No rows is an error unless `empty_ok`."""
    import json
    try:
        with open(path) as f:
            if path.endswith(".jsonl"):
                rows, meta = _jsonl_rows(f.read(), path), _run_identity(path)   # ({} unless a run's own)
            else:
                doc = json.load(f)
                rows, meta = doc["samples"], doc["meta"]
    except FileNotFoundError:
        raise EngineError(f"{flag}: no such file: {path}") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise EngineError(f"{flag}: {path} is not an eval results.json or samples jsonl ({e})") from None
    if not rows and not empty_ok:
        raise EngineError(f"{flag}: {path} holds no samples")
    if not isinstance(rows, list) or not isinstance(meta, dict):
        raise EngineError(f"{flag}: {path} is not an eval results.json or samples jsonl (its layout)")
    for i, r in enumerate(rows):
        missing = [k for k in ROW_KEYS if k not in r] if isinstance(r, dict) else list(ROW_KEYS)
        if missing:
            raise EngineError(f"{flag}: {path} sample {i} is not an eval sample (missing {', '.join(missing)})")
    if path.endswith(".jsonl") and rows:
        meta = {**_meta_from_rows(rows, meta.get("model")), **meta}
    return meta, _unique(rows)


def _jsonl_rows(text: str, path: str) -> list[dict]:
    """The rows of a samples.partial.jsonl. A last line cut short (a disk that filled up,
    or a file read while its run appends) is left out with a warning."""
    import json
    lines = [line for line in text.split("\n") if line.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except ValueError:
            if i < len(lines) - 1:
                raise
            print(f"warning: {path}: its last line is cut short; left out", file=sys.stderr)
    return rows


def _unique(rows: list[dict]) -> list[dict]:
    """One row per sample and policy: a row written twice (a run cut short mid-write, then
    resumed) counts once."""
    seen, out = set(), []
    for r in rows:
        key = (r["task"], r["length"], r["index"], r.get("seed"), r["policy"])
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


IDENTITY = ("model", "model_bytes", "backend", "ctx", "seed", "max_new_tokens", "fidelity_tokens")


def _identity_path(partial: str) -> str:
    return os.path.join(os.path.dirname(partial), "samples.meta.json")


def _run_identity(partial: str) -> dict:
    """What a run cut short was run with (samples.meta.json beside its samples.partial.jsonl;
    {} for rows under another name, or a run from before that file existed)."""
    import json
    if os.path.basename(partial) != "samples.partial.jsonl":
        return {}
    try:
        with open(_identity_path(partial)) as f:
            meta = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise EngineError(f"{_identity_path(partial)} is unreadable ({e}): delete it to go on without its checks") from None
    return {k: meta[k] for k in IDENTITY if k in meta} if isinstance(meta, dict) else {}


def _meta_from_rows(rows: list[dict], model: str | None) -> dict:
    """The meta of a report rebuilt from its rows (a run cut short, or the union of runs)."""
    names = list(dict.fromkeys(r["policy"] for r in rows))
    return {"model": model or "(partial run)", "n_samples": len({(r["task"], r["length"], r["index"], r["seed"]) for r in rows}),
            "policies": {n: P.parse_policy(n).describe() for n in names},
            "seed": rows[0].get("seed"), "tasks": list(dict.fromkeys(r["task"] for r in rows)),
            "lengths": sorted({r["length"] for r in rows}),
            "defaults": {k: getattr(P.DEFAULT, k) for k in ("granularity", "pool", "kernel", "window", "sinks")},
            "timings": _row_timings(rows)}


def _row_timings(rows: list[dict]) -> dict:
    """The timings that rows hold (of a run cut short, resumed, or split over runs; no wall
    time): each prefill once (a sample's policies of one KV type share its prefill, each
    KV type has its own), evictions and decodes summed."""
    prefills = {(r["task"], r["length"], r["index"], r.get("seed"), P.parse_policy(r["policy"]).kv_dtype):
                (r.get("prefill_s", 0.0), r["prompt_tokens"]) for r in rows}
    return {"prefill_s": sum(s for s, _ in prefills.values()),
            "prefill_tokens": sum(n for _, n in prefills.values()),
            "evict_s": sum(r.get("evict_s", 0.0) for r in rows),
            "decode_s": sum(r.get("decode_s", 0.0) for r in rows)}


def _union(paths: list[str]) -> tuple[dict, list[dict]]:
    """(meta, rows) of one run whose samples were split over several runs (for example
    by task, one process per core): the same model and policies, no sample twice."""
    parts = [_load_rows(p) for p in paths]
    if len(parts) == 1:
        return parts[0]
    (meta0, _), rows = parts[0], [r for _, part in parts for r in part]
    known = lambda m, k: m.get(k) not in (None, "(partial run)")          # noqa: E731
    for path, (meta, part) in zip(paths[1:], parts[1:]):
        for key in ("policies",) + IDENTITY:
            if known(meta, key) and known(meta0, key) and meta[key] != meta0[key]:
                raise EngineError(f"--render: {path} and {paths[0]} are not parts of one run (their {key} differ)")
    seeds = {r.get("seed") for r in rows}
    if len(seeds) > 1:
        raise EngineError(f"--render: {', '.join(paths)} are not parts of one run (seeds {sorted(seeds, key=str)})")
    seen = set()
    for r in rows:
        key = (r["task"], r["length"], r["index"], r.get("seed"), r["policy"])
        if key in seen:
            raise EngineError(f"--render: sample {r['task']} {r['length']} #{r['index']} ({r['policy']}) "
                              f"is in more than one file")
        seen.add(key)
    common = {k: v for k, v in meta0.items() if all(m.get(k) == v for m, _ in parts[1:])}
    for key in IDENTITY:                     # checked above: where known, the parts agree
        common.update({key: m[key] for m, _ in parts if known(m, key)})
    meta = {**common, **_meta_from_rows(rows, common.get("model", "(union of runs)")), "parts": list(paths)}
    return meta, rows


def _resumed_rows(partial: str, plan, seed: int) -> list[dict]:
    """--resume: the rows in `partial` (none if it does not exist), checked to come from
    this plan: same seed, tasks, lengths and needle depths, policies of the plan. A
    sample holding only some of the plan's policies (cut short mid-write, or a policy
    added to the plan since) runs only the others (Runner.run)."""
    if not os.path.exists(partial) or not os.path.getsize(partial):
        return []
    _, rows = _load_rows(partial, "--resume", empty_ok=True)   # (a lone line cut short: none)
    names = [p.name for p in plan.policies]
    for r in rows:                           # (a row written twice was dropped by _load_rows)
        if r.get("seed") != seed or r["task"] not in plan.tasks or r["length"] not in plan.lengths \
                or r["policy"] not in names or r["index"] >= plan.samples \
                or r["depth"] != sample_depth(plan.depths, r["index"], plan.samples):
            raise EngineError(f"--resume: {partial} was written by another plan (sample {r['task']} "
                              f"{r['length']} #{r['index']}, seed {r.get('seed')}, depth {r['depth']}, policy {r['policy']}); "
                              f"run the same command, or drop --resume to start again")
    return rows


def _baselines(text: str | None, policies: list[str]) -> list[str]:
    """--baseline: the named policies, each one of the run's."""
    names = [n.strip() for n in (text or "").split(",") if n.strip()]
    for n in names:
        if n not in policies:
            raise EngineError(f"--baseline: {n} is not a policy of this run ({', '.join(policies)})")
    return names


def cmd_render(args) -> int:
    from . import report
    if len(args.render) > 1 and not args.out:
        raise EngineError("--render with several files needs --out (the folder for their union)")
    meta, rows = _union(args.render)
    if args.baseline is not None:                    # else a results.json keeps its own
        meta["baselines"] = _baselines(args.baseline, list(meta["policies"]))
    out = output_dir(args.out or os.path.dirname(os.path.abspath(args.render[0])))
    try:
        paths = report.write_all(out, meta, rows, sorted(meta["lengths"]), list(meta["tasks"]))
    except (KeyError, TypeError, ValueError) as e:  # a file edited by hand: nothing written (write_all)
        raise EngineError(f"--render: {', '.join(args.render)} cannot be rendered "
                          f"({type(e).__name__}: {e})") from None
    _print_summary(report.summarize(rows, list(meta["policies"])))
    print(f"wrote {paths['json']}, {paths['markdown']} and 3 plots from {len(rows)} rows")
    return 0


def _print_summary(summary: dict) -> None:
    for name, s in summary.items():
        acc = "-" if s["retrieval_acc"] is None else f"{100 * s['retrieval_acc']:.0f}%"
        fid = "" if s["kl"] is None else f"  KL {s['kl']:.4f}  top-1 {100 * s['top1']:.0f}%"
        print(f"{name:<40} retrieval {acc:>4}{fid}")


def cmd_eval(args) -> int:
    if args.render:
        return cmd_render(args)
    from .. import config as config_mod
    from ..gguf import GgufFile, model_config
    from ..model import Model
    from ..model_path import model_path_or_default
    from . import report
    from .runner import EvalPlan, Runner

    r = resolve(args)
    baselines = _baselines(args.baseline, [p.name for p in r["policies"]])
    path = model_path_or_default(args.model)
    out = output_dir(args.out or "results/eval")    # a bad --out fails now, not after the run
    plan = EvalPlan(tasks=r["tasks"], lengths=r["lengths"], policies=r["policies"], samples=r["samples"],
                    depths=r["depths"], seed=args.seed, max_new_tokens=args.max_new_tokens,
                    fidelity_tokens=args.fidelity_tokens)
    cli = {k: getattr(args, k) for k in ("backend", "threads") if getattr(args, k, None) is not None}
    settings = config_mod.resolve(cli=cli)
    # Eviction is applied by the runner per policy; the model itself never evicts.
    settings = settings.with_overrides(snapkv_budget=0)
    model_ctx = settings.ctx or model_config(GgufFile(path)).context_length
    partial = os.path.join(out, "samples.partial.jsonl")
    if not args.resume and os.path.exists(partial):
        raise EngineError(f"{partial} holds the rows of a run cut short: add --resume to continue it, "
                          f"or delete it to start again")
    if args.resume and not os.path.exists(partial) and os.path.exists(os.path.join(out, "results.json")):
        raise EngineError(f"--resume: {out} holds a finished run (results.json, no samples.partial.jsonl): "
                          f"nothing to resume; drop --resume to run it again")
    model = Model(path, settings.with_overrides(ctx=plan.context(model_ctx)))
    # each KV type checked against the model before any prefill, named as the model names it
    # (two spellings of one layout are one policy: one prefill, one name in the results)
    named = {p.name: p.with_kv_dtype(model.kv_dtype_of(p.kv_dtype)) for p in plan.policies}
    if len({p.name for p in named.values()}) != len(named):
        raise EngineError("--policies lists a policy twice (two spellings of one KV layout)")
    plan = dataclasses.replace(plan, policies=list(named.values()))
    baselines = [named[b].name for b in baselines]
    runner = Runner(model, plan)
    identity = {"model": os.path.basename(str(path)), "model_bytes": os.path.getsize(path),
                "backend": model.backend.name, "ctx": model.ctx, "seed": args.seed,
                "max_new_tokens": plan.max_new_tokens,
                "fidelity_tokens": plan.fidelity_tokens}
    done = []
    if args.resume:
        for key, value in _run_identity(partial).items():
            if identity[key] != value:
                raise EngineError(f"--resume: {partial} was run with {key} {value}, this command has "
                                  f"{identity[key]}: run the same command, or drop --resume to start again")
        done = _resumed_rows(partial, plan, args.seed)
    report.write_doc(_identity_path(partial), identity)
    rows = runner.run(progress=args.progress, partial_path=partial, done=done)
    meta = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": os.path.basename(str(path)), "backend": model.backend.name,
        "threads": settings.threads or os.cpu_count(), "machine": platform.processor() or platform.machine(),
        "ctx": model.ctx, "model_ctx": model_ctx, "seed": args.seed, "tasks": plan.tasks,
        "lengths": plan.lengths, "samples": plan.samples, "depths": list(plan.depths),
        "max_new_tokens": plan.max_new_tokens, "fidelity_tokens": plan.fidelity_tokens,
        "n_samples": len(rows) // max(len(plan.policies), 1),
        "policies": {p.name: p.describe() for p in plan.policies},
        "defaults": {k: getattr(P.DEFAULT, k) for k in ("granularity", "pool", "kernel", "window", "sinks")},
        # a resumed run's timings: those its rows hold, over every session
        "timings": _row_timings(rows) if done else runner.timings.as_dict(), "quick": bool(args.quick),
        "resumed_samples": len(done) // max(len(plan.policies), 1),
        "baselines": baselines,
    }
    paths = report.write_all(out, meta, rows, plan.lengths, plan.tasks)
    for done_with in (partial, _identity_path(partial)):     # results.json holds every row now
        if os.path.exists(done_with):
            os.remove(done_with)
    _print_summary(report.summarize(rows, list(meta["policies"])))
    print(f"wrote {paths['json']}, {paths['markdown']} and 3 plots "
          f"({runner.timings.wall_s:.0f} s)")
    return 0
