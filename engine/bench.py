"""`engine bench`: prefill and decode throughput at several prompt lengths, with
llama.cpp (llama-cpp-python, optional extra `bench`) measured in the same run."""
from __future__ import annotations

import json
import os
import platform
import sys
import time
from datetime import datetime, timezone

import numpy as np

from .errors import EngineError
from .forward import decode_stats_of, describe_decode_steps

FILLER = ("The quick brown fox jumps over the lazy dog while the river runs past the old mill. "
          "Numbers like 1234 and 5678 appear in ledgers, and names such as Alice, Bob and Carol "
          "show up in stories about travel, cooking, weather and music. ")


def bench_prompt(tokenizer, n: int) -> list[int]:
    """n token ids of plain English filler (the same ids for every engine)."""
    ids = tokenizer.encode(FILLER * 8, add_bos=False)
    reps = -(-n // len(ids))
    return (ids * reps)[:n]


def _engine_case(model, ids, n_decode: int, snapkv=None, kv_dtype: str | None = None,
                 fresh: dict | None = None) -> dict:
    """snapkv: None = the model's policy, False = full cache; kv_dtype: None = the model's;
    fresh: _decode_case's. peak_rss_mib: the process's peak during the case (reset_peak_rss
    before it; where the kernel cannot reset it, the peak so far)."""
    from .model import reset_peak_rss
    reset_peak_rss()
    cache = model.new_cache(kv_dtype=kv_dtype)
    t0 = time.perf_counter()
    cache, logits = model.prefill(ids, cache, snapkv=snapkv)
    return _decode_case(model, cache, logits, len(ids), time.perf_counter() - t0, n_decode, fresh)


def _shared_cases(model, ids, n_decode: int, kv_dtype: str | None,
                  fresh: dict | None = None) -> tuple[dict, dict]:
    """(the SnapKV case, the full-cache case) of `--share-prefill`: one prefill with the
    model's policy, the cache copied (KvCache.copy) just before SnapKV compacts it. The
    full case's prefill time ends where the copy begins, the SnapKV case's leaves the
    copy out; both caches are held at once, so peak RSS counts both."""
    from .model import reset_peak_rss
    reset_peak_rss()
    cache = model.new_cache(kv_dtype=kv_dtype)
    held = {}

    def keep_full(c, _q_window):
        held["t"] = time.perf_counter()
        held["full"] = c.copy()
        held["copy_s"] = time.perf_counter() - held["t"]

    t0 = time.perf_counter()
    logits = model.forward.prefill(ids, cache, snapkv=model.snapkv, before_evict=keep_full)
    t1 = time.perf_counter()
    if "full" not in held:
        raise EngineError(f"--share-prefill: SnapKV did not compact the {len(ids)}-token prompt (its budget "
                          f"keeps every row): run without --share-prefill")
    snap = _decode_case(model, cache, logits, len(ids), t1 - t0 - held["copy_s"], n_decode, fresh)
    full = _decode_case(model, held["full"], logits, len(ids), held["t"] - t0, n_decode, fresh)
    return snap, full


def _greedy(model, cache, token: int, n: int) -> tuple[list[int], float]:
    """(n greedy tokens decoded after `token`, the seconds they took)."""
    out = []
    t0 = time.perf_counter()
    for _ in range(n):
        token = model.forward.decode_argmax(token, cache)
        out.append(token)
    return out, time.perf_counter() - t0


def _decode_case(model, cache, logits, n_prompt: int, prefill_s: float, n_decode: int,
                 fresh: dict | None = None) -> dict:
    """A case's report: n_decode greedy tokens decoded after a prefill of n_prompt tokens
    that took prefill_s and left `cache` and the last token's `logits`. `fresh` (a dict, for
    --compare-replay): the same tokens decoded again, each kernel launched from Python,
    from a copy of the cache taken before the first (decode_fresh_tok_s, replay_speedup,
    replay_same_tokens: how many greedy tokens agree before the first that differs);
    decode_counters are left as the replayed decode left them and those decodes' own added
    into `fresh`."""
    from .model import peak_rss_mib
    token = int(np.argmax(logits))
    twin = None
    if fresh is not None:
        twin = cache.copy()
        model.backend.synchronize()      # the copy's device work, outside the decode's timer
    tokens, decode_s = _greedy(model, cache, token, n_decode)
    case = {"prefill_tok_s": n_prompt / prefill_s, "decode_tok_s": n_decode / decode_s,
            "prefill_s": prefill_s, "kv_bytes": cache.bytes, "kv_rows": cache.length,
            "kv_dtype": cache.kv_dtype, "snapkv": cache.eviction}
    if twin is not None:
        with model.forward.without_replay() as added:
            fresh_tokens, fresh_s = _greedy(model, twin, token, n_decode)
        for k, v in added.items():
            fresh[k] = fresh.get(k, 0) + v
        case.update(decode_fresh_tok_s=n_decode / fresh_s, replay_speedup=fresh_s / decode_s,
                    replay_same_tokens=next((i for i, (a, b) in enumerate(zip(tokens, fresh_tokens)) if a != b),
                                            n_decode))
    return dict(case, peak_rss_mib=peak_rss_mib())


def _llama_cpp_last_logits(llm) -> np.ndarray:
    """f32 [vocab] logits of the last evaluated token (llama-cpp-python keeps no
    scores unless logits_all, so read them from the context)."""
    return np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),))


def _llama_cpp_case(llm, ids, n_decode: int) -> dict:
    """Prefill and decode timed as ours: until the last token's logits are read (on a GPU
    llama_decode returns before the device is done; reading the logits waits for it)."""
    from .model import reset_peak_rss
    reset_peak_rss()
    llm.reset()
    llm._ctx.kv_cache_clear() if hasattr(llm._ctx, "kv_cache_clear") else None
    t0 = time.perf_counter()
    llm.eval(ids)
    token = int(np.argmax(_llama_cpp_last_logits(llm)))
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(n_decode):
        llm.eval([token])
        token = int(np.argmax(_llama_cpp_last_logits(llm)))
    decode_s = time.perf_counter() - t0
    return {"prefill_tok_s": len(ids) / prefill_s, "decode_tok_s": n_decode / decode_s, "prefill_s": prefill_s}


LLAMA_CPP_CACHE_TYPES = {"f16": 1, "q8_0": 8, "q4_0": 2}      # ggml_type values


def llama_cpp_modes(flash_attn: str, cache_type: str) -> list[bool]:
    """The flash-attention modes llama.cpp runs in: "both" (a speed ratio is claimed
    against its faster mode), "on" or "off"; a quantized V cache needs it on."""
    if llama_cpp_cache_types(cache_type)[1] != LLAMA_CPP_CACHE_TYPES["f16"]:
        return [True]
    return {"both": [False, True], "on": [True], "off": [False]}[flash_attn]


def llama_cpp_cache_types(spec: str) -> tuple[int, int]:
    """llama.cpp's KV cache type, "f16" / "q8_0" / "q4_0" or KEYS/VALUES such as
    "q8_0/q4_0" -> (type_k, type_v) as ggml_type values."""
    k, _, v = str(spec).partition("/")
    v = v or k
    if k not in LLAMA_CPP_CACHE_TYPES or v not in LLAMA_CPP_CACHE_TYPES:
        raise EngineError(f"llama.cpp's cache type must be f16, q8_0, q4_0 or KEYS/VALUES, got {spec!r}")
    return LLAMA_CPP_CACHE_TYPES[k], LLAMA_CPP_CACHE_TYPES[v]


def llama_cpp_available() -> bool:
    import importlib.util
    return importlib.util.find_spec("llama_cpp") is not None


def _llama_cpp_worker(path: str, ctx: int, threads: int, cases: list[list[int]], n_decode: int,
                      gpu: bool = False, flash_attn: bool = False, cache_type: str = "f16") -> list[dict] | None:
    """Runs in a child process with the default environment (our process sets
    OMP_WAIT_POLICY for numba, which would also slow llama.cpp's OpenMP pool).
    `gpu`: every layer offloaded; None when this llama.cpp build cannot offload.
    `flash_attn`: llama.cpp's flash-attention kernels (off by default in llama-cpp-python).
    `cache_type`: its KV cache type (llama_cpp_cache_types)."""
    import llama_cpp
    if gpu and not llama_cpp.llama_supports_gpu_offload():
        return None
    import inspect
    type_k, type_v = llama_cpp_cache_types(cache_type)
    # sliding-window layers cache their window only, as ours do (where this build knows swa_full)
    swa = {"swa_full": False} if "swa_full" in inspect.signature(llama_cpp.Llama.__init__).parameters else {}
    llm = llama_cpp.Llama(model_path=path, n_ctx=ctx, n_threads=threads, n_threads_batch=threads,
                          n_batch=512, logits_all=False, verbose=False, n_gpu_layers=-1 if gpu else 0,
                          flash_attn=flash_attn, type_k=type_k, type_v=type_v, **swa)
    _llama_cpp_case(llm, cases[0][:64], 4)     # warm up
    from .model import peak_rss_mib
    rows = []
    for ids in cases:                            # each case's own peak (reset_peak_rss in the case)
        rows.append(dict(_llama_cpp_case(llm, ids, n_decode), peak_rss_mib=peak_rss_mib()))
    return rows


def run_llama_cpp(path: str, ctx: int, threads: int, cases: list[list[int]], n_decode: int,
                  gpu: bool = False, flash_attn: bool = False, cache_type: str = "f16") -> list[dict] | None:
    import subprocess
    import sys
    import tempfile

    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "KMP_"))}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"path": str(path), "ctx": ctx, "threads": threads, "cases": cases, "n_decode": n_decode,
                   "gpu": gpu, "flash_attn": flash_attn, "cache_type": cache_type}, f)
        job = f.name
    code = ("import json,sys; from engine.bench import _llama_cpp_worker; a=json.load(open(sys.argv[1])); "
            "print(json.dumps(_llama_cpp_worker(a['path'],a['ctx'],a['threads'],a['cases'],a['n_decode'],a['gpu'],a['flash_attn'],a['cache_type'])))")
    try:
        r = subprocess.run([sys.executable, "-c", code, job], capture_output=True, text=True, env=env)
    finally:
        os.unlink(job)
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
        if r.returncode < 0:                     # killed by a signal: a crash inside llama.cpp
            import signal
            tail = (f"llama.cpp crashed ({signal.Signals(-r.returncode).name}); {tail}; on a CPU with AMX, "
                    f"llama-cpp-python built for it crashes in its AMX kernels: rebuild without them "
                    f"(docs/benchmarks.md), or --no-llama-cpp skips it")
        raise EngineError(f"llama.cpp benchmark failed: {tail}")
    return json.loads(r.stdout.strip().splitlines()[-1])


TIMED = ("prefill_tok_s", "decode_tok_s", "prefill_s")


def _median_case(runs: list[dict]) -> dict:
    """One case of several runs: its timings the medians (each run's in `runs_<field>`
    when there are several), its peak RSS the highest, the rest the first run's."""
    case = dict(runs[0])
    if len(runs) > 1:
        for f in TIMED + (("decode_fresh_tok_s",) if "decode_fresh_tok_s" in case else ()):
            values = [r[f] for r in runs]
            case[f], case[f"runs_{f}"] = float(np.median(values)), values
        case["peak_rss_mib"] = max(r["peak_rss_mib"] for r in runs)
        if "decode_fresh_tok_s" in case:      # --compare-replay: of the medians; the fewest tokens agreeing
            case["replay_speedup"] = case["decode_tok_s"] / case["decode_fresh_tok_s"]
            case["replay_same_tokens"] = min(r["replay_same_tokens"] for r in runs)
    return case


# Warm-up prompts reach this length where the cases do: past every backend's switch to its
# long-cache kernels (the CPU's parallel decode above 1024 rows), which would otherwise
# compile inside the first long case's timer (a fresh install's first SnapKV 4K decode: 4.6
# instead of 54 tok/s)
WARM_TOKENS = 1280


def _warm_eviction(cfg, longest: int):
    """(a policy like `cfg` with a budget of at most WARM_TOKENS - 64, the length of a
    warm-up prompt it compacts, at most `longest`) so eviction's kernels, and decode over
    a compacted cache of that many rows, are compiled and loaded before the timed cases;
    None if no prompt that fits can be compacted."""
    import dataclasses
    budget = max(cfg.sinks + cfg.recent + cfg.merge + 8, min(cfg.budget, WARM_TOKENS - 64, longest - 64))
    n = min(longest, budget + 64)
    if n <= budget or n < cfg.window:
        return None
    return dataclasses.replace(cfg, budget=budget, min_tokens=0), n


def run_bench(args, settings) -> int:
    from .inputs import output_dir
    from .model import Model, peak_rss_mib
    from .model_path import model_path_or_default

    try:
        lengths = [int(x) for x in str(args.lengths).split(",") if x.strip()]
    except ValueError:
        raise EngineError(f"--lengths must be comma-separated integers, got {args.lengths!r}") from None
    if not lengths or min(lengths) < 1:
        raise EngineError("--lengths needs at least one positive length")
    if args.decode_tokens < 1:
        raise EngineError(f"--decode-tokens must be >= 1, got {args.decode_tokens}")
    repeats = getattr(args, "repeats", 1)
    if repeats < 1:
        raise EngineError(f"--repeats must be >= 1, got {repeats}")
    llama_cpp_cache_types(args.llama_cache_type)  # a bad --llama-cpp-cache-type fails now, not after loading
    dtypes = [t.strip() for t in str(args.kv_dtypes or "").split(",") if t.strip()]
    output_dir(args.out)                         # a bad --out fails now, not after the run
    path = model_path_or_default(args.model)
    threads = settings.threads or os.cpu_count() or 1
    settings = settings.with_overrides(threads=threads)
    need_ctx = max(lengths) + args.decode_tokens + 1
    if settings.ctx is None:
        settings = settings.with_overrides(ctx=need_ctx)
    model = Model(path, settings)
    fresh = {} if getattr(args, "compare_replay", False) else None
    if fresh is not None and model.forward.replay is None:
        raise EngineError(f"--compare-replay: the {model.backend.name} backend does not replay recorded decode "
                          f"steps here" + (" (SHARPI_DECODE_REPLAY=off)" if settings.decode_replay == "off" else ""))
    # checked now, canonical: two spellings of one layout are measured once
    dtypes = list(dict.fromkeys(model.kv_dtype_of(t) for t in dtypes)) or [model.kv_dtype]
    if need_ctx > model.ctx:
        raise EngineError(f"longest case needs {need_ctx} positions but --ctx is {model.ctx}")
    use_llama_cpp = args.llama_cpp and llama_cpp_available()
    if args.llama_cpp and not use_llama_cpp:
        print("llama.cpp: llama-cpp-python is not installed (pip install -e '.[bench]'); its columns are "
              "left out", file=sys.stderr)
    gpu = model.backend.name == "cuda"           # compare with llama.cpp on the same GPU
    if use_llama_cpp and model.backend.name not in ("cpu", "cuda"):
        print(f"llama.cpp: not run beside the {model.backend.name} backend (it would run on another "
              f"device); compare with --backend cpu or cuda", file=sys.stderr)
        use_llama_cpp = False
    cache_type = args.llama_cache_type
    modes = llama_cpp_modes(getattr(args, "llama_flash_attn", "both"), cache_type)   # flash attention off / on
    prompts = [bench_prompt(model.tokenizer, n) for n in lengths]

    def llama_run() -> dict | None:
        """{flash_attn: its rows} for each mode, one child process each; None without GPU offload."""
        runs = {fa: run_llama_cpp(path, model.ctx, threads, prompts, args.decode_tokens, gpu, fa, cache_type)
                for fa in modes}
        return None if any(r is None for r in runs.values()) else runs
    llama_runs = [llama_run()] if use_llama_cpp else []
    if use_llama_cpp and llama_runs[0] is None:
        print("llama.cpp: the installed build has no GPU offload; its columns are left out", file=sys.stderr)
        use_llama_cpp, llama_runs = False, []
    if use_llama_cpp:
        print(f"llama.cpp: {cache_type} KV cache, flash attention "
              f"{' and '.join('on' if fa else 'off' for fa in modes)}, {threads} threads"
              + ("; its columns: the faster mode per column (fa: with flash attention)" if len(modes) > 1 else ""))
    warm = bench_prompt(model.tokenizer, min(WARM_TOKENS, max(lengths)))   # fits the context the cases need
    evicting = model.snapkv is not None
    warm_evict = _warm_eviction(model.snapkv, max(lengths)) if evicting else None
    for dtype in dtypes:
        _engine_case(model, warm, min(4, args.decode_tokens), kv_dtype=dtype)   # compile / warm once (and check the type)
        if warm_evict is not None:       # eviction's kernels too, not inside the first case's timer
            cfg, n = warm_evict
            _engine_case(model, bench_prompt(model.tokenizer, n), 1, snapkv=cfg, kv_dtype=dtype)
    load_peak = peak_rss_mib()
    share = bool(getattr(args, "share_prefill", False))
    if share and (not evicting or min(lengths) < model.snapkv.window or not model.snapkv.compacts(min(lengths))):
        raise EngineError("--share-prefill needs --kv-budget and prompts SnapKV compacts (longer than its "
                          "budget and window)")
    cases = [(i, n, ids, dtype) for i, (n, ids) in enumerate(zip(lengths, prompts)) for dtype in dtypes]

    fresh_col = f" {'fresh':>10}" if fresh is not None else ""     # decode without replay
    header = (f"{'prompt':>7} {'KV':>5} | {'engine prefill':>14} {'decode':>10}{fresh_col} {'KV MiB':>7} |"
              + (f" {'SnapKV prefill':>14} {'decode':>10}{fresh_col} {'KV MiB':>7} |" if evicting else "")
              + (f" {'llama.cpp prefill':>20} {'decode':>13} | {'ratio p':>7} {'ratio d':>7}" if use_llama_cpp else "")
              + (f"   (medians of {repeats} runs)" if repeats > 1 else ""))
    rows = []

    def report_case(c: int, k, full, llama_rows: dict | None) -> None:
        """A case's row, printed as the table's next line."""
        _, n, _, dtype = cases[c]
        row = {"prompt_tokens": n, "kv_dtype": dtype, "engine": full}
        def decode(case) -> str:
            rate = f"{case['decode_tok_s']:>6.1f} t/s "
            return rate + (f"{case['decode_fresh_tok_s']:>6.1f} t/s " if fresh is not None else "")
        line = f"{n:>7} {dtype:>5} | {full['prefill_tok_s']:>10.1f} t/s {decode(full)}{full['kv_bytes'] / 2**20:>7.1f} |"
        if evicting:
            row["engine_snapkv"] = k
            row["snapkv_decode_speedup"] = k["decode_tok_s"] / full["decode_tok_s"]
            row["snapkv_kv_ratio"] = full["kv_bytes"] / k["kv_bytes"]
            if k["snapkv"]:
                row["snapkv_overhead"] = k["snapkv"]["seconds"] / k["prefill_s"]   # share of prefill time
            line += f" {k['prefill_tok_s']:>10.1f} t/s {decode(k)}{k['kv_bytes'] / 2**20:>7.1f} |"
        if llama_rows is not None:
            # "llama_cpp": without flash attention where that ran, "llama_cpp_fa": with it; each
            # ratio against the faster of the two (the one named in ratio_against)
            row["llama_cpp"] = llama_rows.get(False, llama_rows.get(True))
            if len(llama_rows) > 1:
                row["llama_cpp_fa"] = llama_rows[True]
            row["ratio_against"], cells = {}, ""
            for what in ("prefill", "decode"):
                fa = max(llama_rows, key=lambda m: llama_rows[m][f"{what}_tok_s"])
                theirs = llama_rows[fa][f"{what}_tok_s"]
                row[f"ratio_{what}"] = full[f"{what}_tok_s"] / theirs
                row["ratio_against"][what] = "flash attention" if fa else "no flash attention"
                cells += f" {theirs:>{13 if what == 'prefill' else 6}.1f} t/s {'fa' if fa and len(modes) > 1 else '  '}"
            # llama.cpp's f16 rows are our bf16 ones; its q8_0 / q4_0 ours of the same name
            row["kv_matched"] = (dtype == "bf16" and cache_type == "f16") or dtype == cache_type
            ratios = f"{row['ratio_prefill']:>6.2f}x {row['ratio_decode']:>6.2f}x"
            line += f"{cells} | " + (ratios if row["kv_matched"] else f"({ratios}: KV {dtype} vs {cache_type})")
        print(line, flush=True)
        rows.append(row)

    def our_run(live: bool) -> list[tuple]:
        """Every case once: [(SnapKV case or None, full-cache case)]; `live`: each reported
        as it ends (one run: its numbers are the table's)."""
        out = []
        for c, (i, _, ids, dtype) in enumerate(cases):
            if share:
                out.append(_shared_cases(model, ids, args.decode_tokens, dtype, fresh))
            else:   # the evicting case first: its peak RSS is then its own, not the full cache's
                k = _engine_case(model, ids, args.decode_tokens, kv_dtype=dtype, fresh=fresh) if evicting else None
                out.append((k, _engine_case(model, ids, args.decode_tokens, snapkv=False, kv_dtype=dtype,
                                            fresh=fresh)))
            if live:
                report_case(c, *out[-1], {fa: llama_runs[0][fa][i] for fa in modes} if use_llama_cpp else None)
        return out
    if repeats == 1:
        print(header)
        our_run(live=True)
    else:
        ours_runs = []
        for r in range(repeats):         # in alternating pairs: llama.cpp, ours | ours, llama.cpp | ...
            print(f"repeat {r + 1}/{repeats}", file=sys.stderr, flush=True)
            if use_llama_cpp and r % 2 == 0 and r > 0:      # (the first ran before the warm-up)
                llama_runs.append(llama_run())
            ours_runs.append(our_run(live=False))
            if use_llama_cpp and r % 2 == 1:
                llama_runs.append(llama_run())
        print(header)
        for c, (i, *_) in enumerate(cases):
            report_case(c, _median_case([run[c][0] for run in ours_runs]) if evicting else None,
                        _median_case([run[c][1] for run in ours_runs]),
                        {fa: _median_case([run[fa][i] for run in llama_runs]) for fa in modes}
                        if use_llama_cpp else None)
    llama_rows = [r for row in rows for r in (row.get("llama_cpp"), row.get("llama_cpp_fa")) if r]
    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": os.path.basename(str(path)), "backend": model.backend.name, "threads": threads,
        "kv_dtypes": dtypes,
        "machine": platform.processor() or platform.machine(), "decode_tokens": args.decode_tokens,
        "settings": {k: v for k, v in vars(settings).items()},
        "peak_rss_mib": max([load_peak, peak_rss_mib()] + [c["peak_rss_mib"] for r in rows
                                                             for c in (r["engine"], r.get("engine_snapkv")) if c]),
        "share_prefill": share, "repeats": repeats,
        "snapkv": model.snapkv.summary() if evicting else None,
        "llama_cpp": use_llama_cpp, "llama_cpp_gpu": use_llama_cpp and gpu,
        # the modes llama.cpp ran in ("both": "llama_cpp" without flash attention, "llama_cpp_fa" with it)
        "llama_cpp_flash_attn": (("both" if len(modes) > 1 else modes[0]) if use_llama_cpp else None),
        "llama_cpp_cache_type": cache_type if use_llama_cpp else None, "cases": rows,
        # every decode of one sequence above (warm-up included): ForwardPass.decode_stats;
        # --compare-replay's decodes without replay apart
        "decode_steps": model.forward.decode_stats(),
        "compare_replay": fresh is not None,
        "decode_steps_fresh": decode_stats_of(fresh, model.forward.counts_launches) if fresh else None,
    }
    os.makedirs(args.out, exist_ok=True)
    out = os.path.join(args.out, f"bench-{model.backend.name}.json")
    text = json.dumps(report, indent=1, default=str)
    with open(out + ".tmp", "w") as f:
        f.write(text)
    os.replace(out + ".tmp", out)
    d = report["decode_steps"]
    if d["launches_per_token"] is not None:
        print(f"decode steps: {describe_decode_steps(d)}")
    if report["decode_steps_fresh"]:
        print(f"decode steps without replay: {describe_decode_steps(report['decode_steps_fresh'])}")
    theirs = f", llama.cpp's {max(r['peak_rss_mib'] for r in llama_rows):.0f} MiB" if llama_rows else ""
    print(f"peak RSS {report['peak_rss_mib']:.0f} MiB{theirs}; wrote {out}")
    return 0
