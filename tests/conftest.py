import json
import pathlib
import sys

import pytest

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE))               # tests/tiny_gguf.py
sys.path.insert(0, str(HERE / "backends"))  # tests/backends/_backends.py


def pytest_collection_modifyitems(config, items):
    """The longest test files first, by the seconds tests/durations.json records for
    them (tools/test_durations.py; a file not listed counts as 0): `make test` hands
    whole files to two xdist workers in collection order (--dist loadfile
    --no-loadscope-reorder), so the long files overlap instead of one of them, picked
    up last, running alone at the end. The order within a file stays."""
    seconds = json.loads((HERE / "durations.json").read_text())
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], 0.0))


@pytest.fixture(scope="session")
def smollm2_path():
    """SmolLM2-135M-Instruct Q4_1: the smallest real model, the one the tests run (the
    engine's default is qwen2.5-coder-0.5b; tests pin the model they test)."""
    from engine.model_path import smollm2_model_path
    path = smollm2_model_path()
    if path is None:
        pytest.skip("smollm2 not installed (run `make setup`)")
    return path


@pytest.fixture(scope="session")
def default_model_path(smollm2_path):
    """The tests' default model: smollm2 (the name tests/cuda uses)."""
    return smollm2_path


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    from tiny_gguf import write_tiny_gguf
    return write_tiny_gguf(tmp_path_factory.mktemp("models") / "tiny-llama.gguf")
