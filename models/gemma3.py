"""gemma3: Gemma 3 text models (llama.cpp's `gemma3`, HF Gemma3ForCausalLM).

llama with: embeddings scaled by sqrt(dim); per-head RMSNorm of q and k before
NEOX RoPE; RMSNorm of each sublayer's output before the residual add; GeGLU
(gelu_tanh) feed-forward; five sliding-window layers (RoPE base 10000) for every
global layer (RoPE base `rope.freq_base`, 1e6), i.e. layer i is global iff
(i + 1) % 6 == 0. The GGUF converter already added 1 to every norm weight, so
the norms are plain `x / rms * w`. No logit soft-capping in Gemma 3; the output
head is tied to token_embd.
"""
from . import ArchSpec, register

GEMMA3 = register(ArchSpec(
    name="gemma3",
    rope_neox=True,
    default_rope_base=1000000.0,
    embed_scale=True,
    qk_norm=True,
    post_norms=True,
    ffn_act="gelu_tanh",
    swa_pattern=6,
    local_rope_base=10000.0,
    layer_tensors=(
        "attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
        "attn_q_norm.weight", "attn_k_norm.weight", "attn_output.weight", "post_attention_norm.weight",
        "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight", "post_ffw_norm.weight",
    ),
))
