#version 450
// Causal attention over the paged cache, for prefill and decode alike; keys and values
// in their row formats (K_FMT, V_FMT: kv.glsl), dequantized in registers.
// Query t (of n) sees physical rows 0 .. start_row + t, or with window > 0 only the
// last `window` of them (sliding-window layers): rows below are never read, and the
// row loop starts at the window, so a decode step costs O(window). Decode is n = 1
// with start_row = n_rows - 1. GQA: query head h reads KV head h / (n_q_heads / n_kv).
// One workgroup per (query head, query) (but see GROUP and QPW); rows in tiles of 64 with
// an online softmax (running max M, running sum L, per-thread V accumulators),
// so no scores ever leave shared memory. Grid: (n_q_heads, n, 1).
// tq keys: Q holds the rotated queries R q (kv_rotate); tq values: O receives the
// output in the values' rotated basis, which kv_rotate turns back.
// SPLIT=S (decode, n = 1; flash-decoding): grid (n_q_heads, S, 1), workgroup s takes the
// s-th of S equal spans of the visible rows and writes its unnormalised accumulators,
// running max and sum to O[(h * S + s) * (head_dim + 2) ..]; attention_combine.comp
// merges the S partials of each head. The grid does not depend on the context length,
// so decode keeps one pipeline as the cache grows.
// GROUP (specialization constant 0, default 1): a workgroup serves the GROUP query heads
// of one KV head (grouped-query attention), reading each K/V row once for all of them;
// the grid's x is then the KV head. GROUP is 1 or n_q_heads / n_kv (<= MAX_GROUP).
// QPW (specialization constant 1, default 1; prefill): a workgroup also serves QPW
// consecutive queries, so each K/V row it reads serves GROUP * QPW query vectors
// (<= MAX_GROUP); vector v is query t0 + v / GROUP, head h0 + v % GROUP, each masked to
// its own causal (and window) range. Grid: (.., ceil(n / QPW), 1).
// Row bias (merged rows' log-counts): row r of KV head kv adds RB[bias_off + kv * bias_stride + r]
// to its scaled score when r < n_bias (rows >= n_bias add 0; n_bias = 0 binds a dummy buffer).
// A recorded decode step (engine/replay.py) passes step_at > 0: start_row = STEP[step_at - 1] - 1
// (the slot holds the rows attended), so one recorded dispatch serves every length; else STEP
// is a dummy, unread.
#extension GL_GOOGLE_include_directive : require
#define TILE 64u
layout(local_size_x = 64) in;
layout(set = 0, binding = 0) readonly buffer QB { float Q[]; };
layout(set = 0, binding = 1) readonly buffer KPB { uint KP[]; };
layout(set = 0, binding = 2) readonly buffer VPB { uint VP[]; };
layout(set = 0, binding = 3) readonly buffer PTB { int PT[]; };
layout(set = 0, binding = 4) buffer OB { float O[]; };
layout(set = 0, binding = 5) readonly buffer RBB { float RB[]; };
layout(set = 0, binding = 6) readonly buffer STB { int STEP[]; };  // a recorded step's values
layout(push_constant) uniform P {
    uint n, n_q_heads, n_kv, head_dim, page_size, start_row;
    uint q_off, q_stride, o_off, o_stride, scale_bits, window;
    uint bias_off, bias_stride, n_bias;
    uint step_at;                        // > 0: start_row = STEP[step_at - 1] - 1 (rows attended - 1)
} pc;
#include "common.glsl"
#define KV_READ_K
#define KV_READ_V
layout(constant_id = 0) const uint GROUP = 1u;
layout(constant_id = 1) const uint QPW = 1u;
#define NV (GROUP * QPW)                 // query vectors per workgroup
#define KQ(qo, i) qs[(qo) + (i)]
shared float qs[NV * 256u];              // MAX_DIM (kv.glsl) per vector: declared before k_dot reads it
#include "kv.glsl"

shared float ps[NV * TILE];
shared float red[NV * TILE];

void main() {
    uint start_row = pc.step_at != 0u ? uint(STEP[pc.step_at - 1u]) - 1u : pc.start_row;
    uint tid = gl_LocalInvocationID.x;
    uint hd = pc.head_dim;
    uint k_rb = row_bytes(K_FMT, hd), v_rb = row_bytes(V_FMT, hd);
    uint kvh = GROUP > 1u ? gl_WorkGroupID.x : gl_WorkGroupID.x / (pc.n_q_heads / pc.n_kv);
    uint h0 = GROUP > 1u ? gl_WorkGroupID.x * GROUP : gl_WorkGroupID.x;      // first query head served
#ifdef SPLIT
    uint t0 = 0u, nq = 1u;
    uint end = start_row + 1u;
    uint first = pc.window != 0u && end > pc.window ? end - pc.window : 0u;
    uint span = (end - first + SPLIT - 1u) / SPLIT;
    uint lo = min(first + gl_WorkGroupID.y * span, end);
    uint n_vis = min(lo + span, end);                                // rows lo .. n_vis-1
#else
    uint t0 = gl_WorkGroupID.y * QPW;
    uint nq = min(QPW, pc.n - t0);                                   // queries t0 .. t0+nq-1
    uint n_vis = start_row + t0 + nq;                                // rows lo .. n_vis-1 (the last query's)
    uint first = start_row + t0 + 1u;                                // the first query's rows, its lowest
    uint lo = pc.window != 0u && first > pc.window ? first - pc.window : 0u;
#endif
    float scale = uintBitsToFloat(pc.scale_bits);
    for (uint v = 0u; v < NV; v++) {
        uint q = v / GROUP;
        uint qo = pc.q_off + (t0 + min(q, nq - 1u)) * pc.q_stride + (h0 + v % GROUP) * hd;
        for (uint i = tid; i < hd; i += 64u) qs[v * 256u + i] = Q[qo + i] * scale;
    }
    kv_tables_init(tid);
    barrier();

    float M[NV], L[NV], s[NV];
    vec4 acc[NV];                                 // values 4 tid .. 4 tid + 3 of each vector
    for (uint v = 0u; v < NV; v++) {
        M[v] = -1.0 / 0.0;
        L[v] = 0.0;
        acc[v] = vec4(0.0);
    }
    bool owns = 4u * tid < hd;
    for (uint base = lo; base < n_vis; base += TILE) {
        uint r = base + tid;
        uint kr = r < n_vis ? kv_row(uint(PT[r / pc.page_size]), kvh, r % pc.page_size, pc.n_kv, pc.page_size, k_rb) : 0u;
        float rb = r < pc.n_bias ? RB[pc.bias_off + kvh * pc.bias_stride + r] : 0.0;
        for (uint v = 0u; v < NV; v++) {
#ifdef SPLIT
            bool vis = r < n_vis;                                    // the span's rows
#else
            uint last = start_row + t0 + v / GROUP;                  // this vector's query row
            bool vis = v / GROUP < nq && r <= last && (pc.window == 0u || r + pc.window > last);
#endif
            s[v] = vis ? k_dot(kr, v * 256u) + rb : -1.0 / 0.0;
            red[v * TILE + tid] = s[v];
        }
        barrier();
        for (uint w = TILE / 2u; w > 0u; w >>= 1) {
            if (tid < w)
                for (uint v = 0u; v < NV; v++) red[v * TILE + tid] = max(red[v * TILE + tid], red[v * TILE + tid + w]);
            barrier();
        }
        float m_new[NV];
        for (uint v = 0u; v < NV; v++) m_new[v] = max(M[v], red[v * TILE]);
        barrier();
#ifdef V_ROW_SCALE
        float vs = r < n_vis ? v_row_scale(kv_row(uint(PT[r / pc.page_size]), kvh, r % pc.page_size, pc.n_kv,
                                                  pc.page_size, v_rb)) : 0.0;
#else
        float vs = 1.0;
#endif
        for (uint v = 0u; v < NV; v++) {                             // masked (-inf) scores weigh 0
            float p_ = is_neg_inf(s[v]) ? 0.0 : exp(s[v] - m_new[v]);
            ps[v * TILE + tid] = p_ * vs;
            red[v * TILE + tid] = p_;
        }
        barrier();
        for (uint w = TILE / 2u; w > 0u; w >>= 1) {
            if (tid < w)
                for (uint v = 0u; v < NV; v++) red[v * TILE + tid] += red[v * TILE + tid + w];
            barrier();
        }
        for (uint v = 0u; v < NV; v++) {                             // nothing seen yet: stays 0
            float alpha = is_neg_inf(m_new[v]) ? 1.0 : is_neg_inf(M[v]) ? 0.0 : exp(M[v] - m_new[v]);
            L[v] = L[v] * alpha + red[v * TILE];
            M[v] = m_new[v];
            acc[v] *= alpha;
        }
        uint m = min(TILE, n_vis - base);
        if (owns) {
            for (uint j = 0u; j < m; j++) {
                uint rr = base + j;
                vec4 vv = v_load4(kv_row(uint(PT[rr / pc.page_size]), kvh, rr % pc.page_size, pc.n_kv,
                                         pc.page_size, v_rb), tid);
                for (uint v = 0u; v < NV; v++) acc[v] += ps[v * TILE + j] * vv;
            }
        }
        barrier();
    }
    for (uint g = 0u; g < GROUP; g++) {     // SPLIT: QPW = 1, vector g
#ifdef SPLIT
        uint po = ((h0 + g) * SPLIT + gl_WorkGroupID.y) * (hd + 2u);
        for (uint i = 0u; i < 4u; i++)
            if (4u * tid + i < hd) O[po + 4u * tid + i] = acc[g][i];
        if (tid == 0u) {
            O[po + hd] = M[g];                                       // -inf for an empty span
            O[po + hd + 1u] = L[g];
        }
#else
        for (uint q = 0u; q < nq; q++) {
            uint v = q * GROUP + g;
            uint oo = pc.o_off + (t0 + q) * pc.o_stride + (h0 + g) * hd + 4u * tid;
            for (uint i = 0u; i < 4u; i++)
                if (4u * tid + i < hd) O[oo + i] = acc[v][i] / L[v];
        }
#endif
    }
}
