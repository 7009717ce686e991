"""The CUDA host layer's per-token work, counted without a GPU (issue 35): the real
CudaBackend and op modules over tools/bench_host.py's no-op executor (launches count
themselves, arrays are numpy). Without replay a decode token makes the same launches
every token; with it (engine/replay.py) the first token's launches are recorded and every
later token is one graph launch and no kernel launch from Python. After the first decode
token no kernel function is looked up again (runtime.py keeps each function object per
(file, name, defines))."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from engine.model_path import smollm2_model_path
from tiny_gguf import write_tiny_gguf

ROOT = Path(__file__).resolve().parents[2]


def _bench_host():
    spec = importlib.util.spec_from_file_location("bench_host", ROOT / "tools" / "bench_host.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bench_host = _bench_host()


def _check_steady(m, tokens: int = 6, prompt: int = 128):
    r = bench_host.run(m, tokens, prompt)
    assert r["launches"][0] > m.config.n_layers * 5
    if m.forward.replay is None:
        assert len(set(r["launches"])) == 1, r["launches"]       # every decode token alike
        assert r["graphs"] == [0] * tokens
    else:                                                         # recorded once, then replayed
        assert r["launches"][1:] == [0] * (tokens - 1), r["launches"]
        assert r["graphs"] == [0] + [1] * (tokens - 1), r["graphs"]
        assert m.forward.replay.stats == {"recordings": 1, "replays": tokens - 1}
    assert r["lookups"][1:] == [0] * (tokens - 1), r["lookups"]   # looked up once, never per launch
    return r


@pytest.mark.parametrize("replay", ["on", "off"])
def test_tiny_model_decode_launches_steady_and_no_lookups(tmp_path, replay):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", qtype=Q.Q8_0, seed=1)
    m = bench_host.load(str(path), ctx=256, replay=replay)
    assert m.backend.name == "cuda" and m.backend.ex.name == "null"
    assert (m.forward.replay is not None) == (replay == "on")
    _check_steady(m)


@pytest.mark.skipif(smollm2_model_path() is None, reason="smollm2 not installed")
@pytest.mark.parametrize("replay", ["on", "off"])
def test_smollm2_decode_launches_steady_and_no_lookups(replay):
    m = bench_host.load("smollm2", ctx=256, replay=replay)
    r = _check_steady(m)
    assert r["launches"][0] == 274          # 30 layers: 9 per layer (the gate inside the down projection:
                                            # gated_matmul; RoPE inside the K/V write: rope_kv_write)
                                            # + embedding, final add, norm, head


def test_function_is_a_dict_hit_for_every_spelling_of_defines():
    ex = bench_host.NullExecutor()
    fn = ex.function("matmul.cu", "matvec", ("QTYPE_Q8_0",))
    assert ex.function("matmul.cu", "matvec", ("QTYPE_Q8_0",)) is fn
    assert ex.function("matmul.cu", "matvec", ["QTYPE_Q8_0"]) is fn
    assert ex.function("matmul.cu", "dequant_rows", ("QTYPE_Q8_0",)) is not fn
    assert ex.counts.snapshot()[1:3] == (2, 1)   # two get_function calls, one module built
    fn((1,), (32,), (np.zeros(1),))
    assert ex.counts.launches == 1


def test_recorded_decode_attention_covers_every_length_it_replays():
    """The splits a recorded decode step launches serve every row count its page table
    holds: recorded at 16,384 rows of a 20,032-row table (Qwen2.5's 14/2 heads), the split
    kernel's grid has the 256 splits the kernel works out at 16,384 rows (the table's own
    rounded count, 254, left rows 16,256.. unattended)."""
    from backends.cuda import attention
    ex = bench_host.NullExecutor()
    n_q, n_kv, head_dim, page_size, capacity, n_rows = 14, 2, 64, 64, 20_032, 16_384
    pages = np.zeros((capacity // page_size + 1, n_kv, page_size, head_dim), np.uint16)
    table = np.arange(capacity // page_size, dtype=np.int32)
    q, out = np.zeros((1, n_q * head_dim), np.float32), np.zeros((1, n_q * head_dim), np.float32)
    step = np.array([n_rows], np.int32)
    ex.begin_recording()
    attention.attention_decode(ex, q, pages, pages, table, n_rows, n_q, 0.125, out, step=(step, 0))
    launches = {fn.name: grid for fn, grid, *_ in ex.end_recording().launches}
    want = attention.decode_geometry(n_rows, n_q, n_kv)[2]
    assert want == 256 and launches["attention_decode_split"][1] >= want
