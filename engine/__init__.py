"""snapkv-engine: GGUF inference with post-prefill KV-cache eviction.

    import engine
    m = engine.load()                     # default model, CPU
    r = m.generate("Once upon a time", max_tokens=32)
"""
from .errors import EngineError

__all__ = ["load", "Model", "EngineError", "SnapKvConfig"]


def __getattr__(name):
    # Imported lazily so `models` and `backends` can import engine.errors without a cycle.
    if name in ("load", "Model"):
        from . import model
        return getattr(model, name)
    if name == "SnapKvConfig":
        from .snapkv import SnapKvConfig
        return SnapKvConfig
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
