"""Executors: where the CUDA backend's kernels run and its arrays live.

The op modules (quant.py, attention.py, elementwise.py) launch kernels and
allocate memory only through an executor, so one host layer drives both:

  device       cupy arrays on an NVIDIA GPU; kernels compiled by nvrtc.py (the
               options and target the offline check uses), the image cached in
               CACHE_DIR and loaded by cupy.RawModule(path=...); the prefill GEMM
               is cuBLAS (cupy.matmul).
  cpu-harness  numpy arrays; the same kernel source compiled by g++ against
               harness/cuda_cpu.h and run with one fiber per CUDA thread; the
               GEMM is numpy's. For tests without a GPU: about 1000x slower.

Launch convention (both): `ex.function(file, name, defines)(grid, block, args,
shared_mem=0)` as cupy.RawKernel; array arguments are passed as the address of
their first element (views allowed), scalars as numpy scalars of exactly the
kernel parameter's type. `function` looks each (file, name, defines) up once and
keeps the function object, so a launch's lookup is a dict hit (_FunctionCache).

Recording (both): between `begin_recording()` and `end_recording()` every launch runs
as usual and is also logged; `replay(recorded)` runs the logged launches again with the
same arguments (the kernels read what changes from a step buffer, backend.record_step).
The device executor captures them into a CUDA graph on the first replay and launches
the graph after that: one launch a step. The harness runs them one by one.
"""
from __future__ import annotations

import hashlib
import os
import re
import tempfile
from pathlib import Path

import numpy as np

from engine.errors import BackendUnavailable, EngineError

KERNELS = Path(__file__).parent / "kernels"
CACHE_DIR = Path(__file__).parents[1] / ".cache" / "cuda_nvrtc"   # compiled images, by source+options+NVRTC
# Compiled and loaded when the device executor starts, so a missing NVRTC, a target the
# driver refuses or an unwritable cache is BackendUnavailable before any model work.
PROBE_SOURCE = 'extern "C" __global__ void sharpi_probe(int* x) { x[0] = 1; }\n'
EXECUTORS = ("device", "cpu-harness")
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)
_PRAGMA_ONCE = re.compile(r'^\s*#\s*pragma\s+once\s*$', re.MULTILINE)


def inline_includes(file: str, seen: set | None = None) -> str:
    """The source of kernels/<file> with its local `#include "x"` lines replaced by
    the files themselves (once each), so a compiled-kernel cache keyed by the
    source text sees header changes too."""
    seen = set() if seen is None else seen
    seen.add(file)
    text = _PRAGMA_ONCE.sub("", (KERNELS / file).read_text())

    def expand(m):
        name = m.group(1)
        return "" if name in seen else inline_includes(name, seen)
    return _INCLUDE.sub(expand, text)


class Recorded:
    """The launches of a recorded step in order, (function, grid, block, args, shared_mem);
    `graph`: the device executor's CUDA graph of them, captured on the first replay."""

    def __init__(self, launches: list):
        self.launches = launches
        self.graph = None


class _Logged:
    """A function during a recording: launches it and logs the launch."""
    __slots__ = ("fn", "log")

    def __init__(self, fn, log: list):
        self.fn, self.log = fn, log

    def __call__(self, grid, block, args, shared_mem=0):
        self.fn(grid, block, args, shared_mem=shared_mem)
        self.log.append((self.fn, grid, block, tuple(args), shared_mem))


class _FunctionCache:
    """`function` of both executors: each (file, name, defines) is looked up once (module
    built or loaded, entry point fetched) and kept, so a launch costs a dict hit, not a
    module lookup (cupy: a cuModuleGetFunction per get_function). Also the recording
    of launches (the module docstring)."""

    _functions: dict
    _log: list | None = None            # the launches of the recording under way
    _unrecordable = False               # work the recording cannot replay ran (gemm)
    launches = 0                        # functions handed out to launch (one launch each): ops' launches

    def function(self, file: str, name: str, defines: tuple[str, ...] = ()):
        self.launches += 1
        key = (file, name, tuple(defines))
        fn = self._functions.get(key)
        if fn is None:
            fn = self._functions[key] = self._lookup(*key)
        return fn if self._log is None else _Logged(fn, self._log)

    def begin_recording(self) -> None:
        if self._log is not None:
            raise RuntimeError("a recording is already under way")
        self._log = []

    def end_recording(self) -> Recorded | None:
        """The launches since begin_recording (also what ends a recording an error broke off),
        or None when work a replay would skip ran among them (unrecordable)."""
        log, self._log = self._log, None
        broken, self._unrecordable = self._unrecordable, False
        return None if broken else Recorded(log or [])

    def unrecordable(self) -> None:
        """Work outside the launch log ran (a cuBLAS GEMM, whose output cupy allocates):
        the recording under way, if any, cannot be replayed and is not kept."""
        if self._log is not None:
            self._unrecordable = True

    def replay(self, recorded: Recorded) -> None:
        """The recorded launches again, one by one (the device executor: one graph)."""
        for fn, grid, block, args, shared_mem in recorded.launches:
            fn(grid, block, args, shared_mem=shared_mem)


class HarnessExecutor(_FunctionCache):
    """Kernels on the CPU harness; arrays are numpy."""

    name = "cpu-harness"
    label = "the CUDA CPU harness"

    def __init__(self):
        from . import harness
        self._harness = harness
        self._modules: dict = {}
        self._functions: dict = {}      # (file, name, defines) -> function object (_FunctionCache)
        self.cache: dict = {}           # per-executor state of the op modules (scratch buffers)

    def zeros(self, shape, dtype=np.float32) -> np.ndarray:
        return np.zeros(shape, dtype=dtype)

    def empty(self, shape, dtype=np.float32) -> np.ndarray:
        """Uninitialised on a GPU; NaN-filled (float) or 0xFF bytes here, so a read
        of an unwritten element shows up."""
        out = np.empty(shape, dtype=dtype)
        out.view(np.uint8)[...] = 0xFF
        return out

    def asarray(self, host) -> np.ndarray:
        return np.array(host, copy=True, order="C")

    def to_host(self, arr) -> np.ndarray:
        return np.array(arr, copy=True)

    def _lookup(self, file: str, name: str, defines: tuple[str, ...]):
        key = (file, defines)
        mod = self._modules.get(key)
        if mod is None:
            mod = self._modules[key] = self._harness.build(KERNELS / file, tuple(defines))
        return mod.get_function(name)

    def gemm(self, x, w, out) -> None:
        """out[...] = x @ w.T (f32)."""
        self.unrecordable()
        out[...] = np.asarray(x) @ np.asarray(w).T

    def synchronize(self) -> None:
        pass

    def free_bytes(self) -> int | None:
        """None: host memory, no device limit to check (tests may patch this)."""
        return None


class CupyExecutor(_FunctionCache):
    """Kernels on an NVIDIA GPU through cupy (cupy-cuda12x or -13x); one stream (the
    current one), no host synchronisation except `to_host` and `synchronize`."""

    name = "device"

    def __init__(self, device: int = 0):
        try:
            import cupy
        except Exception as e:   # pragma: no cover - depends on the machine
            raise BackendUnavailable(f"backend 'cuda' needs cupy (pip install cupy-cuda12x or cupy-cuda13x): "
                                     f"{type(e).__name__}: {e}") from None
        n = device_count(cupy)
        if device >= n:
            raise BackendUnavailable(f"backend 'cuda': no CUDA device {device} ({n} found)")
        self.cp = cupy
        self.device_id = device
        self.label = f"CUDA device {device}"
        self._modules: dict = {}
        self._functions: dict = {}      # (file, name, defines) -> function object (_FunctionCache)
        self.cache: dict = {}
        self.target = self._probe(open_device(cupy, device))   # nvrtc.Target: what every kernel is built for

    def bind_thread(self) -> None:
        """Make this executor's device current in the calling thread (cupy's current device
        is per thread: a server's worker would otherwise launch on device 0)."""
        self.cp.cuda.Device(self.device_id).use()

    def _probe(self, compute_capability: int):
        """The target for this device (nvrtc.choose_target), after compiling and loading
        PROBE_SOURCE for it; BackendUnavailable (one line) when NVRTC is missing or too
        old, the compile fails or the driver refuses the image."""
        from . import nvrtc
        try:
            supported = nvrtc.supported_archs()
        except BackendUnavailable as e:
            raise BackendUnavailable(f"backend 'cuda': {e}") from None
        target = nvrtc.choose_target(compute_capability, supported)
        what = f"NVRTC {'.'.join(map(str, nvrtc.version()))} for {target}"
        try:
            self._module(PROBE_SOURCE, "probe.cu", (), target).get_function("sharpi_probe")
        except nvrtc.CompileError as e:
            raise BackendUnavailable(f"backend 'cuda': {what} cannot compile a one-line kernel: "
                                     f"{e.first_error()}") from None
        except OSError as e:
            raise BackendUnavailable(f"backend 'cuda': cannot write compiled kernels to {CACHE_DIR}: {e}") from None
        except Exception as e:    # cupy's CUDADriverError: the driver refused the image
            hint = "; update the NVIDIA driver (it compiles the PTX on load)" if target.kind == "ptx" else ""
            raise BackendUnavailable(f"backend 'cuda': {self.label} cannot load the image of {what} "
                                     f"({type(e).__name__}: {_first_line(e)}){hint}") from None
        return target

    def _module(self, source: str, name: str, defines: tuple[str, ...], target):
        """cupy.RawModule over the image nvrtc.py builds (CACHE_DIR keeps it across runs);
        nvrtc.CompileError when the source does not compile."""
        return self.cp.RawModule(path=str(compiled_image(source, name, defines, target)))

    def zeros(self, shape, dtype=np.float32):
        return self.cp.zeros(shape, dtype=dtype)

    def empty(self, shape, dtype=np.float32):
        return self.cp.empty(shape, dtype=dtype)

    def asarray(self, host):
        return self.cp.asarray(np.ascontiguousarray(host))

    def to_host(self, arr) -> np.ndarray:
        if isinstance(arr, np.ndarray):
            return np.array(arr, copy=True)
        return self.cp.asnumpy(arr)

    def _lookup(self, file: str, name: str, defines: tuple[str, ...]):
        key = (file, defines)
        mod = self._modules.get(key)
        if mod is None:
            from .nvrtc import CompileError
            try:
                mod = self._module(inline_includes(file), file, tuple(defines), self.target)
            except CompileError as e:
                label = " ".join([f"kernels/{file}"] + [f"-D{d}" for d in defines])
                raise EngineError(f"backend 'cuda': {label} does not compile for {self.target}: "
                                  f"{e.first_error()}") from None
            self._modules[key] = mod
        return mod.get_function(name)

    def replay(self, recorded: Recorded) -> None:
        """The recorded launches as one CUDA graph on the current stream, captured on a
        side stream the first time (capture runs nothing; the recording step already ran)."""
        if recorded.graph is None:
            side = self.cp.cuda.Stream(non_blocking=True)
            with side:
                side.begin_capture()
                try:
                    super().replay(recorded)
                finally:
                    graph = side.end_capture()
            recorded.graph = graph
        recorded.graph.launch()

    def gemm(self, x, w, out) -> None:
        """out[...] = x @ w.T (f32, cuBLAS)."""
        self.unrecordable()
        out[...] = self.cp.matmul(x, w.T)

    def synchronize(self) -> None:
        self.cp.cuda.get_current_stream().synchronize()

    def free_bytes(self) -> int:
        """Free device memory plus what cupy's pool holds unused."""
        free, _ = self.cp.cuda.runtime.memGetInfo()
        return int(free) + int(self.cp.get_default_memory_pool().free_bytes())


def compiled_image(source: str, name: str, defines: tuple[str, ...], target) -> Path:
    """The file holding `source` compiled by nvrtc.py for `target` (a .cubin or .ptx in
    CACHE_DIR, named by a hash of the source, the options and the NVRTC version;
    compiled and written atomically when absent)."""
    from . import nvrtc
    key = repr((source, nvrtc.options(tuple(defines), target), nvrtc.version())).encode()
    path = CACHE_DIR / f"{Path(name).stem}-{hashlib.sha256(key).hexdigest()[:24]}.{target.kind}"
    if not path.is_file():
        image = nvrtc.compile_source(source, name, tuple(defines), target).image
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=CACHE_DIR, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(image)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    return path


def open_device(cupy, device: int) -> int:
    """Make `device` current; its compute capability as 90 for 9.0."""
    cupy.cuda.Device(device).use()
    return int(cupy.cuda.Device(device).compute_capability)


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def device_count(cupy=None) -> int:
    """CUDA devices visible through cupy; BackendUnavailable (one line) when there is
    no driver or no device."""
    if cupy is None:
        try:
            import cupy
        except Exception as e:
            raise BackendUnavailable(f"backend 'cuda' needs cupy (pip install cupy-cuda12x or cupy-cuda13x): "
                                     f"{type(e).__name__}: {e}") from None
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        raise BackendUnavailable(f"backend 'cuda': no usable CUDA driver or device "
                                 f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    if n == 0:
        raise BackendUnavailable("backend 'cuda': no CUDA device found")
    return n


def make_executor(name: str = "device", device: int = 0):
    if name == "device":
        return CupyExecutor(device)
    if name == "cpu-harness":
        return HarnessExecutor()
    raise ValueError(f"unknown CUDA executor {name!r}; choose one of: {', '.join(EXECUTORS)}")
