#version 450
// Branch a cache: dst_k[pages[i]] = src_k[pages[i]] (and V) for each listed page.
// Grid: (ceil(page_words / 256), n_listed, 1).
layout(local_size_x = 256) in;
layout(set = 0, binding = 0) readonly buffer SKB { uint SK[]; };
layout(set = 0, binding = 1) readonly buffer SVB { uint SV[]; };
layout(set = 0, binding = 2) buffer DKB { uint DK[]; };
layout(set = 0, binding = 3) buffer DVB { uint DV[]; };
layout(set = 0, binding = 4) readonly buffer PB { int PAGES[]; };
layout(push_constant) uniform P { uint n, page_words; } pc;

void main() {
    uint w = gl_GlobalInvocationID.x, i = gl_WorkGroupID.y;
    if (w >= pc.page_words || i >= pc.n) return;
    uint o = uint(PAGES[i]) * pc.page_words + w;
    DK[o] = SK[o];
    DV[o] = SV[o];
}
