"""Architectures as data: one frozen ArchSpec per GGUF `general.architecture`.

Adding an architecture means adding a file here and registering its spec; the
forward pass branches on spec flags only.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.errors import UnsupportedError, cut


@dataclass(frozen=True)
class ArchSpec:
    name: str                    # GGUF general.architecture
    rope_neox: bool = False      # NEOX half-offset pairs (qwen2) vs adjacent pairs (llama)
    qkv_bias: bool = False       # attn_q/k/v carry .bias tensors
    # Per-layer tensors (GGUF names, "blk.{i}." prefix added) the generic forward uses.
    layer_tensors: tuple[str, ...] = (
        "attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
        "attn_output.weight", "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight",
        "ffn_down.weight",
    )
    bias_tensors: tuple[str, ...] = ("attn_q.bias", "attn_k.bias", "attn_v.bias")
    default_rope_base: float = 10000.0
    # Gemma-style extras (all off for llama/qwen2):
    embed_scale: bool = False    # token embeddings times sqrt(dim) before the first layer
    qk_norm: bool = False        # per-head RMSNorm of q and k before RoPE (attn_q_norm/attn_k_norm [head_dim])
    post_norms: bool = False     # RMSNorm of each sublayer's output before the residual add
                                 # (post_attention_norm, post_ffw_norm)
    ffn_act: str = "silu"        # gate activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    # Sliding-window attention: every `swa_pattern`-th layer is global (full context),
    # the others attend to the last `<arch>.attention.sliding_window` positions only
    # (a file without that key, or with 0, has global layers only). 0 = every layer global.
    # Pattern and local RoPE base are fixed per architecture, as in llama.cpp.
    swa_pattern: int = 0
    local_rope_base: float | None = None   # RoPE base of sliding-window layers (None: rope.freq_base)


_REGISTRY: dict[str, ArchSpec] = {}


def register(spec: ArchSpec) -> ArchSpec:
    _REGISTRY[spec.name] = spec
    return spec


def get_arch(name: str) -> ArchSpec:
    if name not in _REGISTRY:
        raise UnsupportedError(f"unsupported architecture '{cut(name)}'; supported: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


from . import gemma3, llama, qwen2  # noqa: E402,F401  (registers the specs)
