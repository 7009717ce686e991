"""snapkv-engine: GGUF inference with post-prefill KV-cache eviction."""
from .errors import EngineError
from .model import Model, load

__all__ = ["load", "Model", "EngineError"]
