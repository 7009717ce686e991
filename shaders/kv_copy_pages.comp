#version 450
// Branch a cache: dst_k[PAGES[n + i]] = src_k[PAGES[i]] (and V) for each listed page, pages
// of k_page_bytes / v_page_bytes (any row format); PAGES holds the n source ids, then the n
// destination ids. The destination may be the source buffer itself, its pages distinct from
// the sources. Each destination word is assembled byte by byte from the source page (the two
// may start at different offsets within a word); a word shared with a neighbouring page
// (possible when a page is not a whole number of words) changes only in the page's own
// bytes (KV_STORE).
// Grid: (ceil(max page words + 1) / 256), pages in this dispatch, 1): page first + y (at most
// 65,535 pages a dispatch, the grid's guaranteed y limit: a longer list takes several).
#extension GL_GOOGLE_include_directive : require
layout(local_size_x = 256) in;
layout(set = 0, binding = 0) readonly buffer SKB { uint SK[]; };
layout(set = 0, binding = 1) readonly buffer SVB { uint SV[]; };
layout(set = 0, binding = 2) buffer DKB { uint DK[]; };
layout(set = 0, binding = 3) buffer DVB { uint DV[]; };
layout(set = 0, binding = 4) readonly buffer PB { int PAGES[]; };
layout(push_constant) uniform P { uint n, k_page_bytes, v_page_bytes, first; } pc;
#include "kv.glsl"

#define COPY(S, D, PB) {                                                             \
    uint src = uint(PAGES[i]) * (PB), start = uint(PAGES[pc.n + i]) * (PB);          \
    uint end = start + (PB), w = (start >> 2) + x;                                   \
    if (4u * w < end) {                                                              \
        uint val = 0u, mask = 0u;                                                    \
        for (uint p = 0u; p < 4u; p++) {                                             \
            uint b = 4u * w + p;                                                     \
            if (b >= start && b < end) {                                             \
                uint sb = b - start + src;                                           \
                val |= ((S[sb >> 2] >> (8u * (sb & 3u))) & 0xFFu) << (8u * p);      \
                mask |= 0xFFu << (8u * p);                                           \
            }                                                                        \
        }                                                                            \
        KV_STORE(D, w, val, mask)                                                    \
    } }

void main() {
    uint x = gl_GlobalInvocationID.x, i = pc.first + gl_WorkGroupID.y;
    if (i >= pc.n) return;
    COPY(SK, DK, pc.k_page_bytes)
    COPY(SV, DV, pc.v_page_bytes)
}
