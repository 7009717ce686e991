"""End to end on Vulkan: the default model (SmolLM2-135M Q4_1: Q4_1 blocks, a Q8_0
tied embedding/head, F32 norms) against the CPU backend.

Tolerances: last-token logits NMSE < 1e-4 against CPU (f32 accumulation in a
different order through 30 layers; measured ~4e-6), the same argmax, and 32
identical greedy tokens. With SnapKV (budget 96, window 16) on a ~200-token prompt:
per layer and KV head >= 95% of the keep set equal to CPU's (near-ties in votes
may swap), identical greedy tokens after compaction, and the device cache holding
exactly the kept rows of the full cache, bit for bit.
"""
from __future__ import annotations

import numpy as np
import pytest

from _backends import available_backends
from backends.reference import read_rows

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


def greedy(model, ids, n, snapkv=False):
    """Prefill once, then n greedy tokens: (cache, prompt logits, tokens)."""
    cache, logits = model.prefill(ids, snapkv=snapkv)
    first, tokens = logits, []
    for _ in range(n):
        tokens.append(int(np.argmax(logits)))
        logits = model.forward.decode(tokens[-1], cache)
    return cache, first, tokens


def nmse(a, b):
    return float(np.sum((np.asarray(a, np.float64) - b) ** 2) / np.sum(np.asarray(b, np.float64) ** 2))


def test_logits_and_greedy_tokens(models):
    cpu, vk = models
    ids = cpu.tokenize(PROMPT)
    _, lc, tc = greedy(cpu, ids, 32)
    _, lv, tv = greedy(vk, ids, 32)
    assert nmse(lv, lc) < 1e-4
    assert int(np.argmax(lv)) == int(np.argmax(lc))
    assert tv == tc


def test_decode_moves_only_the_logits(models):
    """Per decode token: nothing to the device (token id is a push constant), logits back."""
    _, vk = models
    cache, logits = vk.prefill(vk.tokenize(PROMPT))
    b = vk.backend
    before = (b.bytes_to_device, b.bytes_to_host)
    vk.forward.decode(int(np.argmax(logits)), cache)
    assert b.bytes_to_device - before[0] == 0
    assert b.bytes_to_host - before[1] == 4 * vk.config.vocab_size


def _pool_rows(model, cache, layer, n_rows):
    """f64 [n_kv, n_rows, head_dim] K and V rows of one layer, read back from the device."""
    b = model.backend
    table = np.asarray(cache.layers[layer]._table)
    k = b.download(cache.pool.k_pages)
    v = b.download(cache.pool.v_pages)
    return read_rows(k, table, n_rows), read_rows(v, table, n_rows)


def test_snapkv_keep_sets_tokens_and_device_cache(models):
    from engine.snapkv import SnapKvConfig
    cpu, vk = models
    ids = cpu.tokenize(PROMPT * 8)[:200]
    assert len(ids) == 200
    cfg = SnapKvConfig(budget=96, window=16, min_tokens=32)
    cache_c, _, tc = greedy(cpu, ids, 16, snapkv=cfg)
    cache_v, _, tv = greedy(vk, ids, 16, snapkv=cfg)
    assert cache_v.eviction["rows_after"] == 96
    assert cache_v.length == 96 + 16 and cache_v.logical_length == 200 + 16
    for lc, lv in zip(cache_c.layers, cache_v.layers):
        assert lv.last_keep.shape == lc.last_keep.shape == (vk.config.n_kv_heads, 96)
        for h in range(lv.last_keep.shape[0]):
            same = len(np.intersect1d(lv.last_keep[h], lc.last_keep[h]))
            assert same >= 0.95 * 96, f"keep sets differ beyond ties: {same}/96"
    assert tv == tc                                   # greedy continuation after compaction
    # the compacted device cache holds exactly the kept rows of the full cache
    full, _ = vk.prefill(ids, snapkv=False)
    for layer in (0, 13, vk.config.n_layers - 1):
        keep = cache_v.layers[layer].last_keep
        kf, vf = _pool_rows(vk, full, layer, 200)
        kc, vc = _pool_rows(vk, cache_v, layer, 96)
        for h in range(keep.shape[0]):
            np.testing.assert_array_equal(kc[h], kf[h, keep[h]])
            np.testing.assert_array_equal(vc[h], vf[h, keep[h]])
    # a branched copy (kv_copy_pages on device) reads back the same rows
    branch = cache_v.copy()
    kb, vb = _pool_rows(vk, branch, 0, 96)
    kc, vc = _pool_rows(vk, cache_v, 0, 96)
    np.testing.assert_array_equal(kb, kc)
    np.testing.assert_array_equal(vb, vc)
