"""qwen2: llama with Q/K/V biases and NEOX (half-offset) RoPE."""
from . import ArchSpec, register

QWEN2 = register(ArchSpec(name="qwen2", rope_neox=True, qkv_bias=True, default_rope_base=1000000.0))
