// KV-cache writes, compaction and page copies over the paged bf16 layout of
// common.cuh (row_word).
#include "common.cuh"

// K/V rows (f32, strided) -> bf16 rows start_row .. start_row + n - 1.
// Grid (n, n_kv, 1), block: head_dim/2 rounded up to 32 (one word each, looping if more).
extern "C" __global__ void kv_write(u32* __restrict__ k_pages, u32* __restrict__ v_pages,
                                    const int* __restrict__ page_table, const float* __restrict__ k, int k_stride,
                                    const float* __restrict__ v, int v_stride, int n_kv, int head_dim,
                                    int page_size, int start_row) {
    const int t = blockIdx.x, h = blockIdx.y, hd2 = head_dim / 2;
    const long long dst = row_word(page_table, start_row + t, h, n_kv, page_size, hd2);
    const float* kr = k + (long long)t * k_stride + h * head_dim;
    const float* vr = v + (long long)t * v_stride + h * head_dim;
    for (int p = threadIdx.x; p < hd2; p += blockDim.x) {
        k_pages[dst + p] = f32_to_bf16(kr[2 * p]) | (f32_to_bf16(kr[2 * p + 1]) << 16);
        v_pages[dst + p] = f32_to_bf16(vr[2 * p]) | (f32_to_bf16(vr[2 * p + 1]) << 16);
    }
}

// Compaction, pass 1: row keep[h][j] of head h (K and V) -> tmp[2][n_kv][n_keep][hd2].
// Pass 2 writes tmp into rows j. Two passes because rows move down in place: in
// one pass a block could overwrite a row another block has not read yet.
// Grid (n_keep, n_kv, 1), block: head_dim/2 rounded up to 32.
extern "C" __global__ void kv_gather_read(const u32* __restrict__ k_pages, const u32* __restrict__ v_pages,
                                          const int* __restrict__ page_table, const int* __restrict__ keep,
                                          u32* __restrict__ tmp, int n_keep, int n_kv, int head_dim,
                                          int page_size) {
    const int j = blockIdx.x, h = blockIdx.y, hd2 = head_dim / 2;
    const long long src = row_word(page_table, keep[(long long)h * n_keep + j], h, n_kv, page_size, hd2);
    u32* tk = tmp + ((long long)h * n_keep + j) * hd2;
    u32* tv = tk + (long long)n_kv * n_keep * hd2;
    for (int p = threadIdx.x; p < hd2; p += blockDim.x) {
        tk[p] = k_pages[src + p];
        tv[p] = v_pages[src + p];
    }
}

extern "C" __global__ void kv_gather_write(u32* __restrict__ k_pages, u32* __restrict__ v_pages,
                                           const int* __restrict__ page_table, const u32* __restrict__ tmp,
                                           int n_keep, int n_kv, int head_dim, int page_size) {
    const int j = blockIdx.x, h = blockIdx.y, hd2 = head_dim / 2;
    const long long dst = row_word(page_table, j, h, n_kv, page_size, hd2);
    const u32* tk = tmp + ((long long)h * n_keep + j) * hd2;
    const u32* tv = tk + (long long)n_kv * n_keep * hd2;
    for (int p = threadIdx.x; p < hd2; p += blockDim.x) {
        k_pages[dst + p] = tk[p];
        v_pages[dst + p] = tv[p];
    }
}

// Branching a cache: dst pools' listed pages = src pools' pages.
// Grid (ceil(page_words / blockDim.x), n_listed, 1).
extern "C" __global__ void kv_copy_pages(const u32* __restrict__ src_k, const u32* __restrict__ src_v,
                                         u32* __restrict__ dst_k, u32* __restrict__ dst_v,
                                         const int* __restrict__ pages, int page_words) {
    const int w = blockIdx.x * blockDim.x + threadIdx.x;
    if (w >= page_words) return;
    const long long o = (long long)pages[blockIdx.y] * page_words + w;
    dst_k[o] = src_k[o];
    dst_v[o] = src_v[o];
}
