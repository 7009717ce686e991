"""Write small, valid GGUF models with random weights for fast tests.

The tokenizer is byte-level BPE with the 256 byte tokens and one merge (" t"),
plus three control tokens, so any text round-trips.
"""
from __future__ import annotations

import numpy as np
from gguf import GGUFValueType, GGUFWriter, GGMLQuantizationType as Q, RopeScalingType
from gguf.quants import quantize

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Logits of one prompt computed in other steps (whole prefill, chunks, token by token,
# decode after prefill) on the CPU: steps of more than quant.MULTI_MAX tokens quantize
# activations to 2 int8 planes (~15 bits), shorter ones to 3 (~22); either can flip
# the bf16 rounding of a cached K/V element (2^-9 relative), which a tiny random model
# turns into up to ~1e-2 on logits of ~10 (real models: test_*_reference).
STEPS_AGREE = dict(rtol=1e-3, atol=1e-2)
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# K-quant blocks: byte offsets of the fp16 scale fields and a value that keeps
# weights around 0.1 in magnitude (gguf.quants cannot quantize these types).
_KQUANT_SCALES = {Q.Q4_K: ((0, 2), 1e-4), Q.Q5_K: ((0, 2), 5e-5), Q.Q6_K: ((208,), 2e-5)}


def random_kquant(rows: int, cols: int, qtype: Q, rng) -> np.ndarray:
    """uint8 [rows, cols/256 * block_bytes]: random K-quant blocks with finite, small scales."""
    from gguf import GGML_QUANT_SIZES
    block, nbytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
    offsets, scale = _KQUANT_SCALES[qtype]
    for off in offsets:
        d = (scale * rng.uniform(0.5, 1.5, size=(rows, cols // block))).astype(np.float16)
        raw[:, :, off:off + 2] = d.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


def byte_tokens() -> list[str]:
    """GPT-2's byte -> printable unicode mapping, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


GEMMA3_SLIDING_WINDOW = 16   # tiny gemma3's local-layer window (the real 270m: 512)


def write_tiny_gguf(path, arch: str = "llama", n_layers: int | None = None, dim: int = 64, n_heads: int = 4,
                    n_kv_heads: int = 2, ffn_dim: int = 128, qtype: Q = Q.F32, ctx: int = 512,
                    seed: int = 0, tensor_overrides: dict | None = None, drop: tuple[str, ...] = (),
                    extra_tensors: dict | None = None, rope_scaling: tuple[str, float] | None = None,
                    metadata: dict | None = None, head_dim: int | None = None,
                    sliding_window: int = GEMMA3_SLIDING_WINDOW):
    """A random-weight model. `qtype` is used for the 2-D matrices; norms are F32.
    `tensor_overrides`: name -> (raw uint8 array, qtype) written as is; `drop`: names omitted;
    `extra_tensors`: name -> f32 array added as is; `rope_scaling`: (type, factor) metadata;
    `metadata`: key ("{arch}." is expanded) -> (value, GGUFValueType), written over the defaults.
    `head_dim`: written as attention.key_length/value_length when given (default dim / n_heads).

    arch "gemma3" (6 layers by default, so that layer 5 is the global one of llama.cpp's
    fixed pattern of 6) adds per-head q/k norms [head_dim], post-attention and
    post-feed-forward norms, and `attention.sliding_window` = `sliding_window`; the
    output head is tied, as in every tiny model."""
    rng = np.random.default_rng(seed)
    tokens = byte_tokens() + ["\u0120t"] + SPECIALS
    vocab = len(tokens)
    gemma = arch == "gemma3"
    if n_layers is None:
        n_layers = 6 if gemma else 2
    explicit_head_dim = head_dim is not None
    head_dim = head_dim if explicit_head_dim else dim // n_heads
    w = GGUFWriter(str(path), arch)
    w.add_block_count(n_layers)
    w.add_context_length(ctx)
    w.add_embedding_length(dim)
    w.add_feed_forward_length(ffn_dim)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(1000000.0 if gemma else 10000.0)
    if explicit_head_dim:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if gemma:
        w.add_sliding_window(sliding_window)
    if rope_scaling is not None:
        w.add_rope_scaling_type(RopeScalingType(rope_scaling[0]))
        w.add_rope_scaling_factor(float(rope_scaling[1]))
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([1] * 257 + [3] * len(SPECIALS))
    w.add_token_merges(["\u0120 t"])
    w.add_bos_token_id(vocab - 3)
    w.add_eos_token_id(vocab - 3)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    for key, (value, vtype) in (metadata or {}).items():
        key = key.replace("{arch}", arch)
        w.kv_data[0].pop(key, None)                 # replace without the writer's duplicate warning
        w.add_key_value(key, value, vtype, sub_type=GGUFValueType.UINT32 if vtype == GGUFValueType.ARRAY else None)

    def matrix(name, rows, cols, scale=None):
        if name in drop:
            return
        if tensor_overrides and name in tensor_overrides:
            raw, qt = tensor_overrides[name]
            w.add_tensor(name, raw, raw_dtype=qt)
            return
        if qtype in _KQUANT_SCALES:
            w.add_tensor(name, random_kquant(rows, cols, qtype, rng), raw_dtype=qtype)
            return
        m = (rng.standard_normal((rows, cols)) * (scale or 1.0 / np.sqrt(cols))).astype(np.float32)
        if qtype == Q.F32:
            w.add_tensor(name, m)
        else:
            w.add_tensor(name, quantize(m, qtype), raw_dtype=qtype)

    def vector(name, n):
        if name in drop:
            return
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    matrix("token_embd.weight", vocab, dim, scale=1.0)
    vector("output_norm.weight", dim)
    q, kv = n_heads * head_dim, n_kv_heads * head_dim
    for i in range(n_layers):
        p = f"blk.{i}."
        vector(p + "attn_norm.weight", dim)
        matrix(p + "attn_q.weight", q, dim)
        matrix(p + "attn_k.weight", kv, dim)
        matrix(p + "attn_v.weight", kv, dim)
        matrix(p + "attn_output.weight", dim, q)
        vector(p + "ffn_norm.weight", dim)
        matrix(p + "ffn_gate.weight", ffn_dim, dim)
        matrix(p + "ffn_up.weight", ffn_dim, dim)
        matrix(p + "ffn_down.weight", dim, ffn_dim)
        if gemma:
            vector(p + "attn_q_norm.weight", head_dim)
            vector(p + "attn_k_norm.weight", head_dim)
            vector(p + "post_attention_norm.weight", dim)
            vector(p + "post_ffw_norm.weight", dim)
        if arch == "qwen2":
            for name, n in (("attn_q.bias", q), ("attn_k.bias", kv), ("attn_v.bias", kv)):
                if p + name not in drop:
                    w.add_tensor(p + name, (0.1 * rng.standard_normal(n)).astype(np.float32))
    for name, array in (extra_tensors or {}).items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama3_rope_factors(rot_dim: int, base: float = 10000.0, factor: float = 8.0, low: float = 1.0,
                        high: float = 4.0, old_ctx: int = 8192) -> np.ndarray:
    """f32 [rot_dim/2]: Llama 3.1's `rope_freqs` as its converter writes them, 1 for
    wavelengths under old_ctx/high, `factor` above old_ctx/low, a smooth ramp between."""
    inv = base ** (-2.0 * np.arange(rot_dim // 2) / rot_dim)
    smooth = np.clip((old_ctx * inv / (2 * np.pi) - low) / (high - low), 0.0, 1.0)
    return (1.0 / ((1 - smooth) / factor + smooth)).astype(np.float32)


ROPE_VARIANTS = ("plain", "rope_freqs", "linear4")


def rope_variant(name: str, factors) -> dict:
    """write_tiny_gguf keywords of the RoPE variants of tests/e2e/test_rope_scaling.py:
    no scaling, `rope_freqs.weight` = factors, or linear scaling x4."""
    if name == "plain":
        return {}
    if name == "rope_freqs":
        return {"extra_tensors": {"rope_freqs.weight": np.asarray(factors, np.float32)}}
    if name == "linear4":
        return {"rope_scaling": ("linear", 4.0)}
    raise ValueError(f"unknown RoPE variant {name!r}")
