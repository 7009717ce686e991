// KV-cache writes, compaction and page copies over the paged layout of kvrow.cuh:
//   pages[n_pages][n_kv][page_size][row_bytes], row r in page page_table[r / page_size].
//
// Writes quantize on the device exactly as backends/kvformat.py (KvFormat.quantize):
//   kv_write           K and V rows -> bf16 pages, one launch (the default pair)
//   kv_write_<fmt>     one pool's rows -> fmt (bf16, q8_0, q4_0, tq4, tq3), a launch per pool
// Grid (n, n_kv), a block per (token, KV head) row; KVW_THREADS threads for kv_write_<fmt>.
// start_row is the argument, or step[step_at] when step_at >= 0 (a recorded decode step reads
// it from the step buffer its replays rewrite; step is any pointer, unread, otherwise).
//   q8_0 / q4_0   a warp per 32-value block: ggml's reference rounding (quantize_row_q8_0_ref:
//                 d = amax / 127, q = roundf(x / d); quantize_row_q4_0_ref: d = max / -8,
//                 q = min(15, (int)(x / d + 8.5)), max the first value of largest |x|), with
//                 the products rounded on their own (__fmul_rn / __fadd_rn: no FMA contraction)
//   tq4 / tq3     the block: y = R x (rot_t = R^T, coalesced columns), sigma = |y| / sqrt(D),
//                 code = number of boundaries below y / sigma, s = <y, c> / |c|^2 stored as f16
//                 (round to nearest even); sums in f32 (kvformat: f64), so a code may differ
//                 at a near-tie and s by an ulp.
// Moves copy whole rows / pages in units of T = u32, u16 or u8 (the largest that divides
// every width involved), whatever the format: a quantized row carries its scales.
#include "kvrow.cuh"

#define KVW_THREADS 128
#define MAX_HEAD_DIM 256

// K/V rows (f32, strided) -> bf16 rows start_row .. start_row + n - 1.
// Grid (n, n_kv, 1), block: head_dim/2 rounded up to 32 (one word each, looping if more).
extern "C" __global__ void kv_write(u32* __restrict__ k_pages, u32* __restrict__ v_pages,
                                    const int* __restrict__ page_table, const float* __restrict__ k, int k_stride,
                                    const float* __restrict__ v, int v_stride, int n_kv, int head_dim,
                                    int page_size, int start_row, const int* __restrict__ step, int step_at) {
    const int t = blockIdx.x, h = blockIdx.y, hd2 = head_dim / 2;
    if (step_at >= 0) start_row = step[step_at];
    const long long dst = row_word(page_table, start_row + t, h, n_kv, page_size, hd2);
    const float* kr = k + (long long)t * k_stride + h * head_dim;
    const float* vr = v + (long long)t * v_stride + h * head_dim;
    for (int p = threadIdx.x; p < hd2; p += blockDim.x) {
        k_pages[dst + p] = f32_to_bf16(kr[2 * p]) | (f32_to_bf16(kr[2 * p + 1]) << 16);
        v_pages[dst + p] = f32_to_bf16(vr[2 * p]) | (f32_to_bf16(vr[2 * p + 1]) << 16);
    }
}

// C roundf: halves away from zero (v - trunc(v) is exact).
__device__ __forceinline__ float round_away(float v) {
    const float t = truncf(v);
    return fabsf(v - t) >= 0.5f ? t + (v > 0.0f ? 1.0f : -1.0f) : t;
}

__device__ __forceinline__ void put_f16(u8* dst, float x) {
    const u32 h = f32_to_f16(x);
    dst[0] = (u8)(h & 0xFFu);
    dst[1] = (u8)(h >> 8);
}

template <int F>
__device__ __forceinline__ void write_row(u8* __restrict__ dst, const float* __restrict__ x, int head_dim,
                                          const float* __restrict__ rot_t, const float* __restrict__ cb,
                                          const float* __restrict__ bounds) {
    const int tid = threadIdx.x, lane = tid % WARP_SIZE, warp = tid / WARP_SIZE;
    if constexpr (F == KV_BF16) {
        u32* w = reinterpret_cast<u32*>(dst);
        for (int p = tid; p < head_dim / 2; p += KVW_THREADS)
            w[p] = f32_to_bf16(x[2 * p]) | (f32_to_bf16(x[2 * p + 1]) << 16);
    } else if constexpr (F == KV_Q8_0) {                       // quantize_row_q8_0_ref
        for (int b = warp; b < head_dim / 32; b += KVW_THREADS / WARP_SIZE) {
            const float xv = x[32 * b + lane];
            const float d = warp_max(fabsf(xv)) / 127.0f;
            const float id = d >= MIN_NORMAL ? 1.0f / d : 0.0f;          // subnormal: 0 under -ftz=true
            u8* blk = dst + 34 * b;
            blk[2 + lane] = (u8)(int)round_away(__fmul_rn(xv, id));
            if (lane == 0) put_f16(blk, d);
        }
    } else if constexpr (F == KV_Q4_0) {                       // quantize_row_q4_0_ref
        for (int b = warp; b < head_dim / 32; b += KVW_THREADS / WARP_SIZE) {
            const float xv = x[32 * b + lane], ax = fabsf(xv);
            const float amax = warp_max(ax);
            const int first = __ffs(__ballot_sync(FULL_MASK, ax == amax)) - 1;
            const float d = __shfl_sync(FULL_MASK, xv, first) / -8.0f;
            const float id = fabsf(d) >= MIN_NORMAL ? 1.0f / d : 0.0f;    // as q8_0's
            const int qv = min(15, (int)truncf(__fadd_rn(__fmul_rn(xv, id), 8.5f)));
            const int hi = __shfl_down_sync(FULL_MASK, qv, 16);
            u8* blk = dst + 18 * b;
            if (lane < 16) blk[2 + lane] = (u8)(qv | (hi << 4));
            if (lane == 0) put_f16(blk, d);
        }
    } else {                                         // tq4 / tq3
        constexpr int BITS = F == KV_TQ4 ? 4 : 3, YT = MAX_HEAD_DIM / KVW_THREADS;
        __shared__ float xs[MAX_HEAD_DIM];
        __shared__ u8 codes[MAX_HEAD_DIM];
        __shared__ float red[32];
        for (int k = tid; k < head_dim; k += KVW_THREADS) xs[k] = x[k];
        __syncthreads();
        float y[YT];
        float ss = 0.0f;
#pragma unroll
        for (int j = 0; j < YT; ++j) {
            const int p = tid + KVW_THREADS * j;
            float acc = 0.0f;
            if (p < head_dim)
                for (int k = 0; k < head_dim; ++k) acc += rot_t[k * head_dim + p] * xs[k];
            y[j] = acc;
            ss += acc * acc;
        }
        const float sigma = sqrtf(block_sum(ss, red) / (float)head_dim);
        const float inv = sigma > 0.0f ? 1.0f / sigma : 0.0f;
        float num = 0.0f, den = 0.0f;
#pragma unroll
        for (int j = 0; j < YT; ++j) {
            const int p = tid + KVW_THREADS * j;
            if (p < head_dim) {
                const float v = __fmul_rn(y[j], inv);
                int c = 0;
#pragma unroll
                for (int t = 0; t < (1 << BITS) - 1; ++t) c += v > bounds[t];
                const float level = cb[c];
                num += y[j] * level;
                den += level * level;
                codes[p] = (u8)c;
            }
        }
        num = block_sum(num, red);                   // its barriers publish codes[]
        den = block_sum(den, red);
        if (tid == 0) put_f16(dst, num / fmaxf(den, 1e-30f));
        if constexpr (BITS == 4) {                             // value 2j low nibble of byte j
            for (int j = tid; j < head_dim / 2; j += KVW_THREADS)
                dst[2 + j] = (u8)(codes[2 * j] | (codes[2 * j + 1] << 4));
        } else {                                     // 8 values per 3 bytes, value i at bits 3i
            for (int j = tid; j < head_dim / 8; j += KVW_THREADS) {
                u32 w = 0u;
#pragma unroll
                for (int i = 0; i < 8; ++i) w |= (u32)codes[8 * j + i] << (3 * i);
                dst[2 + 3 * j] = (u8)(w & 0xFFu);
                dst[3 + 3 * j] = (u8)((w >> 8) & 0xFFu);
                dst[4 + 3 * j] = (u8)(w >> 16);
            }
        }
    }
}

// One pool's rows (f32, strided) -> format F rows start_row .. start_row + n - 1.
// rot_t = R^T f32 [head_dim, head_dim], cb f32 [16], bounds f32 [15]: read by tq only.
#define KV_WRITE_ENTRY(NAME, F)                                                                              \
    extern "C" __global__ void __launch_bounds__(KVW_THREADS) NAME(                                          \
            u8* __restrict__ pages, const int* __restrict__ page_table, const float* __restrict__ x,          \
            int x_stride, int n_kv, int head_dim, int page_size, int start_row,                              \
            const float* __restrict__ rot_t, const float* __restrict__ cb, const float* __restrict__ bounds,  \
            const int* __restrict__ step, int step_at) {                                                     \
        const int t = blockIdx.x, h = blockIdx.y;                                                            \
        if (step_at >= 0) start_row = step[step_at];                                                         \
        u8* dst = pages + kv_row_offset(page_table, start_row + t, h, n_kv, page_size,                       \
                                        KvRow<F>::row_bytes(head_dim));                                      \
        write_row<F>(dst, x + (long long)t * x_stride + (long long)h * head_dim, head_dim, rot_t, cb, bounds); \
    }
KV_WRITE_ENTRY(kv_write_bf16, KV_BF16)
KV_WRITE_ENTRY(kv_write_q8_0, KV_Q8_0)
KV_WRITE_ENTRY(kv_write_q4_0, KV_Q4_0)
KV_WRITE_ENTRY(kv_write_tq4, KV_TQ4)
KV_WRITE_ENTRY(kv_write_tq3, KV_TQ3)

// A decode step's RoPE fused into its K/V writes (ForwardPass: one launch where rope, the
// keys' centre add and kv_write took two to four). Row t of x holds the step's q | k | v
// (q at 0, k at k_off, v at v_off floats; rows x_stride apart). Blocks y < n_kv: key head y
// is rotated by RoPE at the row's position (rope.cu's table and rope_pair), moved by centre
// (f32 [n_kv * head_dim], when centred) and stored as KF; its value head is stored as VF, or left
// to kv_write_<fmt> (VF = KV_NONE: a rotated value format). Blocks y >= n_kv rotate query
// head y - n_kv in place, as rope.cu does. x's keys are read, not rotated in place.
// Positions as rope.cu's; start_row as kv_write_<fmt>'s. Grid (n, n_kv + n_q), KVW_THREADS.
#define KV_NONE -1
template <int KF, int VF>
__device__ __forceinline__ void rope_write(u8* __restrict__ k_pages, u8* __restrict__ v_pages,
                                           const int* __restrict__ page_table, float* x, int x_stride, int k_off,
                                           int v_off, int n_kv, int head_dim, int page_size, int start_row,
                                           const float* __restrict__ table, const int* __restrict__ positions,
                                           int use_positions, int pos0, int rot_dim, int neox,
                                           const float* __restrict__ centre, int centred,
                                           const int* __restrict__ step, int step_at) {
    __shared__ float ks[MAX_HEAD_DIM];
    const int t = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, half = rot_dim / 2;
    const int pos = use_positions ? positions[t] : pos0 + t;
    const float2* cs = reinterpret_cast<const float2*>(table) + (long long)pos * half;
    float* row = x + (long long)t * x_stride;
    if (h >= n_kv) {                                             // a query head, in place
        for (int i = tid; i < half; i += KVW_THREADS) rope_pair(row + (long long)(h - n_kv) * head_dim, i, half,
                                                                neox, cs[i]);
        return;
    }
    const float* k = row + k_off + (long long)h * head_dim;
    for (int i = tid; i < head_dim; i += KVW_THREADS) ks[i] = k[i];
    __syncthreads();
    for (int i = tid; i < half; i += KVW_THREADS) rope_pair(ks, i, half, neox, cs[i]);
    __syncthreads();
    if (centred) {
        for (int i = tid; i < head_dim; i += KVW_THREADS) ks[i] += centre[h * head_dim + i];
        __syncthreads();
    }
    if (step_at >= 0) start_row = step[step_at];
    write_row<KF>(k_pages + kv_row_offset(page_table, start_row + t, h, n_kv, page_size, KvRow<KF>::row_bytes(head_dim)),
                  ks, head_dim, nullptr, nullptr, nullptr);
    if constexpr (VF != KV_NONE)
        write_row<VF>(v_pages + kv_row_offset(page_table, start_row + t, h, n_kv, page_size,
                                              KvRow<VF>::row_bytes(head_dim)),
                      row + v_off + (long long)h * head_dim, head_dim, nullptr, nullptr, nullptr);
}

#define ROPE_WRITE_ENTRY(NAME, KF, VF)                                                                       \
    extern "C" __global__ void __launch_bounds__(KVW_THREADS) NAME(                                          \
            u8* __restrict__ k_pages, u8* __restrict__ v_pages, const int* __restrict__ page_table, float* x,   \
            int x_stride, int k_off, int v_off, int n_kv, int head_dim, int page_size, int start_row,          \
            const float* __restrict__ table, const int* __restrict__ positions, int use_positions, int pos0,   \
            int rot_dim, int neox, const float* __restrict__ centre, int centred,                               \
            const int* __restrict__ step, int step_at) {                                                     \
        rope_write<KF, VF>(k_pages, v_pages, page_table, x, x_stride, k_off, v_off, n_kv, head_dim, page_size, \
                           start_row, table, positions, use_positions, pos0, rot_dim, neox, centre, centred,   \
                           step, step_at);                                                                   \
    }
#define ROPE_WRITE_ENTRIES(KN, KF)                                                                           \
    ROPE_WRITE_ENTRY(rope_kv_write_##KN##_bf16, KF, KV_BF16)                                                 \
    ROPE_WRITE_ENTRY(rope_kv_write_##KN##_q8_0, KF, KV_Q8_0)                                                 \
    ROPE_WRITE_ENTRY(rope_kv_write_##KN##_q4_0, KF, KV_Q4_0)                                                 \
    ROPE_WRITE_ENTRY(rope_kv_write_##KN##_none, KF, KV_NONE)
ROPE_WRITE_ENTRIES(bf16, KV_BF16)
ROPE_WRITE_ENTRIES(q8_0, KV_Q8_0)
ROPE_WRITE_ENTRIES(q4_0, KV_Q4_0)

// Element offset of (row, head) in a pool of rows `w` units wide.
__device__ __forceinline__ long long row_at(const int* page_table, int row, int head, int n_kv, int page_size,
                                            int w) {
    const long long page = page_table[row / page_size];
    return ((page * n_kv + head) * page_size + row % page_size) * w;
}

// Compaction, pass 1: row keep[h][j] of head h (K and V) -> tmp: K rows [n_kv][n_keep][kw],
// then V rows [n_kv][n_keep][vw] (units of T). Pass 2 writes tmp into rows j. Two passes
// because rows move down in place: in one pass a block could overwrite a row another
// block has not read yet. Grid (n_keep, n_kv, 1).
template <typename T>
__device__ __forceinline__ void gather_read(const T* __restrict__ k_pages, const T* __restrict__ v_pages,
                                            const int* __restrict__ page_table, const int* __restrict__ keep,
                                            T* __restrict__ tmp, int n_keep, int n_kv, int page_size, int kw,
                                            int vw) {
    const int j = blockIdx.x, h = blockIdx.y, row = keep[(long long)h * n_keep + j];
    const T* sk = k_pages + row_at(page_table, row, h, n_kv, page_size, kw);
    const T* sv = v_pages + row_at(page_table, row, h, n_kv, page_size, vw);
    T* tk = tmp + ((long long)h * n_keep + j) * kw;
    T* tv = tmp + (long long)n_kv * n_keep * kw + ((long long)h * n_keep + j) * vw;
    for (int p = threadIdx.x; p < kw; p += blockDim.x) tk[p] = sk[p];
    for (int p = threadIdx.x; p < vw; p += blockDim.x) tv[p] = sv[p];
}

template <typename T>
__device__ __forceinline__ void gather_write(T* __restrict__ k_pages, T* __restrict__ v_pages,
                                             const int* __restrict__ page_table, const T* __restrict__ tmp,
                                             int n_keep, int n_kv, int page_size, int kw, int vw) {
    const int j = blockIdx.x, h = blockIdx.y;
    T* dk = k_pages + row_at(page_table, j, h, n_kv, page_size, kw);
    T* dv = v_pages + row_at(page_table, j, h, n_kv, page_size, vw);
    const T* tk = tmp + ((long long)h * n_keep + j) * kw;
    const T* tv = tmp + (long long)n_kv * n_keep * kw + ((long long)h * n_keep + j) * vw;
    for (int p = threadIdx.x; p < kw; p += blockDim.x) dk[p] = tk[p];
    for (int p = threadIdx.x; p < vw; p += blockDim.x) dv[p] = tv[p];
}

// Branching a cache: dst page pages[n + i] = src page pages[i] (kpw / vpw units of T per page;
// pages holds the n source ids, then the n destination ids). dst may be src itself, with
// the destination pages distinct from the sources. Grid (n, ceil(max(kpw, vpw) / blockDim.x), 1):
// pages on x, whose limit is 2^31 - 1 (y stops at 65535).
template <typename T>
__device__ __forceinline__ void copy_pages(const T* src_k, const T* src_v, T* dst_k, T* dst_v,
                                           const int* __restrict__ pages, int kpw, int vpw) {
    const int w = blockIdx.y * blockDim.x + threadIdx.x;
    const long long src = pages[blockIdx.x], dst = pages[(long long)gridDim.x + blockIdx.x];
    if (w < kpw) dst_k[dst * kpw + w] = src_k[src * kpw + w];
    if (w < vpw) dst_v[dst * vpw + w] = src_v[src * vpw + w];
}

#define KV_MOVE_ENTRIES(T)                                                                                   \
    extern "C" __global__ void kv_gather_read_##T(                                                           \
            const T* __restrict__ k_pages, const T* __restrict__ v_pages, const int* __restrict__ page_table, \
            const int* __restrict__ keep, T* __restrict__ tmp, int n_keep, int n_kv, int page_size, int kw,   \
            int vw) {                                                                                        \
        gather_read<T>(k_pages, v_pages, page_table, keep, tmp, n_keep, n_kv, page_size, kw, vw);           \
    }                                                                                                        \
    extern "C" __global__ void kv_gather_write_##T(                                                          \
            T* __restrict__ k_pages, T* __restrict__ v_pages, const int* __restrict__ page_table,             \
            const T* __restrict__ tmp, int n_keep, int n_kv, int page_size, int kw, int vw) {                \
        gather_write<T>(k_pages, v_pages, page_table, tmp, n_keep, n_kv, page_size, kw, vw);                \
    }                                                                                                        \
    extern "C" __global__ void kv_copy_pages_##T(                                                            \
            const T* src_k, const T* src_v, T* dst_k, T* dst_v, const int* __restrict__ pages, int kpw,      \
            int vpw) {                                                                                       \
        copy_pages<T>(src_k, src_v, dst_k, dst_v, pages, kpw, vpw);                                         \
    }
KV_MOVE_ENTRIES(u32)
KV_MOVE_ENTRIES(u16)
KV_MOVE_ENTRIES(u8)
