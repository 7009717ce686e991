"""Every bad input: one clear line on stderr, non-zero exit, no traceback."""
import os
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from tiny_gguf import write_tiny_gguf


def run_cli(*args, env=None):
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "engine.cli", *args], capture_output=True, text=True,
                          env=full_env, timeout=300)


def assert_one_line_error(r, *needles):
    assert r.returncode != 0
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: ") and "Traceback" not in r.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_missing_file(tmp_path):
    r = run_cli("run", str(tmp_path / "nope.gguf"), "-p", "hi")
    assert_one_line_error(r, "not found")


def test_not_a_gguf(tmp_path):
    p = tmp_path / "text.gguf"
    p.write_text("hello, I am not a model\n")
    assert_one_line_error(run_cli("info", str(p)), "not a GGUF")


def test_truncated_gguf(tmp_path, tiny_llama):
    data = open(tiny_llama, "rb").read()
    for cut in (20, len(data) // 3, len(data) - 100):
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(data[:cut])
        assert_one_line_error(run_cli("run", str(p), "-p", "hi"), "truncated or malformed")


def test_unsupported_architecture(tmp_path):
    p = write_tiny_gguf(tmp_path / "m.gguf", arch="mamba")
    assert_one_line_error(run_cli("run", str(p), "-p", "hi"), "unsupported architecture 'mamba'", "llama", "qwen2")


def test_unsupported_tensor_type(tmp_path):
    # IQ4_NL: 32-element blocks of 18 bytes; a type we do not implement
    raw = np.zeros((64, 2 * 18), dtype=np.uint8)
    p = write_tiny_gguf(tmp_path / "m.gguf", tensor_overrides={"blk.0.attn_q.weight": (raw, Q.IQ4_NL)})
    assert_one_line_error(run_cli("run", str(p), "-p", "hi"), "unsupported tensor type IQ4_NL", "Q4_K", "Q8_0")


def test_unsupported_rope_scaling_is_refused(tmp_path):
    p = write_tiny_gguf(tmp_path / "m.gguf", rope_scaling=("yarn", 4.0))
    assert_one_line_error(run_cli("run", str(p), "-p", "hi"), "RoPE scaling 'yarn'", "not supported")
    p = write_tiny_gguf(tmp_path / "f.gguf", extra_tensors={"rope_freqs.weight": np.ones(5, np.float32)})
    assert_one_line_error(run_cli("run", str(p), "-p", "hi"), "rope_freqs.weight has shape")
    p = write_tiny_gguf(tmp_path / "z.gguf", extra_tensors={"rope_freqs.weight": np.zeros(8, np.float32)})
    assert_one_line_error(run_cli("run", str(p), "-p", "hi"), "rope_freqs.weight holds non-positive")


def test_missing_tensor(tmp_path):
    p = write_tiny_gguf(tmp_path / "m.gguf", drop=("blk.1.ffn_up.weight",))
    assert_one_line_error(run_cli("run", str(p), "-p", "hi"), "missing tensor blk.1.ffn_up.weight")


def test_prompt_longer_than_context(tiny_llama):
    assert_one_line_error(run_cli("run", str(tiny_llama), "-p", "x" * 600), "context")
    assert_one_line_error(run_cli("run", str(tiny_llama), "--ctx", "8", "-p", "abcdefghijkl"),
                          "12 tokens", "context is 8")


@pytest.mark.parametrize("flags,needle", [                          # each error names its flag
    (["--temp", "-1"], "--temp"), (["--top-p", "0"], "--top-p"), (["--top-p", "1.5"], "--top-p"),
    (["--top-k", "-3"], "--top-k"), (["-n", "-1"], "-n/--max-tokens"), (["--seed", "-5"], "--seed"),
    (["--temp", "nan"], "--temp"), (["--presence-penalty", "2.5"], "--presence-penalty"),
    (["--frequency-penalty", "-3"], "--frequency-penalty"),
])
def test_invalid_sampling(tiny_llama, flags, needle):
    assert_one_line_error(run_cli("run", str(tiny_llama), "-p", "hi", *flags), needle)


def test_bad_env_and_flag(tiny_llama):
    assert_one_line_error(run_cli("run", str(tiny_llama), "-p", "hi", env={"SHARPI_SNAPKV_POOL": "sum"}),
                          "SHARPI_SNAPKV_POOL")
    assert_one_line_error(run_cli("run", str(tiny_llama), "-p", "hi", env={"SHARPI_CPU_KERNELS": "avx9000"}),
                          "SHARPI_CPU_KERNELS must be one of auto|portable")
    assert_one_line_error(run_cli("run", str(tiny_llama), "-p", "hi", "--kv-window", "zero"), "--kv-window")
    assert_one_line_error(run_cli("run", str(tiny_llama), "-p", "hi", "--backend", "tpu"), "--backend")


def test_bad_llama_cpp_cache_type(tiny_llama, tmp_path):
    assert_one_line_error(run_cli("bench", str(tiny_llama), "--lengths", "8", "--out", str(tmp_path),
                                  "--llama-cpp-cache-type", "q2_k"), "cache type", "q4_0")


def test_bad_kv_dtype(tiny_llama):
    assert_one_line_error(run_cli("run", str(tiny_llama), "-p", "hi", "--kv-dtype", "fp8"), "--kv-dtype", "tq4")
    assert_one_line_error(run_cli("run", str(tiny_llama), "-p", "hi", env={"SHARPI_KV_DTYPE": "q8_0/"}),
                          "SHARPI_KV_DTYPE")
    assert_one_line_error(run_cli("run", str(tiny_llama), "-p", "hi", "--backend", "reference", "--kv-dtype",
                                  "q8_0"), "q8_0 needs a head_dim divisible by 32, got 16")


def test_kv_dtype_the_head_dim_does_not_fit_on_vulkan(tiny_llama):
    r = run_cli("run", str(tiny_llama), "-p", "hi", "--backend", "vulkan", "--kv-dtype", "q8_0")
    if "head_dim" not in r.stderr and "vulkan" in r.stderr:
        pytest.skip(f"no Vulkan device here: {r.stderr.strip()}")
    assert_one_line_error(r, "q8_0 needs a head_dim divisible by 32, got 16")


def test_unavailable_backend(tiny_llama):
    assert_one_line_error(run_cli("run", str(tiny_llama), "-p", "hi", "--backend", "cuda"), "cuda")


def test_empty_prompt(tiny_llama):
    assert_one_line_error(run_cli("run", str(tiny_llama), "-p", ""), "empty")


def test_no_prompt(tiny_llama):
    assert_one_line_error(run_cli("run", str(tiny_llama)), "no prompt")


@pytest.mark.parametrize("flags,needle", [
    (["--port", "70000"], "--port must be in 0..65535"),
    (["--max-queue", "-1"], "--max-queue must be >= 0"),
    (["--parallel", "0"], "--parallel must be >= 1"),
    (["--kv-pool-tokens", "0"], "--kv-pool-tokens must be >= 1"),
    (["--prompt-cache", "-1"], "--prompt-cache must be >= 0"),
])
def test_serve_flags_out_of_range(tiny_llama, flags, needle):
    assert_one_line_error(run_cli("serve", str(tiny_llama), *flags), needle)
