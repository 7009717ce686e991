"""The CPU backend: numba kernels (ops.py and the modules it uses).

numba's on-disk cache knows only the file that defines a kernel, not the intrinsics and
inlined helpers it takes from the other modules here (vnni.py's quantizer, jit.py's expf):
an edit to those would leave every cached kernel using the old code. So the cache lives
in a folder named by a hash of every module of this package (NUMBA_CACHE_DIR, when set,
holds those folders), and folders of earlier sources are removed after a day unused. Every module is
imported here, with that folder set, so no kernel is decorated with another.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path


def _cache_dir() -> Path:
    here = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(here.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    env = os.environ.get("NUMBA_CACHE_DIR")
    bases = [Path(env)] if env else [here / "__pycache__", Path.home() / ".cache" / "snapkv-engine"]
    for base in bases:
        try:
            base.mkdir(parents=True, exist_ok=True)
            if os.access(base, os.W_OK):
                break
        except OSError:
            continue
    folder = base / f"numba-cpu-{digest.hexdigest()[:16]}"
    stale = time.time() - 86400          # a day unused (another checkout may share NUMBA_CACHE_DIR)
    for old in [*base.glob("numba-cpu-*"), *base.glob("*.nb[ic]")]:   # (and numba's own in-tree files)
        try:
            if old != folder and old.stat().st_mtime < stale:
                shutil.rmtree(old) if old.is_dir() else old.unlink()
        except OSError:
            pass
    return folder


def _import_kernels() -> None:
    """Every module of the package imported (its kernels decorated) with numba's cache in
    _cache_dir(); other packages' numba caches are left where numba puts them."""
    import importlib

    from numba.core import config
    saved, config.CACHE_DIR = config.CACHE_DIR, str(_cache_dir())
    try:
        for path in sorted(Path(__file__).resolve().parent.glob("*.py")):
            if path.stem != "__init__":
                importlib.import_module(f"{__name__}.{path.stem}")
    finally:
        config.CACHE_DIR = saved


_import_kernels()

from .backend import CpuBackend  # noqa: E402

__all__ = ["CpuBackend"]
