"""The whole forward pass through the CUDA backend, loaded as users load it
(`engine.load(..., backend="cuda")`), against the CPU backend.

Small random GGUF models (tests/tiny_gguf.py) run on the executor the CUDA tests
use (tests/backends/_backends.py cuda_test_executor: SHARPI_CUDA_EXECUTOR, else the
CPU harness; the test id says which); the default model runs on the harness and,
on a machine with an NVIDIA GPU (or asked for by SHARPI_CUDA_EXECUTOR=device), on
the device.

Tolerances: tests/backends/_model_checks.py.
"""
from __future__ import annotations

import os

import pytest
from gguf import GGMLQuantizationType as Q

import engine
from _backends import EXECUTOR_IDS, available_backends, cuda_test_executor
from _model_checks import (check_adaptive, check_decode_batch, check_decode_moves_only_the_logits,
                           check_logits_and_tokens, check_snapkv)
from tiny_gguf import write_tiny_gguf

PROMPT = list(range(3, 200, 2)) * 3     # 291 token ids of the tiny vocabulary

TINY = {
    "llama-q8": dict(qtype=Q.Q8_0, seed=1),
    "qwen2-q4_1": dict(arch="qwen2", qtype=Q.Q4_1, seed=2),
    "llama-q4_k-gqa4": dict(dim=256, n_heads=4, n_kv_heads=1, ffn_dim=256, qtype=Q.Q4_K, seed=3),
}


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-cuda")
    return {name: write_tiny_gguf(d / f"{name}.gguf", **kw) for name, kw in TINY.items()}


EXECUTOR = cuda_test_executor()


@pytest.fixture(params=[pytest.param(EXECUTOR, id=EXECUTOR_IDS[EXECUTOR])])
def executor(request, monkeypatch):
    """engine.load(backend="cuda") on the tests' executor (without a GPU, "device" fails
    the load with BackendUnavailable)."""
    monkeypatch.setenv("SHARPI_CUDA_EXECUTOR", request.param)
    return request.param


def load_pair(path, **kw):
    cuda = engine.load(path, backend="cuda", snapkv_budget=0, **kw)
    cpu = engine.load(path, backend="cpu", snapkv_budget=0, **kw)
    assert cuda.backend.name == "cuda" and cuda.backend.ex.name == os.environ["SHARPI_CUDA_EXECUTOR"]
    return cpu, cuda


# -- tiny models, on the tests' executor ------------------------------------------------
@pytest.mark.parametrize("name", list(TINY))
def test_tiny_logits_and_greedy_tokens(executor, tiny_models, name):
    cpu, cuda = load_pair(tiny_models[name], prefill_chunk=64)   # chunks of 64: the GEMM path; decode: mat-vec
    check_logits_and_tokens(cpu, cuda, PROMPT[:150], 8)


def test_tiny_long_prompt_splits_prefill_rows(executor, tmp_path):
    """Chunks past 512 rows in a grid of few blocks: the prefill attention splits the rows
    (attention.prefill_splits) and the decode combine merges them, as on a GPU at 32K."""
    from backends.cuda import attention
    path = write_tiny_gguf(tmp_path / "long.gguf", **TINY["llama-q4_k-gqa4"], ctx=1024)
    cpu, cuda = load_pair(path, prefill_chunk=64)
    head_dim = cuda.config.head_dim
    assert attention.prefill_splits(64, 640, 0, attention.prefill_kernel(head_dim)[1], cuda.config.n_heads) > 1
    check_logits_and_tokens(cpu, cuda, (PROMPT * 3)[:720], 4)


@pytest.mark.parametrize("name,kv_dtype", [("llama-q4_k-gqa4", "q8_0/tq4"), ("llama-q8", "tq3"),
                                           ("llama-q4_k-gqa4", "rq4_0:0=q8_0/rq4_0")])   # layer 0 apart
def test_tiny_quantized_kv_cache(executor, tiny_models, name, kv_dtype):
    """A quantized KV cache end to end (keys and values of different formats; tq3 at
    head_dim 16): logits near the CPU backend's with the same cache dtype (each backend
    quantizes its own K/V, so a code may differ at a near-tie) and the same tokens."""
    cpu, cuda = load_pair(tiny_models[name], prefill_chunk=64, kv_dtype=kv_dtype)
    assert (cuda.k_dtype, cuda.v_dtype) == (cpu.k_dtype, cpu.v_dtype)
    check_logits_and_tokens(cpu, cuda, PROMPT[:100], 4, tol=1e-4)


def test_tiny_decode_moves_only_the_logits(executor, tiny_models):
    _, cuda = load_pair(tiny_models["llama-q8"])
    check_decode_moves_only_the_logits(cuda, PROMPT[:40])


def test_tiny_snapkv_keep_sets_tokens_and_device_cache(executor, tiny_models):
    cpu, cuda = load_pair(tiny_models["qwen2-q4_1"], prefill_chunk=64)
    check_snapkv(cpu, cuda, PROMPT[:200], budget=96, window=16, n_tokens=6, layers=(0, 1))



def test_tiny_adaptive_head_budgets(executor, tiny_models):
    cpu, cuda = load_pair(tiny_models["qwen2-q4_1"], prefill_chunk=64)
    check_adaptive(cpu, cuda, PROMPT[:200], budget=96, window=16, n_tokens=4)

def test_tiny_batched_decode_over_caches_of_different_lengths(executor, tiny_models):
    cpu, cuda = load_pair(tiny_models["qwen2-q4_1"], prefill_chunk=64)
    check_decode_batch(cpu, cuda, [PROMPT[:80], PROMPT[5:15], PROMPT[20:60]])


# -- the default model (SmolLM2-135M Q4_1, Q8_0 head): on the harness, and on a GPU when there is one
CTX = 512
TEXT = ("The history of the lighthouse at Alexandria is told in many sources. Built in the third "
        "century BC, it guided ships into the harbour for centuries. ")
EXECUTORS = [pytest.param("cpu-harness", id=EXECUTOR_IDS["cpu-harness"]),
             pytest.param("device", id=EXECUTOR_IDS["device"], marks=pytest.mark.skipif(
                 "cuda" not in available_backends(), reason="no CUDA device / cupy"))]


@pytest.fixture(scope="module", params=EXECUTORS)
def default_models(request, default_model_path):
    """(cpu, cuda, greedy tokens to compare): the harness takes ~1.5 s per token here."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SHARPI_CUDA_EXECUTOR", request.param)
        cpu, cuda = load_pair(default_model_path, ctx=CTX)
    return cpu, cuda, 6 if request.param == "cpu-harness" else 32


def test_default_model_logits_and_greedy_tokens(default_models):
    cpu, cuda, n = default_models
    check_logits_and_tokens(cpu, cuda, cpu.tokenize(TEXT), n)


def test_default_model_decode_moves_only_the_logits(default_models):
    check_decode_moves_only_the_logits(default_models[1], default_models[1].tokenize(TEXT))


def test_default_model_snapkv_keep_sets_tokens_and_device_cache(default_models):
    cpu, cuda, n = default_models
    ids = cpu.tokenize(TEXT * 8)[:200]
    check_snapkv(cpu, cuda, ids, budget=96, window=16, n_tokens=n // 2,
                 layers=(0, 13, cuda.config.n_layers - 1))


def test_model_that_does_not_fit_is_refused_before_allocating(tiny_models, monkeypatch):
    """check_fits runs before any weight or KV page is allocated, with the numbers (on the
    harness whatever the tests' executor: it fakes the harness's free memory)."""
    from backends.cuda.runtime import HarnessExecutor
    from engine.errors import EngineError
    monkeypatch.setenv("SHARPI_CUDA_EXECUTOR", "cpu-harness")
    monkeypatch.setattr(HarnessExecutor, "free_bytes", lambda self: 100_000)
    allocated = []
    monkeypatch.setattr(HarnessExecutor, "asarray", lambda self, host: allocated.append(host) or host)
    with pytest.raises(EngineError, match=r"does not fit on the CUDA CPU harness: weights \d+ MiB \+ KV cache "
                                          r"for 512 tokens \d+ MiB \+ buffers for a 256-token prefill chunk \d+ MiB "
                                          r"\+ 256 MiB reserve = \d+ MiB, but only 0 MiB are free") as e:
        engine.load(tiny_models["llama-q8"], backend="cuda", ctx=512)
    assert "\n" not in str(e.value) and allocated == []
