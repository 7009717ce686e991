"""tools/gpu_check.py, the one-call GPU check, and tools/gguf_cut.py, the model cutter it carries
models with (docs/gpu_check.md).

The cutter: a kept block is byte for byte the source's (a 2-layer model cut to 2 layers is the
same model: same tensors, metadata and logits), dropped blocks are gone, a vocabulary cut keeps
the tokenizer consistent, and the cut SmolLM2 loads with the real tokenizer. The kit: its dry run
(`gpu_check.py dry-run --no-download`: CUDA on the CPU harness, Vulkan on lavapipe, the cut real
models, scaled down) writes a complete report with no step failed and a bundle under the limit.
The dry run takes 45-75 s here with warm kernel caches (prepare ~15 s of it)."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import tarfile

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader

import engine
from tiny_gguf import write_tiny_gguf

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
import gguf_cut  # noqa: E402
import gpu_check  # noqa: E402

IDS = list(range(3, 120, 3))


def _tensors(path) -> dict[str, tuple[str, bytes]]:
    return {t.name: (t.tensor_type.name, bytes(np.asarray(t.data).tobytes())) for t in GGUFReader(str(path)).tensors}


def _fields(path) -> dict:
    r = GGUFReader(str(path))
    return {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}


def _logits(path, ids=IDS):
    m = engine.load(str(path), backend="cpu", snapkv_budget=0)
    _, logits = m.prefill(ids, snapkv=False)
    return logits


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("cut") / "tiny.gguf", qtype=Q.Q4_K, dim=256, ffn_dim=256,
                           seed=7)


def test_cut_to_all_layers_is_the_same_model(tiny, tmp_path):
    out = tmp_path / "same.gguf"
    summary = gguf_cut.cut_gguf(tiny, out, range(2))
    assert summary["layers"] == [0, 1] and summary["n_vocab"] == 260
    assert _tensors(out) == _tensors(tiny)
    assert _fields(out) == _fields(tiny)
    np.testing.assert_array_equal(_logits(out), _logits(tiny))


def test_cut_keeps_first_blocks_raw_and_drops_the_rest(tiny, tmp_path):
    out = tmp_path / "one.gguf"
    gguf_cut.cut_gguf(tiny, out, [0])
    src, got = _tensors(tiny), _tensors(out)
    assert set(got) == {n for n in src if not n.startswith("blk.1.")}
    assert all(got[n] == src[n] for n in got)                     # quantized blocks copied raw
    assert _fields(out)["llama.block_count"] == 1
    assert engine.load(str(out), backend="cpu").config.n_layers == 1


def test_repeat_blocks_and_override_metadata(tiny, tmp_path):
    out = tmp_path / "four.gguf"
    gguf_cut.cut_gguf(tiny, out, [0, 1, 0, 1], metadata={"llama.context_length": 4096})
    got, src = _tensors(out), _tensors(tiny)
    assert got["blk.2.attn_q.weight"] == src["blk.0.attn_q.weight"] and got["blk.3.ffn_down.weight"] == src["blk.1.ffn_down.weight"]
    cfg = engine.load(str(out), backend="cpu", ctx=4096).config
    assert (cfg.n_layers, cfg.context_length) == (4, 4096)
    with pytest.raises(ValueError, match="not in"):
        gguf_cut.cut_gguf(tiny, tmp_path / "x.gguf", [0], metadata={"llama.no_such_key": 1})
    with pytest.raises(ValueError, match="out of range"):
        gguf_cut.cut_gguf(tiny, tmp_path / "x.gguf", [2])


def test_vocabulary_cut_keeps_rows_tokens_and_refuses_cut_specials(tiny, tmp_path):
    # the tiny tokenizer's specials (bos = eos = 257) stay below 258
    out = tmp_path / "v258.gguf"
    gguf_cut.cut_gguf(tiny, out, range(2), n_vocab=258)
    f = _fields(out)
    assert f["tokenizer.ggml.tokens"] == _fields(tiny)["tokenizer.ggml.tokens"][:258]
    assert len(f["tokenizer.ggml.token_type"]) == 258
    m = engine.load(str(out), backend="cpu", snapkv_budget=0)
    assert m.config.vocab_size == 258
    _, logits = m.prefill(IDS, snapkv=False)
    np.testing.assert_allclose(logits, _logits(tiny)[:258], rtol=1e-5, atol=1e-5)   # tied head: the same rows
    with pytest.raises(ValueError, match=r"_token_id = 257 is not below n_vocab 200"):
        gguf_cut.cut_gguf(tiny, tmp_path / "v200.gguf", range(2), n_vocab=200)


def test_cut_smollm2_loads_with_the_real_tokenizer(smollm2_path, tmp_path):
    out = tmp_path / "smollm2-2l.gguf"
    gguf_cut.cut_gguf(smollm2_path, out, range(2))
    full_meta, cut_meta = GGUFReader(str(smollm2_path)).fields, GGUFReader(str(out)).fields
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"):
        assert cut_meta[key].contents() == full_meta[key].contents()
    cut = engine.load(str(out), backend="cpu", snapkv_budget=0, ctx=256)
    full_tok = engine.load(str(smollm2_path), backend="cpu", snapkv_budget=0, ctx=256).tokenizer
    text = "The lighthouse at Alexandria guided ships for centuries."
    assert cut.tokenizer.encode(text) == full_tok.encode(text)
    assert cut.config.n_layers == 2 and cut.config.vocab_size == 49152
    assert out.stat().st_size < 40 * 2**20


def test_dry_run_writes_a_complete_report(smollm2_path, tmp_path):
    from engine.model_path import gemma3_model_path
    if gemma3_model_path() is None:
        pytest.skip("gemma3 not installed (run `make setup`)")
    bundle, out = tmp_path / "bundle", tmp_path / "out"
    p = subprocess.run([sys.executable, str(REPO / "tools" / "gpu_check.py"), "dry-run", "--no-download",
                        "--bundle", str(bundle), "--out", str(out)], cwd=REPO, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["dry_run"] and report["finished"] and report["executor"] == "cpu-harness"
    expected = [s.name for s in gpu_check.plan(bundle, out, tmp_path / "w", dry=True)]
    steps = {s["name"]: s for s in report["steps"]}
    assert list(steps) == expected and len(expected) >= 14
    for name, s in steps.items():
        assert s["status"] in ("ok", "skipped"), (name, s)
        if s["status"] == "skipped":
            assert s["reason"], name
    for name in ("env", "install", "compile", "derive-gemma", "parity-cuda-smollm2", "parity-cuda-gemma3",
                 "tiny-cuda-quick", "pytest-cuda", "bench-cuda", "bench-cuda-chunk"):
        assert steps[name]["status"] == "ok", name
    assert report["environment"]["executor"] == "cpu-harness"             # the env step's JSON, parsed
    assert any(n.startswith("SPIR-V from the bundle (") for n in report["vulkan_notes"])                            # the device has no shader compiler
    assert all(steps[f"sanitizer-{t}"]["status"] == "skipped" for t in ("memcheck", "racecheck", "synccheck"))
    parity = [json.loads(line) for line in steps["parity-cuda-gemma3"]["tail"].splitlines() if line.startswith("{")]
    assert [r["layer_windows"] for r in parity] == [[512, 512], [0, 0]] and all(r["ok"] for r in parity)
    bench = report["bench"]["bench-cuda"]                          # the bench JSON, in the report
    with tarfile.open(out / gpu_check.LOGS_TAR) as t:               # and beside the logs
        assert json.load(t.extractfile("logs/bench-cuda/bench-cuda.json")) == bench
    assert bench["backend"] == "cuda" and bench["cases"][0]["engine_snapkv"]["snapkv"]
    # --compare-replay: replayed and fresh decodes from one prefill, the same greedy tokens
    assert all(c[k]["replay_same_tokens"] == 2 for c in bench["cases"] for k in ("engine", "engine_snapkv"))
    returned = [f for f in out.rglob("*") if f.is_file()]          # the device tool returns at most 8
    assert sorted(f.name for f in returned) == ["logs.tar.gz", "report.json", "report.md"], returned
    with tarfile.open(out / gpu_check.LOGS_TAR) as t:
        assert {f"logs/{n}.log" for n, s in steps.items() if s["status"] == "ok"} <= set(t.getnames())
    md = (out / "report.md").read_text()
    assert "DRY RUN" in md and all(f"| {name} |" in md for name in expected)
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["call_total_bytes"] <= gpu_check.LIMIT_MIB * 2**20
    assert {m["file"] for m in manifest["models"]} == {c.file for c in gpu_check.CUTS}


def test_one_call_command_is_in_the_help_and_the_doc():
    p = subprocess.run([sys.executable, str(REPO / "tools" / "gpu_check.py"), "--help"], capture_output=True,
                       text=True, timeout=60)
    assert gpu_check.ONE_CALL_COMMAND in p.stdout
    doc = (REPO / "docs" / "gpu_check.md").read_text()
    assert gpu_check.ONE_CALL_COMMAND in doc and json.dumps(gpu_check.ONE_CALL_CARRY) in doc
    assert "gpu_bundle/" in (REPO / ".gitignore").read_text().splitlines()


def test_the_gpu_plan_measures_what_never_ran_on_a_gpu_first_and_fits_its_budget(tmp_path):
    """The device plan (built here, as `run` builds it there): CUDA's parity and bench, then
    Vulkan's parity and benches (never run on a GPU; issue 35's rows), before the CUDA
    checks an H100 already passed; the steps that must start fit the budget by their
    min_s; no step writes a file of its own into out (the tool returns 8 files)."""
    steps = gpu_check.plan(tmp_path / "bundle", tmp_path / "out", tmp_path / "w", dry=False)
    names = [s.name for s in steps]
    first = ["install", "env", "derive-bench", "parity-cuda-smollm2", "bench-cuda", "vulkan-env",
             "parity-vulkan-smollm2", "bench-vulkan", "bench-vulkan-32k"]
    assert names[:len(first)] == first
    assert names.index("tiny-cuda") > names.index("sanitizer-racecheck") and names[-1] == "compile"
    assert sum(s.min_s for s in steps if s.name in first) <= gpu_check.BUDGET_S
    for s in steps:
        assert s.min_s <= s.timeout and not any(str(tmp_path / "out") in a for a in s.argv or [])
        if s.name.startswith("bench-"):
            assert s.argv[s.argv.index("--out") + 1] == str(tmp_path / "w" / "logs" / s.name)


def test_check_finds_a_stale_bundle(tmp_path, monkeypatch):
    """`check`, just before the call: a shader changed since prepare leaves SPIR-V for only
    some variants (every Vulkan step skipped on the device): found here instead."""
    assert gpu_check.check_bundle(tmp_path / "none") == [f"no bundle at {tmp_path / 'none'} "
                                                         f"(python tools/gpu_check.py prepare)"]
    bundle = tmp_path / "b"
    (bundle / "models").mkdir(parents=True)
    (bundle / "vulkan").mkdir()
    (bundle / "manifest.json").write_text("{}")
    problems = gpu_check.check_bundle(bundle)
    assert any("holds 0 of the shaders'" in p for p in problems) and any("models/" in p for p in problems)
