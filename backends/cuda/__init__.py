"""The CUDA backend: CUDA C kernels (kernels/*.cu) compiled at run time, launched
through cupy on a GPU or through our CPU harness in tests (docs/cuda.md)."""
from __future__ import annotations

from .backend import CudaBackend
from .devices import list_devices
from . import attention, elementwise, quant

# Every (kernel file, defines) the backend compiles: the NVRTC tests build each for every GPU arch.
ALL_VARIANTS = quant.VARIANTS + attention.VARIANTS + elementwise.VARIANTS

__all__ = ["CudaBackend", "list_devices", "ALL_VARIANTS"]
