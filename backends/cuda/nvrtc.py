"""The one NVRTC compile path: kernels/*.cu -> a cubin (or PTX) image, with or without a GPU.

The device executor (runtime.py, CupyExecutor) and the offline check compile through
`compile_source` with the same `options()`, so ptxas's report read here (registers,
spills, static shared memory) is what the GPU gets. NVRTC is reached through cupy's
binding module and needs no driver, so a machine without a GPU checks every variant
for sm_75..sm_90 (and any arch the loaded NVRTC supports):

    result = compile_cubin("norm.cu", (), 80)
    result.kernels["rms_norm"].registers

The target for a live device is `choose_target(compute capability, supported_archs())`:
SASS (cubin) for the device's own arch when NVRTC can build it, else PTX for the newest
virtual arch below it, which the driver compiles on load (e.g. sm_100/120 with NVRTC < 12.8).

`python -m backends.cuda.nvrtc [--arch 80] [FILE ...]` prints the report as a table of
kernels x archs; tests/cuda/test_compile.py checks it for every (file, defines) in
ALL_VARIANTS.
"""
from __future__ import annotations

import argparse
import ctypes
import glob
import os
import re
import sys
import time
from dataclasses import dataclass

from engine.errors import BackendUnavailable

from .runtime import KERNELS, inline_includes

# Compute capabilities checked offline: Turing, Ampere (A100, RTX 30xx), Ada, Hopper.
# NVRTC 12.9 and 13.x both accept all five. Blackwell (100, 120) needs NVRTC >= 12.8;
# `--arch 100` checks it where the loaded NVRTC has it.
ARCHS = (75, 80, 86, 89, 90)
MIN_ARCH = 75                  # the oldest GPU the kernels are built and checked for

# Shared memory per block (static + dynamic), bytes. Without opt-in every arch
# allows 48 KiB; more needs cudaFuncSetAttribute(MaxDynamicSharedMemorySize) and
# is capped per arch (CUDA C Programming Guide, "Technical Specifications per
# Compute Capability"). ptxas rejects static __shared__ above 48 KiB on every arch.
SMEM_DEFAULT = 48 * 1024
SMEM_LIMIT = {75: 64 * 1024, 80: 163 * 1024, 86: 99 * 1024, 87: 163 * 1024, 89: 99 * 1024, 90: 227 * 1024,
              100: 227 * 1024, 103: 227 * 1024, 120: 99 * 1024, 121: 99 * 1024}

INSTALL_HINT = ("pip install -e '.[cuda]' (cupy-cuda12x + nvidia-cuda-nvrtc-cu12; "
                "with CUDA 13: cupy-cuda13x + nvidia-cuda-nvrtc)")
# What the binding module must offer (cupy-cuda12x 13.x and cupy-cuda13x 14.x both do)
_BINDING_API = ("getVersion", "createProgram", "compileProgram", "getProgramLog", "getCUBIN", "getPTX",
                "destroyProgram", "NVRTCError")


@dataclass(frozen=True)
class Target:
    """What NVRTC builds: `cubin` (SASS for sm_<arch>, loads on that arch only) or
    `ptx` (compute_<arch>, compiled by the driver on load for any arch >= it)."""
    arch: int
    kind: str                  # "cubin" | "ptx"

    @property
    def option(self) -> str:
        return f"-arch=sm_{self.arch}" if self.kind == "cubin" else f"-arch=compute_{self.arch}"

    def __str__(self) -> str:
        return f"sm_{self.arch}" if self.kind == "cubin" else f"compute_{self.arch} PTX"


@dataclass(frozen=True)
class KernelResources:
    """ptxas's report for one entry function (one arch)."""
    registers: int
    spill_stores: int          # bytes
    spill_loads: int           # bytes
    stack_bytes: int           # stack frame (local arrays and spills)
    smem_bytes: int            # static __shared__ only; dynamic is set at launch


@dataclass(frozen=True)
class CompileResult:
    image: bytes                             # cubin, or PTX text for a ptx Target
    target: Target
    log: str                                 # NVRTC + ptxas -v output (no ptxas for PTX)
    kernels: dict[str, KernelResources]      # entry function name -> resources (empty for PTX)

    @property
    def cubin(self) -> bytes:
        assert self.target.kind == "cubin", self.target
        return self.image


class CompileError(RuntimeError):
    """NVRTC rejected a kernel source; str() is a header line followed by the
    compiler's log. Picklable (compiles may run in worker processes)."""

    def __init__(self, message: str, log: str = ""):
        super().__init__(message, log)
        self.log = log

    def __str__(self) -> str:
        return self.args[0]

    def first_error(self) -> str:
        """The log's first error line (NVRTC's or ptxas's), else its first line."""
        lines = [ln.strip() for ln in (self.log or self.args[0]).splitlines() if ln.strip()]
        return next((ln for ln in lines if "error" in ln.lower()), lines[0] if lines else "no log")


# --- loading NVRTC --------------------------------------------------------------

_binding = None


def load():
    """cupy's NVRTC binding module (cupy_backends.cuda.libs.nvrtc), usable without a
    GPU or driver. When cupy cannot dlopen libnvrtc.so.<its CUDA major> itself, the
    library is preloaded from the NVIDIA pip packages on sys.path (nvidia-cuda-nvrtc-cu12:
    nvidia/cuda_nvrtc/lib; the CUDA 13 wheel: nvidia/cu13/lib) or a CUDA toolkit.
    BackendUnavailable (one line, naming what to install) when that fails."""
    global _binding
    if _binding is not None:
        return _binding
    try:
        import cupy_backends  # noqa: F401
    except Exception as e:
        raise BackendUnavailable(f"NVRTC: cupy is not installed ({type(e).__name__}); {INSTALL_HINT}") from None
    try:                       # not public cupy API: checked, so a cupy that moves it fails in one line
        from cupy_backends.cuda.libs import nvrtc
        missing = [name for name in _BINDING_API if not hasattr(nvrtc, name)]
    except Exception as e:
        missing = [f"cupy_backends.cuda.libs.nvrtc ({type(e).__name__})"]
    if missing:
        raise BackendUnavailable(f"NVRTC: this cupy ({_cupy_version()}) lacks the NVRTC binding we use "
                                 f"({', '.join(missing)}); {INSTALL_HINT}")
    if not _usable(nvrtc):
        majors = _cuda_majors()
        for path in _library_candidates(majors):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            if _usable(nvrtc):
                break
        else:
            wanted = " or ".join(f"libnvrtc.so.{m}" for m in majors)
            raise BackendUnavailable(f"NVRTC: cupy is installed but {wanted} was not found; {INSTALL_HINT}")
    _binding = nvrtc
    return nvrtc


def _usable(nvrtc) -> bool:
    try:
        nvrtc.getVersion()
    except Exception:         # noqa: BLE001 - "CuPy failed to load libnvrtc.so.12: ..." (RuntimeError in
        return False          # cupy 13; another type in another cupy is still "not usable"); not cached
    return True


def _cupy_version() -> str:
    try:
        from importlib.metadata import packages_distributions, version
        dists = packages_distributions().get("cupy", ["cupy"])
        return f"{dists[0]} {version(dists[0])}"
    except Exception:
        return "cupy"


def _cuda_majors() -> tuple[int, ...]:
    """The CUDA major version(s) whose libnvrtc cupy's build dlopens (private cupy API,
    present in cupy-cuda12x 13.x and cupy-cuda13x 14.x; both majors when it moves)."""
    try:
        from cupy_backends.cuda.api import runtime
        return (int(runtime._getCUDAMajorVersion()),)
    except Exception:
        return (12, 13)


def _library_candidates(majors: tuple[int, ...]) -> list[str]:
    names = [f"libnvrtc.so.{m}" for m in majors]
    dirs = []
    for entry in sys.path:
        dirs += sorted(glob.glob(os.path.join(entry or ".", "nvidia", "*", "lib")))
    for var in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(var):
            dirs.append(os.path.join(os.environ[var], "lib64"))
    dirs += ["/usr/local/cuda/lib64"] + sorted(glob.glob("/usr/local/cuda-*/lib64"))
    return [os.path.join(d, n) for n in names for d in dirs if os.path.isfile(os.path.join(d, n))]


def version() -> tuple[int, int]:
    return tuple(load().getVersion())


# Real archs by NVRTC version, for a binding without getSupportedArchs (both cupy
# releases above have it): (first version, archs); 13.0 dropped everything below 75.
_ARCHS_BY_VERSION = (((12, 0), (50, 52, 53, 60, 61, 62, 70, 72, 75, 80, 86, 87, 89, 90)),
                     ((12, 8), (50, 52, 53, 60, 61, 62, 70, 72, 75, 80, 86, 87, 89, 90, 100, 101, 120)),
                     ((12, 9), (50, 52, 53, 60, 61, 62, 70, 72, 75, 80, 86, 87, 89, 90, 100, 101, 103, 120, 121)),
                     ((13, 0), (75, 80, 86, 87, 88, 89, 90, 100, 103, 110, 120, 121)))


def supported_archs() -> tuple[int, ...]:
    """The real archs (sm_XX) the loaded NVRTC builds SASS for, ascending."""
    nvrtc = load()
    try:
        return tuple(sorted(int(a) for a in nvrtc.getSupportedArchs()))
    except Exception:
        v = version()
        return next((archs for first, archs in reversed(_ARCHS_BY_VERSION) if v >= first), ())


def choose_target(device_cc: int, supported: tuple[int, ...]) -> Target:
    """What to build for a device of compute capability `device_cc` (e.g. 90) with an
    NVRTC that builds SASS for `supported`: SASS for the device's own arch when it is
    among them, else PTX for the newest supported arch below it (the driver compiles
    PTX forward, e.g. compute_90 on sm_120 with NVRTC < 12.8; cubin for an older arch
    would not load). BackendUnavailable (one line) below MIN_ARCH or when NVRTC has
    no arch from MIN_ARCH up to the device's."""
    cc = f"{device_cc // 10}.{device_cc % 10}"
    if device_cc < MIN_ARCH:
        raise BackendUnavailable(f"backend 'cuda': the GPU's compute capability {cc} is below "
                                 f"{MIN_ARCH // 10}.{MIN_ARCH % 10}, the oldest the kernels are built for")
    if device_cc in supported:
        return Target(device_cc, "cubin")
    below = [a for a in supported if MIN_ARCH <= a < device_cc]
    if not below:
        have = f"sm_{min(supported)}..sm_{max(supported)}" if supported else "no arch"
        raise BackendUnavailable(f"backend 'cuda': this NVRTC builds {have}, nothing for compute capability "
                                 f"{cc}; install a newer one: {INSTALL_HINT}")
    return Target(max(below), "ptx")


# --- compiling -------------------------------------------------------------------

def options(defines: tuple[str, ...], target: Target) -> list[str]:
    """NVRTC options, the same for the GPU and the offline check: the target, ptxas's
    resource report (a log only), C++17, flush-to-zero as cupy's RawModule always
    compiled (`-ftz=true`: f32 subnormals read and written as 0; with it ptxas allocates
    registers differently), our include dir (for test sources that include common.cuh),
    one -D per define. FMA contraction is NVRTC's default (`--fmad=true`)."""
    return [target.option, "-Xptxas=-v", "-std=c++17", "-ftz=true", f"-I{KERNELS}"] + [f"-D{d}" for d in defines]


def _as_target(target) -> Target:
    return target if isinstance(target, Target) else Target(int(target), "cubin")


def compile_cubin(file: str, defines: tuple[str, ...], arch) -> CompileResult:
    """kernels/<file> with -D<define>s -> cubin for sm_<arch> (or `arch` a Target);
    CompileError with the log. The source is the one the GPU executor compiles: its
    includes inlined (runtime.py)."""
    return compile_source(inline_includes(file), file, defines, arch)


def compile_source(source: str, name: str, defines: tuple[str, ...], target) -> CompileResult:
    """Like compile_cubin for source text (`name` labels the compiler's messages);
    `#include "common.cuh"` resolves to kernels/. `target`: a Target or an arch (cubin)."""
    nvrtc = load()
    target, defines = _as_target(target), tuple(defines)
    prog = nvrtc.createProgram(source, name, [], [])
    try:
        try:
            nvrtc.compileProgram(prog, options(defines, target))
        except nvrtc.NVRTCError:
            log = nvrtc.getProgramLog(prog)
            label = " ".join((name,) + tuple(f"-D{d}" for d in defines))
            raise CompileError(f"NVRTC: {label} failed to compile for {target}:\n{_without_ptxas_info(log)}",
                               log) from None
        log = nvrtc.getProgramLog(prog)
        image = nvrtc.getCUBIN(prog) if target.kind == "cubin" else nvrtc.getPTX(prog)
        return CompileResult(image=bytes(image), target=target, log=log, kernels=parse_ptxas(log))
    finally:
        nvrtc.destroyProgram(prog)


def _without_ptxas_info(log: str) -> str:
    """The log without ptxas's info lines (they bury a ptxas error; CompileError.log keeps them)."""
    lines = [ln.rstrip() for ln in log.splitlines()
             if ln.strip() and not re.match(r"\s*ptxas(\s+info\s*:|\s+\.)", ln)]
    return "\n".join(lines) or log.strip()


_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PROPS = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas(log: str) -> dict[str, KernelResources]:
    """Entry function -> resources from `ptxas -v` output. Spills and stack are the
    entry's own frame (non-inlined callees report their own, not added here)."""
    frames: dict[str, tuple[int, int, int]] = {}     # function -> (stack, spill st, spill ld)
    used: dict[str, tuple[int, int]] = {}            # entry -> (registers, smem)
    entry = props = None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            entry = m.group(1)
        elif m := _PROPS.search(line):
            props = m.group(1)
        elif (m := _FRAME.search(line)) and props is not None:
            frames[props] = (int(m.group(1)), int(m.group(2)), int(m.group(3)))
            props = None
        elif (m := _USED.search(line)) and entry is not None:
            s = _SMEM.search(line)
            used[entry] = (int(m.group(1)), int(s.group(1)) if s else 0)
            entry = None
    return {name: KernelResources(registers=regs, spill_stores=frames.get(name, (0, 0, 0))[1],
                                  spill_loads=frames.get(name, (0, 0, 0))[2],
                                  stack_bytes=frames.get(name, (0, 0, 0))[0], smem_bytes=smem)
            for name, (regs, smem) in used.items()}


# --- many variants ------------------------------------------------------------------

def _compile_job(job):
    file, defines, arch = job
    try:
        return compile_cubin(file, defines, arch)
    except CompileError as e:
        return e


def compile_all(jobs, pool_after_s: float = 90.0, workers: int | None = None, on_result=None) -> dict:
    """{(file, defines, arch): CompileResult or CompileError} for every job. Compiles
    in this process; when the first jobs predict more than `pool_after_s` in all,
    the rest go to a pool of `workers` processes (default: the cores, at most 16).
    `on_result(job, result)`: called as each job's result arrives (in job order)."""
    workers = workers or min(os.cpu_count() or 2, 16)
    jobs = list(dict.fromkeys((f, tuple(d), a) for f, d, a in jobs))
    load()
    out, t0 = {}, time.perf_counter()
    i = 0
    while i < len(jobs):
        out[jobs[i]] = _compile_job(jobs[i])
        if on_result is not None:
            on_result(jobs[i], out[jobs[i]])
        i += 1
        elapsed = time.perf_counter() - t0
        if i >= min(3, len(jobs)) and elapsed / i * len(jobs) > pool_after_s:
            break
    if i < len(jobs):
        from concurrent.futures import ProcessPoolExecutor
        with ProcessPoolExecutor(max_workers=workers) as pool:
            for job, result in zip(jobs[i:], pool.map(_compile_job, jobs[i:])):
                out[job] = result
                if on_result is not None:
                    on_result(job, result)
    return out


def _progress(job, result) -> None:
    """One line a compiled variant, as it arrives (a run cut short keeps what it had)."""
    file, defines, arch = job
    if isinstance(result, CompileError):
        what = f"COMPILE ERROR: {result.first_error()}"
    else:
        what = ", ".join(f"{k.registers} regs, spill {k.spill_stores}:{k.spill_loads}" for k in result.kernels.values())
    print(f"  sm_{arch} {file} {' '.join(defines) or '-'}: {what or 'ptx'}", flush=True)


# --- command line ----------------------------------------------------------------------

def _table(results: dict, var_list, archs) -> tuple[list[str], int]:
    """Rows of kernel x arch; returns (lines, number of failed compiles)."""
    single = len(archs) == 1
    head = ["file", "defines", "kernel"]
    head += ["regs", "stack", "spill st", "spill ld", "smem"] if single else [f"sm_{a}" for a in archs]
    rows, failed = [], 0
    for file, defines in var_list:
        dtext = " ".join(defines) or "-"
        errs = [(a, results[(file, defines, a)]) for a in archs
                if isinstance(results[(file, defines, a)], CompileError)]
        for a, e in errs:
            failed += 1
            rows.append([file, dtext, f"COMPILE ERROR sm_{a}: {e.first_error()}"])
        ok = {a: results[(file, defines, a)] for a in archs if a not in dict(errs)}
        names = sorted({k for r in ok.values() for k in r.kernels})
        for name in names:
            row = [file, dtext, name]
            for a in archs:
                k = ok[a].kernels.get(name) if a in ok else None
                if single:
                    row += ["-"] * 5 if k is None else [str(k.registers), str(k.stack_bytes),
                                                        str(k.spill_stores), str(k.spill_loads), str(k.smem_bytes)]
                else:
                    spill = "0" if k is None or k.spill_stores == k.spill_loads == 0 \
                        else f"{k.spill_stores}:{k.spill_loads}!"
                    row.append("-" if k is None else f"{k.registers}/{spill}/{k.smem_bytes}")
            rows.append(row)
    widths = [max(len(r[i]) for r in [head] + rows if len(r) == len(head) or i < 2) for i in range(len(head))]

    def fmt(r):
        if len(r) == 3 and r[2].startswith("COMPILE ERROR"):
            return f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]}"
        cells = [f"{c:<{w}}" if i < 3 else f"{c:>{w}}" for i, (c, w) in enumerate(zip(r, widths))]
        return "  ".join(cells).rstrip()
    return [fmt(head)] + [fmt(r) for r in rows], failed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m backends.cuda.nvrtc",
                                 description="Compile CUDA kernel variants offline with NVRTC (no GPU needed) "
                                             "and print ptxas's registers / spills / static shared memory.")
    ap.add_argument("--arch", type=int, action="append", metavar="N",
                    help="compute capability as 75, 80, ..., any the loaded NVRTC builds SASS for "
                         "(repeatable; default: %s)" % ", ".join(map(str, ARCHS)))
    ap.add_argument("files", nargs="*", metavar="FILE", help="kernel files (e.g. norm.cu); default: all variants")
    ap.add_argument("--progress", action="store_true", help="a line per variant as it compiles (then the table)")
    args = ap.parse_args(argv)
    archs = tuple(dict.fromkeys(args.arch or ARCHS))
    try:
        supported = supported_archs()
    except BackendUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    unsupported = [a for a in archs if a not in supported]
    if unsupported:
        major, minor = version()
        runtime = "; ".join(f"a sm_{a} GPU loads {choose_target(a, supported)}" for a in unsupported
                            if a >= MIN_ARCH and any(MIN_ARCH <= s < a for s in supported))
        print(f"error: NVRTC {major}.{minor} builds no SASS for {', '.join(f'sm_{a}' for a in unsupported)} "
              f"(it does for {', '.join(map(str, supported))})" + (f"; {runtime}" if runtime else ""),
              file=sys.stderr)
        return 2
    from backends.cuda import ALL_VARIANTS
    var_list = [(f, tuple(d)) for f, d in ALL_VARIANTS]
    if args.files:
        unknown = sorted(set(args.files) - {f for f, _ in var_list})
        if unknown:
            print(f"error: not among the variants (ALL_VARIANTS): {', '.join(unknown)}", file=sys.stderr)
            return 2
        var_list = [(f, d) for f, d in var_list if f in args.files]
    t0 = time.perf_counter()
    results = compile_all([(f, d, a) for f, d in var_list for a in archs], on_result=_progress if args.progress else None)
    elapsed = time.perf_counter() - t0
    lines, failed = _table(results, var_list, archs)
    major, minor = version()
    print(f"NVRTC {major}.{minor}; {len(var_list)} variants from ALL_VARIANTS x {len(archs)} arch(es) "
          f"compiled in {elapsed:.1f}s")
    print(f"options: {' '.join(options(('<defines>',), Target(archs[0], 'cubin')))} (as the GPU executor)")
    if len(archs) == 1:
        limit = f", {SMEM_LIMIT[archs[0]]} with" if archs[0] in SMEM_LIMIT else ""
        print(f"sm_{archs[0]}: smem = static __shared__ bytes (per block: {SMEM_DEFAULT} without opt-in"
              f"{limit}); spills in bytes")
    else:
        print(f"cells: registers / spill stores:loads in bytes ('!' when any) / static __shared__ bytes "
              f"(per block: {SMEM_DEFAULT} without opt-in)")
    print("\n".join(lines))
    if failed:
        sys.stdout.flush()
        print(f"{failed} compile(s) failed", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
