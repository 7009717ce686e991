// Causal attention over the paged bf16 KV cache (backends/base.py):
//   pages[n_pages][n_kv][page_size][head_dim / 2]   u32 words of bf16 pairs (element 2i low)
// physical row r in page page_table[r / page_size] at offset r % page_size.
// Query head h reads KV head h / (n_q_heads / n_kv); head_dim even, <= 256.
// Sliding window (window > 0): the query at row r sees only rows max(0, r - window + 1) .. r;
// rows below are never read (their pages may be back in the pool, the table entries stale).
//
// Decode (one query per head), flash-decoding in two launches:
//   attention_decode_split    grid (n_kv * n_chunks, n_splits), DEC_THREADS threads. A block
//                             serves up to DEC_HEADS query heads of one KV group (a "chunk" of
//                             the group) over one contiguous range of the attended rows
//                             row0 .. n_rows-1 (row0 > 0 with a window), so each K/V row is
//                             read once per chunk. Warp w takes rows w, w + DEC_WARPS, ... two
//                             at a time; a lane holds words lane + 32 k of q, K, V and the
//                             accumulator; dot products are warp sums. Partial (max, sum,
//                             unnormalised accumulator) per (query head, split) go to scratch,
//                             or, with one split, the normalised result straight to out.
//   attention_decode_combine  grid (n_q_heads), DEC_THREADS threads: merges the splits.
// Prefill (n queries, query i sees rows 0 .. start_row + i, or its window of them):
//   attention_prefill_d{64,128,256}  (BQ = 64, 32, 16) grid (ceil(n / BQ), n_q_heads),
//                             PRE_THREADS threads, dynamic shared memory
//                             attention.prefill_smem_bytes(BQ, head_dim) (<= 35 KiB).
//                             A block stages BQ queries (scaled, f32) once, then walks 32-row
//                             tiles of the cache from the lowest row any of its queries sees
//                             (0, or its first query's window start; tiles below are skipped):
//                             K tile -> S = Q K^T (registers, QT x 2 per thread) -> online
//                             softmax per query (a warp per query row, lane = column) -> V
//                             tile (into the K tile's buffer) -> O = alpha O + P V (registers,
//                             4 queries x 4 words per thread). Queries of one block
//                             share every K/V tile; one KV head's query heads run side by side.
#include "common.cuh"

#define DEC_WARPS 4
#define DEC_THREADS (DEC_WARPS * WARP_SIZE)
#define DEC_HEADS 4              // query heads per decode block
#define DEC_WORDS 4              // u32 words per lane: head_dim <= 2 * 32 * 4
#define MAX_HEAD_DIM 256
#define MAX_SPLITS 256           // attention.py caps n_splits at this

#define PRE_THREADS 128
#define PRE_BK 32                // cache rows per tile (= WARP_SIZE: one lane per column in the softmax)

// -- decode ----------------------------------------------------------------------------

extern "C" __global__ void __launch_bounds__(DEC_THREADS) attention_decode_split(
        const float* __restrict__ q, const u32* __restrict__ k_pages, const u32* __restrict__ v_pages,
        const int* __restrict__ page_table, float* __restrict__ out, float* __restrict__ part_acc,
        float* __restrict__ part_ml, int row0, int n_rows, int rows_per_split, int n_q_heads, int n_kv,
        int head_dim, int page_size, int heads_per_block, float scale) {
    __shared__ float sh_acc[DEC_WARPS][DEC_HEADS][MAX_HEAD_DIM];
    __shared__ float sh_m[DEC_WARPS][DEC_HEADS];
    __shared__ float sh_l[DEC_WARPS][DEC_HEADS];
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int hd2 = head_dim / 2, group = n_q_heads / n_kv;
    const int n_chunks = (group + heads_per_block - 1) / heads_per_block;
    const int g = blockIdx.x / n_chunks, chunk = blockIdx.x % n_chunks;
    const int h0 = g * group + chunk * heads_per_block;
    const int nh = min(heads_per_block, group - chunk * heads_per_block);
    const int split = blockIdx.y, n_splits = gridDim.y;
    const int r_begin = row0 + split * rows_per_split, r_end = min(n_rows, r_begin + rows_per_split);

    float2 qr[DEC_HEADS][DEC_WORDS];                 // scaled query words of this lane
    float2 acc[DEC_HEADS][DEC_WORDS];
    float m[DEC_HEADS], l[DEC_HEADS];
#pragma unroll
    for (int hh = 0; hh < DEC_HEADS; ++hh) {
        m[hh] = NEG_INF;
        l[hh] = 0.0f;
#pragma unroll
        for (int k = 0; k < DEC_WORDS; ++k) {
            const int p = lane + WARP_SIZE * k;
            float2 v = make_float2(0.0f, 0.0f);
            if (hh < nh && p < hd2) {
                const float* src = q + (long long)(h0 + hh) * head_dim + 2 * p;
                v = make_float2(src[0] * scale, src[1] * scale);
            }
            qr[hh][k] = v;
            acc[hh][k] = make_float2(0.0f, 0.0f);
        }
    }

    // Two rows per step (r0 and r1 = r0 + DEC_WARPS): both rows' loads are in flight together.
    for (int r0 = r_begin + warp; r0 < r_end; r0 += 2 * DEC_WARPS) {
        const int r1 = r0 + DEC_WARPS;
        const bool has1 = r1 < r_end;                // warp-uniform
        const long long b0 = row_word(page_table, r0, g, n_kv, page_size, hd2);
        const long long b1 = has1 ? row_word(page_table, r1, g, n_kv, page_size, hd2) : b0;
        u32 k0w[DEC_WORDS], k1w[DEC_WORDS], v0w[DEC_WORDS], v1w[DEC_WORDS];
#pragma unroll
        for (int k = 0; k < DEC_WORDS; ++k) {
            const int p = lane + WARP_SIZE * k;
            const bool ok = p < hd2;
            k0w[k] = ok ? k_pages[b0 + p] : 0u;
            v0w[k] = ok ? v_pages[b0 + p] : 0u;
            k1w[k] = ok && has1 ? k_pages[b1 + p] : 0u;
            v1w[k] = ok && has1 ? v_pages[b1 + p] : 0u;
        }
        float s0[DEC_HEADS], s1[DEC_HEADS];
#pragma unroll
        for (int hh = 0; hh < DEC_HEADS; ++hh) {
            float d0 = 0.0f, d1 = 0.0f;
#pragma unroll
            for (int k = 0; k < DEC_WORDS; ++k) {
                const float2 a = bf16x2_to_f32(k0w[k]), b = bf16x2_to_f32(k1w[k]);
                d0 += qr[hh][k].x * a.x + qr[hh][k].y * a.y;
                d1 += qr[hh][k].x * b.x + qr[hh][k].y * b.y;
            }
            s0[hh] = d0;
            s1[hh] = d1;
        }
#pragma unroll
        for (int hh = 0; hh < DEC_HEADS; ++hh) {
            if (hh < nh) {                           // block-uniform
                s0[hh] = warp_sum(s0[hh]);
                s1[hh] = has1 ? warp_sum(s1[hh]) : NEG_INF;
            }
        }
#pragma unroll
        for (int hh = 0; hh < DEC_HEADS; ++hh) {
            if (hh >= nh) continue;
            const float m_new = fmaxf(m[hh], fmaxf(s0[hh], s1[hh]));
            const float alpha = __expf(m[hh] - m_new);          // 0 on the first row (m = -inf)
            const float p0 = __expf(s0[hh] - m_new);
            const float p1 = has1 ? __expf(s1[hh] - m_new) : 0.0f;
            l[hh] = l[hh] * alpha + p0 + p1;
            m[hh] = m_new;
#pragma unroll
            for (int k = 0; k < DEC_WORDS; ++k) {
                const float2 a = bf16x2_to_f32(v0w[k]), b = bf16x2_to_f32(v1w[k]);
                acc[hh][k].x = acc[hh][k].x * alpha + p0 * a.x + p1 * b.x;
                acc[hh][k].y = acc[hh][k].y * alpha + p0 * a.y + p1 * b.y;
            }
        }
    }

    // Merge the warps' states (a warp with no rows has m = -inf, l = 0, acc = 0).
#pragma unroll
    for (int hh = 0; hh < DEC_HEADS; ++hh) {
        if (hh >= nh) continue;
        if (lane == 0) {
            sh_m[warp][hh] = m[hh];
            sh_l[warp][hh] = l[hh];
        }
#pragma unroll
        for (int k = 0; k < DEC_WORDS; ++k) {
            const int p = lane + WARP_SIZE * k;
            if (p < hd2) {
                sh_acc[warp][hh][2 * p] = acc[hh][k].x;
                sh_acc[warp][hh][2 * p + 1] = acc[hh][k].y;
            }
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < nh * head_dim; i += DEC_THREADS) {
        const int hh = i / head_dim, d = i % head_dim;
        float mx = NEG_INF;
#pragma unroll
        for (int w = 0; w < DEC_WARPS; ++w) mx = fmaxf(mx, sh_m[w][hh]);
        float sum = 0.0f, a = 0.0f;
#pragma unroll
        for (int w = 0; w < DEC_WARPS; ++w) {
            const float e = sh_m[w][hh] == NEG_INF ? 0.0f : __expf(sh_m[w][hh] - mx);
            sum += sh_l[w][hh] * e;
            a += sh_acc[w][hh][d] * e;
        }
        const int h = h0 + hh;
        if (n_splits == 1) {
            out[(long long)h * head_dim + d] = a / sum;
        } else {
            const long long slot = (long long)h * n_splits + split;
            part_acc[slot * head_dim + d] = a;
            if (d == 0) {
                part_ml[2 * slot] = mx;
                part_ml[2 * slot + 1] = sum;
            }
        }
    }
}

// Splits of query head blockIdx.x -> out. part_acc f32 [n_q_heads, n_splits, head_dim],
// part_ml f32 [n_q_heads, n_splits, 2] (max, sum).
extern "C" __global__ void __launch_bounds__(DEC_THREADS) attention_decode_combine(
        const float* __restrict__ part_acc, const float* __restrict__ part_ml, float* __restrict__ out,
        int n_splits, int head_dim) {
    __shared__ float weight[MAX_SPLITS];
    __shared__ float red[32];
    const int h = blockIdx.x;
    const float* ml = part_ml + 2ll * h * n_splits;
    float mx = NEG_INF;
    for (int s = threadIdx.x; s < n_splits; s += DEC_THREADS) mx = fmaxf(mx, ml[2 * s]);
    mx = block_max(mx, red);
    float sum = 0.0f;
    for (int s = threadIdx.x; s < n_splits; s += DEC_THREADS) {
        const float e = ml[2 * s] == NEG_INF ? 0.0f : __expf(ml[2 * s] - mx);
        weight[s] = e;
        sum += ml[2 * s + 1] * e;
    }
    sum = block_sum(sum, red);                       // its barriers publish weight[]
    const float inv = 1.0f / sum;
    const float* acc = part_acc + (long long)h * n_splits * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += DEC_THREADS) {
        float a = 0.0f;
        for (int s = 0; s < n_splits; ++s) a += weight[s] * acc[(long long)s * head_dim + d];
        out[(long long)h * head_dim + d] = a * inv;
    }
}

// -- prefill ----------------------------------------------------------------------------
// Rows k0 .. k0 + PRE_BK - 1 of KV head g (zeros from n_vis on) -> tile[PRE_BK][ks], a warp per row.
// k0 need not be a multiple of PRE_BK (a windowed block starts at its lowest visible row).
__device__ __forceinline__ void load_tile(u32* tile, int ks, const u32* __restrict__ pages,
                                          const int* __restrict__ page_table, int k0, int n_vis, int g,
                                          int n_kv, int page_size, int hd2) {
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    for (int j = warp; j < PRE_BK; j += PRE_THREADS / WARP_SIZE) {
        u32* dst = tile + j * ks;
        if (k0 + j < n_vis) {
            const u32* src = pages + row_word(page_table, k0 + j, g, n_kv, page_size, hd2);
            for (int p = lane; p < hd2; p += WARP_SIZE) dst[p] = src[p];
        } else {
            for (int p = lane; p < hd2; p += WARP_SIZE) dst[p] = 0u;
        }
    }
}

// Per configuration (BQ queries per block, DL lanes across a row's words in the P V step):
//   S step:   thread (qg = tid / 16, rj = tid % 16) computes queries qg*QT .. qg*QT+QT-1
//             against tile rows rj and rj + 16 (QT = BQ / 8).
//   P V step: thread (qo = tid / DL, dl = tid % DL) owns queries qo*QO .. qo*QO+QO-1 and
//             words dl + DL*k, k < 4 (QO = BQ * DL / 128; head_dim <= 8 * DL).
// Shared memory (floats): Q [BQ][head_dim] | K or V tile [32][hd2 | 1] | S [BQ][SS] | m, l, alpha [BQ].

template <int BQ>
struct PrefillShape {
    static constexpr int QT = BQ / 8;
    static constexpr int SS = PRE_BK + 16 / QT;     // S row stride: the two query groups of a warp
                                                     // land 16 banks apart in the S step's stores
};

template <int BQ, int DL>
__device__ __forceinline__ void prefill_block(const float* __restrict__ q, int q_stride,
                                              const u32* __restrict__ k_pages, const u32* __restrict__ v_pages,
                                              const int* __restrict__ page_table, float* __restrict__ out,
                                              int out_stride, int n, int start_row, int n_q_heads, int n_kv,
                                              int head_dim, int page_size, int window, float scale,
                                              float* smem) {
    constexpr int QT = PrefillShape<BQ>::QT, SS = PrefillShape<BQ>::SS;
    constexpr int QO = BQ * DL / PRE_THREADS, DW = 4;
    const int tid = threadIdx.x, lane = tid % WARP_SIZE, warp = tid / WARP_SIZE;
    const int hd2 = head_dim / 2, ks = hd2 | 1;      // odd tile stride: S-step K reads are conflict free
    // Blocks start in linear order; make the query head vary fastest in it and the longest
    // (last) query tiles come first: blocks running together share KV heads in L2, and no
    // long tile starts at the end of the launch.
    const int linear = blockIdx.y * gridDim.x + blockIdx.x;
    const int h = linear % n_q_heads, g = h / (n_q_heads / n_kv);
    const int q0 = (gridDim.x - 1 - linear / n_q_heads) * BQ;
    const int nq = min(BQ, n - q0);
    const int n_vis = start_row + q0 + nq;          // rows any query of this block sees: k_lo .. n_vis-1
    const int k_lo = window > 0 ? max(0, start_row + q0 - window + 1) : 0;     // the first query's lowest

    float2* qs = reinterpret_cast<float2*>(smem);   // [BQ][hd2]
    u32* kv = reinterpret_cast<u32*>(smem + BQ * head_dim);      // [PRE_BK][ks]
    float* sc = smem + BQ * head_dim + PRE_BK * ks;             // [BQ][SS]
    float* mq = sc + BQ * SS;                        // running max per query
    float* lq = mq + BQ;                             // running sum
    float* aq = lq + BQ;                             // this tile's rescale factor

    for (int i = tid; i < BQ * hd2; i += PRE_THREADS) {
        const int qi = i / hd2, p = i % hd2;
        float2 v = make_float2(0.0f, 0.0f);
        if (qi < nq) {
            const float* src = q + (long long)(q0 + qi) * q_stride + (long long)h * head_dim + 2 * p;
            v = make_float2(src[0] * scale, src[1] * scale);
        }
        qs[i] = v;
    }
    for (int i = tid; i < BQ; i += PRE_THREADS) {
        mq[i] = NEG_INF;
        lq[i] = 0.0f;
    }

    const int qg = tid / 16, rj = tid % 16;          // S step
    const int qo = tid / DL, dl = tid % DL;          // P V step
    float2 acc[QO][DW];
#pragma unroll
    for (int i = 0; i < QO; ++i)
#pragma unroll
        for (int k = 0; k < DW; ++k) acc[i][k] = make_float2(0.0f, 0.0f);

    for (int k0 = k_lo; k0 < n_vis; k0 += PRE_BK) {
        __syncthreads();                             // previous P V step is done with kv and sc
        load_tile(kv, ks, k_pages, page_table, k0, n_vis, g, n_kv, page_size, hd2);
        __syncthreads();

        float s[QT][2];
#pragma unroll
        for (int i = 0; i < QT; ++i) s[i][0] = s[i][1] = 0.0f;
        const u32* ka = kv + rj * ks;
        const u32* kb = kv + (rj + 16) * ks;
        const float2* qa = qs + qg * QT * hd2;
        for (int p = 0; p < hd2; ++p) {
            const float2 a = bf16x2_to_f32(ka[p]), b = bf16x2_to_f32(kb[p]);
#pragma unroll
            for (int i = 0; i < QT; ++i) {
                const float2 x = qa[i * hd2 + p];
                s[i][0] += x.x * a.x + x.y * a.y;
                s[i][1] += x.x * b.x + x.y * b.y;
            }
        }
#pragma unroll
        for (int i = 0; i < QT; ++i) {
            sc[(qg * QT + i) * SS + rj] = s[i][0];
            sc[(qg * QT + i) * SS + rj + 16] = s[i][1];
        }
        __syncthreads();                             // S complete; the K tile is no longer read

        load_tile(kv, ks, v_pages, page_table, k0, n_vis, g, n_kv, page_size, hd2);   // V tile over K
        const int row = k0 + lane;
        for (int qi = warp; qi < BQ; qi += PRE_THREADS / WARP_SIZE) {     // online softmax, lane = column
            const int q_row = start_row + q0 + qi;
            const bool vis = row <= q_row && row < n_vis && (window <= 0 || row > q_row - window);
            const float sv = vis ? sc[qi * SS + lane] : NEG_INF;
            const float m_old = mq[qi];
            // -inf only while a windowed query has seen no row yet (its window starts in a later tile)
            const float m_new = fmaxf(m_old, warp_max(sv));
            const float p = vis ? __expf(sv - m_new) : 0.0f;
            const float psum = warp_sum(p);
            sc[qi * SS + lane] = p;
            if (lane == 0) {
                const float alpha = m_new == NEG_INF ? 1.0f : __expf(m_old - m_new);
                aq[qi] = alpha;
                lq[qi] = lq[qi] * alpha + psum;
                mq[qi] = m_new;
            }
        }
        __syncthreads();                             // P, alpha and the V tile are in place

        const int rows_here = min(PRE_BK, n_vis - k0);
#pragma unroll
        for (int i = 0; i < QO; ++i) {
            const float alpha = aq[qo * QO + i];
#pragma unroll
            for (int k = 0; k < DW; ++k) {
                acc[i][k].x *= alpha;
                acc[i][k].y *= alpha;
            }
        }
        for (int j = 0; j < rows_here; ++j) {
            float2 v[DW];
#pragma unroll
            for (int k = 0; k < DW; ++k) {
                const int w = dl + DL * k;
                v[k] = w < hd2 ? bf16x2_to_f32(kv[j * ks + w]) : make_float2(0.0f, 0.0f);
            }
#pragma unroll
            for (int i = 0; i < QO; ++i) {
                const float pj = sc[(qo * QO + i) * SS + j];
#pragma unroll
                for (int k = 0; k < DW; ++k) {
                    acc[i][k].x += pj * v[k].x;
                    acc[i][k].y += pj * v[k].y;
                }
            }
        }
    }

#pragma unroll
    for (int i = 0; i < QO; ++i) {
        const int qi = qo * QO + i;
        if (qi >= nq) continue;
        const float inv = 1.0f / lq[qi];
        float* dst = out + (long long)(q0 + qi) * out_stride + (long long)h * head_dim;
#pragma unroll
        for (int k = 0; k < DW; ++k) {
            const int w = dl + DL * k;
            if (w < hd2) {
                dst[2 * w] = acc[i][k].x * inv;
                dst[2 * w + 1] = acc[i][k].y * inv;
            }
        }
    }
}

// head_dim <= 64: BQ 64; <= 128: BQ 32; <= 256: BQ 16 (attention.py picks by head_dim).
#define PREFILL_ENTRY(NAME, BQ, DL)                                                                          \
    extern "C" __global__ void __launch_bounds__(PRE_THREADS) NAME(                                          \
            const float* __restrict__ q, int q_stride, const u32* __restrict__ k_pages,                      \
            const u32* __restrict__ v_pages, const int* __restrict__ page_table, float* __restrict__ out,     \
            int out_stride, int n, int start_row, int n_q_heads, int n_kv, int head_dim, int page_size,      \
            int window, float scale) {                                                                       \
        DYN_SHARED(float, smem);                                                                             \
        prefill_block<BQ, DL>(q, q_stride, k_pages, v_pages, page_table, out, out_stride, n, start_row,     \
                              n_q_heads, n_kv, head_dim, page_size, window, scale, smem);                    \
    }
PREFILL_ENTRY(attention_prefill_d64, 64, 8)
PREFILL_ENTRY(attention_prefill_d128, 32, 16)
PREFILL_ENTRY(attention_prefill_d256, 16, 32)
