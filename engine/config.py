"""All configuration read in one place: environment < CLI flag < API argument.

Every setting is declared once in SETTINGS with its env var, CLI flag, parser,
default and a one-line comment. The rest of the code receives a frozen Settings.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace

from backends.kvformat import KV_DTYPES, KvSpec

from .errors import ConfigError


def _int(lo=None):
    def parse(text, name):
        try:
            value = int(str(text).strip())
        except ValueError:
            raise ConfigError(f"{name} must be an integer, got {text!r}") from None
        if lo is not None and value < lo:
            raise ConfigError(f"{name} must be >= {lo}, got {value}")
        return value
    parse.range = "integer" if lo is None else f"integer >= {lo}"   # for the docs' settings table
    return parse


def _odd_int(lo: int, hi: int):
    inner = _int(lo)

    def parse(text, name):
        value = inner(text, name)
        if value % 2 == 0 or value > hi:
            raise ConfigError(f"{name} must be an odd integer in {lo}..{hi}, got {value}")
        return value
    parse.range = f"odd integer {lo}..{hi}"
    return parse


def _choice(*options):
    def parse(text, name):
        value = str(text).strip().lower()
        if value not in options:
            raise ConfigError(f"{name} must be one of {'|'.join(options)}, got {text!r}")
        return value
    parse.range = "one of " + ", ".join(options)
    return parse


def _optional_int(lo=None):
    inner = _int(lo)

    def parse(text, name):
        if text is None or str(text).strip().lower() in ("", "none"):
            return None
        return inner(text, name)
    parse.range = f"{inner.range}, or unset"
    return parse


def _float(lo: float = 0.0):
    def parse(text, name):
        try:
            value = float(str(text).strip())
        except ValueError:
            raise ConfigError(f"{name} must be a number, got {text!r}") from None
        if not value >= lo or value == float("inf"):
            raise ConfigError(f"{name} must be a finite number >= {lo:g}, got {text!r}")
        return value
    parse.range = f"number >= {lo:g}"
    return parse


def _kv_dtype(text, name):
    """A KV dtype, KEYS/VALUES ("q8_0/tq4"), with layer exceptions ("rq4_0:0=q8_0/rq4_0"),
    normalised to its canonical spelling."""
    return KvSpec.parse(text, name).name


_kv_dtype.range = "one of " + ", ".join(KV_DTYPES) + ", or KEYS/VALUES, then :LAYERS=FORMAT exceptions"


@dataclass(frozen=True)
class Spec:
    field: str
    env: str | None
    flag: str | None
    parse: object
    default: object
    doc: str


SETTINGS = (
    Spec("backend", "SHARPI_BACKEND", "--backend", _choice("cpu", "vulkan", "cuda", "reference", "auto"),
         "cpu", "compute backend; auto picks CUDA, then a Vulkan GPU, then CPU"),
    Spec("threads", "SHARPI_THREADS", "--threads", _optional_int(1), None,
         "CPU threads for the kernels and BLAS (default: all cores)"),
    Spec("ctx", "SHARPI_CTX", "--ctx", _optional_int(1), None,
         "context size in tokens (default: the model's trained context)"),
    Spec("prefill_chunk", "SHARPI_PREFILL_CHUNK", "--prefill-chunk", _int(1), 256,
         "prompt tokens per prefill step"),
    Spec("kv_dtype", "SHARPI_KV_DTYPE", "--kv-dtype", _kv_dtype, "bf16",
         "KV cache row format: bf16, q8_0, q4_0, tq4, tq3, rq4_0, or KEYS/VALUES such as q8_0/tq4; "
         "then :LAYERS=FORMAT for layers stored otherwise, as rq4_0:0=q8_0/rq4_0"),
    Spec("snapkv_budget", "SHARPI_SNAPKV_BUDGET", "--kv-budget", _optional_int(0), None,
         "SnapKV KV budget per layer: N>0 on, 0 off (also disables auto-on), unset = auto policy"),
    Spec("snapkv_window", "SHARPI_SNAPKV_WINDOW", "--kv-window", _int(1), 32,
         "observation window: last W prompt tokens whose queries vote"),
    Spec("snapkv_recency", "SHARPI_SNAPKV_RECENCY", "--kv-recency", _optional_int(1), None,
         "always keep the last R prompt tokens (default: the window)"),
    Spec("snapkv_sinks", "SHARPI_SNAPKV_SINKS", "--kv-sinks", _int(0), 4,
         "always keep the first S prompt tokens (attention sinks)"),
    Spec("snapkv_kernel", "SHARPI_SNAPKV_KERNEL", "--kv-kernel", _odd_int(1, 1001), 31,   # 1001 = snapkv.MAX_KERNEL
         "pooling kernel width along positions (odd; 1 = no pooling)"),
    Spec("snapkv_pool", "SHARPI_SNAPKV_POOL", "--kv-pool", _choice("avg", "max"), "avg",
         "vote pooling: avg (zero padded) or max"),
    Spec("snapkv_granularity", "SHARPI_SNAPKV_GRANULARITY", "--kv-granularity",
         _choice("head", "layer", "global"), "head",
         "keep sets per KV head, per layer, or one for the whole model"),
    Spec("snapkv_min_tokens", "SHARPI_SNAPKV_MIN_TOKENS", "--kv-min-tokens", _int(0), 128,
         "prompts this short or shorter are never compacted"),
    Spec("snapkv_merge", "SHARPI_SNAPKV_MERGE", "--kv-merge", _int(0), 0,
         "rows of the budget per KV head that summarise the evicted rows (k-means means with a log-count "
         "bias); 0 = off"),
    Spec("snapkv_allocation", "SHARPI_SNAPKV_ALLOCATION", "--kv-allocation",
         _choice("uniform", "pyramid", "adaptive", "pyramid-adaptive"), "uniform",
         "where the budget goes: uniform, pyramid (layer budgets falling with depth), adaptive (a layer's "
         "rows shared among its KV heads by their votes) or pyramid-adaptive; the total stays the same"),
    Spec("snapkv_pyramid_beta", "SHARPI_SNAPKV_PYRAMID_BETA", "--kv-pyramid-beta", _int(1), 20,
         "pyramid: the last compacted layer keeps 1/beta of a uniform layer's voted rows, the first "
         "2 - 1/beta of them (kvpress's 20); 1 = uniform"),
    Spec("snapkv_auto_mib", "SHARPI_SNAPKV_AUTO_MIB", None, _int(0), 256,
         "auto-on threshold: KV ring (in the chosen KV dtype) for the context above this many MiB"),
    Spec("cpu_kernels", "SHARPI_CPU_KERNELS", None, _choice("auto", "portable"), "auto",
         "CPU mat-vecs: auto = AVX-512 VNNI or AVX2 where the CPU has it, portable = portable vector code "
         "(read once per process, when the CPU backend is first imported)"),
    Spec("cuda_executor", "SHARPI_CUDA_EXECUTOR", None, _choice("device", "cpu-harness"), "device",
         "where CUDA kernels run: device = an NVIDIA GPU through cupy; cpu-harness = the same kernel "
         "source on the CPU through our test harness (no GPU needed, ~1000x slower)"),
    Spec("decode_replay", "SHARPI_DECODE_REPLAY", None, _choice("on", "off"), "on",
         "decode (one sequence, or the server's batch) on a backend that records steps (CUDA, Vulkan): "
         "on = each step replays a recorded one (a CUDA graph, a recorded Vulkan command buffer), off = "
         "every kernel launched from Python each token"),
    # read once, when backends/cuda/harness.py is imported (its MEMCHECK switch)
    Spec("cuda_harness_memcheck", "SHARPI_CUDA_HARNESS_MEMCHECK", None, _choice("1", "0"), "1",
         "CUDA CPU harness: 1 = every array argument between guard pages, an out-of-bounds access "
         "is an error naming the thread and the argument (docs/cuda.md); 0 = off"),
    # engine serve: what one request or client may hold (engine/serve/limits.py); a request over a
    # limit gets a 4xx before anything is allocated for it
    Spec("serve_max_body_mb", "SHARPI_SERVE_MAX_BODY_MB", "--max-body-mb", _float(0.001), 8.0,
         "engine serve: largest request body in MB (413 beyond, before it is parsed)"),
    Spec("serve_max_stop", "SHARPI_SERVE_MAX_STOP", "--max-stop", _int(0), 16,
         "engine serve: most stop strings a request may give"),
    Spec("serve_max_stop_chars", "SHARPI_SERVE_MAX_STOP_CHARS", "--max-stop-chars", _int(1), 512,
         "engine serve: longest stop string, in characters"),
    Spec("serve_template_timeout", "SHARPI_SERVE_TEMPLATE_TIMEOUT", "--template-timeout", _float(0.01), 5.0,
         "engine serve: seconds a chat template may take to render (in a worker process, killed after)"),
    Spec("serve_header_timeout", "SHARPI_SERVE_HEADER_TIMEOUT", "--header-timeout", _float(0.01), 10.0,
         "engine serve: seconds a connection may take to send its request headers"),
    Spec("serve_body_timeout", "SHARPI_SERVE_BODY_TIMEOUT", "--body-timeout", _float(0.01), 30.0,
         "engine serve: seconds a request body may take to arrive, all of it (408 after)"),
    Spec("serve_write_timeout", "SHARPI_SERVE_WRITE_TIMEOUT", "--write-timeout", _float(0.01), 60.0,
         "engine serve: seconds one write of a response may wait for a client that does not read "
         "(the request is cancelled and the connection closed after)"),
    Spec("serve_max_connections", "SHARPI_SERVE_MAX_CONNECTIONS", "--max-connections", _int(1), 512,
         "engine serve: open connections; more are closed at once"),
    Spec("serve_request_timeout", "SHARPI_SERVE_REQUEST_TIMEOUT", "--request-timeout", _float(0.0), 900.0,
         "engine serve: seconds a request may run, queue included (504, a stream's error event); 0 = none"),
    Spec("serve_shutdown_timeout", "SHARPI_SERVE_SHUTDOWN_TIMEOUT", "--shutdown-timeout", _float(0.0), 30.0,
         "engine serve: on SIGTERM/SIGINT, seconds running requests have to finish before they are ended"),
    Spec("serve_content_specials", "SHARPI_SERVE_CONTENT_SPECIALS", "--content-special-tokens",
         _choice("text", "parse"), "text",
         "engine serve: special-token text inside chat message content: text (tokenized as plain text) or "
         "parse (control tokens, as llama-server and vLLM do)"),
)

_BY_FIELD = {s.field: s for s in SETTINGS}


@dataclass(frozen=True)
class Settings:
    backend: str = "cpu"
    threads: int | None = None
    ctx: int | None = None
    prefill_chunk: int = 256
    kv_dtype: str = "bf16"
    snapkv_budget: int | None = None
    snapkv_window: int = 32     # window and kernel measured by `engine eval` (README)
    snapkv_recency: int | None = None
    snapkv_sinks: int = 4
    snapkv_kernel: int = 31
    snapkv_pool: str = "avg"
    snapkv_granularity: str = "head"
    snapkv_min_tokens: int = 128
    snapkv_merge: int = 0
    snapkv_allocation: str = "uniform"
    snapkv_pyramid_beta: int = 20
    snapkv_auto_mib: int = 256
    cpu_kernels: str = "auto"
    cuda_executor: str = "device"
    decode_replay: str = "on"
    cuda_harness_memcheck: str = "1"
    serve_max_body_mb: float = 8.0
    serve_max_stop: int = 16
    serve_max_stop_chars: int = 512
    serve_template_timeout: float = 5.0
    serve_header_timeout: float = 10.0
    serve_body_timeout: float = 30.0
    serve_write_timeout: float = 60.0
    serve_max_connections: int = 512
    serve_request_timeout: float = 900.0
    serve_shutdown_timeout: float = 30.0
    serve_content_specials: str = "text"

    def with_overrides(self, source: str = "argument", **overrides) -> "Settings":
        """A copy with overrides applied (None values ignored). `source` names where
        they came from in error messages: 'argument' (API) or 'flag' (CLI)."""
        clean = {}
        for key, value in overrides.items():
            if key not in _BY_FIELD:
                raise ConfigError(f"unknown setting '{key}'")
            if value is None:
                continue
            spec = _BY_FIELD[key]
            label = spec.flag if source == "flag" and spec.flag else key
            clean[key] = spec.parse(value, label)
        return replace(self, **clean)


def label(field: str) -> str:
    """How errors name a setting: its flag and variable ("--kv-budget/SHARPI_SNAPKV_BUDGET")."""
    spec = _BY_FIELD[field]
    return "/".join(x for x in (spec.flag, spec.env) if x) or field


def parse_setting(field: str, value, name: str):
    """One value through its setting's parser (the rules env vars and flags follow);
    errors name `name`, e.g. a request field of the server ("kv_window")."""
    return _BY_FIELD[field].parse(value, name)


def from_env(env=None) -> Settings:
    """Settings from the environment over the defaults."""
    env = os.environ if env is None else env
    values = {}
    for spec in SETTINGS:
        text = env.get(spec.env) if spec.env else None
        if text is not None and text.strip() != "":
            values[spec.field] = spec.parse(text, spec.env)
    return replace(Settings(), **values)


# Settings read from the environment itself (env_setting), not from the Settings a Model is
# given: engine.load refuses them as keywords (they would have no effect)
ENV_ONLY = {
    "cpu_kernels": "read when the CPU backend is first imported",
    "cuda_executor": "read when a CUDA backend is created",
    "cuda_harness_memcheck": "read when the CUDA CPU harness is imported",
}


def env_name(field: str) -> str | None:
    """The environment variable of a setting."""
    return _BY_FIELD[field].env


def env_setting(field: str, env=None):
    """One setting from the environment (or its default), for the few read at import."""
    spec = _BY_FIELD[field]
    env = os.environ if env is None else env
    text = env.get(spec.env) if spec.env else None
    if text is None or text.strip() == "":
        return getattr(Settings(), field)
    return spec.parse(text, spec.env)


def resolve(cli: dict | None = None, api: dict | None = None, env=None) -> Settings:
    """env < CLI < API."""
    settings = from_env(env)
    if cli:
        settings = settings.with_overrides("flag", **cli)
    if api:
        settings = settings.with_overrides("argument", **api)
    return settings


assert {f.name for f in fields(Settings)} == set(_BY_FIELD), "Settings and SETTINGS disagree"
