import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))               # tests/tiny_gguf.py
sys.path.insert(0, str(pathlib.Path(__file__).parent / "backends"))  # tests/backends/_backends.py


@pytest.fixture(scope="session")
def default_model_path():
    from engine.model_path import default_model_path as locate
    path = locate()
    if path is None:
        pytest.skip("default model not installed (run `make setup`)")
    return path


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    from tiny_gguf import write_tiny_gguf
    return write_tiny_gguf(tmp_path_factory.mktemp("models") / "tiny-llama.gguf")
