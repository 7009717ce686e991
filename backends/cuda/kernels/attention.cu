// Causal attention over the paged KV cache (backends/base.py), compiled per KV format pair:
// KV_K / KV_V (kvrow.cuh; bf16 when not defined) name the key and value row formats.
//   pages[n_pages][n_kv][page_size][row_bytes]   rows of the format (kvrow.cuh), read in units
// physical row r in page page_table[r / page_size] at offset r % page_size.
// Query head h reads KV head h / (n_q_heads / n_kv); head_dim <= 256 (even; q8_0 / q4_0:
// a multiple of 32; tq: of 8). Quantized rows are read as they are stored and decoded in
// registers. tq keys: q arrives already rotated (q' = R q, rotate.cu), scored against the
// stored rotated rows; tq values: the kernels produce the output in the rotated basis and
// the host rotates it back once per head (attention_decode_combine here, rotate.cu for
// prefill). k_cb / v_cb: the formats' codebooks (f32 [16], tq only; any pointer otherwise).
// Sliding window (window > 0): the query at row r sees only rows max(0, r - window + 1) .. r;
// rows below are never read (their pages may be back in the pool, the table entries stale).
// Merged rows: row_bias f32 [n_kv][bias_stride] adds row_bias[g][r] to the scaled score of
// row r of KV head g for r < n_bias (a log-count: the row weighs like that many copies), 0
// above; n_bias 0 when there is none (row_bias then any pointer, never read).
//
// Decode (one query per head), flash-decoding in two launches:
//   attention_decode_split    grid (n_kv * n_chunks, n_splits), DEC_THREADS threads. A block
//                             serves up to DEC_HEADS query heads of one KV group (a "chunk" of
//                             the group) over one contiguous range of the attended rows
//                             row0 .. n_rows-1 (row0 > 0 with a window), so each K/V row is
//                             read once per chunk. Warp w takes rows w, w + DEC_WARPS, ... two
//                             at a time; a lane holds units lane + 32 k of the row (bf16: words,
//                             DEC_VALS values in all) and the matching values of q and of the
//                             accumulator; dot products are warp sums. Partial (max, sum,
//                             unnormalised accumulator) per (query head, split) go to scratch,
//                             or, with one split and unrotated values, the normalised result
//                             straight to out.
//   attention_decode_combine  grid (n_q_heads), DEC_THREADS threads: merges the splits (and
//                             rotates tq values back: out = R^T y, v_rot = R).
//   A recorded decode step (step_at >= 0) reads n_rows from step[step_at] and derives row0,
//   the splits and their rows in the kernels (decode_splits: attention.decode_geometry's
//   arithmetic), so one launch serves every length: the grid has the most splits any length
//   up to the table's capacity needs, and blocks past this length's splits return at once;
//   the combine returns when the split kernel wrote out itself. Otherwise step is unread.
// Prefill (n queries, query i sees rows 0 .. start_row + i, or its window of them):
//   attention_prefill_d{64,128,256}  (BQ = 64, 32, 16) grid (ceil(n / BQ), n_q_heads,
//                             n_splits), PRE_THREADS threads, dynamic shared memory
//                             attention.prefill_smem_bytes(BQ, head_dim, formats) (<= 37 KiB).
//                             A block stages BQ queries (scaled, f32, in key-unit order) once,
//                             then walks 32-row tiles of the cache from the lowest row any of its
//                             queries sees (0, or its first query's window start; tiles below are
//                             skipped): K tile (units as stored, scales as f32) -> S = Q K^T
//                             (registers, QT x 2 per thread, units decoded as read) -> online
//                             softmax per query (a warp per query row, lane = column) -> V tile
//                             (into the K tile's buffer) -> O = alpha O + P V (registers, QO
//                             queries x PRE_VALS values per thread). Queries of one block share
//                             every K/V tile; one KV head's query heads run side by side.
//                             n_splits > 1 (a grid too small for the device, long rows:
//                             attention.prefill_splits): block z walks the z-th share of its
//                             tiles and writes (max, sum, unnormalised O) per (query, head, split)
//                             to part_ml / part_acc, laid out as the decode partials with query
//                             i's head h as "head" i * n_q_heads + h; attention_decode_combine
//                             then merges them into out (which must be dense rows).
#include "kvrow.cuh"

typedef KvRow<KV_K> KF;
typedef KvRow<KV_V> VF;

#define DEC_WARPS 4
#define DEC_THREADS (DEC_WARPS * WARP_SIZE)
#define DEC_HEADS 4              // query heads per decode block
#define DEC_VALS 8               // values per lane: head_dim <= 32 * 8
#define MAX_HEAD_DIM 256
#define MAX_SPLITS 256           // attention.py caps n_splits at this
#define DEC_SPLIT_ROWS 64        // attention.py: rows a split has at least
#define DEC_TARGET_BLOCKS 1024   // attention.py: blocks a decode launch aims for

#define PRE_THREADS 128
#define PRE_BK 32                // cache rows per tile (= WARP_SIZE: one lane per column in the softmax)
#define PRE_VALS 8               // values per thread and query in the P V step: head_dim <= 8 * DL
// A register budget of MINB blocks of 128 threads per SM (MINB 5: 96 registers, about the
// blocks their shared memory allows on sm_80/90; 4: 128), bf16 rows included: left to
// itself ptxas caps some variants lower and spills (quantized rows; bf16 d64 on sm_90 with
// -ftz=true, as the runtime compiles; bf16 d256 on sm_120 with NVRTC 13).
#define PRE_BOUNDS(MINB) __launch_bounds__(PRE_THREADS, MINB)

// -- decode ----------------------------------------------------------------------------

// attention.decode_geometry for `rows` attended rows and `blocks` blocks per split (n_kv *
// n_chunks): the number of splits, and the rows of each (the last may have fewer).
__device__ __forceinline__ int decode_splits(int rows, int blocks, int* rows_per_split) {
    const int want = (DEC_TARGET_BLOCKS + blocks - 1) / blocks;
    const int n = max(1, min(MAX_SPLITS, min(want, (rows + DEC_SPLIT_ROWS - 1) / DEC_SPLIT_ROWS)));
    *rows_per_split = (rows + n - 1) / n;
    return (rows + *rows_per_split - 1) / *rows_per_split;
}

extern "C" __global__ void __launch_bounds__(DEC_THREADS) attention_decode_split(
        const float* __restrict__ q, const u8* __restrict__ k_pages, const u8* __restrict__ v_pages,
        const int* __restrict__ page_table, const float* __restrict__ k_cb, const float* __restrict__ v_cb,
        const float* __restrict__ row_bias, int bias_stride, int n_bias, float* __restrict__ out,
        float* __restrict__ part_acc, float* __restrict__ part_ml, int row0, int n_rows, int rows_per_split,
        int n_q_heads, int n_kv, int head_dim, int page_size, int heads_per_block, float scale,
        const int* __restrict__ step, int step_at, int window) {
    constexpr int KU = KF::UNIT, VU = VF::UNIT, KPL = DEC_VALS / KU, VPL = DEC_VALS / VU;
    __shared__ float sh_acc[DEC_WARPS][DEC_HEADS][MAX_HEAD_DIM];
    __shared__ float sh_m[DEC_WARPS][DEC_HEADS];
    __shared__ float sh_l[DEC_WARPS][DEC_HEADS];
    __shared__ float sh_cb[2][16];                   // key, value codebooks (tq)
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int nuk = head_dim / KU, nuv = head_dim / VU;
    const int kbytes = KF::row_bytes(head_dim), vbytes = VF::row_bytes(head_dim);
    const int group = n_q_heads / n_kv;
    const int n_chunks = (group + heads_per_block - 1) / heads_per_block;
    const int g = blockIdx.x / n_chunks, chunk = blockIdx.x % n_chunks;
    const int h0 = g * group + chunk * heads_per_block;
    const int nh = min(heads_per_block, group - chunk * heads_per_block);
    const int split = blockIdx.y;
    int n_splits = gridDim.y;
    if (step_at >= 0) {                              // a recorded step (block-uniform)
        n_rows = step[step_at];
        row0 = window > 0 ? max(0, n_rows - window) : 0;
        n_splits = decode_splits(n_rows - row0, n_kv * n_chunks, &rows_per_split);
        if (split >= n_splits) return;
    }
    const int r_begin = row0 + split * rows_per_split, r_end = min(n_rows, r_begin + rows_per_split);
    const float* bias = row_bias + (long long)g * bias_stride;   // read below n_bias only

    stage_codebook<KV_K>(sh_cb[0], k_cb);
    stage_codebook<KV_V>(sh_cb[1], v_cb);
    if (KF::ROTATED || VF::ROTATED) __syncthreads();

    float qr[DEC_HEADS][DEC_VALS];                   // scaled query values of this lane's key units
    float acc[DEC_HEADS][DEC_VALS];                  // ... and of its value units
    float m[DEC_HEADS], l[DEC_HEADS];
#pragma unroll
    for (int hh = 0; hh < DEC_HEADS; ++hh) {
        m[hh] = NEG_INF;
        l[hh] = 0.0f;
#pragma unroll
        for (int k = 0; k < KPL; ++k) {
            const int u = lane + WARP_SIZE * k;
#pragma unroll
            for (int i = 0; i < KU; ++i)
                qr[hh][k * KU + i] = hh < nh && u < nuk
                                         ? q[(long long)(h0 + hh) * head_dim + KF::value(u, i)] * scale : 0.0f;
        }
#pragma unroll
        for (int e = 0; e < DEC_VALS; ++e) acc[hh][e] = 0.0f;
    }

    // Two rows per step (r0 and r1 = r0 + DEC_WARPS): both rows' loads are in flight together.
    for (int r0 = r_begin + warp; r0 < r_end; r0 += 2 * DEC_WARPS) {
        const int r1 = r0 + DEC_WARPS;
        const bool has1 = r1 < r_end;                // warp-uniform
        const u8* k0 = kv_row(k_pages, page_table, r0, g, n_kv, page_size, kbytes);
        const u8* v0 = kv_row(v_pages, page_table, r0, g, n_kv, page_size, vbytes);
        const u8* k1 = has1 ? kv_row(k_pages, page_table, r1, g, n_kv, page_size, kbytes) : k0;
        const u8* v1 = has1 ? kv_row(v_pages, page_table, r1, g, n_kv, page_size, vbytes) : v0;
        const float bias0 = r0 < n_bias ? bias[r0] : 0.0f;
        const float bias1 = has1 && r1 < n_bias ? bias[r1] : 0.0f;
        u32 k0w[KPL], k1w[KPL], v0w[VPL], v1w[VPL];
        float k0s[KPL], k1s[KPL], v0s[VPL], v1s[VPL];  // scales (0 past the row: the unit reads as 0)
#pragma unroll
        for (int k = 0; k < KPL; ++k) {
            const int u = lane + WARP_SIZE * k;
            const bool ok = u < nuk;
            k0w[k] = ok ? KF::load(k0, u) : 0u;
            k1w[k] = ok && has1 ? KF::load(k1, u) : 0u;
            k0s[k] = ok ? KF::scale(k0, KF::block(u)) : 0.0f;
            k1s[k] = ok && has1 ? KF::scale(k1, KF::block(u)) : 0.0f;
        }
#pragma unroll
        for (int k = 0; k < VPL; ++k) {
            const int u = lane + WARP_SIZE * k;
            const bool ok = u < nuv;
            v0w[k] = ok ? VF::load(v0, u) : 0u;
            v1w[k] = ok && has1 ? VF::load(v1, u) : 0u;
            v0s[k] = ok ? VF::scale(v0, VF::block(u)) : 0.0f;
            v1s[k] = ok && has1 ? VF::scale(v1, VF::block(u)) : 0.0f;
        }
        float a[DEC_VALS], b[DEC_VALS];
#pragma unroll
        for (int k = 0; k < KPL; ++k) {
            kv_decode<KV_K>(k0w[k], k0s[k], sh_cb[0], a + k * KU);
            kv_decode<KV_K>(k1w[k], k1s[k], sh_cb[0], b + k * KU);
        }
        float s0[DEC_HEADS], s1[DEC_HEADS];
#pragma unroll
        for (int hh = 0; hh < DEC_HEADS; ++hh) {
            float d0 = 0.0f, d1 = 0.0f;
#pragma unroll
            for (int e = 0; e < DEC_VALS; ++e) {
                d0 += qr[hh][e] * a[e];
                d1 += qr[hh][e] * b[e];
            }
            s0[hh] = d0;
            s1[hh] = d1;
        }
#pragma unroll
        for (int hh = 0; hh < DEC_HEADS; ++hh) {
            if (hh < nh) {                           // block-uniform
                s0[hh] = warp_sum(s0[hh]) + bias0;
                s1[hh] = has1 ? warp_sum(s1[hh]) + bias1 : NEG_INF;
            }
        }
#pragma unroll
        for (int k = 0; k < VPL; ++k) {
            kv_decode<KV_V>(v0w[k], v0s[k], sh_cb[1], a + k * VU);
            kv_decode<KV_V>(v1w[k], v1s[k], sh_cb[1], b + k * VU);
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
            for (int e = 0; e < DEC_VALS; ++e) acc[hh][e] = acc[hh][e] * alpha + p0 * a[e] + p1 * b[e];
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
        for (int k = 0; k < VPL; ++k) {
            const int u = lane + WARP_SIZE * k;
            if (u < nuv) {
#pragma unroll
                for (int i = 0; i < VU; ++i) sh_acc[warp][hh][VF::value(u, i)] = acc[hh][k * VU + i];
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
        if (n_splits == 1 && !VF::ROTATED) {
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

// Splits of query head blockIdx.x -> out (prefill: of query x / n_q_heads, head x % n_q_heads,
// out dense [n][n_q_heads * head_dim]). part_acc f32 [n_q_heads, n_splits, head_dim],
// part_ml f32 [n_q_heads, n_splits, 2] (max, sum). tq values: the merged row y is in the
// rotated basis; out = R^T y with v_rot = R f32 [head_dim, head_dim] (read for tq only).
extern "C" __global__ void __launch_bounds__(DEC_THREADS) attention_decode_combine(
        const float* __restrict__ part_acc, const float* __restrict__ part_ml, const float* __restrict__ v_rot,
        float* __restrict__ out, int n_splits, int head_dim, const int* __restrict__ step, int step_at,
        int window, int split_blocks) {
    __shared__ float weight[MAX_SPLITS];
    __shared__ float red[32];
    __shared__ float y[VF::ROTATED ? MAX_HEAD_DIM : 1];
    const int h = blockIdx.x;
    if (step_at >= 0) {                              // a recorded step: split_blocks = n_kv * n_chunks
        const int n_rows = step[step_at], row0 = window > 0 ? max(0, n_rows - window) : 0;
        int rows_per_split;
        n_splits = decode_splits(n_rows - row0, split_blocks, &rows_per_split);
        if (n_splits == 1 && !VF::ROTATED) return;   // the split kernel wrote out
    }
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
        if (VF::ROTATED) y[d] = a * inv;
        else out[(long long)h * head_dim + d] = a * inv;
    }
    if (VF::ROTATED) {                               // compile-time: block-uniform
        __syncthreads();
        for (int p = threadIdx.x; p < head_dim; p += DEC_THREADS) {
            float o = 0.0f;
            for (int k = 0; k < head_dim; ++k) o += v_rot[k * head_dim + p] * y[k];
            out[(long long)h * head_dim + p] = o;
        }
    }
}

// -- prefill ----------------------------------------------------------------------------
// Per configuration (BQ queries per block, DL lanes across a row's units in the P V step):
//   S step:   thread (qg = tid / 16, rj = tid % 16) computes queries qg*QT .. qg*QT+QT-1
//             against tile rows rj and rj + 16 (QT = BQ / 8).
//   P V step: thread (qo = tid / DL, dl = tid % DL) owns queries qo*QO .. qo*QO+QO-1 and
//             value units dl + DL*k, k < PRE_VALS / UNIT (QO = BQ * DL / 128; head_dim <= 8 * DL).
// Shared memory (floats): Q [BQ][head_dim] | K or V tile units [32][ws] | their scales
// [32][ss] | S [BQ][SS] | m, l, alpha [BQ] | codebooks [32] (tq only); PrefillShape and
// attention.prefill_smem_bytes agree on it.

template <int BQ>
struct PrefillShape {
    static constexpr int QT = BQ / 8;
    static constexpr int SS = PRE_BK + 16 / QT;     // S row stride: the two query groups of a warp
                                                     // land 16 banks apart in the S step's stores
    static constexpr int CB = (KF::ROTATED || VF::ROTATED) ? 32 : 0;
    // odd unit / scale strides: the 16 rows read together in the S step hit 16 banks
    __device__ static int kst(int d) { return (d / KF::UNIT) | 1; }
    __device__ static int vst(int d) { return (d / VF::UNIT) | 1; }
    __device__ static int kss(int d) { return KF::SCALED ? KF::n_scales(d) | 1 : 0; }
    __device__ static int vss(int d) { return VF::SCALED ? VF::n_scales(d) | 1 : 0; }
};

template <int BQ, int DL>
__device__ __forceinline__ void prefill_block(const float* __restrict__ q, int q_stride,
                                              const u8* __restrict__ k_pages, const u8* __restrict__ v_pages,
                                              const int* __restrict__ page_table, const float* __restrict__ k_cb,
                                              const float* __restrict__ v_cb, float* __restrict__ out,
                                              int out_stride, const float* __restrict__ row_bias,
                                              int bias_stride, int n_bias, int n, int start_row, int n_q_heads,
                                              int n_kv, int head_dim, int page_size, int window, float scale,
                                              float* __restrict__ part_acc, float* __restrict__ part_ml,
                                              int n_splits, float* smem) {
    typedef PrefillShape<BQ> Shape;
    constexpr int QT = Shape::QT, SS = Shape::SS, KU = KF::UNIT, VU = VF::UNIT;
    constexpr int QO = BQ * DL / PRE_THREADS, VPT = PRE_VALS / VU;
    const int tid = threadIdx.x, lane = tid % WARP_SIZE, warp = tid / WARP_SIZE;
    const int nuk = head_dim / KU, nuv = head_dim / VU;
    const int kst = Shape::kst(head_dim), vst = Shape::vst(head_dim);
    const int kss = Shape::kss(head_dim), vss = Shape::vss(head_dim);
    const int ws = max(kst, vst), ss = max(kss, vss);
    // Blocks start in linear order; make the query head vary fastest in it and the longest
    // (last) query tiles come first: blocks running together share KV heads in L2, and no
    // long tile starts at the end of the launch.
    const int linear = blockIdx.y * gridDim.x + blockIdx.x;
    const int h = linear % n_q_heads, g = h / (n_q_heads / n_kv);
    const int q0 = (gridDim.x - 1 - linear / n_q_heads) * BQ;
    const int nq = min(BQ, n - q0);
    const int n_vis = start_row + q0 + nq;          // rows any query of this block sees: k_lo .. n_vis-1
    const int k_lo = window > 0 ? max(0, start_row + q0 - window + 1) : 0;     // the first query's lowest
    const float* bias_g = row_bias + (long long)g * bias_stride;                // read below n_bias only

    float* qs = smem;                                // [BQ][head_dim], key-unit order
    u32* tw = reinterpret_cast<u32*>(smem + BQ * head_dim);      // [PRE_BK][ws] units
    float* tsc = smem + BQ * head_dim + PRE_BK * ws;            // [PRE_BK][ss] scales
    float* sc = tsc + PRE_BK * ss;                   // [BQ][SS]
    float* mq = sc + BQ * SS;                        // running max per query
    float* lq = mq + BQ;                             // running sum
    float* aq = lq + BQ;                             // this tile's rescale factor
    float* cbk = aq + BQ;                            // codebooks [16] + [16] (tq)
    float* cbv = cbk + 16;

    for (int i = tid; i < BQ * head_dim; i += PRE_THREADS) {
        const int qi = i / head_dim, e = i % head_dim;
        float v = 0.0f;
        if (qi < nq)
            v = q[(long long)(q0 + qi) * q_stride + (long long)h * head_dim + KF::value(e / KU, e % KU)] * scale;
        qs[i] = v;
    }
    for (int i = tid; i < BQ; i += PRE_THREADS) {
        mq[i] = NEG_INF;
        lq[i] = 0.0f;
    }
    stage_codebook<KV_K>(cbk, k_cb);
    stage_codebook<KV_V>(cbv, v_cb);

    const int qg = tid / 16, rj = tid % 16;          // S step
    const int qo = tid / DL, dl = tid % DL;          // P V step
    float acc[QO][PRE_VALS];
#pragma unroll
    for (int i = 0; i < QO; ++i)
#pragma unroll
        for (int e = 0; e < PRE_VALS; ++e) acc[i][e] = 0.0f;

    // split blockIdx.z of n_splits takes its share of the tiles k_lo .. n_vis-1 (none: m = -inf, l = 0)
    const int n_tiles = (n_vis - k_lo + PRE_BK - 1) / PRE_BK;
    const int tiles_per_split = (n_tiles + n_splits - 1) / n_splits;
    const int k_begin = k_lo + (int)blockIdx.z * tiles_per_split * PRE_BK;
    const int k_end = min(n_vis, k_begin + tiles_per_split * PRE_BK);
    for (int k0 = k_begin; k0 < k_end; k0 += PRE_BK) {
        __syncthreads();                             // previous P V step is done with the tile and sc
        stage_units<KV_K, PRE_THREADS>(tw, kst, tsc, kss, k_pages, page_table, k0, PRE_BK, n_vis, g, n_kv,
                                       page_size, KF::row_bytes(head_dim), 0, nuk);
        __syncthreads();

        float s[QT][2];
#pragma unroll
        for (int i = 0; i < QT; ++i) s[i][0] = s[i][1] = 0.0f;
        const u32* ka = tw + rj * kst;
        const u32* kb = tw + (rj + 16) * kst;
        const float* sa = tsc + rj * kss;
        const float* sb = tsc + (rj + 16) * kss;
        const float* qa = qs + qg * QT * head_dim;
        for (int p = 0; p < nuk; ++p) {
            const u32 wa = ka[p], wb = kb[p];
            const float fa = KF::SCALED ? sa[KF::block(p)] : 1.0f, fb = KF::SCALED ? sb[KF::block(p)] : 1.0f;
            // a unit in chunks of KV_CHUNK values, not unrolled: unrolled, ptxas hoists the
            // chunks' query loads and spills at head_dim 64 (BQ 64)
#pragma unroll 1
            for (int e0 = 0; e0 < KU; e0 += KV_CHUNK) {
                constexpr int C = KU < KV_CHUNK ? KU : KV_CHUNK;
                float a[C], b[C];
                kv_decode<KV_K, C>(wa, fa, cbk, a, e0);
                kv_decode<KV_K, C>(wb, fb, cbk, b, e0);
#pragma unroll
                for (int i = 0; i < QT; ++i) {
                    float x[C];
                    load_floats<C>(qa + i * head_dim + p * KU + e0, x);
#pragma unroll
                    for (int e = 0; e < C; ++e) {
                        s[i][0] += x[e] * a[e];
                        s[i][1] += x[e] * b[e];
                    }
                }
            }
        }
#pragma unroll
        for (int i = 0; i < QT; ++i) {
            sc[(qg * QT + i) * SS + rj] = s[i][0];
            sc[(qg * QT + i) * SS + rj + 16] = s[i][1];
        }
        __syncthreads();                             // S complete; the K tile is no longer read

        stage_units<KV_V, PRE_THREADS>(tw, vst, tsc, vss, v_pages, page_table, k0, PRE_BK, n_vis, g, n_kv,
                                       page_size, VF::row_bytes(head_dim), 0, nuv);     // V tile over K
        const int row = k0 + lane;
        const float bias = row < n_bias ? bias_g[row] : 0.0f;
        for (int qi = warp; qi < BQ; qi += PRE_THREADS / WARP_SIZE) {     // online softmax, lane = column
            const int q_row = start_row + q0 + qi;
            const bool vis = row <= q_row && row < n_vis && (window <= 0 || row > q_row - window);
            const float sv = vis ? sc[qi * SS + lane] + bias : NEG_INF;
            const float m_old = mq[qi];
            // -inf only while a windowed query has seen no row yet (its window starts in a later tile)
            const float m_new = fmaxf(m_old, warp_max(sv));
            const float p = vis ? __expf(sv - m_new) : 0.0f;
            const float psum = warp_sum(p);
            sc[qi * SS + lane] = p;
            __syncwarp();                            // every lane has read mq[qi] (shuffles do not order
                                                     // shared memory: compute-sanitizer racecheck, H100)
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
            for (int e = 0; e < PRE_VALS; ++e) acc[i][e] *= alpha;
        }
        for (int j = 0; j < rows_here; ++j) {
            float v[PRE_VALS];
#pragma unroll
            for (int k = 0; k < VPT; ++k) {
                const int u = dl + DL * k;
                if (u < nuv) {
                    kv_decode<KV_V>(tw[j * vst + u], VF::SCALED ? tsc[j * vss + VF::block(u)] : 1.0f, cbv, v + k * VU);
                } else {
#pragma unroll
                    for (int e = 0; e < VU; ++e) v[k * VU + e] = 0.0f;
                }
            }
#pragma unroll
            for (int i = 0; i < QO; ++i) {
                const float pj = sc[(qo * QO + i) * SS + j];
#pragma unroll
                for (int e = 0; e < PRE_VALS; ++e) acc[i][e] += pj * v[e];
            }
        }
    }

    __syncthreads();                                 // m, l as set up, where a split had no tiles
#pragma unroll
    for (int i = 0; i < QO; ++i) {
        const int qi = qo * QO + i;
        if (qi >= nq) continue;
        float* dst;
        float mul;
        if (n_splits > 1) {                          // unnormalised partials for attention_decode_combine
            const long long slot = ((long long)(q0 + qi) * n_q_heads + h) * n_splits + blockIdx.z;
            dst = part_acc + slot * head_dim;
            mul = 1.0f;
            if (dl == 0) {
                part_ml[2 * slot] = mq[qi];
                part_ml[2 * slot + 1] = lq[qi];
            }
        } else {
            dst = out + (long long)(q0 + qi) * out_stride + (long long)h * head_dim;
            mul = 1.0f / lq[qi];
        }
#pragma unroll
        for (int k = 0; k < VPT; ++k) {
            const int u = dl + DL * k;
            if (u < nuv) {
#pragma unroll
                for (int e = 0; e < VU; ++e) dst[VF::value(u, e)] = acc[i][k * VU + e] * mul;
            }
        }
    }
}

// head_dim <= 64: BQ 64; <= 128: BQ 32; <= 256: BQ 16 (attention.py picks by head_dim);
// MINB: the register budget (PRE_BOUNDS).
#define PREFILL_ENTRY(NAME, BQ, DL, MINB)                                                                    \
    extern "C" __global__ void PRE_BOUNDS(MINB) NAME(                                          \
            const float* __restrict__ q, int q_stride, const u8* __restrict__ k_pages,                       \
            const u8* __restrict__ v_pages, const int* __restrict__ page_table,                              \
            const float* __restrict__ k_cb, const float* __restrict__ v_cb, float* __restrict__ out,         \
            int out_stride, const float* __restrict__ row_bias, int bias_stride, int n_bias, int n,          \
            int start_row, int n_q_heads, int n_kv, int head_dim, int page_size, int window, float scale,   \
            float* __restrict__ part_acc, float* __restrict__ part_ml, int n_splits) {                       \
        DYN_SHARED(float, smem);                                                                             \
        prefill_block<BQ, DL>(q, q_stride, k_pages, v_pages, page_table, k_cb, v_cb, out, out_stride,       \
                              row_bias, bias_stride, n_bias, n, start_row, n_q_heads, n_kv, head_dim,        \
                              page_size, window, scale, part_acc, part_ml, n_splits, smem);                  \
    }
PREFILL_ENTRY(attention_prefill_d64, 64, 8, 4)
PREFILL_ENTRY(attention_prefill_d128, 32, 16, 5)
PREFILL_ENTRY(attention_prefill_d256, 16, 32, 5)
