"""Every CUDA kernel variant compiles with NVRTC for every GPU arch we target, on a
machine without a GPU (backends/cuda/nvrtc.py), with the options the device executor
compiles with (-ftz=true included): static shared memory fits the 48 KiB a block gets
without opt-in, and decode-path, prefill-attention and SnapKV kernels do not spill.
Skipped only when NVRTC cannot be loaded (pip install -e '.[cuda]')."""
import fnmatch

import pytest

from backends.cuda import ALL_VARIANTS, nvrtc

# Kernels launched for every decoded token (once or more per layer): ptxas must
# report zero spill stores/loads for them, since a spill there is local-memory
# traffic on every step. fnmatch patterns over the entry-function names in
# kernels/*.cu; test_decode_path_patterns_match keeps the list in step with them.
#   matvec            every projection and the LM head (matmul.cu, one variant per QTYPE; the
#                     FFN's down projection with the gate in its GATE_* variants)
#   attention_decode* flash-decoding split + combine (attention.cu)
#   dequant*          the token's embedding row (dequant_rows, dequant.cu)
#   add*              residual adds (add; add_rms_norm with the norm after it) and the qwen2
#                     q/k/v bias (add_bias)
#   rms_norm*         row norms and Gemma 3's per-head Q/K norm (rms_norm, rms_norm_warp)
#   scale*, gelu*     Gemma's embedding scale and gated FFN (eltwise.cu)
#   kv_write*         the token's K/V rows, bf16 or quantized (kv.cu)
#   rotate_vectors*   tq KV rows: the query into the rotated basis (rotate.cu)
#   argmax*           greedy decoding's token from the logits (argmax_rows, eltwise.cu)
DECODE_PATH = ("matvec*", "attention_decode*", "rms_norm*", "rope*", "kv_write*", "add*", "scale*", "silu*",
               "gelu*", "dequant*", "rotate_vectors*", "argmax*")
# and the kernels docs/cuda.md promises spill-free on every arch: prefill attention and the votes
NO_SPILL = DECODE_PATH + ("attention_prefill*", "snapkv*")

VARIANTS = [(f, tuple(d)) for f, d in ALL_VARIANTS]


def _archs(variant) -> tuple[int, ...]:
    """Every arch, except, to keep CI short, for a pair of different KV row formats (20 of
    the 25 attention and votes variants) and the gated mat-vecs (GATE_*), compiled for
    sm_80 only: the per-format row readers the pairs combine, and the mat-vec the gated
    variants stage their input for, are compiled for every arch in the other variants."""
    kv = {d.split("=")[0]: d.split("=")[1] for d in variant[1] if d.startswith("KV_")}
    mixed = kv.get("KV_K", "KV_BF16") != kv.get("KV_V", "KV_BF16")
    gated = any(d.startswith("GATE_") for d in variant[1])
    return (80,) if mixed or gated else nvrtc.ARCHS


PAIRS = [(v, a) for v in VARIANTS for a in _archs(v)]


def _variant_id(variant) -> str:
    file, defines = variant
    return "-".join((file,) + tuple(defines))


@pytest.fixture(scope="module")
def compiled(nvrtc_loaded):
    """{(file, defines, arch): CompileResult or CompileError}, each compiled once
    (a pool of 2 processes takes over when the whole set would exceed ~90 s)."""
    return nvrtc.compile_all([(f, d, a) for (f, d), a in PAIRS])


def _result(compiled, variant, arch) -> nvrtc.CompileResult:
    file, defines = variant
    result = compiled[(file, tuple(defines), arch)]
    if isinstance(result, nvrtc.CompileError):
        pytest.fail(str(result), pytrace=False)
    return result


by_variant_and_arch = pytest.mark.parametrize(
    "variant, arch", PAIRS, ids=[f"{_variant_id(v)}-sm_{a}" for v, a in PAIRS])


@by_variant_and_arch
def test_compiles(compiled, variant, arch):
    result = _result(compiled, variant, arch)
    assert result.cubin, "empty cubin"
    assert result.kernels, f"ptxas reported no entry function:\n{result.log}"


@by_variant_and_arch
def test_static_shared_memory_fits_default(compiled, variant, arch):
    result = _result(compiled, variant, arch)
    over = {name: k.smem_bytes for name, k in result.kernels.items() if k.smem_bytes > nvrtc.SMEM_DEFAULT}
    assert not over, f"static __shared__ bytes above {nvrtc.SMEM_DEFAULT} on sm_{arch}: {over}"


@by_variant_and_arch
def test_does_not_spill(compiled, variant, arch):
    result = _result(compiled, variant, arch)
    spills = {name: (k.spill_stores, k.spill_loads) for name, k in result.kernels.items()
              if any(fnmatch.fnmatchcase(name, p) for p in NO_SPILL) and (k.spill_stores or k.spill_loads)}
    assert not spills, f"kernels spill on sm_{arch} (store, load bytes): {spills}"


def test_no_spill_patterns_match(compiled):
    names = {name for r in compiled.values() if isinstance(r, nvrtc.CompileResult) for name in r.kernels}
    unmatched = [p for p in NO_SPILL if not fnmatch.filter(names, p)]
    assert not unmatched, f"NO_SPILL patterns matching no kernel: {unmatched}; kernels: {sorted(names)}"


def test_targets_supported_by_nvrtc(nvrtc_loaded):
    assert set(nvrtc.ARCHS) <= set(nvrtc.SMEM_LIMIT)
    assert set(nvrtc.ARCHS) <= set(nvrtc.supported_archs())


_FLOAT_OPS = r"""
extern "C" __global__ void muladd(const float* __restrict__ a, float* __restrict__ out) {
    out[threadIdx.x] = a[threadIdx.x] * a[threadIdx.x + 32] + out[threadIdx.x];
}
"""


def test_runtime_codegen_flags(nvrtc_loaded):
    """What the harness cannot reproduce, as the GPU gets it (docs/cuda.md): f32 math
    flushes subnormals (-ftz=true, as cupy's RawModule always compiled) and a*b+c
    contracts to one FMA (NVRTC's default --fmad=true)."""
    ptx = nvrtc.compile_source(_FLOAT_OPS, "muladd.cu", (), nvrtc.Target(80, "ptx")).image
    assert b"fma.rn.ftz.f32" in ptx and b"mul.ftz.f32" not in ptx and b"mul.f32" not in ptx, ptx.decode()


_DYN_SHARED_KERNEL = r"""
#include "common.cuh"
extern "C" __global__ void reverse_sum(const float* __restrict__ x, float* __restrict__ out) {
    DYN_SHARED(float, buf);
    buf[threadIdx.x] = x[threadIdx.x];
    __syncthreads();
    out[threadIdx.x] = warp_sum(buf[blockDim.x - 1 - threadIdx.x]);
}
"""


@pytest.mark.parametrize("arch", nvrtc.ARCHS, ids=lambda a: f"sm_{a}")
def test_dyn_shared_and_common_header(nvrtc_loaded, arch):
    result = nvrtc.compile_source(_DYN_SHARED_KERNEL, "dyn_shared.cu", ("UNUSED_DEFINE=1",), arch)
    k = result.kernels["reverse_sum"]
    assert k.registers > 0 and k.smem_bytes == 0     # dynamic shared memory is not in ptxas's count
    assert f"sm_{arch}" in result.log


def test_typo_fails_with_compiler_message(nvrtc_loaded):
    source = _DYN_SHARED_KERNEL.replace("float* __restrict__ out", "flaot* __restrict__ out")
    with pytest.raises(nvrtc.CompileError) as info:
        nvrtc.compile_source(source, "typo.cu", (), 80)
    message = str(info.value)
    assert "typo.cu" in message and "sm_80" in message
    assert 'identifier "flaot" is undefined' in message


_OVERSIZED_SHARED = r"""
#include "common.cuh"
extern "C" __global__ void big_shared(float* x) {
    __shared__ float tile[16384];      // 64 KiB: above the 48 KiB static limit of every arch
    tile[threadIdx.x] = x[threadIdx.x];
    __syncthreads();
    x[threadIdx.x] = tile[threadIdx.x ^ 1];
}
"""


@pytest.mark.parametrize("arch", nvrtc.ARCHS, ids=lambda a: f"sm_{a}")
def test_oversized_static_shared_fails(nvrtc_loaded, arch):
    with pytest.raises(nvrtc.CompileError, match="too much shared data"):
        nvrtc.compile_source(_OVERSIZED_SHARED, "big_shared.cu", (), arch)


def test_parse_ptxas():
    log = """\
ptxas info    : 0 bytes gmem
ptxas info    : Function properties for helper
ptxas         .     32 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads
ptxas info    : Compiling entry function 'attn_decode' for 'sm_86'
ptxas info    : Function properties for attn_decode
ptxas         .     16 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 16 bytes cumulative stack size, 4224 bytes smem, 400 bytes cmem[0]
ptxas info    : Compile time = 3.1 ms
ptxas info    : Compiling entry function 'add' for 'sm_86'
ptxas info    : Function properties for add
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 16 registers, 388 bytes cmem[0]
"""
    assert nvrtc.parse_ptxas(log) == {
        "attn_decode": nvrtc.KernelResources(registers=255, spill_stores=4, spill_loads=12, stack_bytes=16,
                                             smem_bytes=4224),
        "add": nvrtc.KernelResources(registers=16, spill_stores=0, spill_loads=0, stack_bytes=0, smem_bytes=0),
    }
