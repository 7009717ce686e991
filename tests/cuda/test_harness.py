"""The CPU harness itself (backends/cuda/harness.py + harness/cuda_cpu.h): small kernels
written here, run through the harness and compared with numpy; deliberately broken
kernels that must fail; the real kernels/common.cuh helpers. Always on the harness,
whatever SHARPI_CUDA_EXECUTOR says: what is tested (HarnessError, the NaN fill, the
shuffled thread order, memcheck) is the harness's own behaviour."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from backends.bf16 import f32_to_bf16
from backends.cuda.harness import HarnessError, build

FULL = 0xFFFFFFFF
ROOT = Path(__file__).resolve().parents[2]

WARP_CU = r"""
#include "common.cuh"

// seven [n] planes: xor-butterfly sum, down-tree sum, up-scan (inclusive prefix sum) in
// segments of `width`, then plain __shfl_sync / down / up / xor by `delta`
extern "C" __global__ void shfl_kinds(const float* __restrict__ x, float* __restrict__ out, int width, int delta) {
    const int n = gridDim.x * blockDim.x, i = blockIdx.x * blockDim.x + threadIdx.x;
    const int in_seg = (threadIdx.x % 32) % width;
    const float v = x[i];
    float s = v, d = v, u = v;
    for (int o = width / 2; o > 0; o >>= 1) s += __shfl_xor_sync(FULL_MASK, s, o, width);
    for (int o = width / 2; o > 0; o >>= 1) d += __shfl_down_sync(FULL_MASK, d, o, width);
    for (int o = 1; o < width; o <<= 1) {
        const float t = __shfl_up_sync(FULL_MASK, u, o, width);
        if (in_seg >= o) u += t;
    }
    out[i] = s;
    out[n + i] = d;
    out[2 * n + i] = u;
    out[3 * n + i] = __shfl_sync(FULL_MASK, v, in_seg + delta, width);
    out[4 * n + i] = __shfl_down_sync(FULL_MASK, v, delta, width);
    out[5 * n + i] = __shfl_up_sync(FULL_MASK, v, delta, width);
    out[6 * n + i] = __shfl_xor_sync(FULL_MASK, v, delta, width);
}

extern "C" __global__ void shfl_types(const long long* __restrict__ x, long long* ll, unsigned long long* ull,
                                      double* d, int* i32, unsigned* u32v) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x, lane = threadIdx.x % 32;
    const long long v = x[i];
    ll[i] = __shfl_xor_sync(FULL_MASK, v, 5);
    ull[i] = __shfl_sync(FULL_MASK, (unsigned long long)v, 31 - lane);
    d[i] = __shfl_down_sync(FULL_MASK, (double)v * 0.5, 3);
    i32[i] = __shfl_up_sync(FULL_MASK, (int)v, 2);
    u32v[i] = __shfl_xor_sync(FULL_MASK, (unsigned)v, 16, 32);
}

extern "C" __global__ void votes(const int* __restrict__ pred, unsigned* ballot, int* any, int* all) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    const int p = pred[i];
    __syncwarp();
    ballot[i] = __ballot_sync(FULL_MASK, p);
    any[i] = __any_sync(FULL_MASK, p);
    all[i] = __all_sync(FULL_MASK, p);
}

// only warp 1 reduces; warp 2 takes another path; lanes of warp 3 split into two
// half-warp shuffles with their own masks
extern "C" __global__ void branches(const float* __restrict__ x, float* __restrict__ out) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float v = x[i];
    if (warp == 1) {
        v = warp_sum(v);
    } else if (warp == 2) {
        v = -v;
    } else if (warp == 3) {
        if (lane < 16) v += __shfl_xor_sync(0x0000FFFFu, v, 1);
        else v -= __shfl_xor_sync(0xFFFF0000u, v, 2);
    }
    out[i] = v;
}

// lanes 8..15 read lanes 16..23, which are outside the mask (and have exited)
extern "C" __global__ void outside_mask(const float* __restrict__ x, float* __restrict__ out) {
    if (threadIdx.x >= 16) return;
    out[threadIdx.x] = __shfl_down_sync(0x0000FFFFu, x[threadIdx.x], 8);
}
"""

BLOCK_CU = r"""
#include "common.cuh"

// block (bx, by), grid (gx, gy): a tree reduction over shared memory, one sum per block
extern "C" __global__ void tree_sum(const float* __restrict__ x, float* __restrict__ out) {
    __shared__ float s[256];
    const int tid = threadIdx.y * blockDim.x + threadIdx.x, nt = blockDim.x * blockDim.y;
    const int b = blockIdx.y * gridDim.x + blockIdx.x;
    s[tid] = x[b * nt + tid];
#ifndef BROKEN
    __syncthreads();
#endif
    for (int o = nt / 2; o > 0; o >>= 1) {
        if (tid < o) s[tid] += s[tid + o];
        __syncthreads();
    }
    if (tid == 0) out[b] = s[0];
}

// thread i reads what thread i+1 wrote
extern "C" __global__ void neighbour(const float* __restrict__ x, float* __restrict__ out) {
    __shared__ float s[128];
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    s[threadIdx.x] = x[i];
#ifndef BROKEN
    __syncthreads();
#endif
    out[i] = s[(threadIdx.x + 1) % blockDim.x];
}

extern "C" __global__ void reverse(const float* __restrict__ x, float* __restrict__ out, int n) {
    DYN_SHARED(float, buf);
    for (int i = threadIdx.x; i < n; i += blockDim.x) buf[i] = x[blockIdx.x * n + i];
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[blockIdx.x * n + i] = buf[n - 1 - i];
}

// g++ ignores the section attribute here: the harness finds such arrays by symbol
template <int N> __device__ unsigned template_peek() {
    __shared__ unsigned t[N];
    const unsigned v = t[threadIdx.x];
    __syncthreads();
    t[threadIdx.x] = 7u;
    return v;
}

// reads shared memory nobody wrote (the 0xFF fill), then writes it for the next block
extern "C" __global__ void peek(unsigned* dyn_out, unsigned* static_out, unsigned* template_out) {
    DYN_SHARED(unsigned, buf);
    __shared__ unsigned st[64];
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    dyn_out[i] = buf[threadIdx.x];
    static_out[i] = st[threadIdx.x];
    template_out[i] = template_peek<64>();
    __syncthreads();
    buf[threadIdx.x] = 7u;
    st[threadIdx.x] = 7u;
}

extern "C" __global__ void atomics(const int* __restrict__ x, int* counts, unsigned* ucounts, float* fsum,
                                   int* imax, unsigned* umax, int* slot, int* old, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    atomicAdd(&counts[x[i] % 8], 1);
    atomicAdd(&ucounts[x[i] % 8], 2u);
    atomicAdd(fsum, 0.5f);
    atomicMax(imax, x[i] - 50);
    atomicMax(umax, (unsigned)x[i]);
    old[i] = atomicExch(slot, i);
}

extern "C" __global__ void dp4a(const int* __restrict__ a, const int* __restrict__ b, const int* __restrict__ c,
                                int* s, unsigned* u, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    s[i] = __dp4a(a[i], b[i], c[i]);
    u[i] = __dp4a((unsigned)a[i], (unsigned)b[i], (unsigned)c[i]);
}

// 12 ints per thread: threadIdx, blockIdx, blockDim, gridDim
extern "C" __global__ void dims(int* out) {
    const int t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    const int b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    int* o = out + 12 * (b * blockDim.x * blockDim.y * blockDim.z + t);
    const uint3 ti = threadIdx, bi = blockIdx;
    const dim3 bd = blockDim, gd = gridDim;
    o[0] = ti.x; o[1] = ti.y; o[2] = ti.z; o[3] = bi.x; o[4] = bi.y; o[5] = bi.z;
    o[6] = bd.x; o[7] = bd.y; o[8] = bd.z; o[9] = gd.x; o[10] = gd.y; o[11] = gd.z;
}
"""

BROKEN_CU = r"""
#include "common.cuh"

extern "C" __global__ void barrier_in_branch(float* out) {
    __shared__ float s[64];
    if (threadIdx.x < 32) {
        s[threadIdx.x] = 1.0f;
        __syncthreads();
    }
    s[threadIdx.x] = 2.0f;
    __syncthreads();
    out[threadIdx.x] = s[63 - threadIdx.x];
}

extern "C" __global__ void barrier_vs_shuffle(float* out) {
    float v = out[threadIdx.x];
    if (threadIdx.x % 32 < 16) __syncthreads();
    else v = __shfl_xor_sync(FULL_MASK, v, 1);
    out[threadIdx.x] = v;
}

extern "C" __global__ void exited_lane(float* out) {
    if (threadIdx.x % 32 >= 16) return;
    out[threadIdx.x] = warp_sum(out[threadIdx.x]);
}

extern "C" __global__ void mask_without_lane(float* out) {
    out[threadIdx.x] = __shfl_xor_sync(0x1u, out[threadIdx.x], 1);
}

extern "C" __global__ void mixed_ops(float* out) {
    const float v = out[threadIdx.x];
    out[threadIdx.x] = threadIdx.x % 2 ? __shfl_xor_sync(FULL_MASK, v, 1) : __shfl_down_sync(FULL_MASK, v, 1);
}

extern "C" __global__ void bad_width(float* out) {
    out[threadIdx.x] = __shfl_xor_sync(FULL_MASK, out[threadIdx.x], 1, 3);
}

extern "C" __global__ void plain(float* out) {
    out[blockIdx.x * blockDim.x + threadIdx.x] = warp_sum(1.0f);
}

extern "C" __global__ void big_static(float* out) {
    __shared__ float big[10000];
    big[threadIdx.x] = (float)threadIdx.x;
    __syncthreads();
    out[threadIdx.x] = big[threadIdx.x];
}

// two kernels of 32 KiB static shared memory each: the GPU charges each only its own
extern "C" __global__ void half_a(float* out) {
    __shared__ float a[8192];
    a[threadIdx.x] = 1.0f;
    __syncthreads();
    out[threadIdx.x] = a[threadIdx.x];
}

extern "C" __global__ void half_b(float* out) {
    __shared__ float b[8192];
    b[threadIdx.x] = 2.0f;
    __syncthreads();
    out[threadIdx.x] = b[threadIdx.x];
}
"""

PARAMS_CU = r"""
#include "common.cuh"
#define NT 64

#if defined(VARIANT_A)
extern "C" __global__ void
__launch_bounds__(NT * (2), 1)
scalars(const float* __restrict__ x,
        float* y, unsigned n, u32 m,
        long long big, unsigned long long ubig, float s, const int k)
{
    if (threadIdx.x == 0) {
        y[0] = x[0] * s;
        y[1] = (float)n;
        y[2] = (float)m;
        y[3] = (float)(big / 1000000000000LL);
        y[4] = (float)(ubig >> 60);
        y[5] = (float)k;
    }
}
#else
extern "C" __global__ void only_b(float* y) { y[threadIdx.x] = (float)TN; }
extern "C" __global__ __launch_bounds__(32) void before_void(void) {}
#endif
"""

COMMON_CU = r"""
#include "common.cuh"

extern "C" __global__ void common_ops(const float* __restrict__ x, float* sums, float* maxs, float* wsums,
                                      const unsigned* __restrict__ h16, float* f16, const float* __restrict__ bf_in,
                                      unsigned* bf_out) {
    __shared__ float red[32];
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    const float v = x[i];
    const float s = block_sum(v, red);
    const float m = block_max(v, red);
    if (threadIdx.x == 0) {
        sums[blockIdx.x] = s;
        maxs[blockIdx.x] = m;
    }
    wsums[i] = warp_sum(v);
    f16[i] = f16_to_f32(h16[i]);
    bf_out[i] = f32_to_bf16(bf_in[i]);
}
"""


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    d = tmp_path_factory.mktemp("cu")

    def write(name: str, text: str):
        path = d / name
        path.write_text(text)
        return path
    return write


@pytest.fixture(scope="module")
def warp(src):
    return build(src("warp.cu", WARP_CU))


@pytest.fixture(scope="module")
def block(src):
    return build(src("block.cu", BLOCK_CU))


@pytest.fixture(scope="module")
def broken(src):
    return build(src("broken.cu", BROKEN_CU))


# ---------------------------------------------------------------- warp built-ins

def _segments(width: int):
    lane = np.arange(32)
    seg = lane & ~(width - 1)
    return lane, seg, seg + width - 1


@pytest.mark.parametrize("width", [1, 2, 4, 8, 16, 32])
@pytest.mark.parametrize("delta", [0, 1, 3, 17, 33])
def test_shuffle_kinds_and_widths(warp, width, delta):
    rng = np.random.default_rng(width * 100 + delta)
    n_warps = 4
    x = rng.integers(-50, 50, size=(n_warps, 32)).astype(np.float32)
    out = np.zeros((7, n_warps, 32), np.float32)
    warp.get_function("shfl_kinds")((2,), (64,), (x, out, np.int32(width), np.int32(delta)))

    lane, seg, seg_end = _segments(width)
    xs = x.reshape(n_warps, 32 // width, width)
    np.testing.assert_array_equal(out[0], np.repeat(xs.sum(axis=2), width, axis=1))
    d = x.copy()
    o = width // 2
    while o > 0:
        src_lane = np.where(lane + o <= seg_end, lane + o, lane)
        d = d + d[:, src_lane]
        o //= 2
    np.testing.assert_array_equal(out[1], d)
    np.testing.assert_array_equal(out[2], np.cumsum(xs, axis=2).reshape(n_warps, 32))
    np.testing.assert_array_equal(out[3], x[:, seg | ((lane - seg + delta) & (width - 1))])
    b = delta & 31                                  # PTX shfl.sync reads the low 5 bits
    np.testing.assert_array_equal(out[4], x[:, np.where(lane + b <= seg_end, lane + b, lane)])
    np.testing.assert_array_equal(out[5], x[:, np.where(lane - b >= seg, lane - b, lane)])
    xor_lane = lane ^ b
    np.testing.assert_array_equal(out[6], x[:, np.where(xor_lane <= seg_end, xor_lane, lane)])


def test_shuffle_types_move_all_bytes(warp):
    rng = np.random.default_rng(1)
    x = rng.integers(-2**62, 2**62, size=64, dtype=np.int64)
    ll, ull = np.zeros(64, np.int64), np.zeros(64, np.uint64)
    d, i32, u32 = np.zeros(64), np.zeros(64, np.int32), np.zeros(64, np.uint32)
    warp.get_function("shfl_types")(1, 64, (x, ll, ull, d, i32, u32))
    lane = np.arange(64) % 32
    base = np.arange(64) - lane
    np.testing.assert_array_equal(ll, x[base + (lane ^ 5)])
    np.testing.assert_array_equal(ull, x[base + 31 - lane].view(np.uint64))
    np.testing.assert_array_equal(d, x[np.where(lane + 3 < 32, np.arange(64) + 3, np.arange(64))] * 0.5)
    np.testing.assert_array_equal(i32, x.astype(np.int32)[np.where(lane >= 2, np.arange(64) - 2, np.arange(64))])
    np.testing.assert_array_equal(u32, x.astype(np.uint32)[base + (lane ^ 16)])


def test_votes(warp):
    pred = np.zeros(96, np.int32)
    pred[[0, 5, 31]] = 1            # warp 0: some
    pred[32:64] = 7                 # warp 1: all; warp 2: none
    ballot, any_, all_ = np.zeros(96, np.uint32), np.zeros(96, np.int32), np.zeros(96, np.int32)
    warp.get_function("votes")((1,), (96,), (pred, ballot, any_, all_))
    np.testing.assert_array_equal(ballot, np.repeat([(1 << 0) | (1 << 5) | (1 << 31), FULL, 0], 32))
    np.testing.assert_array_equal(any_, np.repeat([1, 1, 0], 32))
    np.testing.assert_array_equal(all_, np.repeat([0, 1, 0], 32))


def test_shuffles_inside_branches(warp):
    x = np.arange(128, dtype=np.float32)
    out = np.zeros(128, np.float32)
    warp.get_function("branches")((1,), (128,), (x, out))
    want = x.copy()
    want[32:64] = x[32:64].sum()
    want[64:96] = -x[64:96]
    lane = np.arange(32)
    w3 = x[96:128]
    want[96:128] = np.where(lane < 16, w3 + w3[lane ^ 1], w3 - w3[lane ^ 2])
    np.testing.assert_array_equal(out, want)


def test_shuffle_from_a_lane_outside_the_mask_reads_nan_bytes(warp):
    x = np.arange(32, dtype=np.float32)
    out = np.zeros(16, np.float32)
    warp.get_function("outside_mask")(1, 32, (x, out))
    np.testing.assert_array_equal(out[:8], x[8:16])
    np.testing.assert_array_equal(out[8:].view(np.uint32), np.full(8, FULL, np.uint32))


# ---------------------------------------------------------------- blocks, shared memory, atomics

def test_block_tree_reduction_2d(block):
    rng = np.random.default_rng(2)
    x = rng.integers(0, 10, size=(6, 128)).astype(np.float32)     # grid (3, 2), block (16, 8)
    out = np.zeros(6, np.float32)
    block.get_function("tree_sum")((3, 2), (16, 8), (x, out))
    np.testing.assert_array_equal(out, x.sum(axis=1))


def test_neighbour_exchange(block):
    x = np.arange(256, dtype=np.float32)
    out = np.zeros(256, np.float32)
    block.get_function("neighbour")((2,), (128,), (x, out))
    np.testing.assert_array_equal(out, np.roll(x.reshape(2, 128), -1, axis=1).ravel())


def test_dynamic_shared_memory(block):
    n = 1000
    x = np.random.default_rng(3).random((3, n), dtype=np.float32)
    out = np.zeros_like(x)
    block.get_function("reverse")((3,), (128,), (x, out, np.int32(n)), shared_mem=4 * n)
    np.testing.assert_array_equal(out, x[:, ::-1])


def test_shared_memory_is_refilled_with_nan_bytes_every_block(block):
    dyn, st, tm = np.zeros(128, np.uint32), np.zeros(128, np.uint32), np.zeros(128, np.uint32)
    peek = block.get_function("peek")
    peek((2,), (64,), (dyn, st, tm), shared_mem=256)
    for got in (dyn, st, tm):
        np.testing.assert_array_equal(got, np.full(128, FULL, np.uint32))
    # a kernel is charged its own arrays plus those outside any kernel (the template helper's
    # 256 bytes, since the harness cannot tell which kernel calls it), never another kernel's
    assert peek.static_smem == 512 and block.get_function("tree_sum").static_smem == 1024 + 256


def test_atomics(block):
    n = 300
    x = np.random.default_rng(4).integers(0, 100, size=n).astype(np.int32)
    counts, ucounts = np.zeros(8, np.int32), np.zeros(8, np.uint32)
    fsum = np.zeros(1, np.float32)
    imax, umax = np.full(1, -1000, np.int32), np.zeros(1, np.uint32)
    slot, old = np.full(1, -1, np.int32), np.zeros(n, np.int32)
    block.get_function("atomics")((3,), (128,), (x, counts, ucounts, fsum, imax, umax, slot, old, np.int32(n)))
    np.testing.assert_array_equal(counts, np.bincount(x % 8, minlength=8))
    np.testing.assert_array_equal(ucounts, 2 * np.bincount(x % 8, minlength=8))
    assert fsum[0] == 0.5 * n
    assert imax[0] == x.max() - 50 and umax[0] == x.max()
    assert sorted([*old, slot[0]]) == [-1, *range(n)]      # every exchange saw the previous value


def test_dp4a_signed_and_unsigned(block):
    rng = np.random.default_rng(5)
    n = 200
    a, b, c = (rng.integers(-2**31, 2**31, size=n, dtype=np.int64).astype(np.int32) for _ in range(3))
    c[:4] = [2**31 - 1, -2**31, 2**31 - 100, -1]                 # wrap-around of the accumulation
    s, u = np.zeros(n, np.int32), np.zeros(n, np.uint32)
    block.get_function("dp4a")((4,), (64,), (a, b, c, s, u, np.int32(n)))
    sa, sb = a.view(np.int8).reshape(n, 4).astype(np.int64), b.view(np.int8).reshape(n, 4).astype(np.int64)
    ua, ub = a.view(np.uint8).reshape(n, 4).astype(np.int64), b.view(np.uint8).reshape(n, 4).astype(np.int64)
    np.testing.assert_array_equal(s, ((sa * sb).sum(1) + c).astype(np.int64).astype(np.uint64).astype(np.uint32)
                                  .view(np.int32))
    np.testing.assert_array_equal(u, ((ua * ub).sum(1) + c.view(np.uint32)).astype(np.uint64).astype(np.uint32))


def test_multidimensional_grid_and_block(block):
    grid, blk = (3, 2, 2), (4, 2, 3)
    n = np.prod(grid) * np.prod(blk)
    out = np.full((n, 12), -1, np.int32)
    block.get_function("dims")(grid, blk, (out,))
    got = {tuple(r) for r in out}
    want = {(tx, ty, tz, bx, by, bz, *blk, *grid)
            for bz in range(2) for by in range(2) for bx in range(3)
            for tz in range(3) for ty in range(2) for tx in range(4)}
    assert got == want and len(got) == n


# ---------------------------------------------------------------- broken kernels must fail

def test_missing_barrier_gives_wrong_results(src, block):
    bad = build(src("block.cu", BLOCK_CU), defines=("BROKEN",))
    rng = np.random.default_rng(2)
    x = rng.integers(0, 10, size=(6, 128)).astype(np.float32)
    out = np.zeros(6, np.float32)
    bad.get_function("tree_sum")((3, 2), (16, 8), (x, out))
    assert not np.array_equal(out, x.sum(axis=1))
    assert np.isnan(out).any()                   # read the 0xFF fill

    x = np.arange(256, dtype=np.float32)
    out = np.zeros(256, np.float32)
    bad.get_function("neighbour")((2,), (128,), (x, out))
    want = np.roll(x.reshape(2, 128), -1, axis=1).ravel()
    assert np.isnan(out).sum() > 32 and not np.array_equal(out, want)
    again = np.zeros(256, np.float32)
    bad.get_function("neighbour")((2,), (128,), (x, again))
    np.testing.assert_array_equal(again.view(np.uint32), out.view(np.uint32))     # deterministic


@pytest.mark.parametrize("kernel, block_size, message", [
    ("barrier_in_branch", 64, "other threads wait at __syncthreads"),
    ("barrier_vs_shuffle", 64, "__syncthreads"),
    ("exited_lane", 64, "exited"),
    ("mask_without_lane", 32, "does not contain the calling lane"),
    ("mixed_ops", 32, "while lane"),
    ("bad_width", 32, "width 3"),
    ("plain", 48, "past the end of the block"),     # a partial warp with a full-mask shuffle
])
def test_sync_errors(broken, kernel, block_size, message):
    out = np.zeros(64, np.float32)
    with pytest.raises(HarnessError, match=message) as e:
        broken.get_function(kernel)((1,), (block_size,), (out,))
    assert f"kernel '{kernel}' block (0,0,0) thread (" in str(e.value) and "\n" not in str(e.value)
    fine = np.zeros(64, np.float32)
    broken.get_function("plain")((2,), (32,), (fine,))       # the module still works after an error
    np.testing.assert_array_equal(fine, np.full(64, 32.0, np.float32))


def test_launch_limits(broken):
    out = np.zeros(2048, np.float32)
    plain = broken.get_function("plain")
    for grid, blk, smem, message in [
        (1, 1025, 0, "1025 threads"),
        (1, (32, 33), 0, "1056 threads"),
        (1, (1, 1, 65), 0, "z <= 64"),
        ((1, 65536), 32, 0, r"grid \(1,65536,1\); CUDA allows x in 1..2\^31-1, y and z in 1..65535"),
        ((1, 1, 65536), 32, 0, r"grid \(1,1,65536\)"),
        ((2**31, 1), 32, 0, r"grid \(2147483648,1,1\)"),
        (0, 32, 0, "grid"),
        (1, 32, 49153, "49153 bytes of dynamic"),
    ]:
        with pytest.raises(HarnessError, match=message):
            plain(grid, blk, (out,), shared_mem=smem)
    plain((1, 65535), 32, (out,))
    plain((1, 1, 65535), 32, (out,))
    plain(1, 1024, (out,), shared_mem=49152)

    big = broken.get_function("big_static")
    assert big.static_smem == 40000
    with pytest.raises(HarnessError, match=r"40000 bytes of static \+ 10000 bytes of dynamic"):
        big(1, 64, (out,), shared_mem=10000)
    big(1, 64, (out,), shared_mem=9152)
    for name, value in (("half_a", 1.0), ("half_b", 2.0)):
        fn = broken.get_function(name)
        assert fn.static_smem == 32768
        fn(1, 64, (out,), shared_mem=16384)
        assert (out[:64] == value).all()


def test_compile_error_is_a_harness_error(src):
    path = src("typo.cu", '#include "common.cuh"\nextern "C" __global__ void k(float* y) {\n'
                          '    __syncthread();\n    y[0] = 1.0f;\n}\n')
    with pytest.raises(HarnessError, match="error") as e:
        build(path)
    assert "__syncthread" in str(e.value) and "typo.cu" in str(e.value)


def test_argument_checks(src, broken, block):
    out = np.zeros(64, np.float32)
    plain = broken.get_function("plain")
    reverse = block.get_function("reverse")
    x = np.zeros(64, np.float32)
    bad_calls = [
        (plain, (), "takes 1 arguments"),
        (plain, (out, out), "takes 1 arguments"),
        (plain, (3,), "takes a numpy array, got a Python int"),
        (plain, (np.float32(1),), "takes a numpy array, got np.float32"),
        (reverse, (x, out, 64), "parameter 2 .*takes np.int32, got a Python int"),
        (reverse, (x, out, np.int64(64)), "takes np.int32, got np.int64"),
        (reverse, (x, out, np.uint32(64)), "takes np.int32, got np.uint32"),
        (reverse, (x, out, np.array([64], np.int32)), "got an array"),
        (reverse, (x, 7, np.int32(1)), "parameter 1 .*got a Python int"),
    ]
    for fn, args, message in bad_calls:
        with pytest.raises(HarnessError, match=message):
            fn(1, 32, args)
    readonly = np.zeros(64, np.float32)
    readonly.flags.writeable = False
    with pytest.raises(HarnessError, match="read-only"):
        plain(1, 32, (readonly,))
    reverse(1, 32, (readonly, out, np.int32(64)), shared_mem=256)     # const float* may be read-only
    with pytest.raises(HarnessError, match="no kernel 'nope'"):
        broken.get_function("nope")
    with pytest.raises(HarnessError, match="grid"):
        plain(1.5, 32, (out,))


def test_entry_point_parsing_across_lines_and_branches(src):
    path = src("params.cu", PARAMS_CU)
    a = build(path, defines=("VARIANT_A",))
    assert list(a.kernels) == ["scalars"]
    kinds = [(p.name, p.pointer, p.const, p.dtype) for p in a.kernels["scalars"]]
    assert kinds == [("x", True, True, None), ("y", True, False, None), ("n", False, False, np.uint32),
                     ("m", False, False, np.uint32), ("big", False, False, np.int64),
                     ("ubig", False, False, np.uint64), ("s", False, False, np.float32),
                     ("k", False, False, np.int32)]
    y = np.zeros(6, np.float32)
    a.get_function("scalars")(1, 32, (np.float32([3.0]), y, np.uint32(7), np.uint32(9), np.int64(5 * 10**12),
                                      np.uint64(3 << 60), np.float32(0.5), np.int32(-4)))
    np.testing.assert_array_equal(y, [1.5, 7, 9, 5, 3, -4])

    b = build(path, defines=("TN=8",))
    assert list(b.kernels) == ["only_b", "before_void"] and b.kernels["before_void"] == ()
    y = np.zeros(32, np.float32)
    b.get_function("only_b")(1, 32, (y,))
    assert (y == 8).all()

    bad = src("bad_scalar.cu", 'typedef unsigned char u8;\nextern "C" __global__ void k(u8 v, float* y) {}\n')
    with pytest.raises(HarnessError, match="scalar type 'u8' is not supported"):
        build(bad)


def test_build_cache(src):
    path = src("cached.cu", 'extern "C" __global__ void k(float* y) { y[threadIdx.x] = 1.0f; }\n')
    first = build(path)
    assert build(path) is first                               # in-process memo
    path.write_text('extern "C" __global__ void k(float* y) { y[threadIdx.x] = 2.0f; }\n')
    second = build(path)
    assert second.path != first.path and second.path.exists()
    y = np.zeros(32, np.float32)
    second.get_function("k")(1, 32, (y,))
    assert (y == 2).all()


# ---------------------------------------------------------------- memcheck

MEMCHECK_CU = r"""
// y[i] = x[i + shift] for i < n (read out of bounds when shift pushes i + shift out)
extern "C" __global__ void read_at(const float* __restrict__ x, float* __restrict__ y, int n, int shift) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i + shift];
}

// y[i + shift] = x[i] for i < n
extern "C" __global__ void write_at(const float* __restrict__ x, float* __restrict__ y, int n, int shift) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i + shift] = x[i];
}

// rows x cols column slices of row-major buffers with `stride` floats per row, addressed
// from their first element as the CUDA host layer passes them
extern "C" __global__ void scale_slice(const float* __restrict__ x, float* __restrict__ y, int rows, int cols,
                                       int x_stride, int y_stride) {
    const int c = threadIdx.x, r = blockIdx.x;
    if (r < rows && c < cols) y[r * y_stride + c] = 2.0f * x[r * x_stride + c];
}

// in place (x and y alias): y[i] = y[i] + x[i]
extern "C" __global__ void twice(const float* x, float* y) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    y[i] = y[i] + x[i];
}

extern "C" __global__ void address_mod_16(const float* __restrict__ x, unsigned* out) {
    out[0] = (unsigned)((unsigned long long)x % 16);
}

extern "C" __global__ void wild_write(float* y, long long where) {
    *(float*)where = y[0];
}
"""


@pytest.fixture
def memcheck(src, monkeypatch):
    from backends.cuda import harness
    monkeypatch.setattr(harness, "MEMCHECK", True)        # even under SHARPI_CUDA_HARNESS_MEMCHECK=0
    return build(src("memcheck.cu", MEMCHECK_CU))


@pytest.mark.parametrize("kernel, n, shift, message", [
    ("read_at", 1024, 1, r"invalid read at 0x[0-9a-f]+, 0 bytes past the end of argument 'x' \(4096 bytes"),
    ("read_at", 1000, 40, r"invalid read at 0x[0-9a-f]+, \d+ bytes past the end of argument 'x' \(4000 bytes"),
    ("write_at", 1024, 1, r"invalid write at 0x[0-9a-f]+, 0 bytes past the end of argument 'y' \(4096 bytes"),
    ("write_at", 1024, 3, r"invalid write at 0x[0-9a-f]+, 8 bytes past the end of argument 'y'"),
    # a length that is a multiple of the page size starts right after the guard page
    ("read_at", 1024, -1, r"invalid read at 0x[0-9a-f]+, 4 bytes before the start of argument 'x'"),
    ("write_at", 1024, -2, r"invalid write at 0x[0-9a-f]+, 8 bytes before the start of argument 'y'"),
])
def test_memcheck_out_of_bounds_access(memcheck, kernel, n, shift, message):
    x, y = np.arange(n, dtype=np.float32), np.zeros(n, np.float32)
    with pytest.raises(HarnessError, match=message) as e:
        memcheck.get_function(kernel)((-(-n // 256),), (256,), (x, y, np.int32(n), np.int32(shift)))
    assert f"kernel '{kernel}' block (" in str(e.value) and ") thread (" in str(e.value)
    assert "\n" not in str(e.value)
    # the thread named made the access described (of several, the first to run)
    m = re.search(r"block \((\d+),0,0\) thread \((\d+),0,0\).* (\d+) bytes (past the end|before the start)",
                  str(e.value))
    i = int(m[1]) * 256 + int(m[2])
    assert i < n and int(m[3]) == 4 * (i + shift - n if shift > 0 else -(i + shift))
    # the harness works on: a correct launch of the same kernel
    memcheck.get_function("read_at")((-(-n // 256),), (256,), (x, y, np.int32(n), np.int32(0)))
    np.testing.assert_array_equal(y, x)


def test_memcheck_writes_into_the_alignment_fill(memcheck):
    """An array whose end is not 16-byte aligned keeps up to 15 bytes of fill before the
    guard page (it keeps its address mod 16), and an array shorter than a page has fill
    before it: writes there are found after the launch, reads there read 0xFF bytes."""
    x, y = np.arange(5, dtype=np.float32), np.zeros(5, np.float32)
    fn = memcheck.get_function("write_at")
    with pytest.raises(HarnessError, match=r"a write 0 bytes past the end of argument 'y' \(20 bytes; found after"):
        fn(1, 32, (x, y, np.int32(5), np.int32(1)))
    with pytest.raises(HarnessError, match=r"a write 4 bytes before the start of argument 'y' \(20 bytes; found"):
        fn(1, 32, (x, y, np.int32(5), np.int32(-1)))
    memcheck.get_function("read_at")(1, 32, (x, y, np.int32(4), np.int32(1)))     # in bounds
    np.testing.assert_array_equal(y[:4], x[1:])


def test_memcheck_column_slice_views_reach_their_base(memcheck):
    """A strided view is passed as its first element; the kernel may index anything in
    the view's base array, which is guarded as a whole."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((7, 200)).astype(np.float32)
    out = np.full((7, 200), 5.0, np.float32)
    fn = memcheck.get_function("scale_slice")
    fn(7, 64, (x[:, 136:200], out[:, 100:164], np.int32(7), np.int32(64), np.int32(200), np.int32(200)))
    np.testing.assert_array_equal(out[:, 100:164], 2 * x[:, 136:200])
    assert np.all(out[:, :100] == 5.0) and np.all(out[:, 164:] == 5.0)
    # one column too many on the last row of the input runs past the base array
    with pytest.raises(HarnessError, match=r"0 bytes past the end of argument 'x' \(a strided view: its base "
                                           r"array\) \(5600 bytes"):
        fn(7, 65, (x[:, 136:200], out[:, 100:164], np.int32(7), np.int32(65), np.int32(200), np.int32(200)))


def test_memcheck_aliased_arguments_share_memory(memcheck):
    y = np.arange(256, dtype=np.float32)
    memcheck.get_function("twice")(2, 128, (y, y))
    np.testing.assert_array_equal(y, 2 * np.arange(256, dtype=np.float32))
    z = np.arange(512, dtype=np.float32)          # overlapping views: x reaches y's memory
    memcheck.get_function("twice")(2, 128, (z, z[256:]))
    np.testing.assert_array_equal(z, np.r_[np.arange(256), np.arange(256, 512) + np.arange(256)])


def test_memcheck_keeps_addresses_mod_16(memcheck):
    x, out = np.zeros(64, np.float32), np.zeros(1, np.uint32)
    for start in range(4):
        memcheck.get_function("address_mod_16")(1, 32, (x[start:], out))
        assert out[0] == x[start:].ctypes.data % 16


def test_memcheck_other_faults_still_crash(src):
    """A fault outside the guard pages is not swallowed: the process dies as it would
    without memcheck (here after a caught out-of-bounds access, so the handler is back)."""
    path = src("memcheck_crash.cu", MEMCHECK_CU)
    code = (
        "import numpy as np\n"
        "from backends.cuda.harness import build, HarnessError\n"
        f"m = build({str(path)!r})\n"
        "x = np.zeros(1024, np.float32)\n"
        "try:\n"
        "    m.get_function('read_at')(4, 256, (x, x.copy(), np.int32(1024), np.int32(1)))\n"
        "except HarnessError as e:\n"
        "    print('caught', e, flush=True)\n"
        "m.get_function('wild_write')(1, 1, (x, np.int64(16)))\n"
        "print('survived', flush=True)\n")
    env = {**os.environ, "SHARPI_CUDA_HARNESS_MEMCHECK": "1"}
    r = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code], check=False, capture_output=True, text=True,
                       cwd=ROOT, env=env, timeout=120)
    assert "caught kernel 'read_at'" in r.stdout and "survived" not in r.stdout
    assert r.returncode != 0 and "Segmentation fault" in r.stderr


def test_memcheck_setting():
    from engine.config import env_setting
    assert env_setting("cuda_harness_memcheck", env={}) == "1"
    assert env_setting("cuda_harness_memcheck", env={"SHARPI_CUDA_HARNESS_MEMCHECK": "0"}) == "0"


# ---------------------------------------------------------------- the real common.cuh

@pytest.mark.parametrize("block_size", [32, 256, 1024])
def test_common_cuh_helpers(src, block_size):
    mod = build(src("common_ops.cu", COMMON_CU))
    rng = np.random.default_rng(block_size)
    n_blocks = 3
    n = n_blocks * block_size
    x = rng.standard_normal(n).astype(np.float32)
    h16 = rng.integers(0, 1 << 16, size=n).astype(np.uint32)
    h16[:6] = [0x0000, 0x8000, 0x0001, 0x7C00, 0xFC00, 0x7E00]     # zeros, subnormal, infs, NaN
    bf_in = rng.standard_normal(n).astype(np.float32) * 1e3
    bf_in[:4] = [np.inf, -np.inf, np.nan, 3.3895314e38]
    sums, maxs = np.zeros(n_blocks, np.float32), np.zeros(n_blocks, np.float32)
    wsums, f16 = np.zeros(n, np.float32), np.zeros(n, np.float32)
    bf_out = np.zeros(n, np.uint32)
    mod.get_function("common_ops")((n_blocks,), (block_size,), (x, sums, maxs, wsums, h16, f16, bf_in, bf_out))

    xb = x.reshape(n_blocks, block_size).astype(np.float64)
    np.testing.assert_allclose(sums, xb.sum(axis=1), rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(maxs, x.reshape(n_blocks, block_size).max(axis=1))
    np.testing.assert_allclose(wsums, np.repeat(x.reshape(-1, 32).astype(np.float64).sum(1), 32), rtol=1e-5,
                               atol=1e-5)
    want16 = h16.astype(np.uint16).view(np.float16).astype(np.float32)
    np.testing.assert_array_equal(np.isnan(f16), np.isnan(want16))
    finite = ~np.isnan(want16)
    np.testing.assert_array_equal(f16[finite].view(np.uint32), want16[finite].view(np.uint32))
    np.testing.assert_array_equal(bf_out, f32_to_bf16(bf_in).astype(np.uint32))
