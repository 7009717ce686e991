"""Gemma 3 on small random-weight GGUFs: the graph against a plain numpy oracle,
CPU vs the numpy reference, prefill chunking across the sliding window, SnapKV
(global layers only) and the memory sliding-window layers hold.

The tiny model has 6 layers (llama.cpp's fixed pattern: layer 5 global, 0-4 local),
head_dim 32 != dim / n_heads (as the real 270m: 256 vs 160), one KV head and a
window of 16 positions."""
import math

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

import engine
from backends.bf16 import bf16_to_f32, f32_to_bf16
from engine.gguf import GgufFile
from engine.kv.paged import layer_pages
from engine.snapkv import SnapKvConfig
from _backends import available_backends, nmse
from tiny_gguf import GEMMA3_SLIDING_WINDOW as WINDOW, STEPS_AGREE, write_tiny_gguf

GLOBAL = 5                                      # (il + 1) % 6 == 0
PROMPT = list(range(3, 200, 2)) * 3             # 297 token ids


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("gemma3")
    shape = dict(arch="gemma3", dim=64, n_heads=4, n_kv_heads=1, head_dim=32, ffn_dim=128, ctx=1024)
    return {
        "f32": write_tiny_gguf(d / "gemma3.gguf", **shape),
        "q8": write_tiny_gguf(d / "gemma3-q8.gguf", qtype=Q.Q8_0, seed=1, **shape),
    }


def oracle_logits(path, ids) -> np.ndarray:
    """The Gemma 3 graph written out in float64 numpy, independent of engine.forward:
    f64 [n, vocab] logits of every position. K and V are rounded to bf16, as the cache
    stores them."""
    g = GgufFile(path)

    def t(name):
        info = g.tensors[name]
        return np.asarray(dequantize(info.raw, info.qtype), np.float64).reshape(info.shape)

    dim, n_layers = 64, 6
    n_heads, head_dim, eps = 4, 32, 1e-5
    base_global = g.get("gemma3.rope.freq_base")
    assert g.get("gemma3.attention.sliding_window") == WINDOW

    def norm(x, w):                               # over the last axis
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w.reshape(-1)

    def rope_neox(x, pos, base):                  # x [n, heads, head_dim]
        half = head_dim // 2
        angle = pos[:, None] * base ** (-2.0 * np.arange(half) / head_dim)   # [n, half]
        cos, sin = np.cos(angle)[:, None], np.sin(angle)[:, None]
        x0, x1 = x[..., :half], x[..., half:]
        return np.concatenate([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1)

    def bf16(x):
        return bf16_to_f32(f32_to_bf16(x.astype(np.float32))).astype(np.float64)

    n = len(ids)
    pos = np.arange(n, dtype=np.float64)
    x = t("token_embd.weight")[ids] * math.sqrt(dim)
    for il in range(n_layers):
        p = f"blk.{il}."
        is_global = (il + 1) % 6 == 0
        h = norm(x, t(p + "attn_norm.weight"))
        q = (h @ t(p + "attn_q.weight").T).reshape(n, n_heads, head_dim)
        k = (h @ t(p + "attn_k.weight").T).reshape(n, 1, head_dim)
        v = (h @ t(p + "attn_v.weight").T).reshape(n, 1, head_dim)
        q, k = norm(q, t(p + "attn_q_norm.weight")), norm(k, t(p + "attn_k_norm.weight"))
        base = base_global if is_global else 10000.0
        q, k = rope_neox(q, pos, base), bf16(rope_neox(k, pos, base))
        v = bf16(v)
        i, j = np.arange(n)[:, None], np.arange(n)[None, :]
        visible = (j <= i) & (is_global | (i - j < WINDOW))                     # [n, n]
        s = np.einsum("qhd,kd->hqk", q, k[:, 0]) / math.sqrt(head_dim)
        s = np.where(visible, s, -np.inf)
        w = np.exp(s - s.max(axis=-1, keepdims=True))
        w /= w.sum(axis=-1, keepdims=True)
        o = np.einsum("hqk,kd->qhd", w, v[:, 0]).reshape(n, n_heads * head_dim)
        x = x + norm(o @ t(p + "attn_output.weight").T, t(p + "post_attention_norm.weight"))
        h = norm(x, t(p + "ffn_norm.weight"))
        gate, up = h @ t(p + "ffn_gate.weight").T, h @ t(p + "ffn_up.weight").T
        act = 0.5 * gate * (1 + np.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate ** 3))) * up
        x = x + norm(act @ t(p + "ffn_down.weight").T, t(p + "post_ffw_norm.weight"))
    return norm(x, t("output_norm.weight")) @ t("token_embd.weight").T


def test_config_reads_the_window_pattern(models):
    m = engine.load(models["f32"], backend="reference")
    c = m.config
    assert c.sliding_window == WINDOW and c.head_dim == 32 and c.q_dim == 128
    assert c.layer_windows == (WINDOW,) * 5 + (0,)
    assert [c.layer_rope_base(i) for i in (0, GLOBAL)] == [10000.0, 1000000.0]
    assert c.kv_bytes_per_token() == 1 * 2 * 32 * 2          # the global layer only


def test_reference_matches_numpy_oracle(models):
    """Prompt of 60 positions, window 16: local layers really slide."""
    ids = PROMPT[:60]
    m = engine.load(models["f32"], backend="reference", prefill_chunk=64)
    got = m.forward.prefill(ids, m.new_cache(), all_logits=True)
    assert nmse(got, oracle_logits(models["f32"], ids)) < 1e-9


@pytest.mark.parametrize("name", ["f32", "q8"])
def test_cpu_matches_reference(models, name):
    ref = engine.load(models[name], backend="reference", prefill_chunk=64)
    cpu = engine.load(models[name], backend="cpu", prefill_chunk=64)
    ids = PROMPT[:150]
    assert nmse(cpu.logits(ids), ref.logits(ids)) < 1e-6
    ra = cpu.generate(ids, max_tokens=12, ignore_eos=True)
    rb = ref.generate(ids, max_tokens=12, ignore_eos=True)
    assert ra.tokens == rb.tokens


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_prefill_chunking_and_token_by_token_agree(models, backend):
    """Chunks of 7 and of 1 cross the window boundary at every offset."""
    ids = PROMPT[:70]
    whole = engine.load(models["q8"], backend=backend, prefill_chunk=256).logits(ids)
    chunked = engine.load(models["q8"], backend=backend, prefill_chunk=7).logits(ids)
    one_by_one = engine.load(models["q8"], backend=backend, prefill_chunk=1).logits(ids)
    np.testing.assert_allclose(chunked, whole, **STEPS_AGREE)
    np.testing.assert_allclose(one_by_one, whole, **STEPS_AGREE)


def test_decode_continues_a_cache(models):
    m = engine.load(models["q8"], backend="cpu", prefill_chunk=32)
    cache, logits = m.prefill(PROMPT[:40])
    token = int(np.argmax(logits))
    step = m.forward.decode(token, cache)
    np.testing.assert_allclose(step, m.logits(PROMPT[:40] + [token]), **STEPS_AGREE)


# -- SnapKV -------------------------------------------------------------------------------

def policy(**kw):
    base = dict(budget=48, window=8, sinks=4, kernel=5, pool="avg", granularity="head", min_tokens=32)
    base.update(kw)
    return SnapKvConfig(**base)


@pytest.mark.parametrize("granularity", ["head", "global"])
def test_snapkv_compacts_global_layers_only(models, granularity):
    m = engine.load(models["q8"], backend="cpu", prefill_chunk=64)
    m.forward.page_size = 16
    cache, _ = m.prefill(PROMPT[:200], snapkv=policy(granularity=granularity))
    st = m.cache_stats()
    ev = st["eviction"]
    assert ev["layers_compacted"] == [GLOBAL] and ev["rows_before"] == 200 and ev["rows_after"] == 48
    for i, layer in enumerate(st["layers"]):
        assert layer["logical_length"] == 200
        if i == GLOBAL:
            assert layer["length"] == 48 and layer["pages"] == 3 and layer["keep"].shape == (1, 48)
            assert (layer["keep"][:, -8:] == np.arange(192, 200)).all()
        else:                                   # local layers keep their window, untouched
            assert layer["window"] == WINDOW and layer["keep"] is None and layer["length"] == 200
            # folded after the prefill: one page of 16 rows, the window's exactly (rows 184..199)
            assert layer["first_row"] == 200 - WINDOW and layer["pages"] == 1
    page_bytes = 2 * 1 * 16 * 32 * 2
    local_bytes = 5 * st["layers"][0]["pages"] * page_bytes
    assert ev["bytes_before"] == local_bytes + 13 * page_bytes          # ceil(200 / 16) global pages
    assert ev["bytes_after"] == local_bytes + 3 * page_bytes == cache.bytes
    m.forward.decode(5, cache)
    assert cache.layers[GLOBAL].length == 49 and cache.layers[0].length == 201
    assert cache.length == 49 and cache.logical_length == 201


def test_decode_after_compaction_equals_masked_full_attention(models):
    """Logits after eviction equal a full-cache run whose global layer is compacted by
    hand to the same keep set (local layers identical in both)."""
    m = engine.load(models["f32"], backend="reference", prefill_chunk=64)
    ids = PROMPT[:120]
    cache, logits = m.prefill(ids, snapkv=policy())
    keep = cache.layers[GLOBAL].last_keep
    token = int(np.argmax(logits))
    evicted = m.forward.decode(token, cache)
    full, _ = m.prefill(ids, snapkv=False)
    full.layers[GLOBAL].compact(keep)
    np.testing.assert_allclose(m.forward.decode(token, full), evicted, rtol=1e-6, atol=1e-6)


def test_merged_rows_through_the_model_cpu_equals_reference(models):
    """SnapKV with 8 of its 48 rows merged: the global layer holds 40 kept + 8 merged
    rows whose log-counts add up to the 160 dropped rows; decode and a continued
    prompt (prefill attention over the merged rows) give the reference's logits on
    the CPU, and differ from plain SnapKV's."""
    ids, more = PROMPT[:200], PROMPT[200:230]
    runs = {}
    for backend in ("cpu", "reference"):
        m = engine.load(models["q8"], backend=backend, prefill_chunk=64)
        m.forward.page_size = 16
        cache, logits = m.prefill(ids, snapkv=policy(merge=8))
        layer = cache.layers[GLOBAL]
        assert layer.length == 48 and layer.row_bias.shape == (1, 48)
        np.testing.assert_allclose(np.exp(layer.row_bias.astype(np.float64)).sum(), 200, rtol=1e-5)
        token = int(np.argmax(logits))
        step = m.forward.decode(token, cache)
        cont = m.forward.prefill(more, cache, all_logits=True)
        runs[backend] = (step, cont)
    # k-means runs on each backend's keys, which differ in their last bits: measured
    # 9e-6 and 6e-5, against 4e-3 between merged and plain SnapKV
    assert nmse(runs["cpu"][0], runs["reference"][0]) < 2e-4
    assert nmse(runs["cpu"][1], runs["reference"][1]) < 2e-4
    plain, logits = m.prefill(ids, snapkv=policy())
    assert nmse(m.forward.decode(token, plain), runs["reference"][0]) > 2e-3


def test_local_layer_memory_is_bounded_at_a_long_prompt(models):
    """A 900-token prompt in chunks of 32 (ctx 1024, pages of 16): each local layer never
    holds more than its planned ceil((16 - 1 + 32) / 16) + 1 = 4 pages, the pool is sized
    for exactly that, what a local layer holds does not grow with the prompt, and
    decoding it holds one page: its window of 16 rows."""
    m = engine.load(models["q8"], backend="cpu", prefill_chunk=32, snapkv=False)
    m.forward.page_size = 16
    cache = m.new_cache()
    assert cache.pool.n_pages == 5 * 4 + 1024 // 16
    assert cache.pool.n_pages * cache.pool.page_bytes == m.config.kv_bytes(1024, 32, 16)
    most = []
    m.prefill((PROMPT * 4)[:900], cache=cache,
              progress=lambda done, total: most.append(max(len(l.pages) for l in cache.layers[:GLOBAL])))
    assert len(most) == -(-900 // 32) and max(most) <= layer_pages(1024, 16, WINDOW, 32) == 4
    page = cache.pool.page_bytes
    assert cache.layers[GLOBAL].bytes == -(-900 // 16) * page
    for _ in range(40):
        m.forward.decode(7, cache)
        assert max(l.n_pages for l in cache.layers[:GLOBAL]) == 1     # a ring of one page: the window
    # rows 924..939 span table entries 57 and 58, one page shared
    assert all(len(l.pages) == 2 and l.n_pages == 1 and l.first_row == 940 - WINDOW for l in cache.layers[:GLOBAL])
    assert cache.bytes == (-(-940 // 16) + 5) * page


RING_BACKENDS = ["reference", "cpu"] + [b for b in ("vulkan", "cuda-harness") if b in available_backends()]


@pytest.mark.parametrize("backend", RING_BACKENDS)
def test_local_layers_cycle_a_ring_of_pages(models, backend, monkeypatch):
    """Pages of 8 rows, window 16: a chunked prefill leaves each local layer spanning 3
    pages, folded to its ring of 2 (16 rows, the window exactly); decode steps write
    into the ring; a prompt continued from the folded cache (multi-row steps) first
    copies the page it writes. The logits of every step equal the float64 oracle's."""
    if backend == "cuda-harness":
        monkeypatch.setenv("SHARPI_CUDA_EXECUTOR", "cpu-harness")
    m = engine.load(models["f32"], backend=backend.split("-")[0], prefill_chunk=12, snapkv=False)
    m.forward.page_size = 8
    ids = PROMPT[:80]
    want = oracle_logits(models["f32"], ids)                   # causal: row i is the logits after ids[:i+1]
    local = [l for l in m.new_cache().layers if l.window]
    assert local and all(l.ring == 2 for l in local)
    cache, got = m.prefill(ids[:61])                           # rows 45..60 visible next: table entries 5..7
    local = [l for l in cache.layers if l.window]
    assert all(l.n_pages == 2 and len(l.pages) == 3 and l.first_row == 61 - WINDOW for l in local)
    outs = [got]
    for t in ids[61:65]:                                       # decode: the ring takes each row
        outs.append(m.forward.decode(t, cache))
        assert all(l.n_pages == 2 for l in local)
    assert all(l.pages[-1] == l.pages[-3] for l in local)      # entry 8 shares entry 6's page
    outs.append(m.forward.prefill(ids[65:77], cache))          # one 12-row step on the ring, folded after
    assert all(l.n_pages == 2 and l.first_row == 77 - WINDOW for l in local)
    for t in ids[77:80]:
        outs.append(m.forward.decode(t, cache))
    rows = [60, 61, 62, 63, 64, 76, 77, 78, 79]
    assert nmse(np.stack(outs), want[rows]) < 1e-6
    free = cache.pool.free_pages
    assert free == cache.pool.n_pages - sum(l.n_pages for l in cache.layers)


def test_auto_policy_counts_what_is_held(models):
    """The SnapKV auto-on threshold and the context check use the bytes really held:
    local layers count their window + chunk, not the context."""
    m = engine.load(models["f32"], backend="reference", prefill_chunk=64)
    c = m.config
    ctx = 1024
    all_global = c.n_layers * 2 * c.kv_dim * 2 * ctx
    held = c.kv_bytes(ctx, 64, 64)
    assert held == (1024 // 64 + 5 * layer_pages(ctx, 64, WINDOW, 64)) * 64 * 2 * c.kv_dim * 2
    assert held < all_global / 2


def test_bad_gemma3_files_are_refused_with_every_problem(tmp_path):
    from gguf import GGUFValueType as T

    from engine.errors import ModelFileError
    from engine.gguf import model_config

    bad = write_tiny_gguf(tmp_path / "bad.gguf", arch="gemma3", dim=64, n_heads=4, n_kv_heads=1, head_dim=32,
                          metadata={"{arch}.attention.sliding_window": ("16", T.STRING)})
    with pytest.raises(ModelFileError, match=r"gemma3.attention.sliding_window is a string"):
        model_config(GgufFile(bad))
    missing = write_tiny_gguf(tmp_path / "missing.gguf", arch="gemma3", dim=64, n_heads=4, n_kv_heads=1,
                              head_dim=32, drop=("blk.2.attn_k_norm.weight", "blk.5.post_ffw_norm.weight"))
    with pytest.raises(ModelFileError, match=r"missing tensor blk.2.attn_k_norm.weight; "
                                             r"missing tensor blk.5.post_ffw_norm.weight"):
        model_config(GgufFile(missing))
    no_window = write_tiny_gguf(tmp_path / "nowin.gguf", arch="gemma3", dim=64, n_heads=4, n_kv_heads=1,
                                head_dim=32, sliding_window=0)
    assert model_config(GgufFile(no_window)).layer_windows == (0,) * 6     # llama.cpp: no window, all global
