import pytest

from _backends import EXECUTOR_IDS, cuda_test_executor

EXECUTOR = cuda_test_executor()


@pytest.fixture(scope="module", params=[pytest.param(EXECUTOR, id=EXECUTOR_IDS[EXECUTOR])])
def ex(request):
    """The CUDA backend's executor the op tests run on (docs/cuda.md): the one
    SHARPI_CUDA_EXECUTOR names, else the CPU harness; the test id says which
    ([harness] or [gpu]). With SHARPI_CUDA_EXECUTOR=device and no GPU every test
    using it errors with the BackendUnavailable reason (never the harness instead)."""
    from backends.cuda.runtime import make_executor
    return make_executor(request.param)


@pytest.fixture(scope="module")
def nvrtc_loaded():
    """NVRTC through cupy's binding (no GPU needed); the test skips with the reason when
    it cannot be loaded (backends/cuda/nvrtc.py)."""
    from backends.cuda import nvrtc
    from engine.errors import BackendUnavailable
    try:
        nvrtc.load()
    except BackendUnavailable as e:
        pytest.skip(str(e))
