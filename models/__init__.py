"""Architectures as data: one frozen ArchSpec per GGUF `general.architecture`.

Adding an architecture means adding a file here and registering its spec; the
forward pass branches on spec flags only.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.errors import UnsupportedError


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


_REGISTRY: dict[str, ArchSpec] = {}


def register(spec: ArchSpec) -> ArchSpec:
    _REGISTRY[spec.name] = spec
    return spec


def get_arch(name: str) -> ArchSpec:
    if name not in _REGISTRY:
        raise UnsupportedError(f"unsupported architecture '{name}'; supported: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


from . import llama, qwen2  # noqa: E402,F401  (registers the specs)
