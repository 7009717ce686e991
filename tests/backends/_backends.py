"""Which backends the parametrised backend tests run on (no conftest needed).

`available_backends()` lists the backends importable and usable on this
machine; `make_backend(name)` builds one. The numpy reference is the oracle and
is never in the list. For now "cpu" is the numba op module behind a thin shim
(backends/cpu/ops.py; embedding/matmul are tested with quant.py); vulkan and
cuda join the list once their packages import and find a device.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

import numpy as np

# name -> (module, class) tried in order; a backend is available when it imports and builds.
_DEVICE_BACKENDS = {
    "vulkan": ("backends.vulkan", "VulkanBackend"),
    "cuda": ("backends.cuda", "CudaBackend"),
}

_OPS = ("rms_norm", "rope", "kv_write", "attention_prefill", "attention_decode",
        "silu_gate", "add", "snapkv_votes", "kv_gather")


def _load_cpu_ops():
    """backends.cpu.ops; by file path when the package's __init__ (the whole
    backend, quantized kernels included) does not import yet."""
    try:
        return importlib.import_module("backends.cpu.ops")
    except ImportError:
        path = Path(__file__).resolve().parents[2] / "backends" / "cpu" / "ops.py"
        spec = importlib.util.spec_from_file_location("backends.cpu.ops", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module        # numba's cache re-imports it by this name
        spec.loader.exec_module(module)
        return module


class CpuOpsShim:
    """backends.cpu.ops as a Backend (numpy memory, numba ops), for the op tests."""

    name = "cpu"

    def __init__(self):
        ops = _load_cpu_ops()
        for op in _OPS:
            setattr(self, op, getattr(ops, op))

    def alloc(self, shape, dtype=np.float32):
        return np.zeros(shape, dtype=dtype)

    def upload(self, host):
        return np.array(host, copy=True)

    def download(self, arr):
        return np.array(arr, copy=True)

    def alloc_kv_pool(self, n_pages, n_kv_heads, page_size, head_dim):
        shape = (n_pages, n_kv_heads, page_size, head_dim)
        return np.zeros(shape, dtype=np.uint16), np.zeros(shape, dtype=np.uint16)

    def synchronize(self):
        pass


def make_backend(name: str):
    if name == "reference":
        from backends.reference import ReferenceBackend
        return ReferenceBackend()
    if name == "cpu":
        return CpuOpsShim()
    module, cls = _DEVICE_BACKENDS[name]
    return getattr(importlib.import_module(module), cls)()


def available_backends() -> list[str]:
    names = ["cpu"]
    for name in _DEVICE_BACKENDS:
        try:
            make_backend(name)
        except Exception:   # not built, not importable, or no device on this machine
            continue
        names.append(name)
    return names
