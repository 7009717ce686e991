"""Backend registry: name -> constructor. `auto` picks CUDA, then a Vulkan GPU, then CPU."""
from __future__ import annotations

import sys

from engine.errors import BackendUnavailable, ConfigError

from .base import OPS, Backend, check_complete

NAMES = ("cpu", "vulkan", "cuda", "reference", "auto")


def get_backend(name: str = "cpu", threads: int | None = None, quiet: bool = False,
                auto_gpu_only: bool = False):
    """Construct a backend by name; every op is checked present. `auto_gpu_only`:
    a Vulkan CPU device (lavapipe) and the CUDA CPU harness do not count (used by `auto`)."""
    if name not in NAMES:
        raise ConfigError(f"unknown backend '{name}'; choose one of: {', '.join(NAMES)}")
    if name == "auto":
        backend = _auto(threads)
        if not quiet:
            print(f"engine: backend auto -> {backend.name}", file=sys.stderr)
    elif name == "cpu":
        from .cpu import CpuBackend
        backend = CpuBackend(threads)
    elif name == "reference":
        from .reference import ReferenceBackend
        backend = ReferenceBackend()
    elif name == "vulkan":
        from .vulkan import VulkanBackend
        backend = VulkanBackend(allow_cpu=not auto_gpu_only)
    else:
        from .cuda import CudaBackend
        backend = CudaBackend(executor="device" if auto_gpu_only else None)
    check_complete(backend)
    return backend


def _auto(threads):
    for name in ("cuda", "vulkan"):
        try:
            return get_backend(name, threads, quiet=True, auto_gpu_only=True)
        except BackendUnavailable:
            continue
    from .cpu import CpuBackend
    return CpuBackend(threads)


__all__ = ["get_backend", "Backend", "OPS", "check_complete", "NAMES"]
