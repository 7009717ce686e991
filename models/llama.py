"""llama: SmolLM2, TinyLlama, Llama 2/3.x. Adjacent-pair RoPE (the GGUF converter
permuted Q/K), no biases, output head separate (`output.weight`) or tied to
`token_embd.weight`."""
from . import ArchSpec, register

LLAMA = register(ArchSpec(name="llama"))
