"""GGUF metadata + ArchSpec -> ModelConfig, with every expected tensor checked."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np
from gguf.quants import dequantize

from backends.kvformat import KvFormat, KvSpec
from models import ArchSpec, get_arch

from ..errors import ModelFileError, UnsupportedError, cut
from .reader import GgufFile


@dataclass(frozen=True)
class ModelConfig:
    arch: ArchSpec
    n_layers: int
    dim: int            # residual width
    ffn_dim: int
    n_heads: int        # query heads
    n_kv_heads: int
    head_dim: int
    rot_dim: int        # rotated dims per head (<= head_dim)
    rope_base: float
    norm_eps: float
    context_length: int
    vocab_size: int
    tied_output: bool   # output head is token_embd.weight
    # RoPE: pair i turns by pos * rope_base^(-2i/rot_dim) / rope_freq_factors[i]; None = all 1.
    # From Llama 3.1+'s `rope_freqs.weight` and/or linear scaling (rope.scaling.factor).
    rope_freq_factors: tuple[float, ...] | None = None
    # Sliding-window attention (Gemma 3): `<arch>.attention.sliding_window` (0 = none) and,
    # per layer, the positions it attends to: 0 = the whole context (a global layer),
    # sliding_window for the local layers of the spec's swa_pattern. Empty = all global.
    sliding_window: int = 0
    layer_windows: tuple[int, ...] = ()
    rope_base_local: float | None = None   # RoPE base of sliding-window layers (None: rope_base)

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def window(self, layer: int) -> int:
        """Positions layer `layer` attends to (its own included); 0 = all of them."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def layer_rope_base(self, layer: int) -> float:
        if self.window(layer) and self.rope_base_local is not None:
            return self.rope_base_local
        return self.rope_base

    def layer_rope_factors(self, layer: int) -> tuple[float, ...] | None:
        """A layer's RoPE frequency divisors: the model's, but none on the sliding-window
        layers of an architecture whose local layers have a RoPE of their own (Gemma 3:
        its 4B+ files scale the global layers' RoPE x8, the local layers' not at all, as
        in llama.cpp and HF)."""
        if self.window(layer) and self.rope_base_local is not None:
            return None
        return self.rope_freq_factors

    @property
    def attention_scale(self) -> float:
        """The scale of the attention scores: 1/sqrt(head_dim), except Gemma 3 27B's
        1/sqrt(dim / n_heads) (HF's query_pre_attn_scalar 168, which GGUF files do not
        carry; llama.cpp tells the 27B by its 62 layers, as here)."""
        if self.arch.name == "gemma3" and self.n_layers == 62:
            return 1.0 / math.sqrt(self.dim / self.n_heads)
        return 1.0 / math.sqrt(self.head_dim)

    @property
    def n_global_layers(self) -> int:
        """Layers that attend to (and hold) every position."""
        return sum(1 for i in range(self.n_layers) if not self.window(i))

    def kv_row_bytes(self, k_dtype: str = "bf16", v_dtype: str = "bf16") -> int:
        """K and V bytes of one position in one layer, every KV head, in the given row
        formats (backends/kvformat.py; quantized rows' scales included)."""
        return self.n_kv_heads * (KvFormat.get(k_dtype, self.head_dim).row_bytes
                                  + KvFormat.get(v_dtype, self.head_dim).row_bytes)

    def kv_bytes_per_token(self, kv_dtype="bf16") -> int:
        """K and V bytes for one position across the layers that hold every position
        (sliding-window layers hold a bounded window instead; see kv_bytes), rows in the
        formats of `kv_dtype` (a KvSpec or its spelling: "tq4", "q8_0/tq4", "rq4_0:0=q8_0")."""
        spec = KvSpec.parse(kv_dtype)
        return sum(self.kv_row_bytes(*spec.at(i)) for i in range(self.n_layers) if not self.window(i))

    def kv_bytes(self, ctx: int, chunk: int, page_size: int, kv_dtype="bf16") -> int:
        """Bytes of the KV page pool for a context of `ctx` positions prefilled in steps
        of up to `chunk` tokens, rows in the formats of `kv_dtype`: what KvCache
        allocates and can hold at most."""
        from ..kv.paged import layer_pages
        spec = KvSpec.parse(kv_dtype)
        return sum(layer_pages(ctx, page_size, self.window(i), chunk) * page_size * self.kv_row_bytes(*spec.at(i))
                   for i in range(self.n_layers))


# Sanity bounds on metadata values (beyond them a file is corrupt, not just large).
MAX_LAYERS = 4096
MAX_WIDTH = 2**20               # embedding, feed-forward width
MAX_HEAD_DIM = 4096
MAX_CONTEXT = 2**26             # 67M positions; Llama 4 Scout's 10M fits, a corrupt 2^32-1 does not
MAX_ROPE_FACTOR = 2.0**20       # a frequency divisor (Llama 3.1's reach 8; linear scalings 2-64)
_REQUIRED = object()


class _Metadata:
    """Typed reads of architecture keys; every bad value is collected as one problem."""

    def __init__(self, g: GgufFile):
        self.g, self.problems = g, []

    def _raw(self, suffix, default):
        value = self.g.arch_key(suffix, default)
        if value is _REQUIRED:
            self.problems.append(f"metadata lacks {self.g.architecture}.{suffix}")
        return value

    def int(self, suffix: str, default=_REQUIRED, lo: int = 1, hi: int = 2**31 - 1) -> int | None:
        """An integer key in [lo, hi]; None (and a problem noted) when it is not."""
        value = self._raw(suffix, default)
        if value is _REQUIRED:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            self.problems.append(f"{self.g.architecture}.{suffix} is {_kind(value)}, expected an integer")
            return None
        if not lo <= value <= hi:
            self.problems.append(f"{self.g.architecture}.{suffix} is {value}, expected {lo}..{hi}")
            return None
        return value

    def float(self, suffix: str, default: float, lo: float, hi: float) -> float | None:
        """A finite number in the open interval (lo, hi); None (and a problem noted) when it is not."""
        value = self._raw(suffix, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.problems.append(f"{self.g.architecture}.{suffix} is {_kind(value)}, expected a number")
            return None
        if not (math.isfinite(value) and lo < value < hi):
            self.problems.append(f"{self.g.architecture}.{suffix} is {value}, expected a finite number "
                                 f"above {lo:g} and below {hi:g}")
            return None
        return float(value)


def _kind(value) -> str:
    """How a metadata value of the wrong type is described: "a string ('30')"."""
    names = {str: "a string", float: "a float", bool: "a bool", list: "an array", type(None): "a nested array"}
    text = repr(value)
    return f"{names.get(type(value), type(value).__name__)} ({cut(text, 40)})"


def model_config(g: GgufFile) -> ModelConfig:
    """Read hyperparameters, check each against sane bounds and the others, then
    verify every tensor the forward pass needs against them; all problems are
    reported in one error, before anything is allocated."""
    spec = get_arch(g.architecture)
    m = _Metadata(g)
    # A value that fails its check is None; checks that depend on it are skipped.
    n_layers = m.int("block_count", hi=MAX_LAYERS)
    dim = m.int("embedding_length", hi=MAX_WIDTH)
    ffn_dim = m.int("feed_forward_length", hi=MAX_WIDTH)
    n_heads = m.int("attention.head_count", hi=dim or MAX_WIDTH)
    n_kv_heads = m.int("attention.head_count_kv", n_heads or 1, hi=n_heads or MAX_WIDTH)
    head_dim = m.int("attention.key_length", max((dim or 1) // (n_heads or 1), 1), hi=MAX_HEAD_DIM)
    value_dim = m.int("attention.value_length", head_dim or 1, hi=MAX_HEAD_DIM)
    rot_dim = m.int("rope.dimension_count", head_dim or 2, hi=head_dim or MAX_HEAD_DIM)
    rope_base = m.float("rope.freq_base", spec.default_rope_base, 1.0, 1e12)
    norm_eps = m.float("attention.layer_norm_rms_epsilon", 1e-5, 0.0, 1.0)
    context_length = m.int("context_length", 2048, hi=MAX_CONTEXT)
    # As llama.cpp: a spec with a sliding-window pattern uses it when the file names a
    # window (> 0); without one every layer is global.
    sliding_window = m.int("attention.sliding_window", 0, lo=0, hi=MAX_CONTEXT) if spec.swa_pattern else 0
    softcap = g.arch_key("final_logit_softcapping", 0.0)
    if softcap not in (None, 0, 0.0):
        m.problems.append(f"{g.architecture}.final_logit_softcapping is {softcap!r}: "
                          f"logit soft-capping is not supported")
    if n_heads and n_kv_heads and n_heads % n_kv_heads:
        m.problems.append(f"{n_heads} query heads cannot be grouped over {n_kv_heads} KV heads")
    if head_dim and value_dim and value_dim != head_dim:
        m.problems.append(f"{g.architecture}.attention.value_length is {value_dim} but key_length is "
                          f"{head_dim}: K and V heads of different widths are not supported")
    if rot_dim and rot_dim % 2:
        m.problems.append(f"{g.architecture}.rope.dimension_count is {rot_dim}, expected an even number")
    blocks = _blocks_in_file(g)
    if n_layers is not None and blocks != n_layers:
        m.problems.append(f"{g.architecture}.block_count is {n_layers} but the file holds tensors "
                          f"for {blocks} blocks")
    embd = g.tensors.get("token_embd.weight")
    vocab = embd.shape[0] if embd is not None else (m.int("vocab_size", 1) or 1)
    tokens = g.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list) and embd is not None and len(tokens) != vocab:
        m.problems.append(f"the tokenizer has {len(tokens)} tokens but token_embd.weight has {vocab} rows")
    if m.problems:
        _raise(g, f"{g.path} holds invalid model metadata", m.problems)
    cfg = ModelConfig(
        arch=spec, n_layers=n_layers, dim=dim, ffn_dim=ffn_dim, n_heads=n_heads,
        n_kv_heads=n_kv_heads, head_dim=head_dim, rot_dim=rot_dim, rope_base=rope_base,
        norm_eps=norm_eps, context_length=context_length,
        vocab_size=vocab, tied_output="output.weight" not in g.tensors,
        rope_freq_factors=_rope_freq_factors(g, rot_dim),
        sliding_window=sliding_window,
        layer_windows=_layer_windows(spec, n_layers, sliding_window),
        rope_base_local=spec.local_rope_base if sliding_window else None,
    )
    problems = _check_tensors(g, cfg)
    if problems:
        _raise(g, f"{g.path} does not match architecture '{spec.name}'", problems)
    return cfg


def _layer_windows(spec: ArchSpec, n_layers: int, sliding_window: int) -> tuple[int, ...]:
    """Per-layer attention window: layer i is global (0) iff (i + 1) % swa_pattern == 0
    (llama.cpp's swa pattern), local (sliding_window) otherwise."""
    if not (spec.swa_pattern and sliding_window):
        return (0,) * n_layers
    return tuple(0 if (i + 1) % spec.swa_pattern == 0 else sliding_window for i in range(n_layers))


def _raise(g: GgufFile, what: str, problems: list[str]) -> None:
    shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
    raise ModelFileError(f"{what}: {shown}")


def _blocks_in_file(g: GgufFile) -> int:
    """Number of layers the tensors describe: 1 + the highest `blk.N.` index (0 if none)."""
    top = -1
    for name in g.tensors:
        parts = name.split(".")
        if len(parts) > 2 and parts[0] == "blk" and re.fullmatch(r"[0-9]{1,9}", parts[1]):
            top = max(top, int(parts[1]))       # ASCII digits only ("²".isdigit()), a bounded count
    return top + 1


def _rope_freq_factors(g: GgufFile, rot_dim: int) -> tuple[float, ...] | None:
    """Per-pair RoPE frequency divisors: Llama 3.1+ `rope_freqs.weight` (f32 [rot_dim/2])
    times a linear `rope.scaling.factor`. Other scalings (YaRN, ...) change more than the
    frequencies and are refused rather than run subtly wrong."""
    factor = g.arch_key("rope.scaling.factor", None) or g.arch_key("rope.scale_linear", None) or 1.0
    # a factor without a type is linear, as llama.cpp reads it (and the older rope.scale_linear)
    kind = str(g.arch_key("rope.scaling.type", None) or ("linear" if factor != 1.0 else "none")).lower()
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor <= 0:
        raise ModelFileError(f"rope.scaling.factor must be a positive number, got {factor!r}: {g.path}")
    factor = float(factor)
    if kind not in ("none", "linear") and factor != 1.0:
        raise UnsupportedError(f"RoPE scaling '{kind}' (x{factor:g}) is not supported yet "
                               f"(supported: rope_freqs factors, linear): {g.path}")
    half = rot_dim // 2
    factors = np.ones(half, dtype=np.float64)
    t = g.tensors.get("rope_freqs.weight")
    if t is not None:
        if t.shape != (1, half):                    # the reader gives vectors as (1, n)
            raise ModelFileError(f"tensor rope_freqs.weight has shape {t.shape}, expected (1, {half}): {g.path}")
        factors *= np.asarray(dequantize(t.raw, t.qtype), dtype=np.float64).reshape(-1)
        if not np.all(np.isfinite(factors)) or np.any(factors <= 0):
            raise ModelFileError(f"tensor rope_freqs.weight holds non-positive or non-finite factors: {g.path}")
    if kind == "linear":
        factors *= factor
    if t is None and kind != "linear":
        return None
    # the kernels take them as f32: past these bounds a factor rounds to inf or 0 there (RoPE
    # silently off, or NaN logits); real scalings stay within a few hundred
    if np.any(factors > MAX_ROPE_FACTOR) or np.any(factors < 1.0 / MAX_ROPE_FACTOR):
        raise ModelFileError(f"RoPE frequency factors (rope_freqs.weight x rope.scaling.factor) must lie in "
                             f"[1/{MAX_ROPE_FACTOR:g}, {MAX_ROPE_FACTOR:g}], got {factors.min():g} .. "
                             f"{factors.max():g}: {g.path}")
    return tuple(float(f) for f in factors)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> (rows, cols) the forward pass expects."""
    d, f, q, kv = cfg.dim, cfg.ffn_dim, cfg.q_dim, cfg.kv_dim
    layer = {
        "attn_norm.weight": (1, d), "ffn_norm.weight": (1, d),
        "attn_q.weight": (q, d), "attn_k.weight": (kv, d), "attn_v.weight": (kv, d),
        "attn_output.weight": (d, q), "ffn_gate.weight": (f, d), "ffn_up.weight": (f, d),
        "ffn_down.weight": (d, f),
        "attn_q.bias": (1, q), "attn_k.bias": (1, kv), "attn_v.bias": (1, kv),
        "attn_q_norm.weight": (1, cfg.head_dim), "attn_k_norm.weight": (1, cfg.head_dim),
        "post_attention_norm.weight": (1, d), "post_ffw_norm.weight": (1, d),
    }
    names = list(cfg.arch.layer_tensors) + (list(cfg.arch.bias_tensors) if cfg.arch.qkv_bias else [])
    shapes = {"token_embd.weight": (cfg.vocab_size, d), "output_norm.weight": (1, d)}
    if not cfg.tied_output:
        shapes["output.weight"] = (cfg.vocab_size, d)
    for i in range(cfg.n_layers):
        for name in names:
            shapes[f"blk.{i}.{name}"] = layer[name]
    return shapes


def _check_tensors(g: GgufFile, cfg: ModelConfig) -> list[str]:
    problems = []
    for name, shape in expected_shapes(cfg).items():
        t = g.tensors.get(name)
        if t is None:
            problems.append(f"missing tensor {name}")
        elif t.shape != shape:
            problems.append(f"tensor {name} has shape {t.shape}, expected {shape}")
    return problems
