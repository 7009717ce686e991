from .backend import CpuBackend

__all__ = ["CpuBackend"]
