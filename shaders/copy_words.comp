#version 450
// D[0 .. n-1] = S[0 .. n-1] (uint32 words), or with FILL D[0 .. n-1] = 0 (S not read):
// fills and reads back buffers that live in device memory only (no host staging copy).
// Grid: (min(ceil(n / 256), 65535), 1, 1); each invocation strides by the whole grid.
layout(local_size_x = 256) in;
layout(set = 0, binding = 0) readonly buffer SB { uint S[]; };
layout(set = 0, binding = 1) writeonly buffer DB { uint D[]; };
layout(push_constant) uniform P { uint n; } pc;

void main() {
    uint stride = gl_NumWorkGroups.x * 256u;
    for (uint i = gl_GlobalInvocationID.x; i < pc.n; i += stride) {
#if defined(FILL)
        D[i] = 0u;
#else
        D[i] = S[i];
#endif
    }
}
