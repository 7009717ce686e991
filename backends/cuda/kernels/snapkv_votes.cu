// SnapKV window votes over the paged KV cache (backends/base.py, DESIGN.md), compiled per key
// format (KV_K, kvrow.cuh; bf16 when not defined): keys are read as stored and decoded in
// registers; tq keys are scored in the rotated basis (q_window arrives rotated, rotate.cu),
// k_cb their codebook (any pointer for the other formats). Window
// query w of query head h sits at row P + w (P = n_rows - W); its causal softmax runs over
// rows 0 .. P + w, window rows included, and is never renormalised over the prefix. The
// votes of prefix row r < P for KV head g: the sum of those probabilities over the W
// window queries of every query head of the group.
//
// A KV group's G*W window queries are the contiguous rows g*G*W .. of q_window
// f32 [n_q_heads * W, head_dim]; a block works on 32 of them ("a query chunk") against
// 32-row tiles of the cache, both staged in shared memory in 128-value slices (the queries
// as f32 in key-unit order, the rows as their units and f32 scales), thread
// (qg = tid / 16, rj = tid % 16) scoring queries 4 qg .. 4 qg + 3 against tile rows rj and
// rj + 16. Both passes compute each score with the same code, so they agree bit for bit.
//
//   snapkv_stats  grid (n_kv * n_qchunks, n_splits), 128 threads: the softmax max and sum
//                 of each window query over one contiguous range of rows (a multiple of
//                 32) -> stats f32 [n_q_heads * W, n_splits, 2].
//   snapkv_votes  grid (ceil(P / 32), n_kv), 128 threads: 32 prefix rows of KV head g;
//                 loops over the group's query chunks (merging their split stats) and sums
//                 exp(s - max) / sum per row -> votes f32 [n_kv, P].
// Memory: O(n_q_heads * W * n_splits) stats + the votes; no score matrix.
#include "kvrow.cuh"

typedef KvRow<KV_K> KF;

#define SNAP_THREADS 128
// A register budget of 80 (6 blocks of 128 threads): left to itself ptxas sizes the blocks by
// their static shared memory and caps the registers lower, which spills for quantized keys.
#define SNAP_MIN_BLOCKS 6
#define SNAP_QC 32               // window queries per chunk
#define SNAP_RT 32               // cache rows per tile
#define SNAP_DV 128              // values per staged slice
#define SNAP_DU (SNAP_DV / KF::UNIT)     // key units per slice (bf16: 64 words)
#define SNAP_KS (SNAP_DU + 1)    // odd row stride: the 16 rows read together hit 16 banks
#define SNAP_SS 5                // scale blocks per staged row and slice (<= 4), odd stride

// Queries c0 .. c0+31 of the group (scaled; zero past n_queries), key units u0 .. u0+nu-1
// -> qs[c][p * UNIT + i] = q_c[value(u0 + p, i)].
__device__ __forceinline__ void stage_queries(float* qs, const float* __restrict__ group_q, int c0, int n_queries,
                                              int head_dim, int u0, int nu, float scale) {
    for (int i = threadIdx.x; i < SNAP_QC * SNAP_DV; i += SNAP_THREADS) {
        const int c = i / SNAP_DV, e = i % SNAP_DV, p = e / KF::UNIT;
        float v = 0.0f;
        if (p < nu && c0 + c < n_queries)
            v = group_q[(long long)(c0 + c) * head_dim + KF::value(u0 + p, e % KF::UNIT)] * scale;
        qs[i] = v;
    }
}

// s[i][k] += q(4 qg + i) . k(rj + 16 k) over the staged slice of nu units (scales relative
// to the slice's first scale block b0).
__device__ __forceinline__ void score_slice(const float* qs, const u32* ks, const float* kss, const float* cb, int u0,
                                            int nu, int qg, int rj, float s[4][2]) {
    const u32* ka = ks + rj * SNAP_KS;
    const u32* kb = ks + (rj + 16) * SNAP_KS;
    const float* sa = kss + rj * SNAP_SS;
    const float* sb = kss + (rj + 16) * SNAP_SS;
    const float* qa = qs + 4 * qg * SNAP_DV;
    const int b0 = KF::block(u0);
    constexpr int KU = KF::UNIT, C = KU < KV_CHUNK ? KU : KV_CHUNK;
    for (int p = 0; p < nu; ++p) {
        const u32 wa = ka[p], wb = kb[p];
        const float fa = KF::SCALED ? sa[KF::block(u0 + p) - b0] : 1.0f;
        const float fb = KF::SCALED ? sb[KF::block(u0 + p) - b0] : 1.0f;
#pragma unroll
        for (int e0 = 0; e0 < KU; e0 += C) {         // a unit in chunks of C values
            float a[C], b[C];
            kv_decode<KV_K, C>(wa, fa, cb, a, e0);
            kv_decode<KV_K, C>(wb, fb, cb, b, e0);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                float x[C];
                load_floats<C>(qa + i * SNAP_DV + p * KU + e0, x);
#pragma unroll
                for (int e = 0; e < C; ++e) {
                    s[i][0] += x[e] * a[e];
                    s[i][1] += x[e] * b[e];
                }
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(SNAP_THREADS, SNAP_MIN_BLOCKS) snapkv_stats(
        const float* __restrict__ q_window, const u8* __restrict__ k_pages, const int* __restrict__ page_table,
        const float* __restrict__ k_cb, float* __restrict__ stats, int n_q_heads, int n_kv, int head_dim,
        int page_size, int n_rows, int window, int rows_per_split, float scale) {
    __shared__ float4 qs4[SNAP_QC * SNAP_DV / 4];
    __shared__ u32 ks[SNAP_RT * SNAP_KS];
    __shared__ float kss[SNAP_RT * SNAP_SS];
    __shared__ float cb[16];
    float* qs = reinterpret_cast<float*>(qs4);
    const int tid = threadIdx.x, qg = tid / 16, rj = tid % 16;
    const int nu_row = head_dim / KF::UNIT, n_slices = (nu_row + SNAP_DU - 1) / SNAP_DU;
    const int n_queries = n_q_heads / n_kv * window;
    const int n_qchunks = (n_queries + SNAP_QC - 1) / SNAP_QC;
    const int g = blockIdx.x / n_qchunks, c0 = blockIdx.x % n_qchunks * SNAP_QC;
    const int split = blockIdx.y, n_splits = gridDim.y;
    const int r_begin = split * rows_per_split, r_end = min(n_rows, r_begin + rows_per_split);
    const int prefix = n_rows - window;
    const float* group_q = q_window + (long long)g * n_queries * head_dim;

    int last[4];                                     // last row each of my queries sees (-1: no query)
    float m[4], l[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int c = c0 + 4 * qg + i;
        last[i] = c < n_queries ? prefix + c % window : -1;
        m[i] = NEG_INF;
        l[i] = 0.0f;
    }
    stage_codebook<KV_K>(cb, k_cb);                  // published by the first slice's barrier
    for (int r0 = r_begin; r0 < r_end; r0 += SNAP_RT) {
        float s[4][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}, {0.0f, 0.0f}, {0.0f, 0.0f}};
        for (int sl = 0; sl < n_slices; ++sl) {
            const int u0 = sl * SNAP_DU, nu = min(SNAP_DU, nu_row - u0);
            __syncthreads();                         // the previous slice is no longer read
            if (n_slices > 1 || r0 == r_begin)
                stage_queries(qs, group_q, c0, n_queries, head_dim, u0, nu, scale);
            stage_units<KV_K, SNAP_THREADS>(ks, SNAP_KS, kss, SNAP_SS, k_pages, page_table, r0, SNAP_RT, r_end, g,
                                            n_kv, page_size, KF::row_bytes(head_dim), u0, nu);
            __syncthreads();
            score_slice(qs, ks, kss, cb, u0, nu, qg, rj, s);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {                // online max / sum over my two rows
            const bool v0 = r0 + rj <= last[i] && r0 + rj < r_end;
            const bool v1 = r0 + rj + 16 <= last[i] && r0 + rj + 16 < r_end;
            if (!v0 && !v1) continue;
            const float m_new = fmaxf(m[i], fmaxf(v0 ? s[i][0] : NEG_INF, v1 ? s[i][1] : NEG_INF));
            l[i] = l[i] * __expf(m[i] - m_new) + (v0 ? __expf(s[i][0] - m_new) : 0.0f) +
                   (v1 ? __expf(s[i][1] - m_new) : 0.0f);
            m[i] = m_new;
        }
    }
    // Merge across the 16 lanes (rj) of each half warp, which share their queries.
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int o = 8; o > 0; o >>= 1) {
            const float mo = __shfl_xor_sync(FULL_MASK, m[i], o), lo = __shfl_xor_sync(FULL_MASK, l[i], o);
            const float mm = fmaxf(m[i], mo);
            l[i] = (m[i] == NEG_INF ? 0.0f : l[i] * __expf(m[i] - mm)) + (mo == NEG_INF ? 0.0f : lo * __expf(mo - mm));
            m[i] = mm;
        }
        const int c = c0 + 4 * qg + i;
        if (rj == 0 && c < n_queries) {
            const long long slot = ((long long)g * n_queries + c) * n_splits + split;
            stats[2 * slot] = m[i];
            stats[2 * slot + 1] = l[i];
        }
    }
}

extern "C" __global__ void __launch_bounds__(SNAP_THREADS, SNAP_MIN_BLOCKS) snapkv_votes(
        const float* __restrict__ q_window, const u8* __restrict__ k_pages, const int* __restrict__ page_table,
        const float* __restrict__ k_cb, const float* __restrict__ stats, float* __restrict__ votes, int n_q_heads,
        int n_kv, int head_dim, int page_size, int n_rows, int window, int n_splits, float scale) {
    __shared__ float4 qs4[SNAP_QC * SNAP_DV / 4];
    __shared__ u32 ks[SNAP_RT * SNAP_KS];
    __shared__ float kss[SNAP_RT * SNAP_SS];
    __shared__ float cb[16];
    __shared__ float q_max[SNAP_QC], q_inv[SNAP_QC];
    __shared__ float red[SNAP_THREADS / 16][SNAP_RT];
    float* qs = reinterpret_cast<float*>(qs4);
    const int tid = threadIdx.x, qg = tid / 16, rj = tid % 16;
    const int nu_row = head_dim / KF::UNIT, n_slices = (nu_row + SNAP_DU - 1) / SNAP_DU;
    const int n_queries = n_q_heads / n_kv * window;
    const int g = blockIdx.y, r0 = blockIdx.x * SNAP_RT;
    const int prefix = n_rows - window;
    const float* group_q = q_window + (long long)g * n_queries * head_dim;

    float vr[2] = {0.0f, 0.0f};                      // votes of rows r0 + rj, r0 + rj + 16
    stage_codebook<KV_K>(cb, k_cb);                  // published by the first slice's barrier
    for (int c0 = 0; c0 < n_queries; c0 += SNAP_QC) {
        float s[4][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}, {0.0f, 0.0f}, {0.0f, 0.0f}};
        for (int sl = 0; sl < n_slices; ++sl) {
            const int u0 = sl * SNAP_DU, nu = min(SNAP_DU, nu_row - u0);
            __syncthreads();                         // the previous slice and q_max / q_inv are no longer read
            if (sl == 0 && tid < SNAP_QC) {          // merge the stats splits of query c0 + tid
                const int c = c0 + tid;
                float mx = 0.0f, inv = 0.0f;         // a missing query adds exp(0 - 0) * 0
                if (c < n_queries) {
                    const float* st = stats + ((long long)g * n_queries + c) * n_splits * 2;
                    mx = NEG_INF;
                    for (int k = 0; k < n_splits; ++k) mx = fmaxf(mx, st[2 * k]);
                    float sum = 0.0f;
                    for (int k = 0; k < n_splits; ++k)
                        if (st[2 * k] != NEG_INF) sum += st[2 * k + 1] * __expf(st[2 * k] - mx);
                    inv = 1.0f / sum;
                }
                q_max[tid] = mx;
                q_inv[tid] = inv;
            }
            stage_queries(qs, group_q, c0, n_queries, head_dim, u0, nu, scale);
            if (n_slices > 1 || c0 == 0)
                stage_units<KV_K, SNAP_THREADS>(ks, SNAP_KS, kss, SNAP_SS, k_pages, page_table, r0, SNAP_RT, prefix,
                                                g, n_kv, page_size, KF::row_bytes(head_dim), u0, nu);
            __syncthreads();
            score_slice(qs, ks, kss, cb, u0, nu, qg, rj, s);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {                // every prefix row is visible to every window query
            const float mx = q_max[4 * qg + i], inv = q_inv[4 * qg + i];
            vr[0] += __expf(s[i][0] - mx) * inv;
            vr[1] += __expf(s[i][1] - mx) * inv;
        }
    }
    red[qg][rj] = vr[0];
    red[qg][rj + 16] = vr[1];
    __syncthreads();
    if (tid < SNAP_RT && r0 + tid < prefix) {
        float v = 0.0f;
#pragma unroll
        for (int k = 0; k < SNAP_THREADS / 16; ++k) v += red[k][tid];
        votes[(long long)g * prefix + r0 + tid] = v;
    }
}
