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
