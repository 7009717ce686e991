#version 450
// out[i, :] = dequantized row ids[i] of the table (raw GGUF blocks).
// ids come from the IDS buffer, IDS[use_ids - 1 + i] when use_ids > 0 (1: an ids buffer;
// 1 + s: slot s of a recorded step's buffer), or from the push constant id0; a table
// split over several buffers (backends/vulkan/weights.py) is one dispatch per part;
// with BLOCK_MAJOR the table is stored block-major (quant.glsl).
// Grid: (ceil(ceil(cols/32) / 64), n, 1); one thread per 32-element sub-block.
#extension GL_GOOGLE_include_directive : require
layout(local_size_x = 64) in;
layout(set = 0, binding = 0) readonly buffer WB { uint Wq[]; };
layout(set = 0, binding = 1) readonly buffer IB { int IDS[]; };
layout(set = 0, binding = 2) buffer OB { float O[]; };
layout(push_constant) uniform P {
    uint n, cols, row_bytes, id0, use_ids, o_off, o_stride;
    uint row0, part_rows;    // this buffer holds table rows row0 .. row0+part_rows-1
} pc;
#include "quant.glsl"

void main() {
    uint sub = gl_GlobalInvocationID.x;
    uint i = gl_WorkGroupID.y;
    if (sub * 32u >= pc.cols || i >= pc.n) return;
    uint id = (pc.use_ids != 0u ? uint(IDS[pc.use_ids - 1u + i]) : pc.id0) - pc.row0;
    if (id >= pc.part_rows) return;                          // another part's row
    float w[32];
#if defined(BLOCK_MAJOR)
    dequant32(block_major_base(id, sub, pc.part_rows, pc.row_bytes), sub, pc.cols, w);
#else
    dequant32(id * pc.row_bytes, sub, pc.cols, w);
#endif
    uint o = pc.o_off + i * pc.o_stride + sub * 32u;
    uint cn = min(32u, pc.cols - sub * 32u);
    for (uint k = 0u; k < cn; k++) O[o + k] = w[k];
}
