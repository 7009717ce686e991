#version 450
// Elementwise binary ops on [n, d] f32 views: OP_ADD (a + b) or OP_SILU_GATE
// (silu(a) * b). `out` may alias `a`. Grid: (ceil(d / 64), n, 1).
layout(local_size_x = 64) in;
layout(set = 0, binding = 0) readonly buffer AB { float A[]; };
layout(set = 0, binding = 1) readonly buffer BB { float B[]; };
layout(set = 0, binding = 2) buffer OB { float O[]; };
layout(push_constant) uniform P {
    uint n, d, a_off, a_stride, b_off, b_stride, o_off, o_stride;
} pc;

void main() {
    uint c = gl_GlobalInvocationID.x, t = gl_WorkGroupID.y;
    if (c >= pc.d || t >= pc.n) return;
    float a = A[pc.a_off + t * pc.a_stride + c];
    float b = B[pc.b_off + t * pc.b_stride + c];
#if defined(OP_ADD)
    O[pc.o_off + t * pc.o_stride + c] = a + b;
#elif defined(OP_SILU_GATE)
    O[pc.o_off + t * pc.o_stride + c] = a / (1.0 + exp(-a)) * b;
#else
#error "define OP_ADD or OP_SILU_GATE"
#endif
}
