"""cupy's device exceptions -> one-line engine errors (engine/errors.py).

  out of memory    cupy.cuda.memory.OutOfMemoryError (an allocation: zeros, empty,
                   asarray, a GEMM's output), CUDARuntimeError/CUDADriverError with
                   the out-of-memory status, CUBLASError CUBLAS_STATUS_ALLOC_FAILED
                   -> DeviceOutOfMemory: the call fails, the process goes on (cupy's
                   pool has already freed its cached blocks and retried).
  sticky fault     CUDARuntimeError/CUDADriverError with a status in STICKY (an
                   illegal address, a failed launch, a device-side assert, ...)
                   -> DeviceFault: the context is unusable until the process exits.
                   Kernels run asynchronously, so the call that reports it is often
                   not the one whose kernel faulted.
  anything else    the other CUDA errors -> DeviceError (the call fails).

`translate_device_errors` wraps every public method of the backend class, so
this is the one place where cupy's exceptions become ours. Nothing here imports
cupy: an exception class is looked up only when an exception passes (`except
device_exceptions()` evaluates its expression only then), among the cupy modules
already imported, the only ones that can have raised it. The happy path costs
one extra Python call per backend op.
"""
from __future__ import annotations

import functools
import os
import sys

from engine.errors import BackendUnavailable, DeviceError, DeviceFault, DeviceOutOfMemory

OUT_OF_MEMORY = 2            # cudaErrorMemoryAllocation = CUDA_ERROR_OUT_OF_MEMORY
CUBLAS_ALLOC_FAILED = 3      # CUBLAS_STATUS_ALLOC_FAILED
# Statuses after which the context is unusable (runtime and driver API share the numbers)
HARDWARE = {214: "cudaErrorECCUncorrectable", 220: "cudaErrorNvlinkUncorrectable"}
STICKY = {700: "cudaErrorIllegalAddress", 702: "cudaErrorLaunchTimeout", 709: "cudaErrorContextIsDestroyed",
          710: "cudaErrorAssert", 714: "cudaErrorHardwareStackError", 715: "cudaErrorIllegalInstruction",
          716: "cudaErrorMisalignedAddress", 717: "cudaErrorInvalidAddressSpace", 718: "cudaErrorInvalidPc",
          719: "cudaErrorLaunchFailure", 999: "cudaErrorUnknown", **HARDWARE}
_CLASSES = (("cupy.cuda.memory", "OutOfMemoryError"), ("cupy_backends.cuda.api.runtime", "CUDARuntimeError"),
            ("cupy_backends.cuda.api.driver", "CUDADriverError"), ("cupy_backends.cuda.libs.cublas", "CUBLASError"))
MEMORY_HINT = ("lower --ctx or --prefill-chunk, use a smaller --kv-dtype such as q8_0 or tq4 "
               "(engine serve: lower --parallel or --kv-pool-tokens), or free memory other processes hold")
LOCATE_HINT = ("to locate it, rerun with CUDA_LAUNCH_BLOCKING=1 (then the op that launched it reports it) "
               "or under compute-sanitizer")


def device_exceptions() -> tuple[type, ...]:
    """cupy's device exception classes among the modules imported so far."""
    found = []
    for module, name in _CLASSES:
        cls = getattr(sys.modules.get(module), name, None)
        if isinstance(cls, type):
            found.append(cls)
    return tuple(found)


def device_error(e: BaseException, where: str, op: str) -> DeviceError:
    """The engine error for cupy's exception `e` raised by backend method `op` on
    `where` ("CUDA device 0")."""
    kind = type(e).__name__
    text = str(e).splitlines()[0] if str(e) else kind
    status = getattr(e, "status", None)
    if kind == "OutOfMemoryError":            # cupy's pool: (size, total so far or -1, its limit or 0)
        size, total, limit = (getattr(e, a, None) for a in ("_size", "_total", "_limit"))
        if isinstance(size, int):
            detail = f"{_mib(size)} requested"
            if isinstance(total, int) and total >= 0:
                detail += f", {_mib(total)} already allocated by this process"
            if isinstance(limit, int) and limit > 0:
                detail += f", pool limit {_mib(limit)} (CUPY_GPU_MEMORY_LIMIT)"
        else:
            detail = text
        return DeviceOutOfMemory(f"{where} ran out of memory in {op} ({detail}): {MEMORY_HINT}")
    if (kind == "CUBLASError" and status == CUBLAS_ALLOC_FAILED) or (kind != "CUBLASError" and status == OUT_OF_MEMORY):
        return DeviceOutOfMemory(f"{where} ran out of memory in {op} ({text}): {MEMORY_HINT}")
    if kind != "CUBLASError" and status in STICKY:
        if status in HARDWARE:
            where_from = "A hardware error: see nvidia-smi -q"
        elif os.environ.get("CUDA_LAUNCH_BLOCKING") == "1":    # the CUDA driver's variable, read for the message only
            where_from = f"Launched by {op} (CUDA_LAUNCH_BLOCKING=1)"
        else:
            where_from = (f"Reported by {op}; kernels run asynchronously, so the faulting one may be any "
                          f"launched before it: {LOCATE_HINT}")
        return DeviceFault(f"{where} faulted ({text}) and its CUDA context is unusable: restart the process. "
                           f"{where_from}")
    return DeviceError(f"{where} error in {op} ({text})")


def translate_device_errors(cls):
    """Class decorator: every public method of `cls` raises `device_error(...)` in place
    of cupy's exceptions (`self.ex.label` names the device); __init__ raises
    BackendUnavailable, so `--backend auto` falls back when a device cannot be set up."""
    for name, fn in list(vars(cls).items()):
        if callable(fn) and (name == "__init__" or not name.startswith("_")):
            setattr(cls, name, _guarded(fn, name))
    return cls


def _guarded(fn, op: str):
    @functools.wraps(fn)
    def guarded(self, *args, **kwargs):
        try:
            return fn(self, *args, **kwargs)
        except device_exceptions() as e:
            if op == "__init__":
                text = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise BackendUnavailable(f"backend 'cuda': the CUDA device could not be set up ({text})") from e
            ex = getattr(self, "ex", None)
            raise device_error(e, getattr(ex, "label", "the CUDA device"), op) from e
    return guarded


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n} bytes"
