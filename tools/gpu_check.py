"""GPU truth in one call: everything this engine can check on a lent GPU machine, in one command.

The one call for the device tool (its `run` function), from the repository root:

    command: python3 tools/gpu_check.py run --bundle gpu_bundle --out "$OUT"
    carry:   ["gpu_bundle"]

Made beforehand on a CPU machine with `python tools/gpu_check.py prepare` (writes gpu_bundle/,
git-ignored). Subcommands:

  prepare   (CPU machine) the bundle: cut real models, the wheels the device image lacks, the
            Vulkan loader, kp built for the device's Python 3.12; measures the whole call (tracked
            + untracked files + bundle) and fails over 62 MiB. --no-download: cut the models only,
            count a fixed allowance for the rest.
  check     (CPU machine, just before the call) the bundle still matches the tree (SPIR-V of
            every shader variant, the models) and the whole call still fits.
  run       (GPU machine) every step a subprocess with its own timeout, the whole under --budget-s
            (500 s); writes report.json (with the bench JSON) + report.md + logs.tar.gz under --out
            after every step (at most 5 files at once: the device tool returns 8).
  dry-run   prepare + run here: CUDA on the CPU harness, Vulkan on lavapipe, heavy steps scaled down.
  parity | tiny | env | install | derive | compile | vulkan-env   the steps themselves (used by run).

docs/gpu_check.md says what each step checks and what the report holds.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import inspect
import io
import json
import os
import pathlib
import platform
import shutil
import signal
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
import zipfile
from dataclasses import dataclass, field

REPO = pathlib.Path(__file__).resolve().parents[1]
ONE_CALL_COMMAND = 'python3 tools/gpu_check.py run --bundle gpu_bundle --out "$OUT"'
ONE_CALL_CARRY = ["gpu_bundle"]
DEFAULT_BUNDLE = "gpu_bundle"
WORK_DIR = ".gpu_check_work"     # run's scratch (git-ignored), removed at its end
LIMIT_MIB = 62.0                 # the whole call: tracked + untracked files + bundle (the tool allows 64)
ALLOWANCE_MIB = 7.0              # counted for wheels, Vulkan loader and kp when prepare --no-download skips them
BUDGET_S = 500.0                 # run's whole budget (the device tool allows 600 s a command; the call's
                                 # timeout_s 560 leaves the rest for a step cut at the budget)
SKIPPED = 3                      # a step's exit status meaning "skipped"; its last line says why
SANITIZER_ERRORS = 86            # compute-sanitizer's exit status when it found errors (not a parity failure's 1)

# What the device image lacks (it has Python 3.12, numpy 2, cupy-cuda13x, numba, jinja2, pytest,
# hypothesis, torch): import name -> distribution, pinned to this venv's version when prepared.
# The project's runtime dependencies less those, less the server's (fastapi, uvicorn, pydantic:
# no step imports engine.serve), plus what they import (gguf imports yaml) and pytest-xdist.
WHEELS = {"gguf": "gguf", "yaml": "pyyaml", "tokenizers": "tokenizers", "psutil": "psutil",
          "threadpoolctl": "threadpoolctl", "xdist": "pytest-xdist", "execnet": "execnet"}
PIP_PLATFORM = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
                "--platform", "manylinux2014_x86_64", "--platform", "manylinux_2_17_x86_64",
                "--platform", "manylinux_2_28_x86_64", "--no-deps"]
SPIRV_TAR = "spirv.tar.xz"       # every shader variant compiled here: the device has no glslangValidator
GLVND_DIR = "glvnd"
LOGS_TAR = "logs.tar.gz"
NVIDIA_EGL_VENDOR = {"file_format_version": "1.0.0", "ICD": {"library_path": "libEGL_nvidia.so.0"}}
NVIDIA_ICD = {"file_format_version": "1.0.0", "ICD": {"library_path": "libGLX_nvidia.so.0", "api_version": "1.3"}}


@dataclass(frozen=True)
class Cut:
    """A real model cut to travel: `source` is its catalog name (engine/catalog.py)."""
    file: str
    source: str
    layers: int
    n_vocab: int | None
    about: str


CUTS = (
    Cut("smollm2-2l.gguf", "smollm2", 2, None,
        "SmolLM2-135M-Instruct Q4_1, blocks 0-1 of 30; the real tokenizer and tied Q8_0 head (49152 x 576)"),
    Cut("gemma3-2l-v2k.gguf", "gemma3", 2, 2048,
        "Gemma 3 270M Q4_K_M, blocks 0-1 of 18 (sliding-window layers, window 512); the first 2048 of "
        "262144 tokens (embedding = tied head rows, tokenizer entries): a cut tokenizer, not the real one "
        "(the full vocabulary is 170 MiB alone)"),
)


# -- prepare ------------------------------------------------------------------------------
def _git_files(*args) -> list[pathlib.Path]:
    out = subprocess.run(["git", "ls-files", "-z", *args], cwd=REPO, capture_output=True, check=True).stdout
    return [REPO / p for p in out.decode().split("\0") if p]


def _size(paths) -> int:
    return sum(p.stat().st_size for p in paths if p.is_file() and not p.is_symlink())


def call_size(bundle: pathlib.Path) -> dict:
    """Bytes the one call carries: tracked files, untracked files git does not ignore, the bundle."""
    tracked, untracked = _git_files(), _git_files("--others", "--exclude-standard")
    inside = [p for p in untracked if bundle.resolve() in p.resolve().parents]   # a non-ignored bundle
    return {"tracked": _size(tracked), "untracked": _size(set(untracked) - set(inside)),
            "bundle": _size(bundle.rglob("*"))}


def _download_wheels(dest: pathlib.Path) -> list[str]:
    reqs = []
    for dist in WHEELS.values():
        try:
            reqs.append(f"{dist}=={importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            reqs.append(dist)
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", *PIP_PLATFORM,
                    "-d", str(dest), *reqs], check=True)
    return reqs


# Debian packages whose libraries the Vulkan steps carry, as plain files (links do not travel
# well), each into its folder of the bundle's vulkan/: the loader, and glvnd's EGL, which
# NVIDIA's Vulkan driver (libGLX_nvidia.so.0) loads at vkCreateInstance: without libEGL.so.1 it
# gives the loader no vkCreateInstance and kp sees no device (the H100 image, 2026-12-05).
VULKAN_DEBS = {"libvulkan1": ("", ["libvulkan.so.1"]),
               "libegl1": (GLVND_DIR, ["libEGL.so.1"]),
               "libglvnd0": (GLVND_DIR, ["libGLdispatch.so.0"])}


def _download_vulkan_libs(dest: pathlib.Path) -> str:
    """VULKAN_DEBS' libraries into `dest` (apt-get download, dpkg-deb -x): the .deb files' names."""
    names = []
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["apt-get", "download", "-q", *VULKAN_DEBS], cwd=tmp, check=True, capture_output=True)
        for pkg, (sub, libs) in VULKAN_DEBS.items():
            deb = next(pathlib.Path(tmp).glob(f"{pkg}_*.deb"))
            x = pathlib.Path(tmp) / pkg
            subprocess.run(["dpkg-deb", "-x", str(deb), str(x)], check=True)
            (dest / sub).mkdir(parents=True, exist_ok=True)
            for lib in libs:
                shutil.copyfile(next(x.rglob(lib)).resolve(), dest / sub / lib)
            names.append(deb.name)
    return ", ".join(names)


KP_VERSION = "0.9.0"
KP_CACHE = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache") / "snapkv-engine" / "kp-py312"


def _python312() -> str | None:
    """A CPython 3.12 with its headers on this machine (pyenv's, or the system's), for the
    device's kp; None if there is none."""
    found = [shutil.which("python3.12")] + sorted(map(str, pathlib.Path.home().glob(".pyenv/versions/3.12*/bin/python3.12")))
    for py in filter(None, found):
        r = subprocess.run([py, "-c", "import os, sysconfig; p = sysconfig.get_paths()['include']; "
                            "print(p if os.path.isfile(os.path.join(p, 'Python.h')) else '')"],
                           capture_output=True, text=True)
        if r.returncode == 0 and r.stdout.strip():
            return py
    return None


def _build_kp_py312(dest: pathlib.Path) -> str:
    """kp 0.9.0 (patched as make setup patches it) and our _kp_barrier for the device's
    CPython 3.12, into dest: built against pybind11 >= 2.12 from PyPI, whose numpy support
    works with numpy 2 (the device's; the system pybind11 2.10 that make setup's kp uses
    needs numpy < 2). Built once in KP_CACHE (a venv and the two modules, keyed by the
    patch and kp_barrier.cpp; about 3 minutes), then copied. -> a line for the manifest."""
    py = _python312()
    if py is None:
        return "not built: no CPython 3.12 with its headers on this machine"
    key = hashlib.sha256(b"".join(f.read_bytes() for f in (REPO / "tools" / f"kp-{KP_VERSION}.patch",
                                                          REPO / "backends" / "vulkan" / "native" / "kp_barrier.cpp"))
                          + inspect.getsource(_build_kp_py312).encode()).hexdigest()[:16]   # its recipe, not this file
    built = KP_CACHE / key
    if not all(any(built.glob(f"{m}.cpython-312-*.so")) for m in ("kp", "_kp_barrier")):
        venv, vpy = KP_CACHE / "venv", KP_CACHE / "venv" / "bin" / "python"
        if not vpy.is_file():
            subprocess.run([py, "-m", "venv", str(venv)], check=True)
        pip = [str(vpy), "-m", "pip", "-q", "--disable-pip-version-check"]
        subprocess.run([*pip, "install", "setuptools", "wheel", "pybind11>=2.12", "numpy>=2"], check=True)
        pybind = subprocess.run([str(vpy), "-c", "import pybind11; print(pybind11.get_cmake_dir()); "
                                 "print(pybind11.get_include())"], check=True, capture_output=True, text=True)
        cmake_dir, include = pybind.stdout.split()
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([*pip, "download", "--no-deps", "--no-binary", ":all:", f"kp=={KP_VERSION}", "-d", tmp],
                           check=True)
            subprocess.run(["tar", "-xzf", f"{tmp}/kp-{KP_VERSION}.tar.gz", "-C", tmp], check=True)
            with open(REPO / "tools" / f"kp-{KP_VERSION}.patch", "rb") as patch:
                subprocess.run(["patch", "-s", "-p1", "-d", f"{tmp}/kp-{KP_VERSION}"], stdin=patch, check=True)
            toolchain = pathlib.Path(tmp) / "python.cmake"      # as tools/setup.sh: pin the interpreter
            toolchain.write_text(f'set(PYTHON_EXECUTABLE "{vpy}" CACHE FILEPATH "" FORCE)\n'
                                 f'set(pybind11_DIR "{cmake_dir}" CACHE PATH "" FORCE)\n')
            env = dict(os.environ, CMAKE_TOOLCHAIN_FILE=str(toolchain), KOMPUTE_OPT_INSTALL="OFF",
                       KOMPUTE_OPT_DISABLE_VK_DEBUG_LAYERS="ON", KOMPUTE_OPT_USE_BUILT_IN_VULKAN_HEADER="OFF",
                       KOMPUTE_OPT_USE_BUILT_IN_FMT="OFF", KOMPUTE_OPT_USE_BUILT_IN_PYBIND11="OFF",
                       KOMPUTE_PYTHON_NUM_PARALLEL_THREADS="2")
            subprocess.run([*pip, "install", "--no-build-isolation", "--no-deps", "--force-reinstall",
                            f"{tmp}/kp-{KP_VERSION}"], check=True, env=env)
        site = subprocess.run([str(vpy), "-c", "import kp; print(kp.__file__)"], check=True, capture_output=True,
                              text=True).stdout.strip()
        built.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(site, built / pathlib.Path(site).name)
        suffix = pathlib.Path(site).name[len("kp"):]
        subprocess.run([str(vpy), str(REPO / "tools" / "build_kp_barrier.py"), "--out",
                        str(built / f"_kp_barrier{suffix}"), "--pybind11", include], check=True)
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for f in sorted(built.glob("*.so")):
        shutil.copyfile(f, dest / f.name)
    libs = _copy_linked_libs(sorted(dest.glob("*.so")), dest)
    return (f"kp {KP_VERSION} + _kp_barrier for CPython 3.12 (pybind11 >= 2.12: numpy 2), built with {py}"
            + (f"; with {', '.join(libs)}" if libs else ""))


# what any Linux a CUDA image runs on has; anything else kp links is carried beside it
BASE_LIBS = ("linux-vdso", "ld-linux", "libc.so", "libm.so", "libstdc++.so", "libgcc_s.so", "libpthread.so",
             "libdl.so", "librt.so", "libvulkan.so")


def _copy_linked_libs(modules: list[pathlib.Path], dest: pathlib.Path) -> list[str]:
    """Copy the shared libraries the modules link beyond BASE_LIBS (kp: libfmt) into dest."""
    copied = []
    for m in modules:
        for line in subprocess.run(["ldd", str(m)], capture_output=True, text=True).stdout.splitlines():
            name, _, rest = line.strip().partition(" => ")
            path = rest.split(" (")[0].strip()
            if name and path.startswith("/") and not name.startswith(BASE_LIBS) and name not in copied:
                shutil.copyfile(path, dest / name)
                copied.append(name)
    return copied


def _spirv_keys() -> dict:
    """The Vulkan backend's SPIR-V cache key of every shader variant -> (shader, defines)."""
    sys.path.insert(0, str(REPO))
    from backends.vulkan import shaders
    return {shaders._key(n, d): (n, d) for n, d in shaders.variants()}


def _tar_names(path: pathlib.Path) -> set[str]:
    """The members of a tar file (none when it does not exist)."""
    if not path.is_file():
        return set()
    with tarfile.open(path) as t:
        return set(t.getnames())


def _spirv_tar(dest: pathlib.Path) -> str:
    """Every Vulkan shader variant as SPIR-V (compiled here, or from this machine's cache)
    in one .tar.xz named by the backend's cache keys, unless dest holds exactly those."""
    keys = _spirv_keys()                 # (puts the repository on sys.path)
    if _tar_names(dest) == set(keys):
        return f"{len(keys)} variants (kept)"
    from backends.vulkan import shaders
    tmp = dest.with_suffix(".tmp")
    with tarfile.open(tmp, "w:xz") as t:
        for key, (name, defines) in sorted(keys.items()):
            data = shaders.spirv(name, defines)
            info = tarfile.TarInfo(key)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            t.addfile(info, io.BytesIO(data))
    os.replace(tmp, dest)
    return f"{len(keys)} variants"


def prepare(bundle: pathlib.Path, download: bool = True) -> dict:
    sys.path.insert(0, str(REPO))
    from engine.model_path import named_model_path
    sys.path.insert(0, str(REPO / "tools"))
    from gguf_cut import cut_gguf

    t0 = time.perf_counter()
    for sub in ("models", "wheels", "vulkan"):
        (bundle / sub).mkdir(parents=True, exist_ok=True)
    old = {}
    if (bundle / "manifest.json").is_file():
        old = json.loads((bundle / "manifest.json").read_text())
    models = []
    for cut in CUTS:
        src = named_model_path(cut.source)
        if src is None:
            raise SystemExit(f"prepare: model {cut.source!r} is not installed (make setup, or engine pull {cut.source})")
        dst = bundle / "models" / cut.file
        key = {"source": str(src), "source_bytes": src.stat().st_size, "layers": cut.layers, "n_vocab": cut.n_vocab,
               "cutter": (REPO / "tools" / "gguf_cut.py").stat().st_size}
        prev = next((m for m in old.get("models", []) if m["file"] == cut.file), None)
        if not (dst.is_file() and prev and prev.get("key") == key):
            cut_gguf(src, dst, range(cut.layers), cut.n_vocab)
        models.append({"file": cut.file, "about": cut.about, "bytes": dst.stat().st_size, "key": key})
    wheels = vulkan = kp = None
    if download:
        wheels = _download_wheels(bundle / "wheels")
        vulkan = _download_vulkan_libs(bundle / "vulkan")
        kp = _build_kp_py312(bundle / "vulkan" / "py312")
    (bundle / "vulkan" / "nvidia_icd.json").write_text(json.dumps(NVIDIA_ICD, indent=1) + "\n")
    (bundle / "vulkan" / GLVND_DIR).mkdir(exist_ok=True)
    (bundle / "vulkan" / GLVND_DIR / "10_nvidia.json").write_text(json.dumps(NVIDIA_EGL_VENDOR, indent=1) + "\n")
    spirv = _spirv_tar(bundle / "vulkan" / SPIRV_TAR)
    have_wheels = sorted(p.name for p in (bundle / "wheels").glob("*.whl"))
    have_loader = all((bundle / "vulkan" / sub / lib).is_file() for sub, libs in VULKAN_DEBS.values() for lib in libs)
    sizes = call_size(bundle)
    allowance = 0.0 if (have_wheels and have_loader) else ALLOWANCE_MIB * 2**20
    total = sum(sizes.values()) + allowance
    manifest = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "downloaded": download,
        "models": models,
        "wheels": [{"file": n, "bytes": (bundle / "wheels" / n).stat().st_size} for n in have_wheels],
        "wheel_requirements": wheels or [f"{d} (not downloaded)" for d in WHEELS.values()],
        "vulkan_loader": vulkan or ("libvulkan.so.1, glvnd/ (kept)" if have_loader else "not downloaded"),
        "kp": kp or ("kept" if any((bundle / "vulkan" / "py312").glob("kp.*.so")) else "not built"),
        "spirv": spirv,
        "call_bytes": sizes, "allowance_bytes": allowance, "call_total_bytes": total,
        "limit_bytes": LIMIT_MIB * 2**20, "one_call": {"command": ONE_CALL_COMMAND, "carry": ONE_CALL_CARRY},
    }
    (bundle / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    mib = lambda n: f"{n / 2**20:6.2f} MiB"   # noqa: E731
    print(f"bundle {bundle} ({time.perf_counter() - t0:.1f} s)")
    for m in models:
        print(f"  models/{m['file']:<28} {mib(m['bytes'])}  {m['about']}")
    for w in manifest["wheels"]:
        print(f"  wheels/{w['file'][:60]:<60} {mib(w['bytes'])}")
    print(f"  vulkan/: {manifest['vulkan_loader']}; py312/: {manifest['kp']}; {SPIRV_TAR}: {spirv}")
    print(f"whole call: tracked {mib(sizes['tracked'])} + untracked {mib(sizes['untracked'])} + bundle "
          f"{mib(sizes['bundle'])}" + (f" + allowance {mib(allowance)}" if allowance else "")
          + f" = {mib(total)} (limit {LIMIT_MIB:.0f} MiB)")
    if total > LIMIT_MIB * 2**20:
        raise SystemExit(f"prepare: the call would carry {total / 2**20:.1f} MiB, over {LIMIT_MIB:.0f} MiB")
    return manifest


def check_bundle(bundle: pathlib.Path) -> list[str]:
    """(CPU machine, just before the call) What would waste the one call: the problems, none
    when the bundle still matches the tree (its SPIR-V the shaders' variants, its models cut
    from the installed ones) and the whole call fits under LIMIT_MIB."""
    if not (bundle / "manifest.json").is_file():
        return [f"no bundle at {bundle} (python tools/gpu_check.py prepare)"]
    manifest, problems = json.loads((bundle / "manifest.json").read_text()), []
    want, have = set(_spirv_keys()), _tar_names(bundle / "vulkan" / SPIRV_TAR)
    if have != want:
        problems.append(f"{SPIRV_TAR} holds {len(have & want)} of the shaders' {len(want)} variants now: "
                        f"every Vulkan step would be skipped")
    for cut in CUTS:
        if not (bundle / "models" / cut.file).is_file():
            problems.append(f"models/{cut.file} is missing")
    sizes = call_size(bundle)
    total = sum(sizes.values()) + manifest.get("allowance_bytes", 0)
    if total > LIMIT_MIB * 2**20:
        problems.append(f"the call would carry {total / 2**20:.1f} MiB, over {LIMIT_MIB:.0f} MiB")
    return problems


# -- run: steps as subprocesses -------------------------------------------------------------
@dataclass
class Step:
    name: str
    title: str
    argv: list[str] | None          # None: decided at run time (skip_reason says why not)
    timeout: float
    env: dict = field(default_factory=dict)
    needs: tuple[str, ...] = ()     # steps that must have passed
    skip_reason: str | None = None
    min_s: float = 20.0             # not started with less than this left of the budget
    tail_lines: int = 25            # log lines shown in the report


def _me(*args) -> list[str]:
    return [sys.executable, str(REPO / "tools" / "gpu_check.py"), *args]


def _sanitizer() -> str | None:
    found = shutil.which("compute-sanitizer")
    more = [str(p) for pattern in ("/usr/local/cuda*/bin/compute-sanitizer", "/usr/local/cuda*/compute-sanitizer/compute-sanitizer",
                                   "/opt/nvidia/*/compute-sanitizer*/compute-sanitizer")
            for p in sorted(pathlib.Path("/").glob(pattern.lstrip("/")))]
    more += [str(p) for d in map(pathlib.Path, sys.path) if d.is_dir()
             for p in sorted(d.glob("nvidia/cu*/bin/compute-sanitizer"))]
    for p in ([found] if found else []) + more:
        if p and os.access(p, os.X_OK):
            return p
    return None


def _vulkan_env(bundle: pathlib.Path, pythonpath: str = "", work: pathlib.Path | None = None) -> tuple[dict, list[str]]:
    """LD_LIBRARY_PATH / VK_ICD_FILENAMES / SNAPKV_SPIRV_CACHE additions for the Vulkan steps,
    and what was found; where this Python has no kp, the bundle's build for it first on
    PYTHONPATH (`pythonpath`: the steps' own), the libraries it needs on LD_LIBRARY_PATH and
    its _kp_barrier copied into backends/vulkan/; the carried SPIR-V unpacked into `work`
    (the device has no shader compiler)."""
    env, notes, libs = {}, [], []
    tag = f"py{sys.version_info.major}{sys.version_info.minor}"
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    if importlib.util.find_spec("kp") is not None:
        notes.append("kp importable")
    elif (bundle / "vulkan" / tag / f"kp{suffix}").is_file():
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(bundle / "vulkan" / tag), pythonpath]))
        libs.append(str(bundle / "vulkan" / tag))        # libfmt and whatever else kp links beyond the base system
        barrier, target = bundle / "vulkan" / tag / f"_kp_barrier{suffix}", REPO / "backends" / "vulkan" / f"_kp_barrier{suffix}"
        if barrier.is_file() and not target.exists():
            shutil.copyfile(barrier, target)
        notes.append(f"kp from the bundle (vulkan/{tag}: built for this Python against pybind11 >= 2.12)")
    else:
        notes.append(f"no kp for Python {platform.python_version()} (none installed, none in the bundle)")
    ldconfig_exe = shutil.which("ldconfig") or next((p for p in ("/sbin/ldconfig", "/usr/sbin/ldconfig")
                                                     if os.access(p, os.X_OK)), None)
    ldconfig = subprocess.run([ldconfig_exe, "-p"], capture_output=True, text=True).stdout if ldconfig_exe else ""
    # the driver's libraries may be mounted where only LD_LIBRARY_PATH finds them (not in the ld cache)
    lib_dirs = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if d] + [
        "/usr/local/nvidia/lib64", "/usr/local/nvidia/lib", "/usr/lib/x86_64-linux-gnu", "/usr/lib64"]
    ldconfig += "".join(f" {p.name}\n" for d in lib_dirs for p in sorted(pathlib.Path(d).glob("lib*_nvidia.so*")))
    if "libvulkan.so.1" in ldconfig:
        notes.append("system Vulkan loader present")
    elif (bundle / "vulkan" / "libvulkan.so.1").is_file():
        libs.append(str(bundle / "vulkan"))
        notes.append("no system Vulkan loader: using the bundle's libvulkan.so.1")
    else:
        notes.append("no Vulkan loader (system or bundle)")
    if "libEGL.so.1" not in ldconfig and (bundle / "vulkan" / GLVND_DIR / "libEGL.so.1").is_file():
        libs.append(str(bundle / "vulkan" / GLVND_DIR))
        notes.append("no system libEGL.so.1 (NVIDIA's Vulkan driver loads it): using the bundle's glvnd/")
    if libs:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [*libs, os.environ.get("LD_LIBRARY_PATH")]))
    tar = bundle / "vulkan" / SPIRV_TAR
    if work is not None and tar.is_file():
        cache = work / "spirv"
        if not cache.is_dir():
            cache.mkdir(parents=True)
            with tarfile.open(tar) as t:
                t.extractall(cache, filter="data")
        env["SNAPKV_SPIRV_CACHE"] = str(cache)
        notes.append(f"SPIR-V from the bundle ({len(list(cache.glob('*.spv')))} variants)")
    icd_dirs = ["/usr/share/vulkan/icd.d", "/etc/vulkan/icd.d", "/usr/local/share/vulkan/icd.d",
                *(f"{d}/vulkan/icd.d" for d in os.environ.get("XDG_DATA_DIRS", "").split(":") if d)]
    icds = [str(p) for d in dict.fromkeys(icd_dirs) for p in sorted(pathlib.Path(d).glob("*.json"))]
    nvidia_json = [p for p in icds if "nvidia" in p.lower()]
    notes.append(f"ICD files: {', '.join(icds) or 'none'}")
    # The NVIDIA container toolkit may mount the driver's own files under /usr/local/nvidia/share,
    # where neither the Vulkan loader nor glvnd looks.
    driver_share = pathlib.Path("/usr/local/nvidia/share")
    egl_vendor = driver_share / "glvnd" / "egl_vendor.d" / "10_nvidia.json"
    if not any((pathlib.Path(d) / "glvnd" / "egl_vendor.d" / "10_nvidia.json").is_file() for d in ("/usr/share", "/etc")):
        if not egl_vendor.is_file() and "libEGL_nvidia.so.0" in ldconfig:
            egl_vendor = bundle / "vulkan" / GLVND_DIR / "10_nvidia.json"     # glvnd finds the driver's EGL by it
        if egl_vendor.is_file():
            env["__EGL_VENDOR_LIBRARY_FILENAMES"] = str(egl_vendor)
            notes.append(f"EGL vendor file {egl_vendor}")
    if not nvidia_json and (driver_share / "vulkan" / "icd.d" / "nvidia_icd.json").is_file():
        env["VK_ICD_FILENAMES"] = str(driver_share / "vulkan" / "icd.d" / "nvidia_icd.json")
        notes.append(f"NVIDIA ICD file from {env['VK_ICD_FILENAMES']}")
    elif not nvidia_json and "libGLX_nvidia.so.0" in ldconfig:
        env["VK_ICD_FILENAMES"] = str(bundle / "vulkan" / "nvidia_icd.json")
        notes.append("libGLX_nvidia.so.0 present but no NVIDIA ICD file: using the bundle's nvidia_icd.json")
    elif not nvidia_json:
        notes.append("no NVIDIA Vulkan driver (libGLX_nvidia.so.0) in the image")
    return env, notes


def _pythonpath(work: pathlib.Path, dry: bool) -> str:
    """The steps' PYTHONPATH: the scratch site of carried wheels (not in a dry run), the repository."""
    return os.pathsep.join(filter(None, ["" if dry else str(work / "site"), str(REPO), os.environ.get("PYTHONPATH")]))


def plan(bundle: pathlib.Path, out: pathlib.Path, work: pathlib.Path, dry: bool) -> list[Step]:
    models = [str(bundle / "models" / c.file) for c in CUTS]
    smol, gemma = models
    gemma_global = str(work / "gemma3-2l-v2k-global.gguf")
    bench_model = smol if dry else str(work / "smollm2-30l-bench.gguf")
    logs = work / "logs"                 # bench JSON beside the logs: packed with them, copied into the report
    cores = os.cpu_count() or 1
    vk_env, _ = _vulkan_env(bundle, _pythonpath(work, dry), work)
    sanitizer = _sanitizer()
    no_san = "dry run: CUDA runs on the CPU harness" if dry else (None if sanitizer else "compute-sanitizer not found")
    if dry:
        parity = ["--tokens", "3", "--prompt-tokens", "140", "--snapkv-tokens", "2"]   # 3 prefill chunks
        gemma_prompt = ["--tokens", "2", "--prompt-tokens", "24", "--snapkv-tokens", "0"]
        compile_ = ["--arch", "90", "rotate.cu", "kv.cu"]
        pytest_k = "cuda and (test_cuda_kv or rope or eltwise) and not default_model and not test_compile"
        bench = ["--lengths", "96", "--kv-budget", "48", "--kv-window", "16", "--kv-min-tokens", "32",
                 "--decode-tokens", "2", "--prefill-chunk", "64"]
        vk_bench = bench
        chunk_bench = vk_long = [*bench[:-1], "32", "--share-prefill"]
    else:
        parity = ["--tokens", "64", "--prompt-tokens", "300"]
        gemma_prompt = ["--tokens", "64", "--prompt-tokens", "640"]   # past the 512 window of the local layers
        compile_ = []
        # the device's own tests: compile is a step of its own; test_device_errors runs its model on
        # the CPU harness (g++), which CI covers
        pytest_k = "cuda and not harness and not test_compile and not test_device_errors"
        bench = ["--lengths", "128,2048,32768", "--kv-budget", "2048"]
        vk_bench = ["--lengths", "128,2048", "--kv-budget", "2048"]
        # Vulkan's prefill never ran on a GPU: 32K apart and late, one prefill
        vk_long = ["--lengths", "32768", "--kv-budget", "2048", "--share-prefill"]
        # the 2026-12-05 H100 run: 32K prefill at 1,042 t/s with chunks of 256 (the prefill
        # attention grid is ceil(chunk / 64) x query heads = 36 blocks on 132 SMs): the same at 2048
        # (--share-prefill needs every length compacted: above the budget)
        chunk_bench = ["--lengths", "4096,32768", "--kv-budget", "2048", "--prefill-chunk", "2048", "--share-prefill"]
    pytest = [sys.executable, "-m", "pytest", "-v", "--tb=short", "-o", "faulthandler_timeout=60", "-p",
              "no:cacheprovider", "--durations=15", "tests/cuda", "tests/backends", "-k", pytest_k]
    if not dry and (importlib.util.find_spec("xdist") or any((bundle / "wheels").glob("pytest_xdist-*.whl"))):
        pytest += ["-n", str(min(cores, 16))]
    if importlib.util.find_spec("pytest_timeout"):     # a hung test ends its worker, not the step
        pytest += ["--timeout", "60", "--timeout-method", "thread"]
    engine_cli = [sys.executable, "-m", "engine.cli", "bench", "--no-llama-cpp"]
    # each case's decode also without replay (every kernel launched from Python), from one prefill
    compare = ["--compare-replay"]

    def sanitizer_step(tool: str, timeout: float) -> Step:
        return Step(f"sanitizer-{tool}", f"compute-sanitizer --tool {tool} over a short tiny-model run",
                    None if no_san else [sanitizer, "--tool", tool, "--error-exitcode", str(SANITIZER_ERRORS),
                                         "--print-limit", "20", *_me("parity", "--backend", "cuda", "--short", "--no-pool")],
                    timeout, needs=("install",), skip_reason=no_san)
    derive = _me("derive", "--bundle", str(bundle), "--to", str(work))
    bench_needs = ("install",) if dry else ("derive-bench",)   # the dry run benches the cut SmolLM2
    # Most telling first: a kill at the budget leaves what ran (each step a process of its own,
    # so a fault or crash in one cannot spoil the next).
    steps = [
        Step("install", "carried wheels into a scratch site (only the missing ones)",
             _me("install", "--bundle", str(bundle), "--site", str(work / "site")) + (["--all"] if dry else []), 60,
             min_s=0),
        Step("env", "machine, driver, CUDA, NVRTC, compute capability, packages (after install: the "
             "backends package imports gguf)", _me("env"), 60, min_s=0),
        Step("derive-bench", "SmolLM2 blocks x15: the bench model (real shapes and depth)",
             None if dry else derive + ["--only", "bench"], 60, needs=("install",),
             skip_reason="dry run: the bench uses the cut SmolLM2" if dry else None),
        Step("parity-cuda-smollm2", "cut SmolLM2 (real weights): CPU vs CUDA logits, greedy tokens, SnapKV",
             _me("parity", "--backend", "cuda", smol, *parity), 150, needs=("install",), min_s=40),
        Step("bench-cuda", "engine bench --backend cuda (with and without SnapKV; decode with and without "
             "replay)",
             engine_cli + [bench_model, "--backend", "cuda", "--out", str(logs / "bench-cuda"), *bench, *compare], 150,
             needs=bench_needs, min_s=100),
        # Vulkan never ran on a GPU: its parity, then issue 35's rows (128 / 2K, then 32K), before
        # the CUDA checks that already passed on an H100 (2026-12-05)
        Step("vulkan-env", "Vulkan loader, ICD, kp import, devices, SPIR-V", _me("vulkan-env", *([] if dry else ["--gpu"])),
             60, env=vk_env, needs=("install",)),
        Step("parity-vulkan-smollm2", "cut SmolLM2: CPU vs Vulkan logits, greedy tokens, SnapKV",
             _me("parity", "--backend", "vulkan", smol, *parity), 150, env=vk_env, needs=("vulkan-env",), min_s=40),
        Step("bench-vulkan", "engine bench --backend vulkan at 128 and 2048 tokens",
             engine_cli + [bench_model, "--backend", "vulkan", "--out", str(logs / "bench-vulkan"), *vk_bench,
                           *compare], 90, env=vk_env, needs=("vulkan-env", *bench_needs), min_s=60),
        Step("bench-vulkan-32k", "engine bench --backend vulkan at 32768 tokens (--share-prefill: one prefill)",
             engine_cli + [bench_model, "--backend", "vulkan", "--out", str(logs / "bench-vulkan-32k"), *vk_long,
                           *compare], 150, env=vk_env, needs=("vulkan-env", *bench_needs),
             min_s=120),   # started with less, a kill mid-prefill would leave no row at all
        sanitizer_step("memcheck", 75),
        sanitizer_step("racecheck", 75),
        sanitizer_step("synccheck", 60),
        Step("tiny-cuda-quick", "tiny random models, one of each: architectures, a KV format pair, SnapKV, decode_batch",
             _me("tiny", "--backend", "cuda", "--quick"), 90, needs=("install",), min_s=30),
        Step("derive-gemma", "Gemma 3 all-global variant of the cut model",
             derive + ["--only", "gemma"], 60, needs=("install",)),
        Step("parity-cuda-gemma3", "cut Gemma 3 (local layers past the window, and all global): CPU vs CUDA",
             _me("parity", "--backend", "cuda", gemma, gemma_global, *gemma_prompt), 120, needs=("derive-gemma",),
             min_s=30),
        Step("bench-cuda-chunk", "bench-cuda at 4K and 32K with --prefill-chunk 2048 (one prefill per length): "
             "prefill attention's grid grows with the chunk",
             engine_cli + [bench_model, "--backend", "cuda", "--out", str(logs / "bench-cuda-chunk"), *chunk_bench],
             90, needs=bench_needs, min_s=40),
        Step("parity-vulkan-gemma3", "cut Gemma 3: CPU vs Vulkan",
             _me("parity", "--backend", "vulkan", gemma, gemma_global, *gemma_prompt), 120, env=vk_env,
             needs=("vulkan-env", "derive-gemma"), min_s=30),
        Step("pytest-cuda", f"pytest tests/cuda tests/backends -k {pytest_k!r} on the "
             f"{'CPU harness' if dry else 'device'}", pytest, 150, needs=("install",), min_s=60),
        Step("tiny-cuda", "tiny random models: every architecture, weight type, KV format; SnapKV, decode_batch",
             None if dry else _me("tiny", "--backend", "cuda", "--rest"), 150, needs=("install",),
             skip_reason="dry run: tiny-cuda-quick only" if dry else None, min_s=110),
        Step("compile", "NVRTC compile of every kernel variant for the live arch: registers, spills",
             _me("compile", *compile_), 150, tail_lines=90, min_s=30),
    ]
    return steps


def _tail(path: pathlib.Path, n: int = 25) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


def _run_step(step: Step, env: dict, log: pathlib.Path, timeout: float) -> tuple[str, int | None]:
    with open(log, "w") as f:
        f.write(f"$ {' '.join(step.argv)}\n")
        f.flush()
        # a process group of its own (not a session: a kill of this run reaches it, and
        # _on_term ends the group), so its workers and a sanitizer's target end with it
        p = subprocess.Popen(step.argv, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, process_group=0)
        _RUNNING[0] = p.pid
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
            _signal_group(p.pid, signal.SIGABRT)   # PYTHONFAULTHANDLER: every thread's stack into the log
            try:
                p.wait(timeout=3)
            except subprocess.TimeoutExpired:
                pass
        _signal_group(p.pid, signal.SIGKILL)       # whatever it left running (workers, a sanitizer target)
        _RUNNING[0] = None
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:          # stuck in the driver: reported, the run goes on
            f.write("\ngpu_check: the step's process did not end 10 s after SIGKILL\n")
    if rc is None:
        return "timeout", None
    if rc == SKIPPED:
        return "skipped", rc
    return ("ok" if rc == 0 else "failed"), rc


_RUNNING: list[int | None] = [None]      # the running step's process group


def _on_term(signum, frame) -> None:
    """This run is being stopped (the device tool's limit): end the running step's group
    first, so nothing runs on in the GPU after it; the report written so far stays."""
    if _RUNNING[0] is not None:
        _signal_group(_RUNNING[0], signal.SIGKILL)
    raise SystemExit(128 + signum)


def _signal_group(pid: int, sig) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _last_json(text: str) -> dict | None:
    """The JSON object the env step printed last (whatever warnings came before it)."""
    start = text.rfind("\n{")
    try:
        return json.loads(text[start + 1:]) if start >= 0 else None
    except ValueError:
        return None


def _pack_logs(logs: pathlib.Path, out: pathlib.Path) -> None:
    tmp = out / (LOGS_TAR + ".tmp")
    with tarfile.open(tmp, "w:gz") as t:
        t.add(logs, arcname="logs")
    os.replace(tmp, out / LOGS_TAR)


def write_report(out: pathlib.Path, report: dict) -> None:
    tmp = out / "report.json.tmp"
    tmp.write_text(json.dumps(report, indent=1, default=str) + "\n")
    os.replace(tmp, out / "report.json")
    (out / "report.md").write_text(markdown(report))


def markdown(r: dict) -> str:
    kind = ("DRY RUN on a CPU machine: CUDA on the CPU harness (SHARPI_CUDA_EXECUTOR=cpu-harness), Vulkan on "
            "whatever device kp finds (lavapipe), heavy steps scaled down; not a GPU result"
            if r["dry_run"] else "GPU run")
    counts = {}
    for s in r["steps"]:
        counts[s["status"]] = counts.get(s["status"], 0) + 1
    lines = [f"# gpu_check report ({'dry run' if r['dry_run'] else 'device'})", "", f"**{kind}.**", "",
             f"Started {r['started']}, {r.get('duration_s', 0):.0f} s of a {r['budget_s']:.0f} s budget; "
             + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) + ("" if r.get("finished") else " (in progress)"),
             "", "| step | status | s | what |", "|---|---|---:|---|"]
    for s in r["steps"]:
        status = (s["status"] + (f" ({s['reason']})" if s.get("reason") else "")).replace("|", "\\|")
        lines.append(f"| {s['name']} | {status} | {s.get('duration_s', 0):.1f} | {s['title']} |")
    if r.get("vulkan_notes"):
        lines += ["", "Vulkan on this machine: " + "; ".join(r["vulkan_notes"])]
    env = r.get("environment")
    if env:
        lines += ["", "## Environment", "", "```", json.dumps(env, indent=1), "```"]
    if r.get("bundle"):
        b = r["bundle"]
        lines += ["", "## Bundle", "", f"whole call {b.get('call_total_bytes', 0) / 2**20:.2f} MiB "
                  f"(limit {LIMIT_MIB:.0f}); models: " + "; ".join(f"{m['file']} {m['bytes'] / 2**20:.1f} MiB: {m['about']}"
                                                              for m in b.get("models", []))]
    lines += ["", f"## Steps (last lines of each log; full logs in {LOGS_TAR})"]
    for s in r["steps"]:
        lines += ["", f"### {s['name']}: {s['status']}", "", f"`{s.get('command', '')}`"[:600]]
        if s.get("tail"):
            lines += ["", "```", s["tail"], "```"]
    return "\n".join(lines) + "\n"


def _run_one(step: Step, env: dict, rec: dict, report: dict, out: pathlib.Path, logs: pathlib.Path,
             left: float) -> None:
    """Run one step and record it in `rec` (its log then goes into out/logs.tar.gz)."""
    log = out / f"{step.name}.log"         # in out while it runs: a kill leaves it there
    rec["status"], rec["reason"] = "running", None
    write_report(out, report)
    s0 = time.monotonic()
    timeout = min(step.timeout, left)
    status, rc = _run_step(step, env, log, timeout)
    rec.update(status=status, rc=rc, duration_s=round(time.monotonic() - s0, 2), log=f"{LOGS_TAR}: logs/{step.name}.log",
               tail=_tail(log, step.tail_lines), timeout_s=round(timeout, 1))
    if status == "skipped":
        rec["reason"] = (rec["tail"].splitlines() or ["?"])[-1][:300]
    if status == "timeout":
        rec["reason"] = (f"cut by the run's budget after {timeout:.0f} s (its own limit: {step.timeout:.0f} s)"
                         if timeout < step.timeout else f"after {timeout:.0f} s")
        rec["reason"] += " (stacks in its log: SIGABRT, faulthandler)"
    elif status == "failed" and rc is not None and rc < 0:
        try:
            rec["reason"] = f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            rec["reason"] = f"killed by signal {-rc}"
    elif status == "failed" and step.name.startswith("sanitizer-"):
        text = log.read_text(errors="replace")
        if "ERROR SUMMARY" not in text and "not supported" in text:   # it never ran the target
            rec["status"], rec["reason"] = "skipped", "compute-sanitizer did not run on this device (see its log)"
        elif rc == SANITIZER_ERRORS:
            rec["reason"] = "sanitizer errors (see its log)"
    if step.name == "env" and status == "ok":
        report["environment"] = _last_json(log.read_text(errors="replace"))
    shutil.move(str(log), str(logs / log.name))  # (not os.replace: out may be on another filesystem)
    if step.name.startswith("bench-"):          # its JSON in the report too (the tool returns 8 files at most)
        found = sorted((logs / step.name).glob("*.json"))
        if found:
            report.setdefault("bench", {})[step.name] = json.loads(found[-1].read_text())
    _pack_logs(logs, out)


def run(bundle: pathlib.Path, out: pathlib.Path, dry: bool, budget_s: float, only: list[str] | None) -> int:
    t0 = time.monotonic()
    signal.signal(signal.SIGTERM, _on_term)
    out.mkdir(parents=True, exist_ok=True)
    (REPO / WORK_DIR).mkdir(exist_ok=True)   # not /tmp: it may be noexec, and the wheels hold .so files
    work = pathlib.Path(tempfile.mkdtemp(prefix="run-", dir=REPO / WORK_DIR))
    logs = work / "logs"                     # the finished steps' logs, packed into out/logs.tar.gz after
    logs.mkdir()                             # each: the device tool returns at most 8 files
    manifest = {}
    if (bundle / "manifest.json").is_file():
        manifest = json.loads((bundle / "manifest.json").read_text())
    steps = plan(bundle, out, work, dry)
    if only:
        unknown = set(only) - {s.name for s in steps}
        if unknown:
            raise SystemExit(f"run: unknown steps {sorted(unknown)}; steps: {', '.join(s.name for s in steps)}")
    if only:
        only = ["install", "env", *only]
    while only:                               # what the chosen steps need runs too
        more = {n for s in steps if s.name in only for n in s.needs} - set(only)
        if not more:
            break
        only = only + sorted(more)
    env = dict(os.environ, PYTHONPATH=_pythonpath(work, dry),
               SHARPI_CUDA_EXECUTOR="cpu-harness" if dry else "device", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    env.pop("SHARPI_BACKEND", None)
    _, vk_notes = _vulkan_env(bundle, env["PYTHONPATH"], work)
    report = {"dry_run": dry, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "budget_s": budget_s,
              "python": sys.version.split()[0], "executor": env["SHARPI_CUDA_EXECUTOR"], "vulkan_notes": vk_notes,
              "bundle": {k: manifest.get(k) for k in ("models", "wheels", "call_total_bytes", "vulkan_loader")},
              "one_call": {"command": ONE_CALL_COMMAND, "carry": ONE_CALL_CARRY}, "steps": [], "finished": False}
    results: dict[str, dict] = {}
    for step in steps:
        rec = {"name": step.name, "title": step.title, "status": "skipped", "reason": None, "duration_s": 0.0,
               "command": " ".join(step.argv) if step.argv else None}
        report["steps"].append(rec)
        left = budget_s - (time.monotonic() - t0)
        if only and step.name not in only:
            rec["reason"] = "not selected (--steps)"
        elif step.skip_reason:
            rec["reason"] = step.skip_reason
        elif unmet := [results[n] for n in step.needs if results[n]["status"] != "ok"]:
            need = unmet[0]
            rec["reason"] = f"needs {need['name']}, {need['status']}" + (f": {need['reason']}" if need["reason"] else "")
        elif left < step.min_s:
            rec["reason"] = "time budget"
        else:
            try:
                _run_one(step, {**env, **step.env}, rec, report, out, logs, left)
            except Exception as e:               # noqa: BLE001 - this step's bookkeeping; the rest still run
                import traceback
                rec.update(status="error", reason=f"gpu_check: {type(e).__name__}: {e}"[:300],
                           tail=traceback.format_exc()[-2000:])
        results[step.name] = rec
        report["duration_s"] = round(time.monotonic() - t0, 1)
        write_report(out, report)
    report["finished"] = True
    report["duration_s"] = round(time.monotonic() - t0, 1)
    write_report(out, report)
    shutil.rmtree(work, ignore_errors=True)
    failed = [s["name"] for s in report["steps"] if s["status"] in ("failed", "timeout")]
    print(f"gpu_check {'dry run' if dry else 'run'}: {report['duration_s']:.0f} s; "
          + ", ".join(f"{s['name']} {s['status']}" for s in report["steps"]) + f"; report {out / 'report.md'}")
    return 1 if failed else 0


# -- the steps ------------------------------------------------------------------------------
def cmd_env(a) -> int:
    info = {"python": sys.version.split()[0], "platform": platform.platform(), "cores": os.cpu_count(),
            "executor": os.environ.get("SHARPI_CUDA_EXECUTOR")}
    pk = {}
    for dist in ("numpy", "numba", "cupy-cuda13x", "cupy-cuda12x", "gguf", "tokenizers", "jinja2", "pytest",
                 "pytest-xdist", "hypothesis", "torch", "kp", "psutil", "threadpoolctl"):
        try:
            pk[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    info["packages"] = pk
    if shutil.which("nvidia-smi"):
        try:
            q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,compute_cap,memory.total,clocks.max.sm",
                                "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
            info["nvidia_smi"] = (q.stdout or q.stderr).strip()
            full = subprocess.run(["nvidia-smi", "-q"], capture_output=True, text=True, timeout=30).stdout
            info["nvidia_smi_q"] = [ln.strip() for ln in full.splitlines()
                                    if any(k in ln for k in ("Driver Version", "CUDA Version", "Product Name",
                                                             "Product Architecture", "MIG Mode", "Current  ",
                                                             "Persistence"))][:12]
        except subprocess.TimeoutExpired:
            info["nvidia_smi"] = "nvidia-smi did not answer within 30 s"
    try:
        info["glibc"] = platform.libc_ver()[1]
        san = _sanitizer()
        if san:
            info["compute_sanitizer_version"] = subprocess.run([san, "--version"], capture_output=True, text=True,
                                                               timeout=30).stdout.strip().splitlines()[-1:]
    except (OSError, subprocess.TimeoutExpired) as e:
        info["compute_sanitizer_version"] = f"{type(e).__name__}: {e}"
    try:
        import cupy
        rt = cupy.cuda.runtime
        info["cuda_driver_version"] = rt.driverGetVersion()
        info["cuda_runtime_version"] = rt.runtimeGetVersion()
        p = rt.getDeviceProperties(0)
        info["device"] = {"name": p["name"].decode() if isinstance(p["name"], bytes) else p["name"],
                          "compute_capability": f"{p['major']}{p['minor']}", "sms": p["multiProcessorCount"],
                          "total_bytes": p["totalGlobalMem"]}
    except Exception as e:               # noqa: BLE001 - reported, not raised: a dry run has no GPU
        import traceback
        info["cuda"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        info["cuda_traceback"] = traceback.format_exc().splitlines()[-8:]
    try:
        sys.path.insert(0, str(REPO))
        from backends.cuda import nvrtc
        info["nvrtc_version"] = ".".join(map(str, nvrtc.version()))
        info["nvrtc_archs"] = list(nvrtc.supported_archs())
    except Exception as e:               # noqa: BLE001
        info["nvrtc"] = f"{type(e).__name__}: {e}"
    info["compute_sanitizer"] = _sanitizer()
    print(json.dumps(info, indent=1, default=str))
    return 0


def cmd_install(a) -> int:
    """Unpack the carried wheels whose module is missing here into --site (wheels are zip
    files; these need no install scripts, so no pip and no network). --all: every wheel
    (the dry run: proves the bundle unpacks; the scratch site is not used)."""
    site = pathlib.Path(a.site)
    site.mkdir(parents=True, exist_ok=True)
    wheels = sorted(pathlib.Path(a.bundle, "wheels").glob("*.whl"))
    done, present, missing = [], [], []
    for module, dist in WHEELS.items():
        if importlib.util.find_spec(module) is not None and not a.all:
            present.append(module)
            continue
        norm = dist.replace("-", "_").lower()
        whl = next((w for w in wheels if w.name.lower().startswith(norm + "-")), None)
        if whl is None:
            missing.append(f"{module} ({dist})")
            continue
        with zipfile.ZipFile(whl) as z:
            z.extractall(site)
        done.append(whl.name)
    print(f"present here: {', '.join(present) or 'none'}")
    print(f"unpacked into {site}: {', '.join(done) or 'nothing'}")
    if missing:
        print(f"missing and not in the bundle: {', '.join(missing)}")
        needed = [m for m in missing if not m.startswith(("xdist", "execnet"))]
        return 1 if needed and not a.all else 0
    return 0


def cmd_compile(a) -> int:
    arch = a.arch
    if arch is None:
        import cupy
        p = cupy.cuda.runtime.getDeviceProperties(0)
        arch = p["major"] * 10 + p["minor"]
    print(f"arch {arch}", flush=True)
    return subprocess.run([sys.executable, "-m", "backends.cuda.nvrtc", "--arch", str(arch), "--progress", *a.files],
                          cwd=REPO).returncode


def cmd_derive(a) -> int:
    sys.path.insert(0, str(REPO / "tools"))
    from gguf_cut import cut_gguf
    models, to = pathlib.Path(a.bundle, "models"), pathlib.Path(a.to)
    to.mkdir(parents=True, exist_ok=True)
    gemma = models / CUTS[1].file
    if a.only in (None, "gemma"):
        print(cut_gguf(gemma, to / "gemma3-2l-v2k-global.gguf", range(CUTS[1].layers),
                       metadata={"gemma3.attention.sliding_window": 0}))
    if a.only in (None, "bench"):   # SmolLM2's real depth and shapes from the two carried blocks: speed, not outputs
        print(cut_gguf(models / CUTS[0].file, to / "smollm2-30l-bench.gguf", [i % CUTS[0].layers for i in range(30)],
                       metadata={"llama.context_length": 32768}))   # the 32K row; past 8192 untrained: speed only
    return 0


TEXT = ("The history of the lighthouse at Alexandria is told in many sources. Built in the third century BC, "
        "it guided ships into the harbour for centuries, and travellers wrote about its fire and its mirror. ")


def _scratch() -> pathlib.Path:
    """A temporary folder removed when the process exits."""
    import atexit
    tmp = tempfile.mkdtemp(prefix="gpu_check-tiny-")
    atexit.register(shutil.rmtree, tmp, True)
    return pathlib.Path(tmp)


def _tests_on_path():
    for p in (REPO, REPO / "tests", REPO / "tests" / "backends"):
        if str(p) not in sys.path:
            sys.path.insert(0, str(p))


def _greedy_logits(model, ids, n):
    import numpy as np
    cache, logits = model.prefill(ids, snapkv=False)
    out, tokens = [logits], []
    for _ in range(n):
        tokens.append(int(np.argmax(logits)))
        logits = model.forward.decode(tokens[-1], cache)
        out.append(logits)
    return out, tokens


def parity_one(path, backend: str, n_prompt: int, n_tokens: int, snap_tokens: int, chunk: int, tol: float) -> dict:
    """CPU backend vs `backend` on one GGUF: prompt and per-step logits (NMSE), greedy tokens, SnapKV."""
    import numpy as np

    import engine
    from _backends import nmse
    from _model_checks import check_snapkv
    ctx = n_prompt + n_tokens + 64
    cpu = engine.load(path, backend="cpu", snapkv_budget=0, ctx=ctx, prefill_chunk=chunk)
    dev = engine.load(path, backend=backend, snapkv_budget=0, ctx=ctx, prefill_chunk=chunk)
    ids = cpu.tokenize(TEXT * (1 + n_prompt // 30))[:n_prompt]     # TEXT is over 30 tokens for any vocabulary
    t0 = time.perf_counter()
    lc, tc = _greedy_logits(cpu, ids, n_tokens)
    lg, tg = _greedy_logits(dev, ids, n_tokens)
    div = next((i for i, (x, y) in enumerate(zip(tg, tc)) if x != y), None)
    same = len(lc) if div is None else div + 1       # steps fed the same tokens (after div: their own)
    errs = [float(nmse(g, c)) for g, c in zip(lg[:same], lc[:same])]
    r = {"model": os.path.basename(str(path)), "backend": backend,
         "executor": getattr(dev.backend, "ex", None) and dev.backend.ex.name, "layers": dev.config.n_layers,
         "layer_windows": list(dev.config.layer_windows), "prompt_tokens": len(ids), "tokens": n_tokens,
         "prefill_chunk": chunk, "nmse_prompt": errs[0], "nmse_max_decode": max(errs[1:], default=0.0),
         "argmax_equal": int(np.argmax(lg[0])) == int(np.argmax(lc[0])), "tokens_equal": tg == tc,
         "first_divergence": div, "tol": tol}
    near_tie = False
    if div is not None:
        top = np.sort(lc[div])[-2:]
        spread = float(np.abs(lg[div] - lc[div]).max())
        r["cpu_top2_margin_at_divergence"] = float(top[1] - top[0])
        r["max_logit_difference_at_divergence"] = spread
        # a near-tie: the CPU's two best closer than the backends' logits differ there (f32 sums
        # in another order, FMA, flush-to-zero), so either token is the model's answer
        near_tie = div > 0 and float(top[1] - top[0]) <= 2 * spread
        r["divergence_is_near_tie"] = near_tie
    r["ok"] = (errs[0] < tol and max(errs) < max(tol, 1e-4) and r["argmax_equal"]
               and (r["tokens_equal"] or near_tie))
    if snap_tokens and any(dev.config.layer_windows):
        r["snapkv"] = "not checked: sliding-window layers (check_snapkv reads every layer's keep sets)"
    elif snap_tokens and len(ids) > 96 + 32:
        try:
            check_snapkv(cpu, dev, ids, budget=96, window=16, n_tokens=snap_tokens,
                         layers=tuple(range(dev.config.n_layers)))
            r["snapkv"] = "ok (keep sets >= 95% equal, tokens equal, device cache = kept rows)"
        except AssertionError as e:
            r["snapkv"] = f"FAILED: {str(e).splitlines()[0] if str(e) else 'assertion'}"
            r["ok"] = False
    r["seconds"] = round(time.perf_counter() - t0, 2)
    return r


def cmd_parity(a) -> int:
    _tests_on_path()
    if a.no_pool:
        import cupy
        cupy.cuda.set_allocator(None)
    models = list(a.models)
    if a.short or not models:
        from tiny_gguf import write_tiny_gguf
        from gguf import GGMLQuantizationType as Q
        tmp = _scratch()
        models = [str(write_tiny_gguf(tmp / "tiny-llama-q8.gguf", dim=128, n_heads=4, n_kv_heads=2,
                                      ffn_dim=256, qtype=Q.Q8_0, seed=5))]
        a.prompt_tokens, a.tokens, a.snapkv_tokens = 130, 4, 2
    ok = True
    for path in models:
        try:
            r = parity_one(path, a.backend, a.prompt_tokens, a.tokens, a.snapkv_tokens, a.chunk, a.tol)
        except Exception as e:           # noqa: BLE001 - one model's failure is reported, the next still runs
            import traceback
            traceback.print_exc()
            r = {"model": os.path.basename(str(path)), "backend": a.backend, "ok": False,
                 "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        print(json.dumps(r), flush=True)
        ok &= bool(r["ok"])
    return 0 if ok else 1


def tiny_cases(quick: bool) -> list[tuple[str, dict, str]]:
    """(name, write_tiny_gguf kwargs, check) over architectures x weight types x KV formats."""
    from gguf import GGMLQuantizationType as Q

    from engine.gguf.qtypes import SUPPORTED
    base = {"llama": dict(dim=256, n_heads=4, n_kv_heads=2, ffn_dim=256),
            "qwen2": dict(arch="qwen2", dim=256, n_heads=4, n_kv_heads=1, ffn_dim=256),
            "gemma3": dict(arch="gemma3", dim=256, n_heads=4, n_kv_heads=1, ffn_dim=256, n_layers=6)}
    if quick:
        return [("llama-Q8_0", dict(base["llama"], qtype=Q.Q8_0), "logits"),
                ("qwen2-Q4_1", dict(base["qwen2"], qtype=Q.Q4_1), "logits"),
                ("gemma3-Q4_K", dict(base["gemma3"], qtype=Q.Q4_K), "logits"),
                ("llama-Q8_0-kv-q8_0/tq4", dict(base["llama"], qtype=Q.Q8_0), "kv:q8_0/tq4"),
                ("qwen2-Q4_1-snapkv", dict(base["qwen2"], qtype=Q.Q4_1), "snapkv"),
                ("qwen2-Q4_1-decode_batch", dict(base["qwen2"], qtype=Q.Q4_1), "decode_batch")]
    cases = [(f"{arch}-{q.name}", dict(kw, qtype=q), "logits") for arch, kw in base.items() for q in SUPPORTED]
    for kv in ("q8_0", "q4_0", "tq4", "tq3", "rq4_0", "q8_0/tq4", "rq4_0:0=q8_0/rq4_0"):
        cases.append((f"llama-Q8_0-kv-{kv}", dict(base["llama"], qtype=Q.Q8_0), f"kv:{kv}"))
    # SnapKV on the models whose every layer is compacted (check_snapkv reads each layer's keep
    # sets; gemma3's sliding-window layers keep none); adaptive needs more than one KV head.
    for arch, checks in (("llama", ("snapkv", "adaptive", "decode_batch")), ("qwen2", ("snapkv", "decode_batch")),
                         ("gemma3", ("decode_batch",))):
        cases += [(f"{arch}-Q4_K-{check}", dict(base[arch], qtype=Q.Q4_K), check) for check in checks]
    return cases


def cmd_tiny(a) -> int:
    _tests_on_path()
    import engine
    from _model_checks import check_adaptive, check_decode_batch, check_logits_and_tokens, check_snapkv
    from engine.errors import DeviceFault
    from tiny_gguf import write_tiny_gguf
    prompt = list(range(3, 200, 2)) * 3
    tmp = _scratch()
    failed, written = 0, {}
    cases = tiny_cases(a.quick)
    if a.rest:
        quick = {name for name, _, _ in tiny_cases(True)}
        cases = [c for c in cases if c[0] not in quick]
    for i, (name, kw, check) in enumerate(cases):
        t0 = time.perf_counter()
        try:
            key = json.dumps({k: str(v) for k, v in kw.items()}, sort_keys=True)
            if key not in written:
                written[key] = write_tiny_gguf(tmp / f"{len(written)}.gguf", seed=len(written) + 1, **kw)
            path, extra = written[key], {}
            if check.startswith("kv:"):
                extra["kv_dtype"] = check[3:]
            load = lambda b: engine.load(path, backend=b, snapkv_budget=0, prefill_chunk=64, **extra)  # noqa: E731
            cpu, dev = load("cpu"), load(a.backend)
            if check == "logits":
                check_logits_and_tokens(cpu, dev, prompt[:150], 8)
            elif check.startswith("kv:"):
                check_logits_and_tokens(cpu, dev, prompt[:100], 4, tol=1e-4)
            elif check == "snapkv":
                check_snapkv(cpu, dev, prompt[:200], budget=96, window=16, n_tokens=4, layers=(0, 1))
            elif check == "adaptive":
                check_adaptive(cpu, dev, prompt[:200], budget=96, window=16, n_tokens=4)
            elif check == "decode_batch":
                check_decode_batch(cpu, dev, [prompt[:80], prompt[5:15], prompt[20:60]])
            status = "ok"
        except Exception as e:           # noqa: BLE001 - every case runs; failures are counted and shown
            import traceback
            failed += 1
            msg = str(e).strip().splitlines()
            status = f"FAILED {type(e).__name__}: {msg[0][:200] if msg else ''}"
            traceback.print_exc()
            if isinstance(e, DeviceFault):   # the CUDA context is gone: every later case would fail with it
                print(f"{name:<32} {check:<14} {time.perf_counter() - t0:6.1f} s  {status}", flush=True)
                print(f"stopped: a device fault; {len(cases) - i - 1} case(s) not run "
                      f"({', '.join(c[0] for c in cases[i + 1:])})")
                return 1
        print(f"{name:<32} {check:<14} {time.perf_counter() - t0:6.1f} s  {status}", flush=True)
    print(f"{len(cases) - failed} passed, {failed} failed")
    return 1 if failed else 0


def _print_loader_errors() -> None:
    """Why the Vulkan loader found no (GPU) driver: its own error and warning lines from a fresh
    enumeration (VK_LOADER_DEBUG), then the libraries the drivers looked for and did not find."""
    probe = "import kp; kp.Manager().list_devices()"
    env = dict(os.environ, VK_LOADER_DEBUG="error,warn", LD_DEBUG="libs")
    try:
        p = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        print("loader diagnosis: the probe took over 60 s")
        return
    lines = (p.stdout + p.stderr).splitlines()
    loader = [ln.strip() for ln in lines if ln.lstrip().startswith(("ERROR", "WARNING"))]
    # LD_DEBUG=libs: "find library=X" then "trying file=..." per folder; X missing when no
    # "calling init: .../X" follows
    wanted = [ln.split("find library=")[1].split(" ")[0].strip(";") for ln in lines if "find library=" in ln]
    loaded = {ln.rsplit("/", 1)[-1].split(" ")[0] for ln in lines if "calling init:" in ln}
    missing = [lib for lib in dict.fromkeys(wanted) if lib not in loaded]
    for ln in list(dict.fromkeys(loader))[:10]:
        print(f"loader: {ln}")
    if missing:
        print(f"libraries looked for and not found: {', '.join(missing)}")


def cmd_vulkan_env(a) -> int:
    print(f"LD_LIBRARY_PATH={os.environ.get('LD_LIBRARY_PATH', '')}")
    print(f"VK_ICD_FILENAMES={os.environ.get('VK_ICD_FILENAMES', '')}")
    try:
        import kp  # noqa: F401
    except Exception as e:               # noqa: BLE001
        print(f"Vulkan: not run: kp not importable on Python {platform.python_version()} ({type(e).__name__}: {e}; "
              f"kp 0.9.0 is an sdist only, and the bundle holds no build for Python "
              f"{sys.version_info.major}.{sys.version_info.minor}: docs/gpu_check.md)")
        return SKIPPED
    sys.path.insert(0, str(REPO))
    from engine.errors import EngineError
    try:
        from backends.vulkan import list_devices
        devices = list_devices()
    except EngineError as e:
        print(f"Vulkan: not run: {e}")
        return SKIPPED
    for d in devices:
        print(f"vulkan {d['index']}: {d['name']} ({d['type']}, {d['vendor']}, Vulkan {d['api_version']})")
    no_gpu = a.gpu and not any(d["type"] in ("discrete", "integrated") for d in devices)
    if no_gpu or not devices:
        _print_loader_errors()
    if not devices:
        print("Vulkan: not run: kp imports but finds no Vulkan device")
        return SKIPPED
    if no_gpu:
        print("Vulkan: not run: no GPU among the Vulkan devices (a CPU driver only: the NVIDIA ICD is missing)")
        return SKIPPED
    from backends.vulkan import backend as vk          # without _kp_barrier a GPU submits each dispatch alone
    if vk.KP_BARRIER_ERROR is None:
        print("dispatch ordering: global barriers in one sequence (_kp_barrier)")
    else:
        print(f"{'WARNING: ' if a.gpu else ''}dispatch ordering: one submission a dispatch, _kp_barrier does not "
              f"import ({vk.KP_BARRIER_ERROR}): correct but far slower than the backend runs with it; its bench "
              f"numbers mean little")
    from backends.vulkan import shaders
    if not (shaders.compiler_available() or shaders.all_cached()):
        print(f"Vulkan: not run: no glslangValidator and SPIR-V for only some variants in {shaders._cache_dir()} "
              f"(SNAPKV_SPIRV_CACHE={os.environ.get('SNAPKV_SPIRV_CACHE', '')})")
        return SKIPPED
    print(f"SPIR-V: {'glslangValidator' if shaders.compiler_available() else 'every variant cached'} "
          f"({shaders._cache_dir()})")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python tools/gpu_check.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="write the bundle (CPU machine)")
    p.add_argument("--bundle", default=DEFAULT_BUNDLE)
    p.add_argument("--no-download", action="store_true", help="cut models only; count an allowance for the rest")
    p = sub.add_parser("check", help="(CPU machine, just before the call) the bundle still matches the tree and "
                                     "the call fits (exit 1 with the problems otherwise)")
    p.add_argument("--bundle", default=DEFAULT_BUNDLE)
    for name, helptext in (("run", "run every step (GPU machine)"), ("dry-run", "prepare + run here, scaled down")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--bundle", default=DEFAULT_BUNDLE)
        p.add_argument("--out", default=os.environ.get("OUT") or "results/gpu_check")
        p.add_argument("--budget-s", type=float, default=BUDGET_S, help=f"the whole run's time (default {BUDGET_S:.0f} s)")
        p.add_argument("--steps", help="comma-separated step names to run, with env and the steps they need "
                       "(the others are reported skipped)")
        if name == "dry-run":
            p.add_argument("--no-download", action="store_true", help="prepare --no-download")
    p = sub.add_parser("parity", help="CPU backend vs a device backend on GGUF files")
    p.add_argument("models", nargs="*")
    p.add_argument("--backend", default="cuda")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=300)
    p.add_argument("--snapkv-tokens", type=int, default=8, help="greedy tokens after SnapKV (0: no SnapKV check)")
    p.add_argument("--chunk", type=int, default=64, help="prefill chunk (several: the GEMM path)")
    p.add_argument("--tol", type=float, default=1e-5, help="NMSE of the prompt's logits (tests/backends/_model_checks.py)")
    p.add_argument("--short", action="store_true", help="a tiny model, a few tokens (under compute-sanitizer)")
    p.add_argument("--no-pool", action="store_true",
                   help="cupy without its memory pool: one cudaMalloc per array, so memcheck sees each array's end")
    p = sub.add_parser("tiny", help="tiny random models: architectures x weight types x KV formats")
    p.add_argument("--backend", default="cuda")
    p.add_argument("--quick", action="store_true", help="one case of each kind")
    p.add_argument("--rest", action="store_true", help="every case but the --quick ones")
    sub.add_parser("env", help="machine facts as JSON")
    p = sub.add_parser("install", help="unpack the missing carried wheels")
    p.add_argument("--bundle", default=DEFAULT_BUNDLE)
    p.add_argument("--site", required=True)
    p.add_argument("--all", action="store_true")
    p = sub.add_parser("compile", help="python -m backends.cuda.nvrtc for the live (or given) arch")
    p.add_argument("--arch", type=int)
    p.add_argument("files", nargs="*")
    p = sub.add_parser("derive", help="models made from the carried ones")
    p.add_argument("--bundle", default=DEFAULT_BUNDLE)
    p.add_argument("--to", required=True)
    p.add_argument("--only", choices=("gemma", "bench"), help="one of the two models (default both)")
    p = sub.add_parser("vulkan-env", help="Vulkan loader, ICD, kp, devices, SPIR-V (exit 3: not usable)")
    p.add_argument("--gpu", action="store_true", help="not usable without a GPU among the devices")
    a = ap.parse_args(argv)

    if a.cmd == "prepare":
        prepare(pathlib.Path(a.bundle).resolve(), download=not a.no_download)
        return 0
    if a.cmd == "check":
        problems = check_bundle(pathlib.Path(a.bundle).resolve())
        for line in problems:
            print(f"gpu_check check: {line}", file=sys.stderr)
        print("gpu_check check: " + ("the bundle is stale: run prepare again" if problems else "ready for the one call"))
        return 1 if problems else 0
    if a.cmd in ("run", "dry-run"):
        bundle, dry = pathlib.Path(a.bundle).resolve(), a.cmd == "dry-run"
        if dry:
            prepare(bundle, download=not a.no_download)
        if not (bundle / "models").is_dir():
            print(f"gpu_check: no bundle at {bundle} (python tools/gpu_check.py prepare)", file=sys.stderr)
            return 2
        only = [s.strip() for s in a.steps.split(",")] if a.steps else None
        return run(bundle, pathlib.Path(a.out).resolve(), dry, a.budget_s, only)
    return {"parity": cmd_parity, "tiny": cmd_tiny, "env": cmd_env, "install": cmd_install, "compile": cmd_compile,
            "derive": cmd_derive, "vulkan-env": cmd_vulkan_env}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
