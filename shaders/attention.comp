#version 450
// Causal attention over the paged bf16 cache, for prefill and decode alike.
// Query t (of n) sees physical rows 0 .. start_row + t, or with window > 0 only the
// last `window` of them (sliding-window layers): rows below are never read, and the
// row loop starts at the window, so a decode step costs O(window). Decode is n = 1
// with start_row = n_rows - 1. GQA: query head h reads KV head h / (n_q_heads / n_kv).
// One workgroup per (query head, query); rows are processed in tiles of 64 with
// an online softmax (running max M, running sum L, per-thread V accumulators),
// so no scores ever leave shared memory. Grid: (n_q_heads, n, 1).
#extension GL_GOOGLE_include_directive : require
#define TILE 64u
#define MAX_HALF 128u            // head_dim <= 256
layout(local_size_x = 64) in;
layout(set = 0, binding = 0) readonly buffer QB { float Q[]; };
layout(set = 0, binding = 1) readonly buffer KPB { uint KP[]; };
layout(set = 0, binding = 2) readonly buffer VPB { uint VP[]; };
layout(set = 0, binding = 3) readonly buffer PTB { int PT[]; };
layout(set = 0, binding = 4) buffer OB { float O[]; };
layout(push_constant) uniform P {
    uint n, n_q_heads, n_kv, head_dim, page_size, start_row;
    uint q_off, q_stride, o_off, o_stride, scale_bits, window;
} pc;
#include "common.glsl"
#include "kv.glsl"

shared vec2 qs[MAX_HALF];
shared float ps[TILE];
shared float red[TILE];

void main() {
    uint h = gl_WorkGroupID.x, t = gl_WorkGroupID.y, tid = gl_LocalInvocationID.x;
    uint hd2 = pc.head_dim / 2u;
    uint kvh = h / (pc.n_q_heads / pc.n_kv);
    uint n_vis = pc.start_row + t + 1u;                              // rows lo .. n_vis-1
    uint lo = pc.window != 0u && n_vis > pc.window ? n_vis - pc.window : 0u;
    float scale = uintBitsToFloat(pc.scale_bits);
    uint qo = pc.q_off + t * pc.q_stride + h * pc.head_dim;
    for (uint p = tid; p < hd2; p += 64u) qs[p] = vec2(Q[qo + 2u * p], Q[qo + 2u * p + 1u]) * scale;
    barrier();

    float M = -1.0 / 0.0, L = 0.0;
    vec2 acc0 = vec2(0.0), acc1 = vec2(0.0);      // pairs tid and tid + 64
    for (uint base = lo; base < n_vis; base += TILE) {
        uint r = base + tid;
        float s = -1.0 / 0.0;
        if (r < n_vis) {
            uint k = kv_word(uint(PT[r / pc.page_size]), kvh, r % pc.page_size, pc.n_kv, pc.page_size, hd2);
            float dot_ = 0.0;
            for (uint p = 0u; p < hd2; p++) {
                vec2 kk = unpack_bf16x2(KP[k + p]);
                dot_ += qs[p].x * kk.x + qs[p].y * kk.y;
            }
            s = dot_;
        }
        red[tid] = s;
        barrier();
        for (uint w = TILE / 2u; w > 0u; w >>= 1) {
            if (tid < w) red[tid] = max(red[tid], red[tid + w]);
            barrier();
        }
        float m_new = max(M, red[0]);
        barrier();
        float p_ = r < n_vis ? exp(s - m_new) : 0.0;
        ps[tid] = p_;
        red[tid] = p_;
        barrier();
        for (uint w = TILE / 2u; w > 0u; w >>= 1) {
            if (tid < w) red[tid] += red[tid + w];
            barrier();
        }
        float alpha = exp(M - m_new);
        L = L * alpha + red[0];
        M = m_new;
        acc0 *= alpha;
        acc1 *= alpha;
        uint m = min(TILE, n_vis - base);
        for (uint j = 0u; j < m; j++) {
            uint rr = base + j;
            uint v = kv_word(uint(PT[rr / pc.page_size]), kvh, rr % pc.page_size, pc.n_kv, pc.page_size, hd2);
            float pj = ps[j];
            if (tid < hd2) acc0 += pj * unpack_bf16x2(VP[v + tid]);
            if (tid + 64u < hd2) acc1 += pj * unpack_bf16x2(VP[v + tid + 64u]);
        }
        barrier();
    }
    uint oo = pc.o_off + t * pc.o_stride + h * pc.head_dim;
    if (tid < hd2) { O[oo + 2u * tid] = acc0.x / L; O[oo + 2u * tid + 1u] = acc0.y / L; }
    if (tid + 64u < hd2) { O[oo + 2u * tid + 128u] = acc1.x / L; O[oo + 2u * tid + 129u] = acc1.y / L; }
}
