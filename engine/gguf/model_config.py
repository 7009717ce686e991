"""GGUF metadata + ArchSpec -> ModelConfig, with every expected tensor checked."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf.quants import dequantize

from models import ArchSpec, get_arch

from ..errors import ModelFileError, UnsupportedError
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

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def kv_bytes_per_token(self) -> int:
        """bf16 K and V for one position across all layers."""
        return self.n_layers * 2 * self.kv_dim * 2


def model_config(g: GgufFile) -> ModelConfig:
    """Read hyperparameters and verify every tensor the forward pass needs; all
    problems are reported in one error."""
    spec = get_arch(g.architecture)

    def need(suffix):
        value = g.arch_key(suffix)
        if value is None:
            raise ModelFileError(f"GGUF metadata lacks {g.architecture}.{suffix}: {g.path}")
        return value

    n_layers = int(need("block_count"))
    dim = int(need("embedding_length"))
    ffn_dim = int(need("feed_forward_length"))
    n_heads = int(need("attention.head_count"))
    n_kv_heads = int(g.arch_key("attention.head_count_kv", n_heads))
    head_dim = int(g.arch_key("attention.key_length", dim // n_heads))
    embd = g.tensors.get("token_embd.weight")
    vocab = embd.shape[0] if embd is not None else int(g.arch_key("vocab_size", 0))
    rot_dim = int(g.arch_key("rope.dimension_count", head_dim))
    cfg = ModelConfig(
        arch=spec, n_layers=n_layers, dim=dim, ffn_dim=ffn_dim, n_heads=n_heads,
        n_kv_heads=n_kv_heads, head_dim=head_dim, rot_dim=rot_dim,
        rope_base=float(g.arch_key("rope.freq_base", spec.default_rope_base)),
        norm_eps=float(g.arch_key("attention.layer_norm_rms_epsilon", 1e-5)),
        context_length=int(g.arch_key("context_length", 2048)),
        vocab_size=vocab, tied_output="output.weight" not in g.tensors,
        rope_freq_factors=_rope_freq_factors(g, rot_dim),
    )
    problems = _check_tensors(g, cfg)
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise ModelFileError(f"{g.path} does not match architecture '{spec.name}': {shown}")
    return cfg


def _rope_freq_factors(g: GgufFile, rot_dim: int) -> tuple[float, ...] | None:
    """Per-pair RoPE frequency divisors: Llama 3.1+ `rope_freqs.weight` (f32 [rot_dim/2])
    times a linear `rope.scaling.factor`. Other scalings (YaRN, ...) change more than the
    frequencies and are refused rather than run subtly wrong."""
    kind = str(g.arch_key("rope.scaling.type", "none") or "none").lower()
    factor = float(g.arch_key("rope.scaling.factor", 1.0) or 1.0)
    if kind not in ("none", "linear") and factor != 1.0:
        raise UnsupportedError(f"RoPE scaling '{kind}' (x{factor:g}) is not supported yet "
                               f"(supported: rope_freqs factors, linear): {g.path}")
    if factor <= 0:
        raise ModelFileError(f"rope.scaling.factor must be positive, got {factor}: {g.path}")
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
    if cfg.dim % cfg.n_heads or cfg.n_heads % cfg.n_kv_heads:
        problems.append(f"heads {cfg.n_heads}/{cfg.n_kv_heads} do not divide width {cfg.dim}")
    for name, shape in expected_shapes(cfg).items():
        t = g.tensors.get(name)
        if t is None:
            problems.append(f"missing tensor {name}")
        elif t.shape != shape:
            problems.append(f"tensor {name} has shape {t.shape}, expected {shape}")
    return problems
