#version 450
// Branch a cache: dst_k[pages[i]] = src_k[pages[i]] (and V) for each listed page, pages
// of k_page_bytes / v_page_bytes (any row format). A word shared with a neighbouring
// page (possible when a page is not a whole number of words) changes only in the
// page's own bytes (KV_STORE).
// Grid: (ceil(max page words + 1) / 256), n_listed, 1).
#extension GL_GOOGLE_include_directive : require
layout(local_size_x = 256) in;
layout(set = 0, binding = 0) readonly buffer SKB { uint SK[]; };
layout(set = 0, binding = 1) readonly buffer SVB { uint SV[]; };
layout(set = 0, binding = 2) buffer DKB { uint DK[]; };
layout(set = 0, binding = 3) buffer DVB { uint DV[]; };
layout(set = 0, binding = 4) readonly buffer PB { int PAGES[]; };
layout(push_constant) uniform P { uint n, k_page_bytes, v_page_bytes; } pc;
#include "kv.glsl"

#define COPY(S, D, PB) {                                                             \
    uint start = uint(PAGES[i]) * (PB), end = start + (PB);                          \
    uint w = (start >> 2) + x;                                                       \
    if (4u * w < end) {                                                              \
        uint mask = 0u;                                                              \
        for (uint p = 0u; p < 4u; p++)                                               \
            if (4u * w + p >= start && 4u * w + p < end) mask |= 0xFFu << (8u * p);  \
        KV_STORE(D, w, S[w], mask)                                                   \
    } }

void main() {
    uint x = gl_GlobalInvocationID.x, i = gl_WorkGroupID.y;
    if (i >= pc.n) return;
    COPY(SK, DK, pc.k_page_bytes)
    COPY(SV, DV, pc.v_page_bytes)
}
