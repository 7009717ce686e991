"""Which backends the parametrised backend tests run on (no conftest needed).

`available_backends()` lists the backends importable and usable on this
machine; `make_backend(name)` builds one. The numpy reference is the oracle and
is never in the list. "cpu" is CpuBackend's ops behind a thin shim with
zero-filled pools (embedding/matmul are tested in test_cpu_quant.py); vulkan and
cuda join the list once their packages import and find a device. "cuda-harness"
is the CUDA backend with its unchanged kernels run on the CPU harness
(docs/cuda.md): it joins wherever g++ exists (make setup makes sure), and a
harness that fails to build fails the tests rather than dropping out. "cuda" also
joins, unprobed, when SHARPI_CUDA_EXECUTOR=device asks for the GPU: without one its
tests then fail with the reason instead of dropping out.

`cuda_test_executor()` is the executor tests/cuda runs its op and model tests on (the
`ex` fixture of tests/cuda/conftest.py, the tiny models of test_cuda_model.py):
SHARPI_CUDA_EXECUTOR when it is set, else "cpu-harness" (the engine's own default is
"device"); `EXECUTOR_IDS` names it in test ids.
"""
from __future__ import annotations

import importlib
import os
import shutil

import numpy as np

# name -> (module, class) tried in order; a backend is available when it imports and builds.
_DEVICE_BACKENDS = {
    "vulkan": ("backends.vulkan", "VulkanBackend"),
    "cuda": ("backends.cuda", "CudaBackend", {"executor": "device"}),
    "cuda-harness": ("backends.cuda", "CudaBackend", {"executor": "cpu-harness"}),
}

_OPS = ("rms_norm", "scale", "rope", "kv_write", "attention_prefill", "attention_decode",
        "silu_gate", "gelu_gate", "add", "snapkv_votes", "kv_gather", "kv_copy_pages")


class CpuOpsShim:
    """The CPU backend's ops (with its dispatch, e.g. BLAS prefill attention for long
    chunks) on zero-filled numpy memory, for the op tests."""

    name = "cpu"

    def __init__(self):
        from backends.cpu import CpuBackend
        from backends.base import OPTIONAL_OPS
        for op in _OPS + tuple(o for o in OPTIONAL_OPS if hasattr(CpuBackend, o)):
            setattr(self, op, getattr(CpuBackend, op))
        self.kv_dtypes = getattr(CpuBackend, "kv_dtypes", ("bf16",))

    def alloc(self, shape, dtype=np.float32):
        return np.zeros(shape, dtype=dtype)

    def upload(self, host):
        return np.array(host, copy=True)

    def download(self, arr):
        return np.array(arr, copy=True)

    def alloc_kv_pool(self, n_pages, n_kv_heads, page_size, head_dim, k_dtype="bf16", v_dtype="bf16"):
        from backends.kvformat import KvFormat
        return tuple(np.zeros(f.page_shape(n_pages, n_kv_heads, page_size), dtype=f.storage)
                     for f in (KvFormat.get(k_dtype, head_dim), KvFormat.get(v_dtype, head_dim)))

    def synchronize(self):
        pass


def make_backend(name: str):
    if name == "reference":
        from backends.reference import ReferenceBackend
        return ReferenceBackend()
    if name == "cpu":
        return CpuOpsShim()
    module, cls, *kwargs = _DEVICE_BACKENDS[name]
    return getattr(importlib.import_module(module), cls)(**(kwargs[0] if kwargs else {}))


def backend_class(name: str):
    """The class a backend name builds, without building it (no device needed)."""
    if name == "cpu":
        from backends.cpu import CpuBackend
        return CpuBackend
    module, cls, *_ = _DEVICE_BACKENDS[name]
    return getattr(importlib.import_module(module), cls)


EXECUTOR_IDS = {"cpu-harness": "harness", "device": "gpu"}


def cuda_test_executor() -> str:
    """SHARPI_CUDA_EXECUTOR when set (an explicit "device" never falls back to the
    harness: without a GPU the tests fail with BackendUnavailable), else "cpu-harness"."""
    name = os.environ.get("SHARPI_CUDA_EXECUTOR", "").strip() or "cpu-harness"
    if name not in EXECUTOR_IDS:
        raise ValueError(f"SHARPI_CUDA_EXECUTOR={name!r}; choose one of: {', '.join(EXECUTOR_IDS)}")
    return name


def available_backends() -> list[str]:
    names = ["cpu"]
    for name in _DEVICE_BACKENDS:
        if name == "cuda-harness":
            if shutil.which("g++"):
                names.append(name)
            continue
        if name == "cuda" and os.environ.get("SHARPI_CUDA_EXECUTOR", "").strip() == "device":
            names.append(name)          # asked for: its tests fail without a GPU, never drop out
            continue
        try:
            make_backend(name)
        except Exception:   # not built, not importable, or no device on this machine
            continue
        names.append(name)
    return names


def nmse(got, want) -> float:
    """sum((got - want)^2) / sum(want^2), float64; got must be finite (a NaN means a
    read of a poisoned slot or garbage logits) and shaped like want."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape
    assert np.all(np.isfinite(got)), "non-finite output (read of a NaN-poisoned slot?)"
    return float(np.sum((got - want) ** 2) / max(np.sum(want ** 2), 1e-300))


def assert_rows_written(got, want, dtype: str, head_dim: int) -> None:
    """Pages after kv_write: bit-exact, except in the rotated formats, where a code may
    go to the neighbouring level where the rotated value sits on a boundary to within
    summation order (at most 1e-3 of the codes) and an f16 scale may move by 1 ulp
    (tq: one per row; rq4_0: one per block of 32). Rows left unwritten (all 0xFF, the
    NaN poison) must stay so."""
    from backends.kvformat import QK, TQ_BITS, _unpack
    if dtype not in TQ_BITS and dtype != "rq4_0":
        np.testing.assert_array_equal(got, want)
        return
    g, w = got.reshape(-1, got.shape[-1]), want.reshape(-1, want.shape[-1])
    written = ~np.all(w == 0xFF, axis=1)
    np.testing.assert_array_equal(np.all(g == 0xFF, axis=1), ~written)
    g, w = g[written], w[written]
    if dtype == "rq4_0":                             # q4_0 blocks: f16 d, 16 bytes of nibbles
        g, w = g.reshape(-1, 2 + QK // 2), w.reshape(-1, 2 + QK // 2)
        cg = np.concatenate([g[:, 2:] & 15, g[:, 2:] >> 4], axis=1).astype(np.int32)
        cw = np.concatenate([w[:, 2:] & 15, w[:, 2:] >> 4], axis=1).astype(np.int32)
    else:
        cg = _unpack(g[:, 2:], TQ_BITS[dtype], head_dim).astype(np.int32)
        cw = _unpack(w[:, 2:], TQ_BITS[dtype], head_dim).astype(np.int32)
    sg = g[:, :2].copy().view(np.int16)[:, 0].astype(np.int32)
    sw = w[:, :2].copy().view(np.int16)[:, 0].astype(np.int32)
    assert np.abs(sg - sw).max() <= 1
    assert np.abs(cg - cw).max() <= 1 and (cg != cw).mean() <= 1e-3


def vulkan_reporting(monkeypatch, device_type=None, **limits):
    """(the Vulkan backend module, device index) with its device list reporting lavapipe
    as another `device_type` and/or with `limits` changed."""
    from backends.vulkan import backend as mod, device
    real = device.list_devices()
    monkeypatch.setattr(mod, "list_devices", lambda: [
        dict(d, type=device_type or d["type"], limits=dict(d.get("limits") or {}, **limits)) for d in real])
    return mod, real[0]["index"]
