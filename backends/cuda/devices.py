"""CUDA devices as cupy sees them (for `engine info --devices` and the memory check)."""
from __future__ import annotations

from engine.errors import BackendUnavailable

from .errors import device_exceptions
from .runtime import device_count


def list_devices() -> list[dict]:
    """[{index, name, compute_capability, total_bytes, free_bytes}]; BackendUnavailable
    (one line) without cupy, a driver or a device."""
    n = device_count()                  # imports cupy, or says in one line what is missing
    import cupy
    out = []
    for i in range(n):
        try:
            props = cupy.cuda.runtime.getDeviceProperties(i)
            with cupy.cuda.Device(i):
                free, total = cupy.cuda.runtime.memGetInfo()
        except device_exceptions() as e:
            raise BackendUnavailable(f"backend 'cuda': CUDA device {i} does not answer "
                                     f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        out.append({"index": i, "name": name, "compute_capability": f"{props['major']}.{props['minor']}",
                    "total_bytes": int(total), "free_bytes": int(free)})
    return out
