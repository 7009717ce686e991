"""ForwardPass: chunked prefill and single-token decode of a llama-family model
over a Backend, writing post-RoPE K/V into a paged cache (bf16 or quantized rows).

One generic layer graph; architecture differences come from ArchSpec flags
(`qkv_bias`, `rope_neox`, `embed_scale`, `qk_norm`, `post_norms`, `ffn_act`) and
from ModelConfig's per-layer attention windows and RoPE bases (Gemma 3's
sliding-window layers). Intermediates live in named scratch buffers so a
divergence can be dumped layer by layer.
"""
from __future__ import annotations

import contextlib
import math
import threading
import time
from dataclasses import dataclass

import numpy as np
from gguf.quants import dequantize

from backends.kvformat import KvSpec
from backends.reference import read_rows

from .errors import EngineError
from .gguf import GgufFile, ModelConfig
from .kv.merge import merged_rows
from .kv.paged import KvCache, PagePool, layer_pages
from .replay import DecodeReplay, step_ids, step_rows
from .snapkv import SnapKvConfig, SnapKvSelector

CENTRE_ROWS = 256   # keys whose mean centres a layer's quantized keys (ForwardPass._key_centre)
HEAD_ROWS = 16      # prompt rows per output-projection call when every position's logits are
                    # wanted (on_logits): 16 MiB of f32 logits at Gemma 3's 262,144 tokens


@dataclass
class LayerWeights:
    attn_norm: object        # f32 [dim]
    qkv: list                # [(Weight, first_col, last_col)] fused when Q/K/V share a type
    qkv_bias: object | None  # f32 [q_dim + 2*kv_dim]
    attn_output: object      # Weight [dim, q_dim]
    ffn_norm: object         # f32 [dim]
    gate_up: list            # [(Weight, first_col, last_col)] fused when gate/up share a type
    ffn_down: object         # Weight [dim, ffn_dim]
    attn_q_norm: object | None = None          # f32 [head_dim] (qk_norm)
    attn_k_norm: object | None = None          # f32 [head_dim] (qk_norm)
    post_attention_norm: object | None = None  # f32 [dim] (post_norms)
    post_ffw_norm: object | None = None        # f32 [dim] (post_norms)


@dataclass
class ModelWeights:
    token_embd: object       # Weight [vocab, dim]
    output_norm: object      # f32 [dim]
    output: object           # Weight [vocab, dim] (token_embd when tied)
    layers: list[LayerWeights]


def load_weights(g: GgufFile, cfg: ModelConfig, backend) -> ModelWeights:
    """Upload every tensor once; quantized blocks stay quantized. Q/K/V and gate/up
    are stacked into one matrix when they share a quantization type, so decode
    makes one mat-vec instead of three (or two)."""

    def weight(name):
        t = g.tensors[name]
        return backend.load_weight(t.raw, t.qtype, t.shape)

    def host_vector(name):                      # f32 [n] on the host
        t = g.tensors[name]
        return np.ascontiguousarray(dequantize(t.raw, t.qtype).reshape(-1), dtype=np.float32)

    def vector(name):
        return backend.upload(host_vector(name))

    def stacked(names):
        tensors = [g.tensors[n] for n in names]
        bounds = np.cumsum([0] + [t.shape[0] for t in tensors])
        if len({t.qtype for t in tensors}) == 1:
            raw = np.concatenate([t.raw for t in tensors], axis=0)
            w = backend.load_weight(raw, tensors[0].qtype, (int(bounds[-1]), tensors[0].shape[1]))
            return [(w, 0, int(bounds[-1]))]
        return [(weight(n), int(bounds[i]), int(bounds[i + 1])) for i, n in enumerate(names)]

    layers = []
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        bias = None
        if cfg.arch.qkv_bias:
            bias = backend.upload(np.concatenate([host_vector(p + n) for n in cfg.arch.bias_tensors]))
        extra = {}
        if cfg.arch.qk_norm:
            extra.update(attn_q_norm=vector(p + "attn_q_norm.weight"), attn_k_norm=vector(p + "attn_k_norm.weight"))
        if cfg.arch.post_norms:
            extra.update(post_attention_norm=vector(p + "post_attention_norm.weight"),
                         post_ffw_norm=vector(p + "post_ffw_norm.weight"))
        layers.append(LayerWeights(
            attn_norm=vector(p + "attn_norm.weight"),
            qkv=stacked([p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"]),
            qkv_bias=bias,
            attn_output=weight(p + "attn_output.weight"),
            ffn_norm=vector(p + "ffn_norm.weight"),
            gate_up=stacked([p + "ffn_gate.weight", p + "ffn_up.weight"]),
            ffn_down=weight(p + "ffn_down.weight"),
            **extra,
        ))
    embd = weight("token_embd.weight")
    output = embd if cfg.tied_output else weight("output.weight")
    return ModelWeights(embd, vector("output_norm.weight"), output, layers)


def work_bytes(cfg: ModelConfig, n: int) -> int:
    """Bytes of a prefill chunk of n tokens beside the weights and the KV cache: its
    activation buffers (Scratch) and the largest mat-mul result written beside them
    (the stacked gate and up projections)."""
    qkv_cols = cfg.q_dim + 2 * cfg.kv_dim
    floats = n * (3 * cfg.dim + qkv_cols + cfg.q_dim + 3 * cfg.ffn_dim) + cfg.vocab_size
    return 4 * (floats + n * 2 * cfg.ffn_dim)


def mark_interrupted(caches: list, before: list[int], e: BaseException) -> None:
    """A forward step on `caches` (their logical lengths `before` it) failed (an error,
    Ctrl-C): a cache whose first layer took its rows has layers at different positions
    (and on Vulkan the step's recorded writes dropped), which later steps would read as a
    prompt; it is marked interrupted (KvCache.check_usable refuses it until released)."""
    for c, n in zip(caches, before):
        if c.logical_length != n:
            first = str(e).strip().splitlines()[:1]          # (kept to one line: it ends up in a message)
            c.interrupted = f"{type(e).__name__}: {first[0]}" if first else type(e).__name__


def decode_stats_of(c: dict, counts_launches: bool) -> dict:
    """ForwardPass.decode_stats of counters `c` (as decode_counters)."""
    n = c["tokens"]
    return {"tokens": n, "launches_per_token": c["launches"] / n if n and counts_launches else None,
            "host_us_per_token": c["host_s"] * 1e6 / n if n else None,
            "replayed_host_us_per_token": (c["replayed_host_s"] * 1e6 / c["replayed_tokens"]
                                           if c["replayed_tokens"] else None),
            "recordings": c["recordings"], "replays": c["replays"]}


def describe_decode_steps(d: dict) -> str:
    """ForwardPass.decode_stats as one line."""
    launches = "" if d["launches_per_token"] is None else f"{d['launches_per_token']:.1f} launches, "
    steady = d["replayed_host_us_per_token"]
    return (f"{launches}{d['host_us_per_token']:.0f} us before the logits are awaited, a token; "
            f"{d['recordings']} recorded, {d['replays']} replayed"
            + ("" if steady is None else f" ({steady:.0f} us a replayed token)"))


def largest_work_buffer(cfg: ModelConfig, n: int) -> int:
    """Bytes of the largest single buffer of a prefill chunk of n tokens (work_bytes')."""
    return 4 * max(n * 2 * cfg.ffn_dim, n * (cfg.q_dim + 2 * cfg.kv_dim), cfg.vocab_size)


class Scratch:
    """Activation buffers for up to `n` tokens (backend f32 arrays), logits for
    `logits_rows` of them (the last row of a prefill chunk; every row of a batch)."""

    def __init__(self, backend, cfg: ModelConfig, n: int, logits_rows: int = 1):
        a = backend.alloc
        qkv_cols = cfg.q_dim + 2 * cfg.kv_dim
        self.n = n
        self.x = a((n, cfg.dim))              # residual stream
        self.h = a((n, cfg.dim))              # normed input of a sublayer
        self.qkv = a((n, qkv_cols))           # q | k | v, post-RoPE q and k
        self.attn = a((n, cfg.q_dim))         # attention output (pre-projection)
        self.proj = a((n, cfg.dim))           # sublayer output before the residual add
        self.gate_up = a((n, 2 * cfg.ffn_dim))
        self.act = a((n, cfg.ffn_dim))        # act(gate) * up
        self.logits = a((logits_rows, cfg.vocab_size))
        self.ids = a((logits_rows,), np.int32)   # greedy tokens (argmax_rows of the logits)


class WindowCapture:
    """Collects the post-RoPE queries of the last W prompt positions of every
    full-attention layer (the ones SnapKV scores), whichever prefill chunks they fall in."""

    def __init__(self, cfg: ModelConfig, window: int, first_pos: int):
        self.cfg, self.window, self.first_pos = cfg, window, first_pos
        self.q = np.zeros((cfg.n_layers, cfg.n_heads, window, cfg.head_dim), dtype=np.float32)

    def __call__(self, backend, layer: int, q_rows, chunk_pos: int) -> None:
        """q_rows: backend f32 [n, n_heads*head_dim] at positions chunk_pos .. chunk_pos+n-1."""
        lo = max(self.first_pos, chunk_pos)
        hi = min(self.first_pos + self.window, chunk_pos + q_rows.shape[0])
        if lo >= hi:
            return
        rows = backend.download(q_rows[lo - chunk_pos:hi - chunk_pos])        # [m, n_heads*head_dim]
        rows = rows.reshape(hi - lo, self.cfg.n_heads, self.cfg.head_dim).transpose(1, 0, 2)
        self.q[layer, :, lo - self.first_pos:hi - self.first_pos] = rows

    @staticmethod
    def seeded(cfg: ModelConfig, window: int, first_pos: int, cache) -> "WindowCapture | None":
        """A capture of positions first_pos.. whose rows below the cache's logical length
        come from the cache's `tail_queries` (positions a prefill ran earlier); None when
        they do not cover them."""
        capture = WindowCapture(cfg, window, first_pos)
        known = min(cache.logical_length, first_pos + window) - first_pos
        if known <= 0:
            return capture
        if cache.tail_queries is None or cache.eviction is not None:
            return None
        start, q = cache.tail_queries
        if not start <= first_pos or first_pos + known > start + q.shape[2]:
            return None
        capture.q[:, :, :known] = q[:, :, first_pos - start:first_pos - start + known]
        return capture


class ForwardPass:
    """Runs the model on a backend. `prefill` and `decode` advance a KvCache."""

    def __init__(self, g: GgufFile, cfg: ModelConfig, backend, max_ctx: int,
                 chunk: int = 256, page_size: int = 64, kv_dtype: str = "bf16", replay: bool = True):
        self.cfg, self.backend = cfg, backend
        self.max_ctx, self.chunk, self.page_size = max_ctx, chunk, page_size
        self.kv_dtype = kv_dtype              # new caches' row formats (see new_cache)
        self.weights = load_weights(g, cfg, backend)
        self.scale = cfg.attention_scale
        self.embed_scale = math.sqrt(cfg.dim) if cfg.arch.embed_scale else None
        acts = {"silu": backend.silu_gate, "gelu_tanh": backend.gelu_gate}
        if cfg.arch.ffn_act not in acts:
            raise EngineError(f"unknown feed-forward activation '{cfg.arch.ffn_act}' ({', '.join(acts)})")
        self.gate_act = acts[cfg.arch.ffn_act]
        # each layer's RoPE frequency divisors, f32 [rot_dim/2] or None
        self.rope_factors = [None if f is None else np.asarray(f, np.float32)
                             for f in map(cfg.layer_rope_factors, range(cfg.n_layers))]
        self._decode_scratch = Scratch(backend, cfg, 1)
        self._prefill_scratch: Scratch | None = None
        self._batch_scratch: Scratch | None = None   # decode_batch, grown on demand
        self.window_capture: WindowCapture | None = None   # set by a caller (eval, tools): fed by prefill
        # decode steps recorded and replayed (engine/replay.py), where the backend records
        self.replay = DecodeReplay(self) if replay and DecodeReplay.supported(backend) else None
        # decode and decode_batch since load, cumulative: see decode_stats
        self.decode_counters = {"tokens": 0, "launches": 0, "host_s": 0.0, "recordings": 0, "replays": 0,
                                "replayed_tokens": 0, "replayed_host_s": 0.0}
        # the backend's per-thread settings (backends/base.py bind_thread: numba's thread count,
        # cupy's device), made for each thread that runs a step: generate() from a thread pool,
        # a stream() generator consumed on several threads
        self._bind = getattr(backend, "bind_thread", None)
        self._bound_thread = threading.get_ident()

    def _bind_thread(self) -> None:
        if self._bind is not None and threading.get_ident() != self._bound_thread:
            self._bind()
            self._bound_thread = threading.get_ident()

    def new_cache(self, kv_dtype: str | None = None, pool: PagePool | None = None) -> KvCache:
        """A cache for max_ctx positions; sliding-window layers get pages for their
        window plus one prefill chunk only. `kv_dtype`: "bf16", "tq4", "q8_0/tq4"
        (keys/values), "rq4_0:0=q8_0/rq4_0" (layer 0 apart), ... (backends/kvformat.py);
        None = self.kv_dtype. `pool`: take pages from a shared PagePool (see new_pool)
        instead of a pool of its own."""
        c = self.cfg
        return KvCache(self.backend, c.n_layers, c.n_kv_heads, c.head_dim, self.max_ctx, self.page_size,
                       windows=[c.window(i) for i in range(c.n_layers)], max_step=self.chunk,
                       kv=KvSpec.parse(kv_dtype or self.kv_dtype), pool=pool)

    def new_pool(self, tokens: int, kv_dtype: str | None = None) -> PagePool:
        """A page pool for caches to share: for each full-attention layer, the pages of
        `tokens` rows; for each sliding-window layer, its bound once per whole context in
        `tokens` (the caches that can hold their windows at once): a pool split into
        segments (a backend's buffer cap) lends no layer another segment's spare pages."""
        c = self.cfg
        return PagePool(self.backend, self._pool_pages(tokens), c.n_kv_heads, self.page_size, c.head_dim,
                        KvSpec.parse(kv_dtype or self.kv_dtype))

    def _pool_pages(self, tokens: int) -> list[int]:
        """Pages per layer of new_pool(tokens)."""
        c = self.cfg
        caches = max(1, -(-tokens // self.max_ctx))
        return [layer_pages(tokens, self.page_size, c.window(i), self.chunk) * (caches if c.window(i) else 1)
                for i in range(c.n_layers)]

    def pool_bytes(self, tokens: int, kv_dtype: str | None = None) -> int:
        """The bytes new_pool(tokens, kv_dtype) would allocate (nothing is allocated)."""
        spec = KvSpec.parse(kv_dtype or self.kv_dtype)
        return sum(n * self.page_size * self.cfg.kv_row_bytes(*spec.at(i))
                   for i, n in enumerate(self._pool_pages(tokens)))

    # -- public steps -------------------------------------------------------------
    def prefill(self, ids, cache: KvCache, all_logits: bool = False, on_chunk=None,
                snapkv: SnapKvConfig | None = None, compact_continued: bool = False,
                before_evict=None) -> np.ndarray:
        """Run prompt tokens through the model in chunks, appending to `cache`.
        Returns host f32 logits [vocab] of the last token, or [n, vocab] with all_logits.
        `on_chunk(done, total)` reports progress.

        Post-prefill hook: with `snapkv`, the last W post-RoPE queries of every
        full-attention layer are captured (across chunk boundaries), scored against the
        cached keys, and those layers are compacted to their keep sets (sliding-window
        layers hold only their window already and are left as they are). A prompt
        continued from an existing cache is compacted only with `compact_continued`;
        `before_evict` as in prefill_steps."""
        steps = self.prefill_steps(ids, cache, all_logits, snapkv, compact_continued, before_evict=before_evict)
        while True:
            try:
                done, total = next(steps)
            except StopIteration as end:
                return end.value
            if on_chunk:
                on_chunk(done, total)

    def prefill_steps(self, ids, cache: KvCache, all_logits: bool = False,
                      snapkv: SnapKvConfig | None = None, compact_continued: bool = False, on_logits=None,
                      before_evict=None):
        """`prefill` one chunk at a time: a generator that yields (done, total) prompt
        tokens after each chunk and returns the logits (StopIteration.value). Other
        caches may run forward steps between chunks (a server interleaves decode).
        `on_logits(start, logits)`: every prompt position's logits, f32 [rows, vocab] of
        positions start.., HEAD_ROWS rows at a time, handed over and not kept (a
        prompt's logprobs). `before_evict(cache, q_window)`: called with the whole prompt's
        cache and the observation window's queries (f32 [n_layers, n_heads, W, head_dim])
        just before SnapKV compacts it (the server branches it there). A window longer than
        the new tokens reaches back into positions the cache holds: their queries come from
        the cache's `tail_queries`, and without them the prompt is not compacted."""
        ids, vocab = np.asarray(ids), self.cfg.vocab_size
        if ids.size and (ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer)
                         or ids.min() < 0 or ids.max() >= vocab):    # the embedding lookups index unchecked
            raise EngineError(f"prompt token ids must be one-dimensional integers in the vocabulary [0, {vocab})")
        ids = ids.astype(np.int32)
        cache.check_usable()
        if self._prefill_scratch is None:
            self._prefill_scratch = Scratch(self.backend, self.cfg, self.chunk)
        rows_after = cache.length + len(ids)
        evict = (snapkv is not None and (cache.logical_length == 0 or compact_continued)
                 and cache.logical_length + len(ids) >= snapkv.window and snapkv.compacts(rows_after)
                 and bool(cache.full_layers))
        capture = self.window_capture        # set from outside (eval, tools) or None
        if evict:
            check_rescorable(cache)          # before any work: the prompt would run for nothing
            seeded = WindowCapture.seeded(self.cfg, snapkv.window, cache.logical_length + len(ids) - snapkv.window,
                                          cache)
            evict = seeded is not None
            capture = seeded if evict else capture
        out = []
        logits = None
        for start in range(0, len(ids), self.chunk):
            part = ids[start:start + self.chunk]
            s = self._prefill_scratch if len(part) > 1 else self._decode_scratch
            before = [cache.logical_length]
            self._bind_thread()
            try:                             # until the chunk's work is submitted (Vulkan drops a batch
                self._forward(part, [(cache, len(part))], s, capture)          # whose submission fails)
                if all_logits:
                    out.append(self._head(s, len(part), first=0))
                elif on_logits is not None:      # a few rows at a time: vocab-wide rows are large
                    for r0 in range(0, len(part), HEAD_ROWS):
                        logits = self._head(s, min(r0 + HEAD_ROWS, len(part)), first=r0)
                        on_logits(start + r0, logits)
                    logits = logits[-1]
                elif start + self.chunk >= len(ids):
                    logits = self._head(s, len(part))
                self.backend.submit()        # one submission per chunk, none runs for a whole prompt
            except BaseException as e:
                mark_interrupted([cache], before, e)
                raise
            yield min(start + self.chunk, len(ids)), len(ids)
        cache.fold()                         # sliding-window layers back to their ring of pages
        if evict:
            if before_evict is not None:
                before_evict(cache, capture.q)
            self.evict(cache, capture.q, snapkv)
        return np.concatenate(out) if all_logits else logits

    def evict(self, cache: KvCache, q_window: np.ndarray, cfg: SnapKvConfig) -> dict:
        """Score the full-attention layers' rows with the window queries and compact
        them; sliding-window layers are bounded already and stay as they are.
        q_window: f32 [n_layers, n_heads, W, head_dim] (rows of sliding-window layers
        unused). Returns the eviction report (also kept as cache.eviction); its bytes
        and ratio are over everything the cache holds, sliding-window layers included."""
        t0 = time.perf_counter()
        cache.check_usable()
        selector = SnapKvSelector(cfg)
        scored = cache.full_layers
        check_rescorable(cache)
        n_rows = cache.layers[scored[0]].length
        votes = [self.backend.snapkv_votes(q_window[i], cache.layers[i].pool.k_pages, cache.layers[i].page_table(),
                                           n_rows, self.scale, k_dtype=cache.layers[i].pool.k_dtype) for i in scored]
        t_scored = time.perf_counter()
        keeps = selector.keep_from_model_votes(votes, n_rows)
        bytes_before = cache.bytes
        merged = self.merge_evicted(cache, scored, keeps, cfg.merge) if cfg.merge else [None] * len(scored)
        cache.compactions = [cache.layers[i].compact(keep, window=cfg.window, merged=m)
                             for i, keep, m in zip(scored, keeps, merged)]
        t1 = time.perf_counter()
        cache.eviction = {
            "policy": cfg.summary(), "rows_before": n_rows, "rows_after": _mean_rows(cache, scored),
            "layers_compacted": list(scored),
            "bytes_before": bytes_before, "bytes_after": cache.bytes,
            "ratio": bytes_before / max(cache.bytes, 1), "seconds": t1 - t0,
            "scoring_seconds": t_scored - t0,
        }
        return cache.eviction

    def merge_evicted(self, cache: KvCache, layers: list[int], keeps: list[np.ndarray], n_merge: int) -> list:
        """Each layer's merged rows for its keep set (engine/kv/merge.py), from its rows
        read back to the host (each segment of the pool downloaded once)."""
        hosts: dict[int, tuple] = {}
        out = []
        for li, keep in zip(layers, keeps):
            kv, seg = cache.layers[li], cache.pool.segment_index(li)
            if seg not in hosts:
                hosts[seg] = (self.backend.download(kv.pool.k_pages), self.backend.download(kv.pool.v_pages))
            rows = [read_rows(pages, kv.host_table, kv.length, dtype, self.cfg.head_dim)
                    for pages, dtype in zip(hosts[seg], (kv.pool.k_dtype, kv.pool.v_dtype))]
            if not isinstance(keep, list):       # one set per KV head (a list: adaptive head budgets)
                keep = np.broadcast_to(keep, (rows[0].shape[0], keep.shape[-1]))
            out.append(merged_rows(*rows, kv.row_bias, keep, n_merge))
        return out

    def decode(self, token: int, cache: KvCache) -> np.ndarray:
        """One token at position cache.logical_length -> host f32 logits [vocab]."""
        return finite(self._decode_step([token], [cache], self._decode_scratch))[0]

    def decode_argmax(self, token: int, cache: KvCache) -> int:
        """decode, then the logits' argmax (the first of equal maxima): greedy decoding.
        Where the backend has argmax_rows it runs on the device and only the id comes back
        (a GPU backend downloads 4 bytes instead of the vocabulary's logits)."""
        if not hasattr(self.backend, "argmax_rows"):
            return int(np.argmax(self.decode(token, cache)))
        best = int(self._decode_step([token], [cache], self._decode_scratch, True)[0])
        if best < 0:
            raise EngineError(NON_FINITE)
        return best

    def _decode_step(self, tokens, caches: list, s: Scratch, argmax: bool = False):
        """The work of a decode step of caches[i] taking tokens[i] (recorded and replayed
        where the backend can), counted in decode_counters: the host logits [n, vocab], or
        with `argmax` their argmax_rows [n]. A failure until they are downloaded (the
        step's work done) marks a cache a layer of which took its row (mark_interrupted)."""
        counts = self.decode_counters
        launches = getattr(self.backend, "launches", None)
        steady = False
        vocab = self.cfg.vocab_size
        tokens = [int(t) for t in tokens]
        for t in tokens:                     # the embedding lookups index unchecked
            if not 0 <= t < vocab:
                raise EngineError(f"token id {t} is outside the vocabulary [0, {vocab})")
        before = []
        for cache in caches:
            cache.check_usable()
            before.append(cache.logical_length)
        self._bind_thread()
        t0 = time.perf_counter()
        try:
            if self.replay is not None and self.replay.usable(caches):
                out = self.replay.step(tokens, caches, s, argmax)
                steady = self.replay.steady
            else:
                self._forward(np.array(tokens, dtype=np.int32), [(cache, 1) for cache in caches], s)
                out = self._step_output(s, len(caches), argmax)
            host_s = time.perf_counter() - t0            # (issued, not yet awaited)
            counts["host_s"] += host_s
            counts["tokens"] += len(caches)
            if steady:
                counts["replayed_host_s"] += host_s
                counts["replayed_tokens"] += len(caches)
            if launches is not None:
                counts["launches"] += self.backend.launches - launches
            return self.backend.download(out)
        except BaseException as e:
            mark_interrupted(caches, before, e)
            raise

    def _step_output(self, s: Scratch, n: int, argmax: bool):
        """A decode step's head: the logits [n, vocab] of its n rows, or their argmax_rows [n]."""
        logits = self._head_logits(s, n, 0)
        if not argmax:
            return logits
        self.backend.argmax_rows(logits, s.ids[:n])
        return s.ids[:n]

    def decode_stats(self, since: dict | None = None) -> dict:
        """The counters of decode and decode_batch since `since` (a copy of decode_counters
        taken earlier; None: since load): tokens (a batched step's count one each);
        launches_per_token, the kernel launches (CUDA) or dispatches (Vulkan) the host
        issued a token (0 for a replayed step, engine/replay.py; None on backends that
        launch nothing, the CPU); host_us_per_token, the time until a token's
        work was issued, before its logits are awaited (host work alone where launches are
        asynchronous: a CUDA device, Vulkan's fresh and replayed steps; on the CUDA CPU
        harness the device's work too, and on Vulkan a recording step's, whose submission
        is awaited), over every step, recordings included; replayed_host_us_per_token,
        the same over replayed steps alone but each recording's first replay (which
        captures the CUDA graph): the steady state, None without such steps; recordings
        and replays."""
        c = {k: v - (since or {}).get(k, 0) for k, v in self.decode_counters.items()}
        return decode_stats_of(c, self.counts_launches)

    @contextlib.contextmanager
    def without_replay(self):
        """Decode steps inside launch every kernel from Python (no replay). Yields a dict
        that holds, on exit, the counters those steps added; decode_counters and the
        replay are left as they were before."""
        replay, before = self.replay, dict(self.decode_counters)
        added: dict = {}
        self.replay = None
        try:
            yield added
        finally:
            self.replay = replay
            added.update({k: v - before[k] for k, v in self.decode_counters.items()})
            self.decode_counters.update(before)

    @property
    def counts_launches(self) -> bool:
        """Whether the backend counts the kernel launches or dispatches it issues."""
        return getattr(self.backend, "launches", None) is not None

    def decode_batch(self, tokens, caches: list[KvCache], argmax: bool = False) -> np.ndarray:
        """One decode step of several sequences at once: token i at position
        caches[i].logical_length -> host f32 logits [n, vocab], or with `argmax` each
        row's argmax (the first of equal maxima), int64 [n]: a batch of greedy sequences,
        for which a backend with argmax_rows sends back n ids instead of n rows of logits.
        The weights run once over all n rows; attention runs over each cache's own pages
        (caches may differ in length, compaction and row format)."""
        n = len(caches)
        self._check_batch(tokens, caches)
        if n == 1:
            if argmax:
                return np.array([self.decode_argmax(int(tokens[0]), caches[0])])
            return self.decode(int(tokens[0]), caches[0])[None]
        if not argmax or not hasattr(self.backend, "argmax_rows"):
            logits = finite(self._decode_step(tokens, caches, self._batch(n)))
            return np.argmax(logits, axis=1) if argmax else logits
        best = self._decode_step(tokens, caches, self._batch(n), True).astype(np.int64)
        if (best < 0).any():
            raise EngineError(NON_FINITE)
        return best

    def _check_batch(self, tokens, caches: list) -> None:
        n = len(caches)
        if n != len(tokens) or n == 0:
            raise ValueError(f"decode_batch: {len(tokens)} tokens for {n} caches")
        if len({id(c) for c in caches}) != n:
            raise ValueError("decode_batch: a cache appears twice")

    def _batch(self, n: int) -> Scratch:
        """The scratch of batched decode steps, grown to n rows (at least 8)."""
        if self._batch_scratch is None or self._batch_scratch.n < n:
            self._batch_scratch = Scratch(self.backend, self.cfg, max(n, 8), logits_rows=max(n, 8))
        return self._batch_scratch

    # -- the layer graph ------------------------------------------------------------
    def _forward(self, ids: np.ndarray, spans: list, s: Scratch, capture=None, step: bool = False) -> None:
        """ids int32 [n]; spans [(KvCache, rows)]: each cache takes the next `rows` of
        the n tokens, at its own positions (a prefill chunk: one cache, n rows; a
        batched decode step: n caches, one row each). Every weight runs once over the
        n rows; RoPE, K/V writes and attention per cache. `capture`: a WindowCapture
        fed with the full-attention layers' queries (prefill of one cache). `step`: a
        decode step being recorded (engine/replay.py): the tokens, their positions and
        each layer's rows go to the ops as StepValues / StepValue (their slots:
        engine/replay.py)."""
        b, c, w = self.backend, self.cfg, self.weights
        n = len(ids)
        x, h, qkv, attn = s.x[:n], s.h[:n], s.qkv[:n], s.attn[:n]
        proj, gate_up, act = s.proj[:n], s.gate_up[:n], s.act[:n]
        q_end, k_end = c.q_dim, c.q_dim + c.kv_dim
        rows, lo = [], 0                     # (cache, first row, end row) in the n rows
        for cache, m in spans:
            rows.append((cache, lo, lo + m))
            lo += m
        positions = np.concatenate([np.arange(cache.logical_length, cache.logical_length + (hi - lo))
                                    for cache, lo, hi in rows]).astype(np.int32)
        for cache, lo, hi in rows:           # pages first: a full cache or pool fails before any write
            for kv in cache.layers:
                kv.reserve(hi - lo)
        if step:
            ids, positions = step_ids(ids, positions)
        b.embedding(w.token_embd, ids, x)
        if self.embed_scale is not None:
            b.scale(x, self.embed_scale, x)
        residual = None                      # the last block's output, not yet added into x
        for li, lw in enumerate(w.layers):
            window = c.window(li)            # 0: full attention; else the last `window` positions
            # attention block
            self._add_norm(x, residual, lw.attn_norm, h)
            for wt, lo, hi in lw.qkv:
                b.matmul(wt, h, qkv[:, lo:hi], None if lw.qkv_bias is None else lw.qkv_bias[lo:hi])
            if lw.attn_q_norm is not None:   # per-head norm: weight [head_dim] over each head
                b.rms_norm(qkv[:, :q_end], lw.attn_q_norm, c.norm_eps, qkv[:, :q_end])
                b.rms_norm(qkv[:, q_end:k_end], lw.attn_k_norm, c.norm_eps, qkv[:, q_end:k_end])
            # a decode step's RoPE goes into each cache's K/V write where the backend fuses them
            fused = capture is None and n == len(rows) and all(self._fuses_rope(r[0], li, step) for r in rows)
            if not fused:
                b.rope(qkv[:, :k_end], positions, c.n_heads + c.n_kv_heads, c.head_dim, c.rot_dim,
                       c.layer_rope_base(li), c.arch.rope_neox, self.rope_factors[li])
            for i, (cache, lo, hi) in enumerate(rows):
                self._attend(cache, li, window, qkv[lo:hi], attn[lo:hi], capture, (i, n) if step else None,
                             positions[lo:hi] if fused else None)
            b.matmul(lw.attn_output, attn, proj)
            if lw.post_attention_norm is not None:
                b.rms_norm(proj, lw.post_attention_norm, c.norm_eps, proj)
            # feed-forward block
            self._add_norm(x, proj, lw.ffn_norm, h)
            for wt, lo, hi in lw.gate_up:
                b.matmul(wt, h, gate_up[:, lo:hi])
            if hasattr(b, "gated_matmul"):  # the gate inside the down projection: a launch less
                b.gated_matmul(lw.ffn_down, gate_up, proj, c.arch.ffn_act, act)
            else:
                self.gate_act(gate_up[:, :c.ffn_dim], gate_up[:, c.ffn_dim:], act)
                b.matmul(lw.ffn_down, act, proj)
            if lw.post_ffw_norm is not None:
                b.rms_norm(proj, lw.post_ffw_norm, c.norm_eps, proj)
            residual = proj
        if residual is not None:
            b.add(x, residual, x)

    def _add_norm(self, x, r, weight, h) -> None:
        """x += r (r None: nothing to add), then h = rms_norm(x) * weight: one call where
        the backend has add_rms_norm (a dispatch saved per residual on a GPU backend)."""
        b, eps = self.backend, self.cfg.norm_eps
        if r is None:
            b.rms_norm(x, weight, eps, h)
        elif hasattr(b, "add_rms_norm"):
            b.add_rms_norm(x, r, weight, eps, h)
        else:
            b.add(x, r, x)
            b.rms_norm(x, weight, eps, h)

    def _fuses_rope(self, cache: KvCache, li: int, step: bool) -> bool:
        """Whether _attend can write cache's rows of layer li with the backend's
        rope_kv_write (RoPE, the keys' centre and the K/V write in one op): a key format it
        fuses, one row count for every KV head, and no centre to set from the rotated keys."""
        kv = cache.layers[li]
        return (kv.pool.k_dtype in getattr(self.backend, "rope_write_keys", ()) and not kv.ragged
                and (kv.pool.k_dtype == "bf16" or kv.logical_length > 0 or step))

    def _attend(self, cache: KvCache, li: int, window: int, qkv, attn, capture, step: tuple | None = None,
                positions=None) -> None:
        """One cache's rows of layer li: write their K/V, attend (queries see the
        cache's earlier rows and their own), advance the layer. `step`: (i, n), the cache
        is sequence i of a recorded step of n (_forward's step). `positions`: the rows'
        positions when RoPE is left to this call, fused into the write (_fuses_rope)."""
        b, c = self.backend, self.cfg
        q_end, k_end = c.q_dim, c.q_dim + c.kv_dim
        n = qkv.shape[0]
        kv = cache.layers[li]
        dtypes = {"k_dtype": kv.pool.k_dtype, "v_dtype": kv.pool.v_dtype}   # the layer's row formats
        if capture is not None and not window:
            capture(b, li, qkv[:, :q_end], kv.logical_length)
        if positions is None:
            centre = self._key_centre(kv, qkv[:, q_end:k_end], kv.pool.k_dtype, step is None)
            if centre is not None:
                b.add(qkv[:, q_end:k_end], centre, qkv[:, q_end:k_end])
        if kv.ragged:
            self._attend_heads(kv, qkv, attn, dtypes)
            kv.advance(n)
            return
        start_row = kv.length
        n_rows = start_row + 1
        if step is not None:                 # read from the step buffer when replayed
            start_row, n_rows = step_rows(start_row, li, *step)
        table = kv.page_table()
        pages = kv.pool                      # the layer's segment of the pool
        if positions is None:
            b.kv_write(pages.k_pages, pages.v_pages, table, qkv[:, q_end:k_end],
                       qkv[:, k_end:], start_row, **dtypes)
        else:
            b.rope_kv_write(qkv, positions, c.n_heads, c.rot_dim, c.layer_rope_base(li), c.arch.rope_neox,
                            self.rope_factors[li], pages.k_pages, pages.v_pages, table, start_row,
                            centre=kv.key_centre, **dtypes)
        if kv.row_bias is not None:          # merged rows after a compaction (engine/kv/merge.py)
            dtypes["row_bias"] = kv.bias()
        if n == 1:
            b.attention_decode(qkv[:, :q_end], pages.k_pages, pages.v_pages, table,
                               n_rows, c.n_heads, self.scale, attn, window=window, **dtypes)
        else:
            b.attention_prefill(qkv[:, :q_end], pages.k_pages, pages.v_pages, table,
                                start_row, c.n_heads, self.scale, attn, window=window, **dtypes)
        kv.advance(n)                        # a sliding-window layer returns pages it no longer needs

    def _key_centre(self, kv, k, k_dtype: str, may_read: bool):
        """Quantized keys are stored minus their layer's centre mu, the mean of the first
        CENTRE_ROWS keys the layer was given (per KV head and channel, after RoPE). Every
        score of a query then moves by the same q . mu, so no softmax changes (attention,
        SnapKV's votes) and merged rows' means stay means, while the quantizer no longer
        sees the large constant offsets some channels carry (Qwen2.5: docs/kv-formats.md).
        mu is set by the write into an empty layer outside a recorded step (which cannot
        read the keys back: such a layer stays uncentred) and kept until the layer is
        empty again; bf16 keys are stored as they are. -> the device row -mu [1, kv_dim]
        to add to the keys, or None."""
        if k_dtype == "bf16":
            return None
        if kv.logical_length == 0 and may_read:
            first = self.backend.download(k[:CENTRE_ROWS]).astype(np.float64)
            kv.key_centre = self.backend.upload(-first.mean(axis=0, keepdims=True).astype(np.float32))
            kv.centre_rows = first.shape[0]
        return kv.key_centre

    def _attend_heads(self, kv, qkv, attn, dtypes: dict) -> None:
        """_attend's writes and attention for a layer with ragged heads (adaptive head
        budgets): each KV head over its own rows, as a one-head cache (the segment's head
        view and the head's table), with its query heads' columns of q and the output; a
        decode step in one call of each op where the backend has the one-call ops
        (Backend's optional kv_write_heads, attention_decode_heads)."""
        b, c = self.backend, self.cfg
        D, G = c.head_dim, c.n_heads // c.n_kv_heads
        k0, v0 = c.q_dim, c.q_dim + c.kv_dim
        k_pages, v_pages = kv.pool.head_view()
        if qkv.shape[0] == 1 and hasattr(b, "attention_decode_heads"):    # one call for every head
            tables, starts = kv.head_tables(), kv.head_len
            b.kv_write_heads(k_pages, v_pages, tables, qkv[:, k0:v0], qkv[:, v0:v0 + c.kv_dim], starts, **dtypes)
            b.attention_decode_heads(qkv[:, :k0], k_pages, v_pages, tables, starts + 1, c.n_heads, self.scale,
                                     attn, row_bias=kv.bias(), **dtypes)
            return
        for h in range(c.n_kv_heads):
            table, start_row, bias = kv.head_table(h), int(kv.head_len[h]), kv.head_bias(h)
            b.kv_write(k_pages, v_pages, table, qkv[:, k0 + h * D:k0 + (h + 1) * D],
                       qkv[:, v0 + h * D:v0 + (h + 1) * D], start_row, **dtypes)
            q, out = qkv[:, h * G * D:(h + 1) * G * D], attn[:, h * G * D:(h + 1) * G * D]
            if qkv.shape[0] == 1:
                b.attention_decode(q, k_pages, v_pages, table, start_row + 1, G, self.scale, out,
                                   row_bias=bias, **dtypes)
            else:
                b.attention_prefill(q, k_pages, v_pages, table, start_row, G, self.scale, out,
                                    row_bias=bias, **dtypes)

    def _head(self, s: Scratch, n: int, first: int | None = None) -> np.ndarray:
        """Final norm + output projection: logits f32 [vocab] of row n-1, or [n - first,
        vocab] of rows first .. n-1, into the scratch's logits when they have room."""
        all_rows = first is not None
        out = finite(self.backend.download(self._head_logits(s, n, n - 1 if first is None else first)))
        return out if all_rows else out[0]

    def _head_logits(self, s: Scratch, n: int, first: int):
        """_head's ops: the backend array of logits [n - first, vocab]."""
        b, w = self.backend, self.weights
        h = s.h[first:n]
        b.rms_norm(s.x[first:n], w.output_norm, self.cfg.norm_eps, h)
        rows = n - first
        logits = s.logits[:rows] if s.logits.shape[0] >= rows else b.alloc((rows, self.cfg.vocab_size))
        b.matmul(w.output, h, logits)
        return logits


def _mean_rows(cache: KvCache, layers) -> int:
    """Rows a KV head attends to after compaction, averaged over the compacted layers and
    their heads (every layer's own budget with pyramid, every head's with adaptive)."""
    rows = [cache.layers[i].head_rows if cache.layers[i].head_rows is not None
            else [cache.layers[i].length] * cache.layers[i].pool.n_kv_heads for i in layers]
    return int(round(float(np.mean(np.concatenate([np.asarray(r, dtype=np.float64) for r in rows])))))


def check_rescorable(cache: KvCache) -> None:
    """EngineError unless SnapKV can score the cache's full-attention layers again: their
    rows must be one count shared by every layer and KV head (not after pyramid or
    adaptive budgets), and none a merged row (votes would not weigh what it stands for)."""
    layers = [cache.layers[i] for i in cache.full_layers]
    if any(l.ragged for l in layers) or len({l.length for l in layers}) > 1:
        raise EngineError("a cache compacted with pyramid or adaptive budgets cannot be compacted again "
                          "(its layers or KV heads hold different row counts)")
    if any(l.row_bias is not None for l in layers):
        raise EngineError("a cache holding merged rows (--kv-merge) cannot be compacted again "
                          "(the votes would not weigh the rows each merged row stands for)")


NON_FINITE = ("the model produced non-finite logits (NaN or Inf): its weights hold non-finite or "
              "out-of-range values (corrupt or mislabelled tensors)")


def finite(logits: np.ndarray) -> np.ndarray:
    """Logits as they are, or an EngineError when any is NaN or infinite: weights that
    hold non-finite values (a corrupt file) would otherwise decode to silent garbage."""
    if not np.isfinite(logits).all():
        raise EngineError(NON_FINITE)
    return logits
