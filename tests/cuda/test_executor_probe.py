"""The device executor's start (runtime.CupyExecutor) without a GPU: the device count,
the compute capability and cupy.RawModule are replaced; everything else is the real
path, NVRTC included. A missing NVRTC, a compile error and an image the driver refuses
are BackendUnavailable in one line when the executor starts, so `--backend auto` falls
back; a kernel that does not compile later is one EngineError line."""
import sys

import pytest

from backends import get_backend
from backends.cuda import nvrtc, runtime
from backends.cuda.nvrtc import Target
from engine.errors import BackendUnavailable, EngineError

cupy = pytest.importorskip("cupy")


class FakeModule:
    """cupy.RawModule(path=...) without a driver: get_function checks that the image
    holds the entry point (a cubin's symbol table, a PTX .entry)."""
    loaded: list = []
    refuse: Exception | None = None

    def __init__(self, path):
        self.path = path

    def get_function(self, name):
        if FakeModule.refuse is not None:
            raise FakeModule.refuse
        image = open(self.path, "rb").read()
        assert name.encode() in image, (name, self.path)
        FakeModule.loaded.append((self.path, name))
        return (self.path, name)


@pytest.fixture
def device(monkeypatch, tmp_path):
    """A fake CUDA device 0 of compute capability `device.cc` (default 90)."""
    try:
        nvrtc.load()
    except BackendUnavailable as e:
        pytest.skip(str(e))

    class Device:
        cc = 90
    monkeypatch.setattr(runtime, "device_count", lambda cp=None: 1)
    monkeypatch.setattr(runtime, "open_device", lambda cp, index: Device.cc)
    monkeypatch.setattr(runtime, "CACHE_DIR", tmp_path)
    monkeypatch.setattr(cupy, "RawModule", lambda path: FakeModule(path))
    monkeypatch.setattr(FakeModule, "loaded", [])
    monkeypatch.setattr(FakeModule, "refuse", None)
    return Device


@pytest.fixture
def no_nvrtc_binding(device, monkeypatch):
    """cupy without cupy_backends.cuda.libs.nvrtc (as if a release moved it)."""
    import cupy_backends.cuda.libs as libs
    monkeypatch.setattr(nvrtc, "_binding", None)
    monkeypatch.delattr(libs, "nvrtc", raising=False)
    monkeypatch.setitem(sys.modules, "cupy_backends.cuda.libs.nvrtc", None)


def test_probe_compiles_and_loads_sass_for_the_device(device, tmp_path):
    ex = runtime.CupyExecutor(0)
    assert ex.target == Target(90, "cubin")
    (path, name), = FakeModule.loaded
    assert name == "sharpi_probe" and path.startswith(str(tmp_path)) and path.endswith(".cubin")
    assert open(path, "rb").read(4) == b"\x7fELF"


def test_probe_loads_ptx_where_nvrtc_lacks_the_arch(device, monkeypatch):
    device.cc = 120
    monkeypatch.setattr(nvrtc, "supported_archs", lambda: (75, 80, 86, 89, 90))     # NVRTC < 12.8
    ex = runtime.CupyExecutor(0)
    assert ex.target == Target(90, "ptx")
    (path, _), = FakeModule.loaded
    assert path.endswith(".ptx") and b".target sm_90" in open(path, "rb").read()


def test_nvrtc_binding_missing(no_nvrtc_binding):
    with pytest.raises(BackendUnavailable, match="lacks the NVRTC binding.*nvidia-cuda-nvrtc") as info:
        runtime.CupyExecutor(0)
    assert "\n" not in str(info.value)


def test_libnvrtc_missing(device, monkeypatch):
    monkeypatch.setattr(nvrtc, "_binding", None)
    monkeypatch.setattr(nvrtc, "_usable", lambda binding: False)
    monkeypatch.setattr(nvrtc, "_library_candidates", lambda majors: [])
    with pytest.raises(BackendUnavailable, match=r"libnvrtc\.so\.\d+ was not found; pip install"):
        runtime.CupyExecutor(0)


def test_probe_compile_error(device, monkeypatch):
    monkeypatch.setattr(runtime, "PROBE_SOURCE", 'extern "C" __global__ void sharpi_probe(int* x) { y[0] = 1; }')
    with pytest.raises(BackendUnavailable, match=r"for sm_90 cannot compile a one-line kernel: .*"
                                                 r'identifier "y" is undefined') as info:
        runtime.CupyExecutor(0)
    assert "\n" not in str(info.value)


def test_driver_refuses_the_image(device):
    FakeModule.refuse = RuntimeError("CUDA_ERROR_UNSUPPORTED_PTX_VERSION: the provided PTX was compiled with "
                                     "an unsupported toolchain.\nmore")
    device.cc = 90
    with pytest.raises(BackendUnavailable, match="cannot load the image of NVRTC .* for sm_90 "
                                                 r"\(RuntimeError: CUDA_ERROR_UNSUPPORTED_PTX_VERSION") as info:
        runtime.CupyExecutor(0)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("broken", ["binding", "compile"])
def test_auto_falls_back(device, monkeypatch, broken, request):
    if broken == "binding":
        request.getfixturevalue("no_nvrtc_binding")
    else:
        monkeypatch.setattr(runtime, "PROBE_SOURCE", "this is not CUDA")
    with pytest.raises(BackendUnavailable):
        get_backend("cuda", auto_gpu_only=True)                  # what `auto` tries first
    assert get_backend("auto", quiet=True).name != "cuda"


def test_kernel_compile_error_later_is_one_line(device):
    ex = runtime.CupyExecutor(0)
    with pytest.raises(EngineError) as info:
        ex.function("attention.cu", "attention_prefill_d64", ("KV_K=KV_BOGUS",))
    message = str(info.value)
    assert type(info.value) is EngineError and "\n" not in message
    assert message.startswith("backend 'cuda': kernels/attention.cu -DKV_K=KV_BOGUS does not compile for sm_90: ")
    assert "KV_BOGUS" in message.split(": ", 2)[2]


def test_kernels_compiled_once_and_cached_on_disk(device, tmp_path):
    ex = runtime.CupyExecutor(0)
    assert ex.function("rope.cu", "rope") == ex.function("rope.cu", "rope")
    images = sorted(p.name for p in tmp_path.iterdir())
    assert len(images) == 2 and any(n.startswith("rope-") and n.endswith(".cubin") for n in images)
    ex2 = runtime.CupyExecutor(0)                     # a new process would find the same file
    ex2.function("rope.cu", "rope")
    assert sorted(p.name for p in tmp_path.iterdir()) == images


def test_a_worker_thread_binds_the_executors_device(device, monkeypatch):
    """cupy's current device is per thread: a server's worker thread (which did not load
    the model) makes the model's device current before it runs anything
    (CudaBackend.bind_thread, called by the scheduler), here device 1 of two."""
    import threading
    used = []

    class Device:
        def __init__(self, index):
            self.index = index

        def use(self):
            used.append((threading.current_thread().name, self.index))

    monkeypatch.setattr(runtime, "device_count", lambda cp=None: 2)
    ex = runtime.CupyExecutor(1)
    monkeypatch.setattr(cupy.cuda, "Device", Device)
    from backends.cuda.backend import CudaBackend
    b = object.__new__(CudaBackend)
    b.ex = ex
    t = threading.Thread(target=b.bind_thread, name="engine-worker")
    t.start()
    t.join()
    assert used == [("engine-worker", 1)]
