"""Device errors from cupy become one-line engine errors (backends/cuda/errors.py).

No GPU here: the real cupy exception classes (they import without a driver) are
raised from below the backend's public methods (the executor, an op module), so
the translation runs as it would on a device; the model runs on the CPU harness
whatever SHARPI_CUDA_EXECUTOR says (the faults are planted in HarnessExecutor; a real
GPU would not raise them on cue)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

cupy = pytest.importorskip("cupy")

import engine  # noqa: E402
from backends.cuda import errors  # noqa: E402
from engine.errors import DeviceError, DeviceFault, DeviceOutOfMemory, EngineError  # noqa: E402

from cupy.cuda.memory import OutOfMemoryError  # noqa: E402
from cupy_backends.cuda.api.driver import CUDADriverError  # noqa: E402
from cupy_backends.cuda.api.runtime import CUDARuntimeError  # noqa: E402

MIB = 2 ** 20


def driver_error(status: int, text: str) -> CUDADriverError:
    """A CUDADriverError as cupy raises it (its constructor asks libcuda for the name)."""
    e = CUDADriverError.__new__(CUDADriverError)
    e.status = status
    Exception.__init__(e, text)
    return e


def test_out_of_memory_names_the_sizes_and_what_to_lower():
    e = errors.device_error(OutOfMemoryError(512 * MIB, 3 * 1024 * MIB, 0), "CUDA device 0", "matmul")
    assert type(e) is DeviceOutOfMemory
    assert str(e).startswith("CUDA device 0 ran out of memory in matmul (512 MiB requested, "
                             "3072 MiB already allocated by this process): lower --ctx")
    assert "--parallel" in str(e) and "\n" not in str(e)
    e = errors.device_error(OutOfMemoryError(4096, -1, 0), "CUDA device 0", "upload")     # cupy's async pool
    assert "in upload (4096 bytes requested): " in str(e)
    e = errors.device_error(OutOfMemoryError(2 * MIB, 7 * MIB, 8 * MIB), "CUDA device 0", "alloc")
    assert ("(2 MiB requested, 7 MiB already allocated by this process, pool limit 8 MiB "
            "(CUPY_GPU_MEMORY_LIMIT))") in str(e)
    for raw in (CUDARuntimeError(2), driver_error(2, "CUDA_ERROR_OUT_OF_MEMORY: out of memory")):
        e = errors.device_error(raw, "CUDA device 1", "alloc_kv_pool")
        assert type(e) is DeviceOutOfMemory and "in alloc_kv_pool (" in str(e) and "out of memory" in str(e)


@pytest.mark.parametrize("raw", [CUDARuntimeError(700), CUDARuntimeError(719), CUDARuntimeError(710),
                                 driver_error(700, "CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access was "
                                                   "encountered"),
                                 driver_error(719, "CUDA_ERROR_LAUNCH_FAILED: unspecified launch failure")])
def test_sticky_faults_say_restart_and_how_to_locate(raw, monkeypatch):
    monkeypatch.delenv("CUDA_LAUNCH_BLOCKING", raising=False)
    e = errors.device_error(raw, "CUDA device 0", "download")
    assert type(e) is DeviceFault and "\n" not in str(e)
    assert str(e).startswith(f"CUDA device 0 faulted ({str(raw)}) and its CUDA context is unusable: "
                             f"restart the process. Reported by download; kernels run asynchronously")
    assert "CUDA_LAUNCH_BLOCKING=1" in str(e) and "compute-sanitizer" in str(e)
    monkeypatch.setenv("CUDA_LAUNCH_BLOCKING", "1")
    assert str(errors.device_error(raw, "CUDA device 0", "matmul")).endswith(
        "Launched by matmul (CUDA_LAUNCH_BLOCKING=1)")


def test_other_cuda_errors_fail_the_call_only():
    e = errors.device_error(CUDARuntimeError(9), "CUDA device 0", "rope")
    assert type(e) is DeviceError and str(e) == ("CUDA device 0 error in rope (cudaErrorInvalidConfiguration: "
                                                 "invalid configuration argument)")


def test_only_cupy_exceptions_are_translated():
    """A host MemoryError, a ValueError, an EngineError pass through the backend as they are."""
    from backends.cuda import CudaBackend
    b = CudaBackend(executor="cpu-harness")
    assert set(errors.device_exceptions()) >= {OutOfMemoryError, CUDARuntimeError, CUDADriverError}
    with pytest.raises(ValueError, match="even head_dim"):
        b.alloc_kv_pool(1, 1, 64, 7)
    b.ex.zeros = lambda shape, dtype=None: (_ for _ in ()).throw(MemoryError("host"))
    with pytest.raises(MemoryError) as info:
        b.alloc((4,))
    assert type(info.value) is MemoryError
    b.ex.zeros = lambda shape, dtype=None: (_ for _ in ()).throw(OutOfMemoryError(4096, 8192, 0))
    with pytest.raises(DeviceOutOfMemory, match=r"^the CUDA CPU harness ran out of memory in alloc \(4096 bytes"):
        b.alloc((4,))


@pytest.fixture
def harness_model(monkeypatch, tiny_llama):
    monkeypatch.setenv("SHARPI_CUDA_EXECUTOR", "cpu-harness")
    return engine.load(tiny_llama, backend="cuda", snapkv_budget=0)


def test_out_of_memory_fails_the_call_and_the_model_goes_on(harness_model, monkeypatch):
    """cuBLAS/allocation OOM in the middle of a prefill: DeviceOutOfMemory; the same
    model then answers as it did before."""
    from backends.cuda import quant
    want = harness_model.generate([5, 6, 7, 8], max_tokens=4, ignore_eos=True).text
    real = quant.matmul

    def matmul(ex, w, x, out, bias=None):
        raise OutOfMemoryError(64 * MIB, 900 * MIB, 0)

    monkeypatch.setattr(quant, "matmul", matmul)
    with pytest.raises(DeviceOutOfMemory, match=r"ran out of memory in matmul \(64 MiB requested, 900 MiB"):
        harness_model.generate([5, 6, 7, 8], max_tokens=4, ignore_eos=True)
    monkeypatch.setattr(quant, "matmul", real)
    assert harness_model.generate([5, 6, 7, 8], max_tokens=4, ignore_eos=True).text == want


def test_a_fault_surfacing_at_the_download_is_a_device_fault(harness_model, monkeypatch):
    def to_host(arr):
        raise CUDARuntimeError(700)

    monkeypatch.setattr(harness_model.backend.ex, "to_host", to_host)
    with pytest.raises(DeviceFault, match=r"faulted \(cudaErrorIllegalAddress: an illegal memory access was "
                                          r"encountered\) .* Reported by download;") as info:
        harness_model.generate([5, 6, 7], max_tokens=2)
    assert isinstance(info.value, EngineError)


FAULTING_CLI = """
import sys
from cupy_backends.cuda.api.runtime import CUDARuntimeError
from backends.cuda import runtime

def to_host(self, arr):
    raise CUDARuntimeError(700)

runtime.HarnessExecutor.to_host = to_host
from engine.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_engine_run_prints_one_line_and_exits_1(tiny_llama, tmp_path):
    script = tmp_path / "faulting_engine.py"
    script.write_text(FAULTING_CLI)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, str(script), "run", str(tiny_llama), "-p", "hi", "-n", "2",
                        "--backend", "cuda"], capture_output=True, text=True, timeout=120, cwd=root,
                       env=dict(os.environ, SHARPI_CUDA_EXECUTOR="cpu-harness", PYTHONPATH=root))
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert r.returncode == 1 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("error: the CUDA CPU harness faulted (cudaErrorIllegalAddress")
    assert "restart the process" in lines[0]


def test_a_device_that_cannot_be_set_up_is_unavailable_so_auto_falls_back(monkeypatch):
    """cupy failing while the executor creates its context (no memory left for it, a
    device in exclusive use) is BackendUnavailable, the error `--backend auto` skips."""
    from backends.cuda import backend as cuda_backend
    from engine.errors import BackendUnavailable

    def fails(*args, **kwargs):
        raise CUDARuntimeError(2)
    monkeypatch.setattr(cuda_backend, "make_executor", fails)
    with pytest.raises(BackendUnavailable, match=r"^backend 'cuda': the CUDA device could not be set up "
                                                 r"\(cudaErrorMemoryAllocation"):
        cuda_backend.CudaBackend(executor="device")



def test_heads_the_attention_kernels_cannot_take_are_refused_at_load(monkeypatch, tmp_path):
    """Heads wider than 256: one line before any weight is uploaded, not a ValueError at
    the first prompt."""
    from engine.errors import UnsupportedError
    from tiny_gguf import write_tiny_gguf
    monkeypatch.setenv("SHARPI_CUDA_EXECUTOR", "cpu-harness")
    wide = write_tiny_gguf(tmp_path / "wide.gguf", head_dim=320)
    with pytest.raises(UnsupportedError, match="backend 'cuda' needs an even head_dim <= 256, the model's is 320"):
        engine.load(wide, backend="cuda", snapkv_budget=0)
