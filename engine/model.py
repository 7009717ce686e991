"""The public Model: load a GGUF, tokenize, run prefill, inspect the cache, generate."""
from __future__ import annotations

import resource
import sys
import time
from typing import Iterator, Sequence

import numpy as np

from . import config as config_mod
from .errors import EngineError
from .forward import ForwardPass
from .generate import GenerationResult, SamplingParams, generate_stream
from .gguf import GgufFile, ModelConfig, model_config
from .kv.paged import KvCache
from .model_path import model_path_or_default
from .snapkv import SnapKvConfig
from .tokenizer import Tokenizer

AUTO_BUDGET = 2048   # budget the auto policy turns on with


def snapkv_from_settings(s: config_mod.Settings, cfg: ModelConfig, ctx: int) -> tuple[SnapKvConfig | None, str | None]:
    """The eviction policy the settings ask for, and a notice when auto-on fired.
    Budget N > 0: on; 0: off (auto included); unset: on with AUTO_BUDGET when the
    bf16 KV ring for `ctx` exceeds snapkv_auto_mib."""
    budget, notice = s.snapkv_budget, None
    if budget is None:
        ring_mib = cfg.kv_bytes_per_token() * ctx / 2**20
        if ring_mib <= s.snapkv_auto_mib:
            return None, None
        budget = AUTO_BUDGET
        notice = (f"SnapKV auto-on: the bf16 KV cache for {ctx} tokens would take {ring_mib:.0f} MiB "
                  f"(> SHARPI_SNAPKV_AUTO_MIB={s.snapkv_auto_mib}); evicting to {budget} rows per layer "
                  f"after prefill (SHARPI_SNAPKV_BUDGET=0 turns this off)")
    if budget == 0:
        return None, None
    return SnapKvConfig(budget=budget, window=s.snapkv_window, sinks=s.snapkv_sinks, recency=s.snapkv_recency,
                        kernel=s.snapkv_kernel, pool=s.snapkv_pool, granularity=s.snapkv_granularity,
                        min_tokens=s.snapkv_min_tokens), notice


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


class Model:
    """A loaded GGUF model on one backend."""

    def __init__(self, path, settings: config_mod.Settings, snapkv: SnapKvConfig | None = None):
        from backends import get_backend

        self.path = str(path)
        self.settings = settings
        self.gguf = GgufFile(path)
        self.config: ModelConfig = model_config(self.gguf)
        self.tokenizer = Tokenizer.from_metadata(self.gguf.metadata)
        self.backend = get_backend(settings.backend, settings.threads)
        self.ctx = settings.ctx or self.config.context_length   # positions the cache can hold
        self.forward = ForwardPass(self.gguf, self.config, self.backend, self.ctx,
                                   chunk=settings.prefill_chunk)
        self.last_cache: KvCache | None = None
        if snapkv is not None:
            self.snapkv, note = snapkv, None
        else:
            self.snapkv, note = snapkv_from_settings(settings, self.config, self.ctx)
        if note:
            notice(note)

    # -- tokens -----------------------------------------------------------------------
    def tokenize(self, text: str, add_bos: bool | None = None, special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_bos=add_bos, special=special)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def render_chat(self, prompt) -> str:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def _prompt_ids(self, prompt, chat: bool) -> list[int]:
        if chat:
            prompt = self.render_chat(prompt)
        if isinstance(prompt, str):
            ids = self.tokenize(prompt)
        else:
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
            if bad:
                raise EngineError(f"token id {bad[0]} out of range for vocabulary of {self.config.vocab_size}")
        if not ids:
            raise EngineError("prompt is empty: give at least one token")
        if len(ids) > self.ctx:
            raise EngineError(f"prompt has {len(ids)} tokens but the context is {self.ctx} "
                              f"(raise it with --ctx, up to the model's {self.config.context_length})")
        return ids

    # -- forward ----------------------------------------------------------------------
    def new_cache(self) -> KvCache:
        return self.forward.new_cache()

    def _policy(self, snapkv) -> SnapKvConfig | None:
        """Per-call policy: None = the model's, False = off, a SnapKvConfig = that one."""
        if snapkv is None:
            return self.snapkv
        if snapkv is False:
            return None
        if not isinstance(snapkv, SnapKvConfig):
            raise EngineError(f"snapkv must be a SnapKvConfig, False or None, got {type(snapkv).__name__}")
        return snapkv

    def prefill(self, prompt, cache: KvCache | None = None, chat: bool = False, snapkv=None,
                compact_continued: bool = False):
        """Run a prompt (text or ids) into `cache` (a fresh one by default), then apply
        the SnapKV policy (see `_policy`). Returns (cache, logits f32 [vocab] of the
        last prompt token). `cache.stats()` / `cache_stats()` show what was kept."""
        return self._prefill(self._prompt_ids(prompt, chat), cache, snapkv, compact_continued)

    def _prefill(self, ids: list[int], cache: KvCache | None, snapkv, compact_continued: bool):
        """`prefill` for ids already checked by `_prompt_ids`."""
        cache = cache if cache is not None else self.new_cache()
        if cache.logical_length + len(ids) > cache.max_rows:
            raise EngineError(f"prompt of {len(ids)} tokens does not fit: the cache holds "
                              f"{cache.logical_length} of {cache.max_rows} positions")
        logits = self.forward.prefill(ids, cache, snapkv=self._policy(snapkv),
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
               snapkv=None) -> Iterator[str]:
        """Yield text pieces as they are generated. `stats`, if given, is filled in.
        `snapkv`: None = the model's policy, False = no eviction, or a SnapKvConfig."""
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                                top_p=top_p, seed=seed, stop=tuple(stop), ignore_eos=ignore_eos)
        stats = {} if stats is None else stats
        ids = self._prompt_ids(prompt, chat)
        t0 = time.perf_counter()
        cache, logits = self._prefill(ids, None, snapkv, compact_continued=False)
        prefill_s = time.perf_counter() - t0
        stats.update(prompt_tokens=len(ids), prefill_s=prefill_s,
                     prefill_tok_s=len(ids) / prefill_s if prefill_s > 0 else 0.0, snapkv=cache.eviction)
        yield from generate_stream(self, params, cache, logits, stats)
        stats.update(kv_bytes=cache.bytes, kv_rows=cache.length,
                     logical_length=cache.logical_length, peak_rss_mib=peak_rss_mib(),
                     backend=self.backend.name)

    def generate(self, prompt, max_tokens: int = 128, **kwargs) -> GenerationResult:
        stats: dict = {}
        text = "".join(self.stream(prompt, max_tokens=max_tokens, stats=stats, **kwargs))
        tokens = stats.pop("tokens")
        return GenerationResult(tokens=tokens, text=text, finish_reason=stats.pop("finish_reason"),
                                stats=stats)


def load(path=None, backend: str | None = None, ctx: int | None = None, threads: int | None = None,
         settings: config_mod.Settings | None = None, snapkv: SnapKvConfig | None = None,
         **overrides) -> Model:
    """Load a GGUF model (the default model when `path` is None). Keyword arguments
    override environment settings (env < CLI < API): backend, ctx, threads, and any
    Settings field (e.g. snapkv_budget=1024). `snapkv` sets the eviction policy
    outright."""
    path = model_path_or_default(path)
    api = dict(overrides, backend=backend, ctx=ctx, threads=threads)
    settings = (settings or config_mod.from_env()).with_overrides("argument", **api)
    return Model(path, settings, snapkv=snapkv)


def notice(message: str) -> None:
    print(f"engine: {message}", file=sys.stderr)
