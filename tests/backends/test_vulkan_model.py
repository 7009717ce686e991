"""End to end on Vulkan: SmolLM2-135M Q4_1 (the tests' model: Q4_1 blocks, a Q8_0
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

from engine.snapkv import SnapKvConfig

from _backends import available_backends, vulkan_reporting
from _model_checks import (check_adaptive, check_decode_batch, check_decode_moves_only_the_logits,
                           check_logits_and_tokens, check_snapkv)

pytestmark = pytest.mark.skipif("vulkan" not in available_backends(), reason="no Vulkan device / kp")

CTX = 512
PROMPT = ("The history of the lighthouse at Alexandria is told in many sources. Built in the third "
          "century BC, it guided ships into the harbour for centuries. ")


@pytest.fixture(scope="module")
def models(smollm2_path):
    import engine

    vk = engine.load(smollm2_path, backend="vulkan", ctx=CTX, snapkv_budget=0)
    cpu = engine.load(smollm2_path, backend="cpu", ctx=CTX, snapkv_budget=0)
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



def test_adaptive_head_budgets(models):
    cpu, vk = models
    check_adaptive(cpu, vk, cpu.tokenize(PROMPT * 8)[:80], budget=48, window=16, n_tokens=4)

def test_batched_decode_over_caches_of_different_lengths(models):
    cpu, vk = models
    ids = cpu.tokenize(PROMPT * 8)
    check_decode_batch(cpu, vk, [ids[:40], ids[:9], ids[30:50]], n_steps=2, tol=1e-4)


def test_decode_counters_per_token(models):
    """72 decode tokens from a ~30-token prompt (crossing the page boundary at row 64):
    one queue submission per token (the logits copy rides with the compute), no
    pipeline created after the first token (page tables are updated in place, so the
    pipelines that bind them stay cached), and host<->device traffic of the logits plus
    the page tables' few ints when a page is added, plus each token's step buffer (the
    token, its position and two ints per layer) where decode replays a recorded step
    (engine/replay.py: the default; the first decode token recorded it)."""
    vk = models[1]
    b, cfg = vk.backend, vk.config
    cache, logits = vk.prefill(vk.tokenize(PROMPT))
    token = int(np.argmax(vk.forward.decode(int(np.argmax(logits)), cache)))     # warm-up
    start_rows = cache.length
    before = (b.submissions, b.algorithms_created, b.bytes_to_device, b.bytes_to_host)
    n = 72
    for _ in range(n):
        token = int(np.argmax(vk.forward.decode(token, cache)))
    assert start_rows < 64 < cache.length
    assert b.submissions - before[0] == n
    assert b.algorithms_created - before[1] == 0
    table_bytes = 4 * -(-CTX // 64)                      # one layer's page table
    step_bytes = 4 * (2 + 2 * cfg.n_layers) if vk.forward.replay is not None else 0
    assert vk.forward.replay is not None and vk.forward.replay.stats["replays"] >= n
    assert b.bytes_to_device - before[2] == cfg.n_layers * table_bytes + n * step_bytes   # tables at row 64
    assert b.bytes_to_host - before[3] == n * 4 * cfg.vocab_size


def test_decode_counters_per_token_with_ragged_heads(models):
    """The same counters with adaptive head budgets (each KV head attended by its own
    call over its own table): one submission per token, no algorithm created as heads
    take new slots of their layers' pages (their tables are updated in place)."""
    vk = models[1]
    b = vk.backend
    cfg = SnapKvConfig(budget=48, window=16, min_tokens=32, allocation="adaptive")
    cache, logits = vk.prefill(vk.tokenize(PROMPT * 8)[:80], snapkv=cfg)
    token = int(np.argmax(vk.forward.decode(int(np.argmax(logits)), cache)))     # warm-up
    rows = np.concatenate([l.head_len for l in cache.layers if l.ragged])
    before = (b.submissions, b.algorithms_created, b.bytes_to_host)
    n = 40
    for _ in range(n):
        token = int(np.argmax(vk.forward.decode(token, cache)))
    assert rows.size and ((rows % 64) + n >= 64).any()          # some head took a new slot
    assert (b.submissions - before[0], b.algorithms_created - before[1]) == (n, 0)
    assert b.bytes_to_host - before[2] == n * 4 * vk.config.vocab_size


def test_a_new_cache_compiles_no_pipeline(models):
    """Pipelines are compiled once per shader variant (kp patched by
    tools/kp-0.9.0.patch) and shared by the algorithms that bind other buffers: after
    one prompt and two decode tokens, another prompt on a fresh cache (new KV pages, new
    page tables, so new algorithms) and its first decode tokens compile nothing. Before,
    lavapipe compiled ~250 pipelines (7-8 s) before the first decoded token."""
    vk = models[1]
    b = vk.backend
    assert b.pipelines_compiled is not None, "kp built without tools/kp-0.9.0.patch: run make setup"
    ids = vk.tokenize(PROMPT)
    for _ in range(2):
        before = (b.pipelines_compiled, b.algorithms_created)
        cache, logits = vk.prefill(ids)
        token = int(np.argmax(logits))
        for _ in range(2):
            token = int(np.argmax(vk.forward.decode(token, cache)))
    assert b.algorithms_created > before[1]
    assert b.pipelines_compiled == before[0]


def test_cpu_device_reads_weights_64_bits_at_a_time(models):
    """On a CPU device (lavapipe supports shaderInt64, which the patched kp enables) the
    default model's q4_1 layer weights and q8_0 embedding/head are stored padded for
    64-bit loads, the mat-vec layout that halves the loads lavapipe makes lane by lane."""
    vk = models[1]
    b = vk.backend
    if not b.matmul_cpu_layout:
        pytest.skip("not a CPU Vulkan device")
    assert b.shader_int64, "kp built without tools/kp-0.9.0.patch's shaderInt64: run make setup"
    w = vk.forward.weights
    assert w.token_embd.padded and all(wt.padded for lw in w.layers for wt, _, _ in lw.qkv)


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


def test_a_small_buffer_range_splits_kv_pools_and_weights(monkeypatch, models, smollm2_path):
    """A device whose shader bindings cover 1 MiB (maxStorageBufferRange, simulated on
    lavapipe; real devices guarantee only 128 MiB): the KV pool goes into buffers of whole
    layers, each within the range, the 28 MiB embedding/head into row ranges, and the
    logits and greedy tokens are the CPU's. One layer's pages over the range fail in one
    line naming the limit."""
    import engine
    from engine.errors import BackendUnavailable
    vulkan_reporting(monkeypatch, max_storage_buffer_range=1 << 20)
    # prefill chunks of 64 tokens: their largest buffer (gate and up, 768 KiB) within the range
    small = engine.load(smollm2_path, backend="vulkan", ctx=CTX, snapkv_budget=0, prefill_chunk=64)
    cache = small.new_cache()
    per_layer = CTX * small.config.n_kv_heads * small.config.head_dim * 2        # bf16 K of one layer
    assert len(cache.pool.segments) == -(-small.config.n_layers // ((1 << 20) // per_layer))
    assert all(4 * a.buffer.n_words <= 1 << 20 for s in cache.pool.segments for a in (s.k_pages, s.v_pages))
    check_logits_and_tokens(models[0], small, models[0].tokenize(PROMPT), 4, tol=1e-4)
    big = engine.load(smollm2_path, backend="vulkan", ctx=4096, snapkv_budget=0, prefill_chunk=64)
    with pytest.raises(BackendUnavailable, match=r"one layer's KV pages need a 2 MiB buffer, .* \(1 MiB: "
                                                 r"maxStorageBufferRange"):
        big.generate("hi", max_tokens=1)
    with pytest.raises(engine.EngineError, match=r"a prefill chunk of 256 tokens needs a 3 MiB buffer, more "
                                                 r"than one shader binding .*--prefill-chunk"):
        engine.load(smollm2_path, backend="vulkan", ctx=CTX, snapkv_budget=0)


def test_gpu_buffers_live_in_device_memory_only(monkeypatch, models, smollm2_path):
    """With device-local buffers and split decode attention (a GPU's; forced on lavapipe),
    every buffer larger than 64 KiB (weights, the KV pool, activations, the logits) lives
    in device memory only, with no host staging copy of the model and the cache; uploads
    and read-backs go through transient host buffers, and the logits, greedy tokens and
    per-token counters (one submission, no new pipeline, the logits back) are as on CPU."""
    import backends
    import engine
    from backends.vulkan import backend as mod

    def gpu_style(name="cpu", threads=None, quiet=False, auto_gpu_only=False):
        b = mod.VulkanBackend(device_local=True)
        b.decode_lanes, b.decode_splits = False, mod.shaders.DECODE_SPLITS   # a GPU's split decode too
        backends.check_complete(b)
        return b

    monkeypatch.setattr(backends, "get_backend", gpu_style)
    gpu = engine.load(smollm2_path, backend="vulkan", ctx=CTX, snapkv_budget=0)
    b = gpu.backend
    assert b._ttype == mod.kp.TensorTypes.device
    w = gpu.forward.weights
    assert all(buf.device_only for _, _, buf in w.token_embd.parts)
    assert w.output_norm.buffer.n_words * 4 <= mod.STAGED_MAX_BYTES and not w.output_norm.buffer.device_only
    cache = gpu.new_cache()
    table = cache.layers[0].page_table()
    assert all(a.buffer.device_only for s in cache.pool.segments for a in (s.k_pages, s.v_pages))
    assert not table.buffer.device_only                    # small: keeps its staging copy
    check_logits_and_tokens(models[0], gpu, models[0].tokenize(PROMPT), 4, tol=1e-4)
    cache, logits = gpu.prefill(gpu.tokenize(PROMPT))
    token = int(np.argmax(gpu.forward.decode(int(np.argmax(logits)), cache)))       # warm-up
    before = (b.submissions, b.algorithms_created, b.bytes_to_host)
    for _ in range(4):
        token = int(np.argmax(gpu.forward.decode(token, cache)))
    assert (b.submissions - before[0], b.algorithms_created - before[1]) == (4, 0)
    assert b.bytes_to_host - before[2] == 4 * 4 * gpu.config.vocab_size
