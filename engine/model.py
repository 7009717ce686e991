"""The public Model: load a GGUF, tokenize, run prefill, inspect the cache, generate."""
from __future__ import annotations

import os
import resource
import sys
import time
from typing import Iterator, Sequence

import numpy as np

from backends.base import check_head_dim, check_kv_dtypes
from backends.kvformat import KvFormat, KvSpec

from . import chat_content
from . import config as config_mod
from . import inputs
from .errors import ConfigError, EngineError
from .forward import ForwardPass
from .generate import GenerationResult, SamplingParams, generate_stream
from .gguf import GgufFile, ModelConfig, model_config
from .kv.paged import KvCache
from .model_path import model_path_or_default
from .snapkv import SnapKvConfig, check_values
from .tokenizer import Tokenizer

AUTO_BUDGET = 2048   # budget the auto policy turns on with
PAGE_SIZE = 64       # KV rows per page


def snapkv_from_settings(s: config_mod.Settings, cfg: ModelConfig, ctx: int) -> tuple[SnapKvConfig | None, str | None]:
    """The eviction policy the settings ask for, and a notice when auto-on fired.
    Budget N > 0: on; 0: off (auto included); unset: on with AUTO_BUDGET when the
    KV ring for `ctx` in the settings' KV dtype exceeds snapkv_auto_mib (the bytes the
    cache really holds: sliding-window layers count their window, not the context)."""
    budget, notice = s.snapkv_budget, None
    if budget is None:
        ring_mib = cfg.kv_bytes(ctx, min(s.prefill_chunk, ctx), PAGE_SIZE, s.kv_dtype) / 2**20
        if ring_mib <= s.snapkv_auto_mib:
            return None, None
        budget = AUTO_BUDGET
        notice = (f"SnapKV auto-on: the {s.kv_dtype} KV cache for {ctx} tokens would take {ring_mib:.0f} MiB "
                  f"(> SHARPI_SNAPKV_AUTO_MIB={s.snapkv_auto_mib}); evicting to {budget} rows per layer "
                  f"after prefill (SHARPI_SNAPKV_BUDGET=0 turns this off)")
    if budget == 0:
        return None, None
    values = dict(budget=budget, window=s.snapkv_window, sinks=s.snapkv_sinks, recency=s.snapkv_recency,
                  kernel=s.snapkv_kernel, pool=s.snapkv_pool, granularity=s.snapkv_granularity,
                  min_tokens=s.snapkv_min_tokens, merge=s.snapkv_merge, allocation=s.snapkv_allocation,
                  pyramid_beta=s.snapkv_pyramid_beta)
    check_values(values, {k: config_mod.label(f"snapkv_{k}") for k in values})   # errors name the flags
    return SnapKvConfig(**values), notice


def available_memory_bytes() -> int | None:
    """Memory the kernel says can be allocated without swapping (MemAvailable), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def kv_spec_for(kv_dtype, backend, cfg: ModelConfig) -> KvSpec:
    """"q8_0/tq4" -> KvSpec("q8_0", "tq4"), checked against the backend's `kv_dtypes`,
    the model's head_dim and its layer count (one-line ConfigError otherwise), in its
    canonical spelling for the model (KvSpec.for_layers)."""
    spec = KvSpec.parse(kv_dtype, "kv_dtype").for_layers(cfg.n_layers)
    check_kv_dtypes(backend, *spec.dtypes)
    check_head_dim(backend, cfg.head_dim)
    for dtype in spec.dtypes:
        KvFormat.get(dtype, cfg.head_dim)
    return spec


def check_context(cfg: ModelConfig, ctx: int, requested: bool, backend, weight_bytes: int,
                  page_size: int = PAGE_SIZE, chunk: int | None = None,
                  kv_dtype="bf16") -> None:
    """Before anything is allocated: a context above the model's trained length is
    warned about (as llama.cpp does); a KV pool that cannot fit in memory is refused
    with the numbers. The pool is allocated for the whole context up front (prefill
    needs every prompt row before SnapKV compacts), so this is the peak. A backend
    with memory of its own (`check_fits`: CUDA, a Vulkan GPU) checks the weights, the pool
    and a prefill chunk's buffers there (and its own limits on a chunk).
    `chunk`: prefill chunk (sliding-window layers hold their window plus one chunk);
    `kv_dtype`: the KV row formats (a KvSpec or its spelling; their real bytes are counted)."""
    spec = KvSpec.parse(kv_dtype)
    kv_bytes = cfg.kv_bytes(ctx, chunk or ctx, page_size, spec)
    check_fits = getattr(backend, "check_fits", None)
    device_checked = False                   # a backend with memory of its own checked it
    if check_fits is not None:
        from .forward import largest_work_buffer, work_bytes
        n = chunk or ctx
        device_checked = check_fits(weight_bytes, kv_bytes, ctx, work_bytes(cfg, n), n, largest_work_buffer(cfg, n))
    what = f"a context of {ctx} tokens" if requested else f"the model's trained context of {ctx} tokens"
    avail = None if device_checked else available_memory_bytes()
    if avail is not None and kv_bytes > avail:
        raise EngineError(f"{what} needs a {_gib(kv_bytes)} {spec.name} KV cache "
                          f"({cfg.kv_bytes_per_token(spec)} bytes per token) but only {_gib(avail)} of memory "
                          f"is available: lower --ctx (SHARPI_CTX, ctx=)")
    if requested and ctx > cfg.context_length:
        notice(f"warning: the context of {ctx} tokens (--ctx) is above the model's trained context of {cfg.context_length} tokens; "
               f"output past {cfg.context_length} tokens is likely to degrade")


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def peak_rss_mib() -> float:
    """This process's peak resident memory in MiB: Linux's VmHWM (/proc/self/status), else
    getrusage's ru_maxrss. On Linux ru_maxrss survives exec, so a program started from a
    large process (llama.cpp's benchmark child of `engine bench`) would report the
    parent's peak at the fork whenever its own is smaller; VmHWM belongs to the new image."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def reset_peak_rss() -> bool:
    """Start this process's peak resident memory afresh (Linux 4.0+: "5" into
    /proc/self/clear_refs sets VmHWM to the current RSS), so peak_rss_mib then measures
    what follows. False where the kernel does not allow it (the peak then keeps counting)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class Model:
    """A loaded GGUF model on one backend."""

    def __init__(self, path, settings: config_mod.Settings, snapkv: SnapKvConfig | bool | None = None):
        """`snapkv`: None = the policy the settings ask for, False = no eviction, or a SnapKvConfig."""
        from backends import get_backend

        if snapkv is not None and snapkv is not False and not isinstance(snapkv, SnapKvConfig):
            raise ConfigError(f"snapkv must be a SnapKvConfig, False or None, got {snapkv!r}")
        path = inputs.model_path(path)
        self.path = str(path)
        self.settings = settings
        self.gguf = GgufFile(path)
        self.config: ModelConfig = model_config(self.gguf)
        self.tokenizer = Tokenizer.from_metadata(self.gguf.metadata)
        self.backend = get_backend(settings.backend, settings.threads)
        # KV row formats of keys and values (backends/kvformat.py), checked against the backend
        self.kv_spec = kv_spec_for(settings.kv_dtype, self.backend, self.config)
        self.ctx = settings.ctx or self.config.context_length   # positions the cache can hold
        chunk = min(settings.prefill_chunk, self.ctx)             # prompt tokens per prefill step
        check_context(self.config, self.ctx, settings.ctx is not None, self.backend,
                      sum(t.raw.nbytes for t in self.gguf.tensors.values()), chunk=chunk,
                      kv_dtype=self.kv_spec)
        if snapkv is None:
            self.snapkv, note = snapkv_from_settings(settings, self.config, self.ctx)
        else:
            self.snapkv, note = (snapkv or None), None
        self.forward = ForwardPass(self.gguf, self.config, self.backend, self.ctx,
                                   chunk=chunk, page_size=PAGE_SIZE, kv_dtype=self.kv_dtype,
                                   replay=settings.decode_replay == "on")
        self.gguf.release_pages()     # the weights are the backend's now: the file's pages need not stay
        self.last_cache: KvCache | None = None
        if note:
            notice(note)

    @property
    def kv_dtype(self) -> str:
        """The model's KV row format: "tq4", "q8_0/tq4" (keys/values), or with layer
        exceptions "rq4_0:0=q8_0/rq4_0"."""
        return self.kv_spec.name

    @property
    def k_dtype(self) -> str:
        """The keys' row format (of the layers kv_dtype names no exception for)."""
        return self.kv_spec.k

    @property
    def v_dtype(self) -> str:
        return self.kv_spec.v

    # -- tokens -----------------------------------------------------------------------
    def tokenize(self, text: str, add_bos: bool | None = None, special: bool = True) -> list[int]:
        return self.tokenizer.encode(inputs.text(text, "text"), add_bos=add_bos, special=special)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(inputs.token_ids(ids, self.config.vocab_size))

    def render_chat(self, prompt) -> str:
        return self.tokenizer.apply_chat_template(inputs.messages(prompt), add_generation_prompt=True)

    def _prompt_ids(self, prompt, chat: bool) -> list[int]:
        """Text, chat messages or token ids -> checked ids (ConfigError for a malformed
        prompt). A chat's content is plain text, special-token text included: only the
        template's markup becomes control tokens (engine/chat_content.py)."""
        if chat:
            ids = self._chat_ids(inputs.messages(prompt))
        elif prompt is None or isinstance(prompt, (str, bytes, bytearray)):
            ids = self.tokenizer.encode(inputs.text(prompt, "prompt"))
        else:
            ids = inputs.token_ids(prompt, self.config.vocab_size, "prompt token ids")
        if not ids:
            raise EngineError("prompt is empty: give at least one token")
        if len(ids) > self.ctx:
            raise EngineError(f"prompt has {len(ids)} tokens but the context is {self.ctx} "
                              f"(raise it with --ctx, up to the model's {self.config.context_length})")
        return ids

    def _chat_ids(self, messages: list[dict]) -> list[int]:
        tok = self.tokenizer
        chat_content.check_fields(tok, messages)
        marked = chat_content.marked_messages(tok, messages)
        text = inputs.text(self.render_chat(messages), "chat prompt")
        if marked is None:
            return tok.encode(text, add_bos=tok.chat_add_bos(text))
        parts = chat_content.content_parts(text, self.render_chat(marked), messages)
        return tok.encode_parts(parts, add_bos=tok.chat_add_bos(text))

    # -- forward ----------------------------------------------------------------------
    def new_cache(self, kv_dtype: str | None = None, pool=None) -> KvCache:
        """An empty cache for the whole context. `kv_dtype`: its row format ("tq4",
        "q8_0/tq4", ...); None = the model's (settings' kv_dtype). `pool`: a shared
        PagePool (`new_pool`) to take pages from; release the cache to return them."""
        return self.forward.new_cache(self.kv_dtype_of(kv_dtype), pool=pool)

    def new_pool(self, tokens: int, kv_dtype: str | None = None):
        """A PagePool for caches to share: the pages of one cache of `tokens` positions."""
        return self.forward.new_pool(tokens, self.kv_dtype_of(kv_dtype))

    def kv_dtype_of(self, kv_dtype: str | None) -> str:
        """The row format a cache of `kv_dtype` gets here ("tq4", "q8_0/tq4"; None = the model's)."""
        if kv_dtype is None:
            return self.forward.kv_dtype
        return kv_spec_for(kv_dtype, self.backend, self.config).name

    def _policy(self, snapkv) -> SnapKvConfig | None:
        """Per-call policy: None = the model's, False = off, a SnapKvConfig = that one."""
        if snapkv is None:
            return self.snapkv
        if snapkv is False:
            return None
        if not isinstance(snapkv, SnapKvConfig):
            raise ConfigError(f"snapkv must be a SnapKvConfig, False or None, got {type(snapkv).__name__}")
        return snapkv

    def prefill(self, prompt, cache: KvCache | None = None, chat: bool = False, snapkv=None,
                compact_continued: bool = False, progress=None, kv_dtype: str | None = None):
        """Run a prompt (text or ids) into `cache` (a fresh one by default, of row format
        `kv_dtype`: None = the model's), then apply the SnapKV policy (see `_policy`).
        Returns (cache, logits f32 [vocab] of the last prompt token). `cache.stats()` /
        `cache_stats()` show what was kept. `progress(done, total)` is called after
        every prefill chunk."""
        return self._prefill(self._prompt_ids(prompt, chat), cache, snapkv, compact_continued, progress,
                             kv_dtype)

    def _prefill(self, ids: list[int], cache: KvCache | None, snapkv, compact_continued: bool, progress=None,
                 kv_dtype: str | None = None):
        """`prefill` for ids already checked by `_prompt_ids`."""
        if cache is not None and not isinstance(cache, KvCache):
            raise ConfigError(f"cache must be a KvCache from this model, got {type(cache).__name__}")
        if cache is not None and kv_dtype is not None:
            raise ConfigError("kv_dtype sets the row format of a new cache: pass it or a cache, not both")
        policy = self._policy(snapkv)
        if cache is None:
            self.last_cache = None    # not held while the new cache's pool is allocated beside it
            cache = self.new_cache(kv_dtype)
        if cache.logical_length + len(ids) > cache.max_rows:
            raise EngineError(f"prompt of {len(ids)} tokens does not fit: the cache holds "
                              f"{cache.logical_length} of {cache.max_rows} positions")
        self.last_cache = None        # an earlier prompt's cache is not held through this one
        logits = self.forward.prefill(ids, cache, snapkv=policy, on_chunk=progress,
                                      compact_continued=compact_continued)
        self.last_cache = cache
        return cache, logits

    def logits(self, ids) -> np.ndarray:
        """f32 [vocab] logits of the last position, computed on a fresh cache."""
        return self.prefill(ids)[1]

    def cache_stats(self, cache: KvCache | None = None) -> dict:
        """Per-layer length, logical length, pages, bytes and last keep sets."""
        cache = cache if cache is not None else self.last_cache
        if cache is None:
            raise EngineError("no cache yet: run prefill or generate first")
        return cache.stats()

    # -- generation ---------------------------------------------------------------------
    def stream(self, prompt, max_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, seed: int | None = None, stop: Sequence[str] = (),
               chat: bool = False, ignore_eos: bool = False, stats: dict | None = None,
               snapkv=None, progress=None, kv_dtype: str | None = None, presence_penalty: float = 0.0,
               frequency_penalty: float = 0.0, logit_bias: dict[int, float] | None = None) -> Iterator[str]:
        """Yield text pieces as they are generated. `stats`, if given, is filled in.
        `snapkv`: None = the model's policy, False = no eviction, or a SnapKvConfig.
        `progress(done, total)`: called after every prefill chunk (prompt tokens).
        `kv_dtype`: the cache's row format ("tq4", "q8_0/tq4", ...); None = the model's.
        `presence_penalty`, `frequency_penalty` (OpenAI's, over the generated tokens) and
        `logit_bias` ({token id: bias}) adjust the logits before sampling."""
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                                top_p=top_p, seed=seed, stop=inputs.stop_strings(stop), ignore_eos=ignore_eos,
                                presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                                logit_bias=inputs.logit_bias(logit_bias, self.config.vocab_size))
        stats = {} if stats is None else stats
        ids = self._prompt_ids(prompt, chat)
        t0 = time.perf_counter()
        cache, logits = self._prefill(ids, None, snapkv, compact_continued=False, progress=progress,
                                      kv_dtype=kv_dtype)
        prefill_s = time.perf_counter() - t0
        stats.update(prompt_tokens=len(ids), prefill_s=prefill_s,
                     prefill_tok_s=len(ids) / prefill_s if prefill_s > 0 else 0.0, snapkv=cache.eviction)
        since = dict(self.forward.decode_counters)
        yield from generate_stream(self, params, cache, logits, stats)
        stats.update(decode_steps=self.forward.decode_stats(since),
                     kv_bytes=cache.bytes, kv_rows=cache.length, kv_dtype=cache.kv_dtype,
                     logical_length=cache.logical_length, peak_rss_mib=peak_rss_mib(),
                     backend=self.backend.name)

    def generate(self, prompt, max_tokens: int = 128, **kwargs) -> GenerationResult:
        stats: dict = {}
        text = "".join(self.stream(prompt, max_tokens=max_tokens, stats=stats, **kwargs))
        tokens = stats.pop("tokens")
        return GenerationResult(tokens=tokens, text=text, finish_reason=stats.pop("finish_reason"),
                                stats=stats)


def load(path=None, backend: str | None = None, ctx: int | None = None, threads: int | None = None,
         settings: config_mod.Settings | None = None, snapkv: SnapKvConfig | bool | None = None,
         **overrides) -> Model:
    """Load a GGUF model (the default model when `path` is None). Keyword arguments
    override environment settings (env < CLI < API): backend, ctx, threads, and any
    Settings field (e.g. snapkv_budget=1024, kv_dtype="tq4"). `snapkv` sets the eviction policy
    outright: a SnapKvConfig, or False for none."""
    path = model_path_or_default(inputs.model_path(path))
    if settings is not None and not isinstance(settings, config_mod.Settings):
        raise ConfigError(f"settings must be an engine.config.Settings, got {type(settings).__name__}")
    for key in overrides.keys() & config_mod.ENV_ONLY:
        raise ConfigError(f"{key} is read from the environment only ({config_mod.ENV_ONLY[key]}): set "
                          f"{config_mod.env_name(key)} before that instead of engine.load({key}=...)")
    api = dict(overrides, backend=backend, ctx=ctx, threads=threads)
    settings = (settings or config_mod.from_env()).with_overrides("argument", **api)
    return Model(path, settings, snapkv=snapkv)


def notice(message: str) -> None:
    print(f"engine: {message}", file=sys.stderr)
