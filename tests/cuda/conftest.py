import pytest


@pytest.fixture(scope="module")
def ex():
    """The CUDA backend's executor on the CPU harness (docs/cuda.md)."""
    from backends.cuda.runtime import make_executor
    return make_executor("cpu-harness")
