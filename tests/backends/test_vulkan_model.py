"""End to end on Vulkan: the default model (SmolLM2-135M Q4_1: Q4_1 blocks, a Q8_0
tied embedding/head, F32 norms) against the CPU backend.

Tolerances (checks in _model_checks.py): last-token logits NMSE < 1e-4 against
CPU (f32 accumulation in a different order through 30 layers; measured ~4e-6),
the same argmax, and 8 identical greedy tokens. With SnapKV (budget 48, window
16) on an 80-token prompt (lavapipe prefills ~5 tokens/s): per layer and KV head
>= 95% of the keep set equal to CPU's (near-ties in votes may swap), 4 identical
greedy tokens after compaction, and the device cache holding exactly the kept rows
of the full cache, bit for bit.
"""
from __future__ import annotations

import numpy as np
import pytest

from _backends import available_backends
from _model_checks import (check_decode_batch, check_decode_moves_only_the_logits, check_logits_and_tokens,
                           check_snapkv)

pytestmark = pytest.mark.skipif("vulkan" not in available_backends(), reason="no Vulkan device / kp")

CTX = 512
PROMPT = ("The history of the lighthouse at Alexandria is told in many sources. Built in the third "
          "century BC, it guided ships into the harbour for centuries. ")


@pytest.fixture(scope="module")
def models(default_model_path):
    import engine

    vk = engine.load(default_model_path, backend="vulkan", ctx=CTX, snapkv_budget=0)
    cpu = engine.load(default_model_path, backend="cpu", ctx=CTX, snapkv_budget=0)
    assert vk.backend.name == "vulkan"
    return cpu, vk


def test_logits_and_greedy_tokens(models):
    cpu, vk = models
    check_logits_and_tokens(cpu, vk, cpu.tokenize(PROMPT), 8, tol=1e-4)


def test_decode_moves_only_the_logits(models):
    check_decode_moves_only_the_logits(models[1], models[1].tokenize(PROMPT))


def test_snapkv_keep_sets_tokens_and_device_cache(models):
    cpu, vk = models
    ids = cpu.tokenize(PROMPT * 8)[:80]
    assert len(ids) == 80
    check_snapkv(cpu, vk, ids, budget=48, window=16, n_tokens=4, layers=(0, 13, vk.config.n_layers - 1))


def test_batched_decode_over_caches_of_different_lengths(models):
    cpu, vk = models
    ids = cpu.tokenize(PROMPT * 8)
    check_decode_batch(cpu, vk, [ids[:40], ids[:9], ids[30:50]], n_steps=2, tol=1e-4)


def test_decode_counters_per_token(models):
    """72 decode tokens from a ~30-token prompt (crossing the page boundary at row 64):
    one queue submission per token (the logits copy rides with the compute), no
    pipeline created after the first token (page tables are updated in place, so the
    pipelines that bind them stay cached), and host<->device traffic of the logits plus
    the page tables' few ints when a page is added."""
    vk = models[1]
    b, cfg = vk.backend, vk.config
    cache, logits = vk.prefill(vk.tokenize(PROMPT))
    token = int(np.argmax(vk.forward.decode(int(np.argmax(logits)), cache)))     # warm-up
    start_rows = cache.length
    before = (b.submissions, b.pipelines_created, b.bytes_to_device, b.bytes_to_host)
    n = 72
    for _ in range(n):
        token = int(np.argmax(vk.forward.decode(token, cache)))
    assert start_rows < 64 < cache.length
    assert b.submissions - before[0] == n
    assert b.pipelines_created - before[1] == 0
    table_bytes = 4 * -(-CTX // 64)                      # one layer's page table
    assert b.bytes_to_device - before[2] == cfg.n_layers * table_bytes   # once, at row 64
    assert b.bytes_to_host - before[3] == n * 4 * cfg.vocab_size


def test_prefill_submits_every_chunk(models):
    """A prompt of 3 chunks is at least 3 submissions (none runs for the whole prompt,
    which an OS GPU watchdog would reset), with the logits of one chunk."""
    vk = models[1]
    ids = vk.tokenize(PROMPT * 2)[:40]
    _, whole = vk.prefill(ids)
    fwd, chunk = vk.forward, vk.forward.chunk
    try:
        fwd.chunk = 16
        before = vk.backend.submissions
        _, chunked = vk.prefill(ids)
        assert vk.backend.submissions - before >= 3
    finally:
        fwd.chunk = chunk
    np.testing.assert_allclose(chunked, whole, rtol=1e-4, atol=1e-4)
