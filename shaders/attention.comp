#version 450
// Causal attention over the paged cache, for prefill and decode alike; keys and values
// in their row formats (K_FMT, V_FMT: kv.glsl), dequantized in registers.
// Query t (of n) sees physical rows 0 .. start_row + t, or with window > 0 only the
// last `window` of them (sliding-window layers): rows below are never read, and the
// row loop starts at the window, so a decode step costs O(window). Decode is n = 1
// with start_row = n_rows - 1. GQA: query head h reads KV head h / (n_q_heads / n_kv).
// One workgroup per (query head, query); rows are processed in tiles of 64 with
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
// Row bias (merged rows' log-counts): row r of KV head kv adds RB[bias_off + kv * bias_stride + r]
// to its scaled score when r < n_bias (rows >= n_bias add 0; n_bias = 0 binds a dummy buffer).
#extension GL_GOOGLE_include_directive : require
#define TILE 64u
layout(local_size_x = 64) in;
layout(set = 0, binding = 0) readonly buffer QB { float Q[]; };
layout(set = 0, binding = 1) readonly buffer KPB { uint KP[]; };
layout(set = 0, binding = 2) readonly buffer VPB { uint VP[]; };
layout(set = 0, binding = 3) readonly buffer PTB { int PT[]; };
layout(set = 0, binding = 4) buffer OB { float O[]; };
layout(set = 0, binding = 5) readonly buffer RBB { float RB[]; };
layout(push_constant) uniform P {
    uint n, n_q_heads, n_kv, head_dim, page_size, start_row;
    uint q_off, q_stride, o_off, o_stride, scale_bits, window;
    uint bias_off, bias_stride, n_bias;
} pc;
#include "common.glsl"
#define KV_READ_K
#define KV_READ_V
layout(constant_id = 0) const uint GROUP = 1u;
#define KQ(qo, i) qs[(qo) + (i)]
shared float qs[GROUP * 256u];           // MAX_DIM (kv.glsl) per head: declared before k_dot reads it
#include "kv.glsl"

shared float ps[GROUP * TILE];
shared float red[GROUP * TILE];

void main() {
    uint tid = gl_LocalInvocationID.x;
    uint hd = pc.head_dim;
    uint k_rb = row_bytes(K_FMT, hd), v_rb = row_bytes(V_FMT, hd);
    uint kvh = GROUP > 1u ? gl_WorkGroupID.x : gl_WorkGroupID.x / (pc.n_q_heads / pc.n_kv);
    uint h0 = GROUP > 1u ? gl_WorkGroupID.x * GROUP : gl_WorkGroupID.x;      // first query head served
#ifdef SPLIT
    uint t = 0u;
    uint end = pc.start_row + 1u;
    uint first = pc.window != 0u && end > pc.window ? end - pc.window : 0u;
    uint span = (end - first + SPLIT - 1u) / SPLIT;
    uint lo = min(first + gl_WorkGroupID.y * span, end);
    uint n_vis = min(lo + span, end);                                // rows lo .. n_vis-1
#else
    uint t = gl_WorkGroupID.y;
    uint n_vis = pc.start_row + t + 1u;                              // rows lo .. n_vis-1
    uint lo = pc.window != 0u && n_vis > pc.window ? n_vis - pc.window : 0u;
#endif
    float scale = uintBitsToFloat(pc.scale_bits);
    uint qo = pc.q_off + t * pc.q_stride + h0 * hd;
    for (uint g = 0u; g < GROUP; g++)
        for (uint i = tid; i < hd; i += 64u) qs[g * 256u + i] = Q[qo + g * hd + i] * scale;
    kv_tables_init(tid);
    barrier();

    float M[GROUP], L[GROUP], s[GROUP];
    vec4 acc[GROUP];                              // values 4 tid .. 4 tid + 3 of each head
    for (uint g = 0u; g < GROUP; g++) {
        M[g] = -1.0 / 0.0;
        L[g] = 0.0;
        acc[g] = vec4(0.0);
    }
    bool owns = 4u * tid < hd;
    for (uint base = lo; base < n_vis; base += TILE) {
        uint r = base + tid;
        uint kr = r < n_vis ? kv_row(uint(PT[r / pc.page_size]), kvh, r % pc.page_size, pc.n_kv, pc.page_size, k_rb) : 0u;
        float rb = r < pc.n_bias ? RB[pc.bias_off + kvh * pc.bias_stride + r] : 0.0;
        for (uint g = 0u; g < GROUP; g++) {
            s[g] = r < n_vis ? k_dot(kr, g * 256u) + rb : -1.0 / 0.0;
            red[g * TILE + tid] = s[g];
        }
        barrier();
        for (uint w = TILE / 2u; w > 0u; w >>= 1) {
            if (tid < w)
                for (uint g = 0u; g < GROUP; g++) red[g * TILE + tid] = max(red[g * TILE + tid], red[g * TILE + tid + w]);
            barrier();
        }
        float m_new[GROUP];
        for (uint g = 0u; g < GROUP; g++) m_new[g] = max(M[g], red[g * TILE]);
        barrier();
#ifdef V_ROW_SCALE
        float vs = r < n_vis ? v_row_scale(kv_row(uint(PT[r / pc.page_size]), kvh, r % pc.page_size, pc.n_kv,
                                                  pc.page_size, v_rb)) : 0.0;
#else
        float vs = 1.0;
#endif
        for (uint g = 0u; g < GROUP; g++) {
            float p_ = r < n_vis ? exp(s[g] - m_new[g]) : 0.0;
            ps[g * TILE + tid] = p_ * vs;
            red[g * TILE + tid] = p_;
        }
        barrier();
        for (uint w = TILE / 2u; w > 0u; w >>= 1) {
            if (tid < w)
                for (uint g = 0u; g < GROUP; g++) red[g * TILE + tid] += red[g * TILE + tid + w];
            barrier();
        }
        for (uint g = 0u; g < GROUP; g++) {
            float alpha = exp(M[g] - m_new[g]);
            L[g] = L[g] * alpha + red[g * TILE];
            M[g] = m_new[g];
            acc[g] *= alpha;
        }
        uint m = min(TILE, n_vis - base);
        if (owns) {
            for (uint j = 0u; j < m; j++) {
                uint rr = base + j;
                vec4 vv = v_load4(kv_row(uint(PT[rr / pc.page_size]), kvh, rr % pc.page_size, pc.n_kv,
                                         pc.page_size, v_rb), tid);
                for (uint g = 0u; g < GROUP; g++) acc[g] += ps[g * TILE + j] * vv;
            }
        }
        barrier();
    }
    for (uint g = 0u; g < GROUP; g++) {
#ifdef SPLIT
        uint po = ((h0 + g) * SPLIT + gl_WorkGroupID.y) * (hd + 2u);
        for (uint i = 0u; i < 4u; i++)
            if (4u * tid + i < hd) O[po + 4u * tid + i] = acc[g][i];
        if (tid == 0u) {
            O[po + hd] = M[g];                                       // -inf for an empty span
            O[po + hd + 1u] = L[g];
        }
#else
        uint oo = pc.o_off + t * pc.o_stride + (h0 + g) * hd + 4u * tid;
        for (uint i = 0u; i < 4u; i++)
            if (4u * tid + i < hd) O[oo + i] = acc[g][i] / L[g];
#endif
    }
}
