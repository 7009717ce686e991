"""Runs the CUDA kernels on the CPU: g++ builds a .cu file against harness/cuda_cpu.h
(every CUDA thread a fiber, all on the calling thread) into a shared library, and a
HarnessFunction launches one of its entry points the way cupy.RawKernel does:

    mod = build(KERNEL_DIR / "matmul.cu", defines=("QTYPE_Q4_0",))
    mod.get_function("matvec")(grid, block, args, shared_mem=n_bytes)
    # args: a numpy array per pointer parameter, a numpy scalar of exactly the
    # parameter's type per scalar (np.int32 for int, np.uint32 for unsigned/u32, ...)

build() preprocesses the source (with CUDA_CPU_PARSE_ONLY, so `__global__` survives)
to find every `extern "C" __global__ void NAME(PARAMS)`, generates a wrapper per kernel
that unpacks CUDA-style `void** args`, and compiles source + wrappers once per cache
key: the content of every file the preprocessor read, the defines, the flags, the
wrappers and the compiler's version. Libraries live in <repo>/.cache/cuda_harness/ and
are written under a temporary name, then renamed, so concurrent or interrupted builds
never leave half a library behind. Every argument is checked against the parsed
signature (on a GPU a mismatch silently shifts the parameters), and every error,
from the compiler or from a launch, is a HarnessError with a short message. With
MEMCHECK (on unless SHARPI_CUDA_HARNESS_MEMCHECK=0) every array argument lies between
PROT_NONE guard pages during the launch, so an access past its end (or before its
start) is a HarnessError naming the thread and the argument (_Guarded, below).
"""
from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import re
import secrets
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from engine.config import env_setting

_HERE = Path(__file__).resolve().parent
HEADER = _HERE / "harness" / "cuda_cpu.h"
KERNEL_DIR = _HERE / "kernels"
CACHE_DIR = _HERE.parents[1] / ".cache" / "cuda_harness"

CXX = "g++"
# -fno-weak: statics of inline functions must not be COMDAT, so that __shared__ ones can
# join the cuda_cpu_shared section; -fno-strict-aliasing: kernels reinterpret loads.
CXXFLAGS = ("-std=c++17", "-O2", "-fPIC", "-fno-weak", "-fno-strict-aliasing", "-fno-math-errno",
            "-fno-exceptions", "-fvisibility=hidden")
_GENERATOR = "cuda_cpu wrappers v3"     # bump when the generated wrapper code changes meaning

# a scalar parameter's C type (qualifiers and name removed) -> the numpy type the host passes
_SCALARS = {
    "int": np.int32, "signed": np.int32, "signed int": np.int32,
    "unsigned": np.uint32, "unsigned int": np.uint32, "u32": np.uint32,
    "float": np.float32,
    "long long": np.int64, "long long int": np.int64, "signed long long": np.int64,
    "unsigned long long": np.uint64, "unsigned long long int": np.uint64,
}
_CTYPE = {np.dtype(np.int32): ctypes.c_int32, np.dtype(np.uint32): ctypes.c_uint32,
          np.dtype(np.float32): ctypes.c_float, np.dtype(np.int64): ctypes.c_int64,
          np.dtype(np.uint64): ctypes.c_uint64}
_QUALIFIERS = {"const", "volatile", "__restrict__", "__restrict", "restrict"}

_MAX_THREADS = 1024                      # fiber stacks in the pool: one per CUDA thread of a block
_STACK_BYTES = 128 << 10                 # per CUDA thread, above one guard page
_STATIC_SHARED_SECTION = "cuda_cpu_shared"


class HarnessError(RuntimeError):
    """A kernel that does not compile, a bad launch or argument, or a CUDA rule broken at run time."""


@dataclass(frozen=True)
class Param:
    decl: str                 # as written (after preprocessing)
    name: str
    pointer: bool
    const: bool               # pointer to const: the kernel only reads through it
    dtype: np.dtype | None    # scalars: the numpy type the host must pass


# ---------------------------------------------------------------- building

def build(source: str | Path, defines: tuple[str, ...] = (), include_dirs: tuple = ()) -> HarnessModule:
    """The .cu file compiled for the CPU harness (cached on disk and in this process)."""
    source = Path(source).resolve()
    defines = tuple(str(d) for d in defines)
    include_dirs = tuple(Path(d).resolve() for d in include_dirs)
    for d in defines:
        if not d or d.startswith("-") or any(c.isspace() for c in d):
            raise HarnessError(f"{source.name}: bad define {d!r} (expected NAME or NAME=VALUE)")
    key = (source, defines, include_dirs)
    with _BUILD_LOCK:
        hit = _MEMO.get(key)
        if hit is not None and hit[0] == _stamp(hit[1].deps):
            return hit[1]
        module = _build(source, defines, include_dirs)
        _MEMO[key] = (_stamp(module.deps), module)
        return module


_BUILD_LOCK = threading.Lock()
_MEMO: dict[tuple, tuple[bytes | None, HarnessModule]] = {}


def _stamp(paths: tuple[Path, ...]) -> bytes | None:
    """Digest of the files' contents (cheap next to a compiler run; mtimes can be too coarse)."""
    h = hashlib.sha256()
    for p in paths:
        try:
            h.update(p.read_bytes() + b"\0\1")
        except OSError:
            return None
    return h.digest()


def _build(source: Path, defines: tuple[str, ...], include_dirs: tuple[Path, ...]) -> HarnessModule:
    search = ["-iquote", str(source.parent), "-I", str(KERNEL_DIR)]
    for d in include_dirs:
        search += ["-I", str(d)]
    macro_defs = [f"-D{d}" for d in defines]
    with tempfile.TemporaryDirectory(prefix="cuda_harness-") as tmp:
        tmp = Path(tmp)
        text, deps = _preprocess(source, search + macro_defs, tmp)
        kernels = _entry_points(text, source.name)
        wrapper = _wrapper_source(source.name, kernels)
        digest = _cache_key(deps, defines, wrapper)
        so = CACHE_DIR / f"{source.stem}-{digest[:24]}.so"
        if not so.exists():
            (tmp / "wrapper.cpp").write_text(wrapper)
            # __FILE__ (barrier sites in error messages) relative to the search path, so
            # that the library does not depend on where the source lies
            prefix_maps = [f"-fmacro-prefix-map={d}/=" for d in (source.parent, KERNEL_DIR, *include_dirs)]
            CACHE_DIR.mkdir(parents=True, exist_ok=True)
            partial = so.with_name(f"{so.stem}.{os.getpid()}.{secrets.token_hex(4)}.so.tmp")
            cmd = [CXX, *CXXFLAGS, "-shared", "-include", str(HEADER), *search, *macro_defs,
                   *prefix_maps, str(tmp / "wrapper.cpp"), "-o", str(partial), "-lm"]
            try:
                _run_compiler(cmd, source, defines)
                os.replace(partial, so)
            finally:
                partial.unlink(missing_ok=True)
    return HarnessModule(so, source, defines, kernels, deps)


def _run_compiler(cmd: list[str], source: Path, defines: tuple[str, ...]) -> str:
    try:
        r = subprocess.run(cmd, check=False, capture_output=True, text=True)
    except FileNotFoundError:
        raise HarnessError(f"the CPU harness needs {CXX} on PATH to build {source.name}") from None
    if r.returncode != 0:
        lines = r.stderr.splitlines()
        first = next((i for i, s in enumerate(lines) if re.search(r"\berror:", s)), 0)
        where = f"{source.name}" + (f" ({' '.join(defines)})" if defines else "")
        raise HarnessError(f"{CXX} failed on {where}:\n" + "\n".join(lines[first:first + 12]))
    return r.stdout


def _preprocess(source: Path, flags: list[str], tmp: Path) -> tuple[str, tuple[Path, ...]]:
    """(preprocessed text with `__global__` intact, every file read)."""
    pre, dep = tmp / "pre.ii", tmp / "deps.d"
    _run_compiler([CXX, "-std=c++17", "-E", "-P", "-DCUDA_CPU_PARSE_ONLY", "-include", str(HEADER), *flags,
                   "-MD", "-MF", str(dep), "-MT", "x", "-x", "c++", str(source), "-o", str(pre)],
                  source, tuple(f[2:] for f in flags if f.startswith("-D")))
    rule = dep.read_text().replace("\\\n", " ").split(":", 1)[1]
    names = [n.replace("\\ ", " ") for n in re.findall(r"(?:\\ |\S)+", rule)]
    return pre.read_text(), tuple(dict.fromkeys(Path(n).resolve() for n in names))


@lru_cache(maxsize=1)
def _compiler_id() -> str:
    try:
        v = subprocess.run([CXX, "--version"], check=False, capture_output=True, text=True).stdout.splitlines()
        m = subprocess.run([CXX, "-dumpmachine"], check=False, capture_output=True, text=True).stdout.strip()
    except FileNotFoundError:
        raise HarnessError(f"the CPU harness needs {CXX} on PATH") from None
    return (v[0] if v else "") + " " + m


def _cache_key(deps: tuple[Path, ...], defines: tuple[str, ...], wrapper: str) -> str:
    h = hashlib.sha256()
    for part in (_GENERATOR, _compiler_id(), " ".join(CXXFLAGS), "\0".join(defines), wrapper):
        h.update(part.encode() + b"\0\1")
    for p in deps:
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0\1")
    return h.hexdigest()


# ---------------------------------------------------------------- entry points

_ENTRY = re.compile(r'extern\s*"C"\s*__global__\b')
_NAME_PAREN = re.compile(r"\s*([A-Za-z_]\w*)\s*\(")
_IDENT = re.compile(r"[A-Za-z_]\w*")
_WORD = re.compile(r"\s*([A-Za-z_]\w*)\b")


def _after_parens(text: str, i: int) -> int:
    """Index just past the parenthesis that closes the one at text[i]."""
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "(":
            depth += 1
        elif text[j] == ")":
            depth -= 1
            if depth == 0:
                return j + 1
    raise HarnessError("unbalanced parentheses")


def _entry_points(text: str, file: str) -> dict[str, tuple[Param, ...]]:
    kernels: dict[str, tuple[Param, ...]] = {}
    for m in _ENTRY.finditer(text):
        i, seen_void = m.end(), False
        while True:         # `void`, with `__launch_bounds__(...)` before or after it
            word = _WORD.match(text, i)
            if word and word.group(1) == "__launch_bounds__":
                i = _after_parens(text, text.index("(", word.end()))
            elif word and word.group(1) == "void" and not seen_void:
                i, seen_void = word.end(), True
            else:
                break
        head = _NAME_PAREN.match(text, i) if seen_void else None
        if head is None:
            raise HarnessError(f"{file}: cannot read the entry point at {text[m.start():m.start() + 80]!r}")
        name = head.group(1)
        end = _after_parens(text, head.end() - 1)
        params = _parse_params(text[head.end():end - 1], name, file)
        # a prototype and then the definition: the same kinds, the names may differ
        if name in kernels and [(p.pointer, p.dtype) for p in kernels[name]] != [(p.pointer, p.dtype) for p in params]:
            raise HarnessError(f"{file}: kernel '{name}' is declared with two different parameter lists")
        kernels[name] = params
    if not kernels:
        raise HarnessError(f'{file}: no entry point (extern "C" __global__ void NAME(...)) found')
    return kernels


def _split_params(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for j, c in enumerate(text):
        depth += c in "([<"
        depth -= c in ")]>"
        if c == "," and depth == 0:
            parts.append(text[start:j])
            start = j + 1
    parts.append(text[start:])
    return [p.strip() for p in parts]


def _parse_params(text: str, kernel: str, file: str) -> tuple[Param, ...]:
    text = " ".join(text.split())
    if text in ("", "void"):
        return ()
    params = []
    for decl in _split_params(text):
        tokens = re.findall(r"[A-Za-z_]\w*|\S", decl)
        if "&" in tokens:
            raise HarnessError(f"{file}: kernel '{kernel}' parameter '{decl}': references cannot be kernel "
                               "parameters")
        if "*" in tokens:
            after = [t for t in tokens[tokens.index("*"):] if _IDENT.fullmatch(t) and t not in _QUALIFIERS]
            params.append(Param(decl, after[-1] if after else "", True,
                                "const" in tokens[:tokens.index("*")], None))
            continue
        if "[" in tokens:
            cut = tokens.index("[")
            params.append(Param(decl, tokens[cut - 1] if cut else "", True, "const" in tokens[:cut], None))
            continue
        words = [t for t in tokens if t not in _QUALIFIERS]
        if " ".join(words) in _SCALARS:
            ctype, name = " ".join(words), ""
        else:
            ctype, name = " ".join(words[:-1]), words[-1] if words else ""
        if ctype not in _SCALARS:
            raise HarnessError(
                f"{file}: kernel '{kernel}' parameter '{decl}': scalar type '{ctype}' is not supported; "
                "scalars are int, unsigned/u32, float, long long or unsigned long long")
        params.append(Param(decl, name, False, False, np.dtype(_SCALARS[ctype])))
    return tuple(params)


def _wrapper_source(source_name: str, kernels: dict[str, tuple[Param, ...]]) -> str:
    lines = ["// generated by backends/cuda/harness.py: one launcher per entry point",
             f'#include "{source_name}"', ""]
    for i, (name, params) in enumerate(kernels.items()):
        args = ", ".join(f"::cuda_cpu::Arg{{a[{j}]}}" for j in range(len(params)))
        lines.append(f"static void cuda_cpu_body_{i}(void** a) {{ (void)a; {name}({args}); }}")
    table = ", ".join(f'{{"{name}", cuda_cpu_body_{i}}}' for i, name in enumerate(kernels))
    lines += [
        "",
        f"static const ::cuda_cpu::KernelEntry cuda_cpu_kernels[] = {{{table}}};",
        "",
        'extern "C" __attribute__((visibility("default"))) int cuda_cpu_launch(',
        "        int index, const unsigned* grid, const unsigned* block, unsigned long long dyn_smem,",
        "        unsigned long long static_smem, const long long* extra_shared, int n_extra,",
        "        unsigned char* stacks, unsigned long long stride, void** args,",
        "        const unsigned long long* guards, const char* const* guard_names, int n_guards,",
        "        char* err, int err_len) {",
        "    return ::cuda_cpu::launch(cuda_cpu_kernels[index], grid, block, dyn_smem, static_smem,",
        "                              extra_shared, n_extra, stacks, stride, args, guards, guard_names,",
        "                              n_guards, err, err_len);",
        "}",
        "",
        'extern "C" __attribute__((visibility("default"))) unsigned long long cuda_cpu_static_shared_bytes() {',
        "    return (unsigned long long)(__stop_cuda_cpu_shared - __start_cuda_cpu_shared);",
        "}",
        "",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------- loading and launching

class HarnessModule:
    """One built .cu: its entry points by name (cf. cupy.RawModule)."""

    def __init__(self, path: Path, source: Path, defines: tuple[str, ...],
                 kernels: dict[str, tuple[Param, ...]], deps: tuple[Path, ...]):
        self.path, self.source, self.defines, self.kernels, self.deps = path, source, defines, kernels, deps
        self._lib = ctypes.CDLL(str(path))
        self._launch = self._lib.cuda_cpu_launch
        self._launch.restype = ctypes.c_int
        self._launch.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_uint), ctypes.POINTER(ctypes.c_uint),
                                 ctypes.c_ulonglong, ctypes.c_ulonglong, ctypes.POINTER(ctypes.c_longlong),
                                 ctypes.c_int, ctypes.c_void_p, ctypes.c_ulonglong,
                                 ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_ulonglong),
                                 ctypes.POINTER(ctypes.c_char_p), ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        self._static_smem, extra = _shared_layout(path, list(kernels), self._lib)
        self._extra_shared = (ctypes.c_longlong * max(1, len(extra)))(*extra)
        self._n_extra_shared = len(extra) // 2
        self._functions: dict[str, HarnessFunction] = {}

    def get_function(self, name: str) -> HarnessFunction:
        if name not in self.kernels:
            raise HarnessError(f"{self.source.name}: no kernel '{name}' (entry points: {', '.join(self.kernels)})")
        if name not in self._functions:
            self._functions[name] = HarnessFunction(self, list(self.kernels).index(name), name,
                                                    self.kernels[name], self._static_smem[name])
        return self._functions[name]


class HarnessFunction:
    """One entry point, called like cupy.RawKernel: fn(grid, block, args, shared_mem=0)."""

    def __init__(self, module: HarnessModule, index: int, name: str, params: tuple[Param, ...],
                 static_smem: int):
        self.module, self.index, self.name, self.params = module, index, name, params
        self.static_smem = static_smem      # bytes of static __shared__ charged to this kernel

    def __call__(self, grid, block, args: tuple, *, shared_mem: int = 0, stream=None) -> None:
        """Runs the kernel to completion (`stream` is accepted for cupy parity and ignored)."""
        grid3, block3 = self._dims(grid, "grid"), self._dims(block, "block")
        if not isinstance(args, (tuple, list)):
            raise HarnessError(f"kernel '{self.name}': args must be a tuple, got {type(args).__name__}")
        if len(args) != len(self.params):
            raise HarnessError(f"kernel '{self.name}' takes {len(self.params)} arguments "
                               f"({', '.join(p.decl for p in self.params)}), got {len(args)}")
        if (isinstance(shared_mem, bool) or not isinstance(shared_mem, (int, np.integer))
                or not 0 <= shared_mem < 2**63):
            raise HarnessError(f"kernel '{self.name}': shared_mem must be a byte count, got {shared_mem!r}")
        holders = [self._convert(i, p, a) for i, (p, a) in enumerate(zip(self.params, args))]
        argv = (ctypes.c_void_p * max(1, len(holders)))(*[ctypes.addressof(h) for h in holders])
        err = ctypes.create_string_buffer(1024)
        stacks = _stacks()
        with _LAUNCH_LOCK:
            guarded = _Guarded(self, args, holders) if MEMCHECK else None
            try:
                rc = self.module._launch(self.index, (ctypes.c_uint * 3)(*grid3), (ctypes.c_uint * 3)(*block3),
                                         int(shared_mem), self.static_smem, self.module._extra_shared,
                                         self.module._n_extra_shared, stacks.base, stacks.stride, argv,
                                         *(guarded.c_args() if guarded else (None, None, 0)), err, len(err))
                _LIBC.fflush(None)       # kernel printf, in launch order
            finally:
                late = guarded.finish() if guarded else None
        if rc != 0:
            raise HarnessError(err.value.decode(errors="replace"))
        if late:
            raise HarnessError(late)

    def _dims(self, v, what: str) -> tuple[int, int, int]:
        dims = (v,) if isinstance(v, (int, np.integer)) else v
        if (not isinstance(dims, (tuple, list)) or not 1 <= len(dims) <= 3
                or any(isinstance(d, bool) or not isinstance(d, (int, np.integer)) or not 0 <= d < 2**32
                       for d in dims)):
            raise HarnessError(f"kernel '{self.name}': {what} must be an int or a tuple of 1-3 ints, got {v!r}")
        return tuple(int(d) for d in dims) + (1,) * (3 - len(dims))

    def _convert(self, i: int, p: Param, a) -> ctypes._SimpleCData:
        where = f"kernel '{self.name}' parameter {i} ({p.decl})"
        if p.pointer:
            if not isinstance(a, np.ndarray):
                raise HarnessError(f"{where} takes a numpy array, got {_describe(a)}")
            if not p.const and not a.flags.writeable:
                raise HarnessError(f"{where} may be written through, but the array is read-only "
                                   "(declare the parameter const if the kernel only reads it)")
            return ctypes.c_void_p(a.ctypes.data)
        if not isinstance(a, np.generic) or a.dtype != p.dtype:
            raise HarnessError(f"{where} takes np.{p.dtype.name}, got {_describe(a)}")
        return _CTYPE[p.dtype](a.item())


def _describe(a) -> str:
    if isinstance(a, np.ndarray):
        return f"an array ({a.dtype}, shape {a.shape})"
    if isinstance(a, np.generic):
        return f"np.{a.dtype.name}"
    return f"a Python {type(a).__name__}"


_SYMBOL = re.compile(r"^([0-9a-f]+) (.{7}) (\S+)\s+([0-9a-f]+)\s+(?:\.hidden\s+)?(.+)$")


def _template_static(name: str) -> bool:
    """Is `name` (demangled) a static local of a template function (`T f<N>(args)::x`)?"""
    owner = name.rsplit("::", 1)[0] if "::" in name else ""
    owner = owner.removesuffix(" const")
    if not owner.endswith(")"):
        return False
    depth = 0
    for i in range(len(owner) - 1, -1, -1):
        depth += (owner[i] == ")") - (owner[i] == "(")
        if depth == 0:
            return "<" in owner[:i]
    return False


def _shared_layout(path: Path, kernels: list[str], lib: ctypes.CDLL) -> tuple[dict[str, int], list[int]]:
    """(bytes of static __shared__ per kernel, as the GPU would count them: a kernel's own
    arrays plus, conservatively, every array declared outside any kernel; flat (offset
    from the section's start, bytes) pairs of the statics of template functions, which
    g++ leaves outside the cuda_cpu_shared section)."""
    try:
        listing = subprocess.run(["objdump", "-t", "-C", str(path)], check=False, capture_output=True,
                                 text=True).stdout
    except FileNotFoundError:
        listing = ""
    start, own, common, outside = None, dict.fromkeys(kernels, 0), 0, []
    for line in listing.splitlines():
        m = _SYMBOL.match(line)
        if m is None:
            continue
        addr, flags, section, size, name = int(m[1], 16), m[2], m[3], int(m[4], 16), m[5].strip()
        if name == f"__start_{_STATIC_SHARED_SECTION}":
            start = addr
        elif "O" not in flags or size == 0:
            continue
        elif section == _STATIC_SHARED_SECTION and not name.endswith("shared_anchor"):
            owner = name.rsplit("::", 1)[0] if "::" in name else None
            if owner in own:
                own[owner] += size
            else:
                common += size
        elif section in (".bss", ".data") and _template_static(name):
            outside.append((addr, size))
            common += size
    if start is None:         # no objdump: charge the whole section to every kernel
        lib.cuda_cpu_static_shared_bytes.restype = ctypes.c_ulonglong
        total = int(lib.cuda_cpu_static_shared_bytes())
        return {k: total for k in kernels}, []
    return {k: n + common for k, n in own.items()}, [v for a, n in outside for v in (a - start, n)]


class _StackPool:
    """The fibers' stacks, shared by every module: 1024 of _STACK_BYTES, each above a
    PROT_NONE guard page, so that a stack overflow faults instead of corrupting a neighbour."""

    def __init__(self):
        page = mmap.PAGESIZE
        self.stride = _STACK_BYTES + page
        map_noreserve = getattr(mmap, "MAP_NORESERVE", 0x4000)
        self._mem = mmap.mmap(-1, self.stride * _MAX_THREADS,
                              flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | map_noreserve)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self._mem))
        mprotect = _LIBC.mprotect
        mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        for i in range(_MAX_THREADS):
            mprotect(self.base + i * self.stride, page, 0)


_LIBC = ctypes.CDLL(None)
_LIBC.fflush.argtypes = [ctypes.c_void_p]
_LAUNCH_LOCK = threading.Lock()         # one launch at a time: the stacks are shared
_POOL: list[_StackPool] = []


def _stacks() -> _StackPool:
    with _LAUNCH_LOCK:
        if not _POOL:
            _POOL.append(_StackPool())
        return _POOL[0]


# ---------------------------------------------------------------- memcheck
# Out-of-bounds accesses to array arguments, as compute-sanitizer's memcheck finds them
# on a GPU. Each array (for a strided view: the whole extent of its base array, all the
# memory the view may legitimately reach) is copied into its own mapping, laid out as
#     [guard][fill][array][fill][guard]        guard: _GUARD bytes of PROT_NONE
# with the array's end against the second guard, so a kernel access that starts at or
# past its end faults; cuda_cpu.h's on_fault turns that into a HarnessError naming the
# thread and the argument. The array keeps its address mod 16 (g++ may use aligned
# vector loads), so when its end is not 16-byte aligned up to 15 bytes of fill lie
# between it and the guard; the fill before it is what the page size leaves (none when
# its length is a multiple of the page size). Fill bytes are 0xFF (NaN, as shared memory):
# reads there are not caught, writes are (checked after the launch, without a thread).
# Arrays are copied back after the launch when a non-const parameter points into them;
# arguments whose memory overlaps share one mapping.

MEMCHECK: bool = env_setting("cuda_harness_memcheck") == "1"   # tests may set it per module

_PAGE = mmap.PAGESIZE
_GUARD = 16 * _PAGE                  # PROT_NONE before and after each array (no memory cost)
_ALIGN = 16                          # an array keeps its address mod _ALIGN
_FILL = 0xFF
_FILLED = bytes([_FILL]) * _PAGE
_KEEP_BYTES = 256 << 20              # free mappings kept for reuse (their pages stay resident)
_PROT_NONE, _PROT_RW = 0, 3
_MAP_FLAGS = 0x02 | 0x20 | 0x4000    # MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE

_LIBC.mmap.restype = ctypes.c_void_p
_LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_LIBC.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_FREE: dict[int, list[int]] = {}     # data pages -> mappings (addresses of their first guard)
_FREE_BYTES = [0]


def _map(pages: int) -> int:
    """A mapping of `pages` read-write pages between two guards (the address of the first)."""
    free = _FREE.get(pages)
    if free:
        _FREE_BYTES[0] -= pages * _PAGE
        return free.pop()
    total = 2 * _GUARD + pages * _PAGE
    base = _LIBC.mmap(None, total, _PROT_NONE, _MAP_FLAGS, -1, 0)
    if base in (None, ctypes.c_void_p(-1).value):
        raise HarnessError(f"memcheck: mmap of {total} bytes failed")
    if _LIBC.mprotect(base + _GUARD, pages * _PAGE, _PROT_RW) != 0:
        _LIBC.munmap(base, total)
        raise HarnessError(f"memcheck: mprotect of {pages * _PAGE} bytes failed")
    return base


def _unmap(pages: int, base: int) -> None:
    if _FREE_BYTES[0] + pages * _PAGE <= _KEEP_BYTES:
        _FREE.setdefault(pages, []).append(base)
        _FREE_BYTES[0] += pages * _PAGE
    else:
        _LIBC.munmap(base, 2 * _GUARD + pages * _PAGE)


def _bounds(a: np.ndarray) -> tuple[int, int]:
    """[first byte, one past the last byte) of the memory the array's elements occupy."""
    lo = hi = a.ctypes.data
    if a.size == 0:
        return lo, lo
    for n, step in zip(a.shape, a.strides):
        if step < 0:
            lo += (n - 1) * step
        else:
            hi += (n - 1) * step
    return lo, hi + a.itemsize


def _extent(a: np.ndarray) -> tuple[int, int, bool]:
    """(lo, hi, whole base): a contiguous array's own bytes; for a strided view, those of
    its outermost base array, which the view's first-element pointer may legitimately reach."""
    if a.flags.c_contiguous or a.flags.f_contiguous:
        return (*_bounds(a), False)
    root = a
    while isinstance(root.base, np.ndarray):
        root = root.base
    (lo, hi), (vlo, vhi) = _bounds(root), _bounds(a)
    return min(lo, vlo), max(hi, vhi), True


def _names(params: list[tuple[Param, bool]]) -> str:
    parts = [f"'{p.name}'" + (" (a strided view: its base array)" if view else "") for p, view in params]
    return ("argument " if len(parts) == 1 else "arguments ") + ", ".join(parts)


@dataclass
class _Region:
    lo: int                  # the host memory it mirrors
    hi: int
    members: list            # (param, whole base, lo, hi, argument index, pointer)
    pages: int = 0
    base: int = 0            # the mapping: first guard
    start: int = 0           # where the copy lies in the mapping
    write_back: bool = False


class _Guarded:
    """The array arguments of one launch, each between guard pages (see above)."""

    def __init__(self, fn: HarnessFunction, args, holders: list):
        self.kernel = fn.name
        arrays = []
        for i, (p, a) in enumerate(zip(fn.params, args)):
            if p.pointer:
                lo, hi, view = _extent(a)
                arrays.append((lo, hi, i, p, view, a.ctypes.data))
        arrays.sort(key=lambda t: (t[0], t[1]))
        self.regions: list[_Region] = []
        for lo, hi, i, p, view, ptr in arrays:      # overlapping memory: one mapping
            r = self.regions[-1] if self.regions else None
            if r is None or lo >= r.hi:
                r = _Region(lo, hi, [])
                self.regions.append(r)
            r.hi = max(r.hi, hi)
            r.members.append((p, view, lo, hi, i, ptr))
        guards, names = [], []
        try:
            for r in self.regions:
                n = r.hi - r.lo
                tail = -r.hi % _ALIGN                 # fill between the copy's end and the guard
                r.pages = max(1, -(-(n + tail) // _PAGE))
                r.base = _map(r.pages)
                data, end = r.base + _GUARD, r.base + _GUARD + r.pages * _PAGE
                r.start = end - tail - n
                ctypes.memset(data, _FILL, r.start - data)
                ctypes.memmove(r.start, r.lo, n)
                ctypes.memset(r.start + n, _FILL, tail)
                for p, view, lo, hi, i, ptr in r.members:
                    holders[i].value = r.start + (ptr - r.lo)
                    r.write_back |= not p.const
                guards += [r.base, data, r.start, r.start + n, end, end + _GUARD]
                names += [_names([(p, v) for p, v, lo, _, _, _ in r.members if lo == r.lo]).encode(),
                          _names([(p, v) for p, v, _, hi, _, _ in r.members if hi == r.hi]).encode()]
        except BaseException:
            self.finish()
            raise
        self._guards = (ctypes.c_ulonglong * max(1, len(guards)))(*guards)
        self._names = (ctypes.c_char_p * max(1, len(names)))(*names)

    def c_args(self) -> tuple:
        return self._guards, self._names, len(self.regions)

    def finish(self) -> str | None:
        """Copies back and gives the mappings back; a write into the fill, if any, as an error."""
        error = None
        for r in self.regions:
            if not r.base:
                continue
            n = r.hi - r.lo
            if r.write_back:
                ctypes.memmove(r.lo, r.start, n)
            data, end = r.base + _GUARD, r.base + _GUARD + r.pages * _PAGE
            before, after = ctypes.string_at(data, r.start - data), ctypes.string_at(r.start + n, end - r.start - n)
            if error is None and before != _FILLED[:len(before)]:
                k = len(before) - min(i for i, b in enumerate(before) if b != _FILL)
                who = _names([(p, v) for p, v, lo, _, _, _ in r.members if lo == r.lo])
                error = (f"kernel '{self.kernel}': memcheck: a write {k} bytes before the start of {who} "
                         f"({n} bytes; found after the launch, in the {len(before)} bytes between the "
                         "guard page and the array)")
            if error is None and after != _FILLED[:len(after)]:
                k = min(i for i, b in enumerate(after) if b != _FILL)
                who = _names([(p, v) for p, v, _, hi, _, _ in r.members if hi == r.hi])
                error = (f"kernel '{self.kernel}': memcheck: a write {k} bytes past the end of {who} "
                         f"({n} bytes; found after the launch, in the {len(after)} bytes between the "
                         "array and the guard page)")
            _unmap(r.pages, r.base)
            r.base = 0
        return error
