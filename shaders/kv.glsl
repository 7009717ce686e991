// Paged bf16 KV addressing. Pages are uint32 words holding bf16 pairs:
//   pages[n_pages][n_kv_heads][page_size][head_dim / 2]
// Physical row r lives in page page_table[r / page_size] at offset r % page_size.
uint kv_word(uint page, uint head, uint offset, uint n_kv, uint page_size, uint half_dim) {
    return ((page * n_kv + head) * page_size + offset) * half_dim;
}
