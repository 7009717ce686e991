"""GLSL -> SPIR-V: the shader variants the backend uses, compiled with
glslangValidator on first use and cached by source hash.

A variant is (file in shaders/, defines). The cache key hashes the .comp file,
every shaders/*.glsl include, the defines and the compiler's version, so an edited
shader is recompiled and an unchanged one never is. Cache directory:
$SNAPKV_SPIRV_CACHE, else ~/.cache/snapkv-engine/spirv (falling back to
backends/vulkan/__pycache__/spirv when the home cache is not writable).
`tools/build_shaders.py` precompiles every variant.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

from engine.errors import BackendUnavailable

from ..base import GATE_DEFINES
from ..kvformat import KV_DTYPES, TQ_BITS, boundaries, codebook, row_layout

SHADER_DIR = Path(__file__).resolve().parents[2] / "shaders"

# qtype name -> #define used by quant.glsl (gguf.GGMLQuantizationType names)
QTYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")

MATMUL_TN = 4       # tokens per workgroup of the mat-mat variant, GPU layout (shaders/matmul.comp)
MATMUL_TN_CPU = 2   # the same, ROW_PER_LANE layout (CPU devices; best on lavapipe)
MATMUL_WG = 64      # invocations per workgroup, GPU layout (matmul.comp's WG)
MATMUL_LANES_CPU = 8       # ROW_PER_LANE: invocations per workgroup (matmul.comp's LX)
MATMUL_TR_CHOICES = (32, 24, 16, 12, 8, 4, 2, 1)   # its rows per lane, TR (each a pipeline: few of them)
BLOCK_MAJOR_ROWS = 256     # rows per group of block-major weights (quant.glsl): a ROW_PER_LANE
                           # workgroup's rows (at most 256) are one or two contiguous runs
PADDED_QTYPES = ("Q4_0", "Q4_1", "Q8_0")   # stored padded for 64-bit loads on CPU devices with
                                          # shaderInt64 (quant.glsl PADDED_BLOCKS; weights.py)
MAX_WORKGROUPS = 65535     # per grid axis: maxComputeWorkGroupCount's guaranteed minimum
DECODE_SPLITS = 16         # spans of the context in split decode attention (attention.comp SPLIT)
MAX_GROUP = 8              # query heads one attention workgroup serves (attention.comp GROUP)
ROPE_WRITE_KEYS = ("bf16", "q8_0", "q4_0")   # key formats kv_write.comp's ROPE variant takes
ATTENTION_LANES = 8        # invocations of an attention_lanes.comp workgroup (its LANES)


def matmul_geometry(rows: int, cols: int, n: int, cpu_threads: int | None) -> tuple[tuple[str, ...], int, tuple, tuple]:
    """(defines, log2 of lanes per row, grid, specialization constants) of a matmul
    dispatch (layouts: matmul.comp). `cpu_threads`: None on GPUs, else the CPU device's
    threads (its workgroups run a whole workgroup per thread).
    GPU layout: LPR lanes walk each row's 32-element sub-blocks together, LPR in 4..32
    chosen to leave the fewest lanes idle on the last pass (ties: more lanes), among those
    whose grid stays within the 65535 workgroups every device allows (a 151936-row head
    of 1024 columns at 32 lanes a row would need 75968).
    ROW_PER_LANE: TR rows per lane (spec constant 0, one of MATMUL_TR_CHOICES) chosen so
    that the threads' rounds of workgroups take the fewest rows per thread (ties: larger
    TR): a 576-row matrix on 2 threads runs 6 workgroups of 96 rows (3 rounds of 96), not
    3 of 256 (2 rounds of 256)."""
    if cpu_threads is not None:
        tn = 1 if n == 1 else MATMUL_TN_CPU

        def rows_per_thread(tr: int) -> int:               # rounds of workgroups x rows per lane
            workgroups = -(-rows // (MATMUL_LANES_CPU * tr))
            return -(-workgroups // cpu_threads) * tr

        tr = min(MATMUL_TR_CHOICES, key=rows_per_thread)
        return ("ROW_PER_LANE", f"TN={tn}u"), 0, (-(-rows // (MATMUL_LANES_CPU * tr)), -(-n // tn), 1), (tr,)
    nsub = -(-cols // 32)
    fit = [lanes for lanes in (32, 16, 8, 4) if -(-rows // (MATMUL_WG // lanes)) <= MAX_WORKGROUPS] or [4]
    lpr = max(fit, key=lambda lanes: nsub / (-(-nsub // lanes) * lanes))
    tn = 1 if n == 1 else MATMUL_TN
    return (f"TN={tn}u",), lpr.bit_length() - 1, (-(-rows // (MATMUL_WG // lpr)), -(-n // tn), 1), ()


# elementwise op -> its eltwise.comp variant
ELTWISE_OPS = {"add": "OP_ADD", "silu_gate": "OP_SILU_GATE", "gelu_gate": "OP_GELU_GATE", "scale": "OP_SCALE"}


def _f32_list(values) -> str:
    """f32 values as exact GLSL literals, comma-separated."""
    return ",".join(repr(float(v)) for v in values)


@lru_cache(maxsize=None)
def kv_defines(k_dtype: str | None = None, v_dtype: str | None = None) -> tuple[str, ...]:
    """The #defines of a KV shader variant (shaders/kv.glsl): K_FMT / V_FMT = the index in
    kvformat.KV_DTYPES of the dtype's row layout (rq4_0: q4_0's; the backend rotates its
    rows), and for tq dtypes the codebook and its boundaries."""
    out = []
    for name, dtype in (("K_FMT", k_dtype), ("V_FMT", v_dtype)):
        if dtype is not None:
            out.append(f"{name}={KV_DTYPES.index(row_layout(dtype))}")
    for bits in sorted({TQ_BITS[d] for d in (k_dtype, v_dtype) if d in TQ_BITS}, reverse=True):
        out.append(f"TQ{bits}_LEVELS={_f32_list(codebook(bits))}")
        out.append(f"TQ{bits}_BOUNDS={_f32_list(boundaries(bits))}")
    return tuple(out)


def variants() -> list[tuple[str, tuple[str, ...]]]:
    """Every (shader, defines) the backend can dispatch."""
    out = [("rms_norm", ()), ("rms_norm", ("ADD",)), ("rope", ()), ("kv_rotate", ()),
           ("kv_gather", ("PASS_GATHER",)), ("kv_gather", ("PASS_SCATTER",)), ("kv_copy_pages", ()),
           ("copy_words", ()), ("copy_words", ("FILL",)), ("attention_combine", ()), ("argmax", ())]
    layouts = list(dict.fromkeys(map(row_layout, KV_DTYPES)))
    for k in layouts:
        out += [("snapkv_votes", ("PASS_STATS",) + kv_defines(k)), ("snapkv_votes", ("PASS_VOTES",) + kv_defines(k))]
        for v in layouts:
            out += [("kv_write", kv_defines(k, v)), ("attention", kv_defines(k, v)),
                    *([("kv_write", ("ROPE",) + kv_defines(k, v))] if k in ROPE_WRITE_KEYS else []),
                    ("attention_lanes", kv_defines(k, v)),
                    ("attention", kv_defines(k, v) + (f"SPLIT={DECODE_SPLITS}u",))]
    out += [("eltwise", (define,)) for define in ELTWISE_OPS.values()]
    for q in QTYPES:
        blocks = q not in ("F32", "F16", "BF16")           # block-major weights (CPU devices)
        out.append(("embedding", (f"QTYPE_{q}",)))
        for gate in ((),) + tuple((g,) for g in GATE_DEFINES.values()):   # gated_matmul: one token (TN=1)
            for tn in (1, MATMUL_TN)[:1 if gate else 2]:
                out.append(("matmul", (f"QTYPE_{q}",) + gate + (f"TN={tn}u",)))
            for tn in (1, MATMUL_TN_CPU)[:1 if gate else 2]:
                out.append(("matmul", (f"QTYPE_{q}",) + gate + ("ROW_PER_LANE", f"TN={tn}u")))
                if blocks:
                    out.append(("matmul", (f"QTYPE_{q}", "BLOCK_MAJOR") + gate + ("ROW_PER_LANE", f"TN={tn}u")))
                if q in PADDED_QTYPES:
                    padded = (f"QTYPE_{q}", "BLOCK_MAJOR", "PADDED_BLOCKS")
                    out.append(("matmul", padded + gate + ("ROW_PER_LANE", f"TN={tn}u")))
        if blocks:
            out.append(("embedding", (f"QTYPE_{q}", "BLOCK_MAJOR")))
        if q in PADDED_QTYPES:
            out.append(("embedding", (f"QTYPE_{q}", "BLOCK_MAJOR", "PADDED_BLOCKS")))
    return out


def _cache_dir() -> Path:
    env = os.environ.get("SNAPKV_SPIRV_CACHE")
    candidates = [Path(env)] if env else []
    candidates += [Path.home() / ".cache" / "snapkv-engine" / "spirv",
                   Path(__file__).resolve().parent / "__pycache__" / "spirv"]
    for d in candidates:
        try:
            d.mkdir(parents=True, exist_ok=True)
            if os.access(d, os.W_OK):
                return d
        except OSError:
            continue
    return Path(tempfile.mkdtemp(prefix="snapkv-spirv-"))


@lru_cache(maxsize=1)
def _compiler() -> tuple[str | None, str]:
    exe = shutil.which("glslangValidator")
    if exe is None:
        return None, ""
    r = subprocess.run([exe, "--version"], capture_output=True, text=True)
    return exe, r.stdout.strip().splitlines()[0] if r.stdout else ""


@lru_cache(maxsize=1)
def _includes_digest() -> bytes:
    h = hashlib.sha256()
    for p in sorted(SHADER_DIR.glob("*.glsl")):
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.digest()


# glslangValidator's flags; part of the cache key, so a change recompiles (the compiler's
# version is not: a cache built where glslang is installed must serve where it is not)
_FLAGS = ("-V", "--target-env", "vulkan1.1")


def _key(name: str, defines: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    h.update("\0".join(_FLAGS).encode() + b"\1")
    h.update((SHADER_DIR / f"{name}.comp").read_bytes())
    h.update(_includes_digest())
    h.update("\0".join(defines).encode())
    return f"{name}-{h.hexdigest()[:24]}.spv"


def compiler_available() -> bool:
    return _compiler()[0] is not None


def all_cached() -> bool:
    d = _cache_dir()
    return all((d / _key(n, defs)).exists() for n, defs in variants())


@lru_cache(maxsize=None)
def spirv(name: str, defines: tuple[str, ...] = ()) -> bytes:
    """SPIR-V bytes of shaders/<name>.comp with the given defines (cached on disk)."""
    path = _cache_dir() / _key(name, defines)
    if path.exists():
        return path.read_bytes()
    exe, _ = _compiler()
    if exe is None:
        raise BackendUnavailable("backend 'vulkan' needs glslangValidator on PATH to compile "
                                 "shaders/*.comp (apt-get install glslang-tools), or run "
                                 "tools/build_shaders.py where it is installed")
    src = SHADER_DIR / f"{name}.comp"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.spv"
        cmd = [exe, *_FLAGS, "-I" + str(SHADER_DIR)]
        cmd += [f"-D{d}" for d in defines] + [str(src), "-o", str(out)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            msg = " ".join((r.stdout + r.stderr).split())
            raise RuntimeError(f"glslangValidator failed on {src.name} {defines}: {msg}")
        data = out.read_bytes()
    tmp_path = path.with_suffix(f".{os.getpid()}.tmp")
    tmp_path.write_bytes(data)
    os.replace(tmp_path, path)       # atomic: concurrent test workers never read half a file
    return data
