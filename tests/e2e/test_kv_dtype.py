"""Quantized KV caches end to end on small random-weight GGUFs: logits near the bf16
cache's, bytes down by the row formats' ratio, SnapKV eviction composed with
quantization, and the settings/API checks (dtype vs backend, vs head_dim)."""
from functools import lru_cache

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

import engine
from backends.kvformat import KvFormat, KvSpec, parse_kv_dtype
from engine.errors import ConfigError
from engine.snapkv import SnapKvConfig
from _backends import available_backends, nmse
from tiny_gguf import write_tiny_gguf

HEAD_DIM = 32
PROMPT = (list(range(3, 200, 2)) * 3)[:150]
# kv dtype -> largest NMSE of the logits against the bf16 cache's (measured ~2e-6, ~1e-3, ~3e-3)
TOLERANCE = {"q8_0": 5e-5, "q4_0": 1e-2, "tq4": 1e-2, "tq3": 3e-2, "q8_0/tq4": 1e-2}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-kv")
    return {
        "llama-q8": write_tiny_gguf(d / "llama.gguf", dim=128, n_heads=4, n_kv_heads=2, qtype=Q.Q8_0, seed=1),
        "qwen2-q4_1": write_tiny_gguf(d / "qwen2.gguf", arch="qwen2", dim=128, n_heads=4, n_kv_heads=2,
                                      qtype=Q.Q4_1, seed=2),
        "gemma3-q8": write_tiny_gguf(d / "gemma3.gguf", arch="gemma3", dim=64, n_heads=4, n_kv_heads=1,
                                     head_dim=32, ffn_dim=128, ctx=1024, qtype=Q.Q8_0, seed=3),
    }


def cpu_kv_dtypes() -> tuple[str, ...]:
    from backends.cpu import CpuBackend
    return tuple(getattr(CpuBackend, "kv_dtypes", ("bf16",)))


@lru_cache(maxsize=1)
def has_vulkan() -> bool:
    return "vulkan" in available_backends()


def load(path, backend, kv_dtype="bf16", **kw):
    if backend == "cpu" and not set(KvSpec.parse(kv_dtype).dtypes) <= set(cpu_kv_dtypes()):
        pytest.skip(f"the CPU backend does not implement KV dtype {kv_dtype} yet (kv_dtypes {cpu_kv_dtypes()})")
    if backend == "vulkan" and not has_vulkan():
        pytest.skip("no Vulkan device / kp")
    return engine.load(path, backend=backend, kv_dtype=kv_dtype, prefill_chunk=64, **kw)


def row_ratio(kv_dtype: str) -> float:
    """Bytes of a K+V row in kv_dtype over bf16's."""
    k, v = (KvFormat.get(d, HEAD_DIM).row_bytes for d in parse_kv_dtype(kv_dtype))
    return (k + v) / (4 * HEAD_DIM)


def policy(**kw):
    base = dict(budget=96, window=16, sinks=4, kernel=5, pool="avg", granularity="head", min_tokens=32)
    return SnapKvConfig(**{**base, **kw})


# Vulkan runs a sample (lavapipe builds a pipeline per dispatch shape, so a model costs
# seconds there); tests/backends/test_ops.py covers every format's kernels on it.
VULKAN_CASES = [("llama-q8", "q4_0"), ("llama-q8", "tq3"), ("llama-q8", "q8_0/tq4"), ("gemma3-q8", "q8_0/tq4")]


@pytest.mark.parametrize("name,kv_dtype,backend",
                         [(name, kv_dtype, backend) for backend in ("reference", "cpu") for kv_dtype in TOLERANCE
                          for name in ("llama-q8", "qwen2-q4_1", "gemma3-q8")]
                         + [(name, kv_dtype, "vulkan") for name, kv_dtype in VULKAN_CASES])
def test_logits_near_bf16_and_bytes_down(models, name, kv_dtype, backend):
    full = load(models[name], backend)
    m = load(models[name], backend, kv_dtype)
    assert m.kv_dtype == kv_dtype and (m.k_dtype, m.v_dtype) == parse_kv_dtype(kv_dtype)
    want_cache, want = full.prefill(PROMPT, snapkv=False)
    cache, got = m.prefill(PROMPT, snapkv=False)
    assert nmse(got, want) < TOLERANCE[kv_dtype]
    tok = int(np.argmax(want))
    assert nmse(m.forward.decode(tok, cache), full.forward.decode(tok, want_cache)) < TOLERANCE[kv_dtype]
    st = m.cache_stats(cache)
    assert st["kv_dtype"] == kv_dtype and cache.length == len(PROMPT) + 1
    assert st["bytes"] == cache.bytes == round(want_cache.bytes * row_ratio(kv_dtype))


@pytest.mark.parametrize("name,backend", [("llama-q8", "reference"), ("qwen2-q4_1", "cpu"), ("gemma3-q8", "cpu"),
                                          ("llama-q8", "vulkan")])
def test_each_layer_runs_in_its_own_formats(models, name, backend):
    """A layer exception ("tq4:0=q8_0": layer 0 in q8_0, the rest in tq4) is what each
    layer's writes, attention, SnapKV votes and merges use: exceptions covering every
    layer give the plain format's logits bit for bit, two spellings of the same layers'
    formats agree bit for bit (caches made from the spellings as given, each with other
    default formats), and a mix equals neither plain format. Its bytes are each layer's
    own, in the stats too; the model names every spelling of a layout one way."""
    m = load(models[name], backend)
    m.forward.page_size = 16                   # small pages, so compaction frees some
    n = m.config.n_layers
    snap = policy(merge=8)

    def run(spelling):
        cache, logits = m.prefill(PROMPT, cache=m.forward.new_cache(spelling), snapkv=snap)
        return cache, logits, m.forward.decode(int(np.argmax(logits)), cache)

    def same(a, b):
        np.testing.assert_array_equal(a[1], b[1])
        np.testing.assert_array_equal(a[2], b[2])

    want = {d: run(d) for d in ("q8_0", "tq4")}
    same(run(f"tq4:0-{n - 1}=q8_0"), want["q8_0"])
    got = run("tq4:0=q8_0")
    same(got, run(f"q8_0:1-{n - 1}=tq4"))
    assert not np.array_equal(got[1], want["q8_0"][1]) and not np.array_equal(got[1], want["tq4"][1])
    cache = got[0]
    assert [s.k_dtype for s in cache.pool.segments] == ["q8_0", "tq4"]
    q8, t4 = (want[d][0].pool.page_bytes for d in ("q8_0", "tq4"))
    assert [layer.pool.page_bytes for layer in cache.layers] == [q8] + [t4] * (n - 1)
    assert cache.bytes == sum(layer.bytes for layer in cache.layers)
    st = m.cache_stats(cache)
    assert st["kv_dtype"] == "tq4:0=q8_0" and [l["kv_dtype"] for l in st["layers"]] == ["q8_0"] + ["tq4"] * (n - 1)
    canonical = "q8_0:1=tq4" if n == 2 else "tq4:0=q8_0"     # the rest: what most layers have
    for spelling in ("tq4:0=q8_0", f"q8_0:1-{n - 1}=tq4", f"tq4:0=q8_0:1-{n - 1}=tq4"):
        assert m.kv_dtype_of(spelling) == canonical
    assert m.kv_dtype_of(f"tq4:0-{n - 1}=q8_0") == "q8_0"


@pytest.mark.parametrize("name,backend", [("llama-q8", "reference"), ("gemma3-q8", "reference"),
                                          ("llama-q8", "cpu"), ("gemma3-q8", "cpu"), ("llama-q8", "vulkan")])
def test_eviction_composes_with_tq4(models, name, backend):
    full = load(models[name], backend)
    m = load(models[name], backend, "tq4")
    for model in (full, m):
        model.forward.page_size = 16            # small pages, so compaction frees some
    cache_bf16, _ = full.prefill(PROMPT, snapkv=policy())
    cache, logits = m.prefill(PROMPT, snapkv=policy())
    ev = cache.eviction
    assert ev["rows_before"] == 150 and ev["rows_after"] == 96 and cache.logical_length == 150
    assert ev["ratio"] == pytest.approx(cache_bf16.eviction["ratio"])          # the same pages freed
    assert ev["bytes_after"] == cache.bytes == round(cache_bf16.bytes * row_ratio("tq4"))
    # the two compressors multiply (llama: every layer goes from ceil(150/16) to ceil(96/16) pages)
    evict_ratio = 10 / 6 if name == "llama-q8" else cache_bf16.eviction["ratio"]
    assert cache_bf16.eviction["bytes_before"] / cache.bytes == pytest.approx(evict_ratio / row_ratio("tq4"))
    assert ev["layers_compacted"] == cache.full_layers
    for i in cache.full_layers:
        layer = cache.layers[i]
        assert layer.length == 96 and layer.last_keep.shape == (m.config.n_kv_heads, 96)
    # keep sets come from votes over the tq4 keys: close to, not necessarily equal to, bf16's
    overlap = np.mean([np.isin(mine, theirs).mean() for i in cache.full_layers
                       for mine, theirs in zip(cache.layers[i].last_keep, cache_bf16.layers[i].last_keep)])
    assert overlap > 0.8
    step = m.forward.decode(int(np.argmax(logits)), cache)
    assert np.isfinite(step).all() and (cache.length, cache.logical_length) == (97, 151)


def offset_keys_model(path):
    """A qwen2 model whose key bias puts large constant offsets on a few channels of each
    KV head (slow RoPE pairs, as Qwen2.5's real keys carry them)."""
    bias = np.zeros(2 * HEAD_DIM, np.float32)
    for h in range(2):
        for c, value in ((14, 40.0), (15, -60.0), (30, 50.0), (31, 30.0)):
            bias[h * HEAD_DIM + c] = value
    names = [f"blk.{i}.attn_k.bias" for i in range(2)]
    return write_tiny_gguf(path, arch="qwen2", dim=128, n_heads=4, n_kv_heads=2, qtype=Q.Q8_0, seed=2,
                           drop=tuple(names), extra_tensors={n: bias for n in names})


@pytest.mark.parametrize("backend", ["reference", "cpu", "vulkan"])
def test_centred_keys_survive_channel_offsets(tmp_path, backend, monkeypatch):
    """Quantized keys are stored less their layer's centre (ForwardPass._key_centre): on
    keys with large per-channel offsets the logits stay near the bf16 cache's, 30-100x
    nearer than the same rows quantized uncentred (measured 4e-4 against 3e-2 to 6e-2
    for the 4-bit types)."""
    path = offset_keys_model(tmp_path / "offsets.gguf")
    _, want = load(path, backend).prefill(PROMPT, snapkv=False)
    for kv_dtype in ("q8_0", "q4_0", "rq4_0", "tq4") if backend != "vulkan" else ("rq4_0",):
        m = load(path, backend, kv_dtype)
        cache, got = m.prefill(PROMPT, snapkv=False)
        assert nmse(got, want) < (1e-4 if kv_dtype == "q8_0" else 2e-3), kv_dtype
        with monkeypatch.context() as mp:
            mp.setattr(type(m.forward), "_key_centre", lambda *a: None)
            _, raw = m.prefill(PROMPT, snapkv=False)
        assert nmse(raw, want) > 20 * nmse(got, want), kv_dtype
        assert all(layer.key_centre is not None for layer in cache.layers)


def test_key_centre_lifecycle(models):
    """bf16 keys have no centre; a quantized layer's is set by the prompt's first write,
    shared by copies and branches (their rows were written with it), kept while the
    layer holds rows and replaced after a release."""
    path = models["qwen2-q4_1"]
    assert all(l.key_centre is None for l in load(path, "reference").prefill(PROMPT[:40], snapkv=False)[0].layers)
    m = load(path, "reference", "q4_0")
    cache, _ = m.prefill(PROMPT[:40], snapkv=False)
    centres = [l.key_centre for l in cache.layers]
    assert all(c is not None and c.shape == (1, m.config.kv_dim) for c in centres)
    assert [l.key_centre for l in cache.copy().layers] == centres
    assert [l.key_centre for l in cache.branch().layers] == centres
    m.forward.decode(5, cache)
    assert [l.key_centre for l in cache.layers] == centres
    cache.release()
    m.prefill(PROMPT[40:90], cache=cache, snapkv=False)
    assert all(mine is not old and not np.array_equal(mine, old) for mine, old in
               zip((l.key_centre for l in cache.layers), centres))


def test_per_call_kv_dtype_and_branching(models):
    m = engine.load(models["llama-q8"], backend="reference", kv_dtype="q8_0/tq4")
    assert m.new_cache().kv_dtype == "q8_0/tq4"
    assert m.new_cache(kv_dtype="tq3").kv_dtype == "tq3"
    r = m.generate(PROMPT[:40], max_tokens=3, ignore_eos=True, kv_dtype="q4_0", snapkv=False)
    assert r.stats["kv_dtype"] == "q4_0" and m.last_cache.kv_dtype == "q4_0"
    cache, _ = m.prefill(PROMPT[:40], snapkv=False)
    assert cache.kv_dtype == "q8_0/tq4" and cache.copy().kv_dtype == "q8_0/tq4"
    with pytest.raises(ConfigError, match="not both"):
        m.prefill(PROMPT[:4], cache=m.new_cache(), kv_dtype="tq4")
    with pytest.raises(ConfigError, match="kv_dtype must be one of"):
        m.new_cache(kv_dtype="fp8")
    with pytest.raises(ConfigError, match=r"names layer 2, but the model has 2 layers \(0-1\)"):
        m.new_cache(kv_dtype="tq4:2=q8_0")
    with pytest.raises(ConfigError, match="names layer 7"):
        engine.load(models["llama-q8"], backend="reference", kv_dtype="tq4:0-7=q8_0")


def test_settings_and_checks(models, tiny_llama, monkeypatch):
    monkeypatch.setenv("SHARPI_KV_DTYPE", "tq4")
    assert engine.load(models["llama-q8"], backend="reference").kv_dtype == "tq4"
    assert engine.load(models["llama-q8"], backend="reference", kv_dtype="bf16").kv_dtype == "bf16"
    monkeypatch.setenv("SHARPI_KV_DTYPE", "int4")
    with pytest.raises(ConfigError, match="SHARPI_KV_DTYPE"):
        engine.load(models["llama-q8"], backend="reference")
    monkeypatch.delenv("SHARPI_KV_DTYPE")
    with pytest.raises(ConfigError, match="q8_0 needs a head_dim divisible by 32, got 16"):
        engine.load(tiny_llama, backend="reference", kv_dtype="q8_0")       # head_dim 16
    from engine.model import kv_spec_for

    class Bf16Only:                     # a backend that implements bf16 rows only
        name, kv_dtypes = "bf16-only", ("bf16",)
    cfg = engine.load(models["llama-q8"], backend="reference").config
    with pytest.raises(ConfigError, match=r"KV dtype q8_0 is not supported on the bf16-only backend \(supported: bf16\)"):
        kv_spec_for("q8_0/tq4", Bf16Only(), cfg)
    assert kv_spec_for("bf16", Bf16Only(), cfg) == KvSpec("bf16", "bf16")


def test_memory_numbers_count_the_dtype(models):
    cfg = engine.load(models["llama-q8"], backend="reference").config
    for kv_dtype in TOLERANCE:
        assert cfg.kv_bytes(512, 64, 64, kv_dtype) == round(cfg.kv_bytes(512, 64, 64) * row_ratio(kv_dtype))
        assert cfg.kv_bytes_per_token(kv_dtype) == round(cfg.kv_bytes_per_token() * row_ratio(kv_dtype))


def test_auto_on_and_memory_check_count_the_dtype(smollm2_path, monkeypatch):
    """SmolLM2-135M at 16K: the bf16 ring (360 MiB) crosses the 256 MiB auto-on line,
    the q8_0 (191 MiB) and tq4 (96 MiB) rings do not; the memory check names the dtype
    and its bytes."""
    from engine import config as config_mod
    from engine.gguf import GgufFile, model_config
    from engine.model import check_context, snapkv_from_settings

    cfg = model_config(GgufFile(smollm2_path))
    for kv_dtype, on in (("bf16", True), ("q8_0", False), ("tq4", False)):
        policy_, notice = snapkv_from_settings(config_mod.Settings(kv_dtype=kv_dtype), cfg, 16384)
        assert (policy_ is not None) == on
        if on:
            assert f"the {kv_dtype} KV cache for 16384 tokens" in notice
    monkeypatch.setattr("engine.model.available_memory_bytes", lambda: 2**20)
    with pytest.raises(engine.EngineError, match=r"needs a 96 MiB tq4 KV cache \(6120 bytes per token\)"):
        check_context(cfg, 16384, True, object(), 0, chunk=256, kv_dtype="tq4")
