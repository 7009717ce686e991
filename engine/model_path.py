"""Where the catalogued models (engine/catalog.py) live on this machine, by short name.

Assembled models go to MODELS_DIR (<venv>/share/snapkv-engine/models/); a WheelFile
model (smollm2) is located through its distribution's metadata, the package never
imported. Anywhere a model path is taken, a short name works too; without one, the
default model (catalog.DEFAULT: Qwen2.5-Coder-0.5B-Instruct).
"""
from __future__ import annotations

import importlib.metadata
import pathlib
import sys

from .catalog import BY_NAME, DEFAULT, CatalogEntry, WheelFile

MODELS_DIR = pathlib.Path(sys.prefix) / "share" / "snapkv-engine" / "models"


def target_path(entry: CatalogEntry) -> pathlib.Path | None:
    """Where an assembled model's file goes (None for a WheelFile model: pip places it)."""
    return None if isinstance(entry.source, WheelFile) else MODELS_DIR / entry.file


def installed_path(entry: CatalogEntry) -> pathlib.Path | None:
    """The installed file of a catalogued model, or None. A file counts only at its
    catalogued size (a cheap check; an assembled file's SHA-256 was checked when it was
    assembled)."""
    if isinstance(entry.source, WheelFile):
        try:
            dist = importlib.metadata.distribution(entry.source.distribution)
        except importlib.metadata.PackageNotFoundError:
            return None
        path = pathlib.Path(dist.locate_file(entry.source.member))
        return path if path.is_file() and path.stat().st_size == entry.size else None
    path = target_path(entry)
    return path if path.is_file() and path.stat().st_size == entry.size else None


def named_model_path(name: str) -> pathlib.Path | None:
    """The installed file of the model called `name` in the catalog, or None."""
    return installed_path(BY_NAME[name])


def default_model_path() -> pathlib.Path | None:
    """The default model's file (qwen2.5-coder-0.5b), or None if not installed."""
    return named_model_path(DEFAULT)


def smollm2_model_path() -> pathlib.Path | None:
    """SmolLM2-135M-Instruct Q4_1 (the tests' model), or None."""
    return named_model_path("smollm2")


def gemma3_model_path() -> pathlib.Path | None:
    """Gemma 3 270M Q4_K_M, or None."""
    return named_model_path("gemma3")


def missing_setup_models() -> list[str]:
    """Names of the models `make setup` installs that are not installed."""
    return [e.name for e in BY_NAME.values() if e.setup and installed_path(e) is None]


def _install_hint(entry: CatalogEntry) -> str:
    return f"`engine pull {entry.name}`" + (" or `make setup`" if entry.setup else "")


def model_path_or_default(path=None):
    """`path` if given (a catalogued short name resolves to its installed file unless a
    file of that name exists), else the default model; one clear error when the model
    is not installed."""
    from .errors import EngineError
    if path is not None:
        name = str(path)
        if name in BY_NAME and not pathlib.Path(name).is_file():
            found = named_model_path(name)
            if found is None:
                raise EngineError(f"model '{name}' is not installed: run {_install_hint(BY_NAME[name])}")
            return found
        return path
    found = default_model_path()
    if found is None:
        raise EngineError(f"the default model ({DEFAULT}) is not installed: run "
                          f"{_install_hint(BY_NAME[DEFAULT])}, or pass a .gguf path or an installed "
                          f"model's name (`engine models`)")
    return found
