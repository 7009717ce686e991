"""tools/plots.py: every documentation plot is redrawn from committed results files, the
committed PNGs are what it draws now, and the plotted numbers are the pages' numbers."""
from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("matplotlib", reason="the eval extra is not installed (pip install -e .[eval])")

ROOT = Path(__file__).resolve().parents[2]
IMG = ROOT / "docs" / "img"


@pytest.fixture(scope="module")
def plots():
    spec = importlib.util.spec_from_file_location("plots", ROOT / "tools" / "plots.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def fresh(plots, tmp_path_factory):
    out = tmp_path_factory.mktemp("img")
    return {k: Path(p) for k, p in plots.write_all(str(out)).items()}


def test_writes_every_plot(fresh):
    assert {"accuracy", "eviction"} <= set(fresh)
    benches = sorted((ROOT / "docs" / "bench").glob("*.json"))
    assert benches, "no committed bench JSON"
    for b in benches:
        assert f"bench_{b.stem}" in fresh
    assert len(fresh) >= 3
    for p in fresh.values():
        assert p.is_file() and p.stat().st_size > 10_000, p


def test_committed_images_are_current(fresh):
    """docs/img holds exactly what the tool draws now (byte-equal on the same matplotlib;
    a small RMS tolerance for another version's anti-aliasing)."""
    from matplotlib.testing.compare import compare_images

    committed = {p.name for p in IMG.glob("*.png")}
    assert committed == {p.name for p in fresh.values()}, "docs/img is stale: run python tools/plots.py"
    for p in fresh.values():
        old = IMG / p.name
        if old.read_bytes() != p.read_bytes():
            diff = compare_images(str(old), str(p), tol=2.0)
            assert diff is None, f"{old.name} differs from what tools/plots.py draws now: {diff}"


def test_pages_show_the_plots():
    pages = {"evaluation.md": ["accuracy_vs_kv_bytes.png", "eviction_cost.png"],
             "kv-formats.md": ["accuracy_vs_kv_bytes.png"],
             "benchmarks.md": ["bench_qwen2.5-coder-0.5b-both-modes-cpu-2026-12-06.png",
                               "bench_qwen2.5-coder-0.5b-cpu-2026-12-05.png", "bench_smollm2-cpu-2026-11-29.png",
                               "bench_gemma3-cpu-2026-11-29.png"],
             "index.md": ["bench_smollm2-cpu-2026-11-29.png"]}
    for page, images in pages.items():
        text = (ROOT / "docs" / page).read_text(encoding="utf-8")
        assert "python tools/plots.py" in text, page
        for img in images:
            assert f"](img/{img})" in text, (page, img)
    assert "](docs/img/bench_qwen2.5-coder-0.5b-both-modes-cpu-2026-12-06.png)" in \
        (ROOT / "README.md").read_text(encoding="utf-8")


def test_accuracy_points_match_the_pages(plots):
    pts = plots.accuracy_points()
    by = {(q["run"], q["policy"]): q for qs in pts.values() for q in qs}
    q = by[("eval8k_rq4_0_all", "snapkv-bL/8-head-avg-k31-w32-s4+rq4_0")]     # kv-formats.md: +4.9 [-1.7, +12.3]
    assert (round(q["diff"], 1), round(q["lo"], 1), round(q["hi"], 1)) == (4.9, -1.7, 12.3)
    assert round(by[("eval8k_kvquant", "full")]["mib"] / q["mib"], 1) == 28.4
    g = by[("eval_gemma3_16k_merge", "snapkv-b2048-head-avg-k31-w32-s4-m64")]  # evaluation.md: -1.0 [-5.4, +2.7]
    assert (round(g["diff"], 1), round(g["lo"], 1), round(g["hi"], 1), round(g["mib"], 2)) == (-1.0, -5.4, 2.7, 13.52)
    a = by[("eval8k_alloc", "snapkv-bL/8-head-avg-k31-w32-s4-adaptive")]      # 23.9 MiB, KL 0.268
    assert (round(a["mib"], 1), round(a["kl"], 3)) == (23.9, 0.268)
    assert plots.short_name("snapkv-bL/16-head-avg-k31-w32-s4-adaptive+tq4") == "L/16 adaptive, tq4"


def test_eviction_points_match_the_page(plots):
    import statistics
    pts = [p for p in plots.eviction_points() if p["run"] == "eval_gemma3_16k_merge"]
    assert len(pts) == 200                                                   # 100 prompts x 2 evicting policies
    med = {m: statistics.median(p["evict_s"] for p in pts if p["merged"] == m) for m in (False, True)}
    assert (round(med[False], 2), round(med[True], 2)) == (0.21, 1.97)       # evaluation.md's medians


def test_bench_series_read_the_bench_schema(plots):
    doc = json.loads((ROOT / "docs" / "bench" / "smollm2-cpu-2026-11-29.json").read_text())
    assert doc["transcribed"]["command"].startswith("engine bench")
    s = plots.bench_series(doc)
    assert s["ours, full cache"]["decode"] == [189, 168, 107, 61]           # benchmarks.md's table
    assert s["ours, SnapKV"]["decode"] == [None, None, 135, 133]
    assert s["llama.cpp (f16 KV)"]["decode"] == [151, 133, 88, 45]
    assert [round(x, 1) for x in s["ours, full cache"]["mib"]] == [4.2, 12.7, 46.4, 177.2]
    # a run with several KV types (engine bench --kv-dtypes bf16,rq4_0): a line per type, llama.cpp once
    two = copy.deepcopy(doc)
    two["cases"] = [dict(copy.deepcopy(c), kv_dtype=t) for c in doc["cases"] for t in ("bf16", "rq4_0")]
    s2 = plots.bench_series(two)
    assert set(s2) == {"ours, full cache, bf16", "ours, SnapKV, bf16", "ours, full cache, rq4_0",
                       "ours, SnapKV, rq4_0", "llama.cpp (f16 KV)"}
    assert s2["llama.cpp (f16 KV)"]["tokens"] == [128, 512, 2048, 8000]


def test_bench_only_cli(plots, tmp_path):
    src = ROOT / "docs" / "bench" / "gemma3-cpu-2026-11-29.json"
    assert plots.main(["--bench", str(src), "--out", str(tmp_path)]) == 0
    assert (tmp_path / "bench_gemma3-cpu-2026-11-29.png").is_file()
