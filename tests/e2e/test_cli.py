"""The command line on small models: run, info, bench write what they promise."""
import json
import os
import re
import subprocess
import sys

import pytest
from _backends import available_backends


def cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "engine.cli", *args], capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, **(env or {})))


def test_run_a_document_and_a_question(tiny_llama, smollm2_path, tmp_path):
    """-f DOC -p QUESTION prompts with the document, a blank line, then the question (the
    question last, where SnapKV's window reads it); -f - reads standard input; --system
    adds a system message to a chat prompt, and needs --chat."""
    doc = tmp_path / "doc.txt"
    doc.write_text("The vault code is 4417. The door is red.")
    flags = ["-n", "6", "--ignore-eos", "--stats"]
    whole = cli("run", str(tiny_llama), "-p", "The vault code is 4417. The door is red.\n\nWhat is the code?", *flags)
    both = cli("run", str(tiny_llama), "-f", str(doc), "-p", "What is the code?", *flags)
    piped = subprocess.run([sys.executable, "-m", "engine.cli", "run", str(tiny_llama), "-f", "-", "-p",
                            "What is the code?", *flags], input=doc.read_text(), capture_output=True, text=True,
                           timeout=600)
    for r in (whole, both, piped):
        assert r.returncode == 0, r.stderr
    assert whole.stdout == both.stdout == piped.stdout
    n = int(whole.stderr.split("prompt ")[1].split(" tok")[0])
    assert f"prompt {n} tok" in both.stderr and f"prompt {n} tok" in piped.stderr
    r = cli("run", str(tiny_llama), "-p", "hi", "--system", "Be brief.")
    assert r.returncode == 1 and r.stderr.strip() == "error: --system needs --chat (a system message is part of the chat template)"
    plain = cli("run", str(smollm2_path), "--chat", "-p", "Hi", "-n", "1", "--stats")
    system = cli("run", str(smollm2_path), "--chat", "--system", "You answer in French, briefly. " * 8, "-p", "Hi",
                 "-n", "1", "--stats")                    # (longer than SmolLM2's default system message)
    for r in (plain, system):
        assert r.returncode == 0, r.stderr
    tokens = lambda r: int(r.stderr.split("prompt ")[1].split(" tok")[0])     # noqa: E731
    assert tokens(system) > tokens(plain)                  # the system message is in the prompt


def test_run_streams_and_stats(tiny_llama):
    r = cli("run", str(tiny_llama), "-p", "hello", "-n", "5", "--ignore-eos", "--stats", "--seed", "3",
            "--temp", "0.8", "--top-k", "20", "--top-p", "0.9")
    assert r.returncode == 0, r.stderr
    assert "prompt 5 tok" in r.stderr and "decode 4 tok" in r.stderr and "peak RSS" in r.stderr
    again = cli("run", str(tiny_llama), "-p", "hello", "-n", "5", "--ignore-eos", "--seed", "3",
                "--temp", "0.8", "--top-k", "20", "--top-p", "0.9")
    assert again.stdout == r.stdout            # seeded sampling is reproducible


@pytest.mark.parametrize("flags, message", [
    (["-n", "-1"], "error: -n/--max-tokens must be a non-negative integer, got -1"),
    (["--temp", "nan"], "error: --temp must be a finite number >= 0, got nan"),
    (["--top-p", "0"], "error: --top-p must be in (0, 1], got 0.0")])
def test_run_flags_are_checked_before_the_model_loads(flags, message):
    r = cli("run", "/no/such/model.gguf", "-p", "hi", *flags)       # the flag's error, not the missing file's
    assert r.returncode == 1 and r.stderr == message + "\n"


def test_chat_template_and_stop(tiny_llama):
    r = cli("run", str(tiny_llama), "--chat", "-p", "hi", "-n", "3", "--stop", "zzz")
    assert r.returncode == 0, r.stderr


def test_info_json(tiny_llama):
    r = cli("info", str(tiny_llama), "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["architecture"] == "llama" and info["layers"] == 2 and info["tensor_types"] == {"F32": 20}
    assert info["tokenizer"]["model"] == "gpt2" and info["kv_heads"] == 2
    per_token = info["kv_bytes_per_token_by_dtype"]          # head_dim 16: no 32-value blocks
    assert per_token == {"bf16": info["kv_bytes_per_token_bf16"], "tq4": 2 * 2 * 2 * 10, "tq3": 2 * 2 * 2 * 8}


def bench_cli(model, out, *flags):
    """engine bench on a small model: 3 tokens decoded a case, SnapKV budget 80 (window 8)."""
    return cli("bench", str(model), "--decode-tokens", "3", "--no-llama-cpp", "--out", str(out),
               "--kv-budget", "80", "--kv-window", "8", "--kv-min-tokens", "16", *flags)


def test_bench_writes_json(tiny_llama, tmp_path):
    r = bench_cli(tiny_llama, tmp_path, "--lengths", "40,100", "--kv-dtypes", "bf16,tq4")
    assert r.returncode == 0, r.stderr
    report = json.loads((tmp_path / "bench-cpu.json").read_text())
    assert [(c["prompt_tokens"], c["kv_dtype"]) for c in report["cases"]] == [
        (40, "bf16"), (40, "tq4"), (100, "bf16"), (100, "tq4")]      # each prompt in each KV type
    assert report["kv_dtypes"] == ["bf16", "tq4"]
    for big in report["cases"][2:]:
        assert big["engine"]["kv_rows"] == 103 and big["engine_snapkv"]["kv_rows"] == 83
        assert big["engine"]["decode_tok_s"] > 0 and "snapkv_overhead" in big
        assert big["engine"]["kv_dtype"] == big["engine_snapkv"]["kv_dtype"] == big["kv_dtype"]
    bf16, tq4 = report["cases"][2:]
    assert tq4["engine"]["kv_bytes"] * 32 == bf16["engine"]["kv_bytes"] * 10   # head_dim 16: rows of 10 bytes, not 32
    d = report["decode_steps"]                               # the CPU backend launches and records nothing
    assert d["launches_per_token"] is None and d["recordings"] == d["replays"] == 0
    # a warm-up per KV type (3 tokens, then 1 after a compacting warm-up: eviction's kernels are
    # loaded before any timed case), then each case with and without SnapKV
    assert d["tokens"] == 2 * (3 + 1) + 4 * 2 * 3 and d["host_us_per_token"] > 0
    peaks = [c[k]["peak_rss_mib"] for c in report["cases"] for k in ("engine", "engine_snapkv")]
    assert 0 < min(peaks) and max(peaks) <= report["peak_rss_mib"]      # each case's own, the run's the max
    assert "decode steps:" not in r.stdout


def test_bench_repeats_report_medians(tiny_llama, tmp_path):
    """--repeats N: every case measured N times, its timings the medians, each run's kept."""
    r = bench_cli(tiny_llama, tmp_path, "--lengths", "100", "--repeats", "3")
    assert r.returncode == 0, r.stderr
    report = json.loads((tmp_path / "bench-cpu.json").read_text())
    assert report["repeats"] == 3 and "repeat 3/3" in r.stderr and "(medians of 3 runs)" in r.stdout
    for case in (report["cases"][0]["engine"], report["cases"][0]["engine_snapkv"]):
        for f in ("prefill_tok_s", "decode_tok_s", "prefill_s"):
            assert len(case[f"runs_{f}"]) == 3 and case[f] == sorted(case[f"runs_{f}"])[1]
    assert report["decode_steps"]["tokens"] == 3 + 1 + 3 * 2 * 3
    r = cli("bench", str(tiny_llama), "--repeats", "0", "--no-llama-cpp", "--out", str(tmp_path))
    assert r.returncode != 0 and r.stderr.strip().splitlines()[-1] == "error: --repeats must be >= 1, got 0"


def test_bench_repeats_alternate_with_llama_cpp(tiny_llama, tmp_path, monkeypatch):
    """The order of --repeats 4 beside llama.cpp: llama.cpp, ours | ours, llama.cpp |
    llama.cpp, ours | ours, llama.cpp, llama.cpp in both its flash-attention modes each
    time, every ratio against the faster mode (its child process stands in for itself
    here: this checks the order and the medians' ratios, not llama.cpp)."""
    import engine.bench as bench
    from engine.cli import main
    order = []
    monkeypatch.setattr(bench, "llama_cpp_available", lambda: True)

    def llama(path, ctx, threads, prompts, n_decode, gpu, flash_attn, cache_type):
        order.append("L")
        t = -(-len([o for o in order if o == "L"]) // 2)      # the t-th llama.cpp run, both modes
        # with flash attention: prefill 3x faster, decode 2x slower
        return [{"prefill_tok_s": 10.0 * t * (3 if flash_attn else 1), "decode_tok_s": t / (2 if flash_attn else 1),
                 "prefill_s": 1.0, "peak_rss_mib": 1.0} for _ in prompts]
    monkeypatch.setattr(bench, "run_llama_cpp", llama)
    real = bench._engine_case

    def ours(model, ids, n_decode, snapkv=None, kv_dtype=None, fresh=None):
        if len(ids) == 100 and snapkv is False:
            order.append("O")
        return real(model, ids, n_decode, snapkv=snapkv, kv_dtype=kv_dtype, fresh=fresh)
    monkeypatch.setattr(bench, "_engine_case", ours)
    assert main(["bench", str(tiny_llama), "--lengths", "100", "--decode-tokens", "2", "--kv-budget", "0",
                 "--out", str(tmp_path), "--repeats", "4"]) == 0
    assert order == ["L", "L", "O", "O", "L", "L", "L", "L", "O", "O", "L", "L"]
    case = json.loads((tmp_path / "bench-cpu.json").read_text())["cases"][0]
    assert case["llama_cpp"]["runs_decode_tok_s"] == [1.0, 2.0, 3.0, 4.0] and case["llama_cpp"]["decode_tok_s"] == 2.5
    assert case["llama_cpp_fa"]["prefill_tok_s"] == 75.0
    assert case["ratio_decode"] == case["engine"]["decode_tok_s"] / 2.5
    assert case["ratio_prefill"] == case["engine"]["prefill_tok_s"] / 75.0
    assert case["ratio_against"] == {"prefill": "flash attention", "decode": "no flash attention"}
    assert case["kv_matched"] is True


def test_bench_share_prefill(tiny_llama, tmp_path):
    """--share-prefill: one prefill a case, the full cache a copy taken before SnapKV
    compacts; both caches as in separate prefills, and prompts SnapKV would not compact
    refused in one line before any work."""
    r = bench_cli(tiny_llama, tmp_path, "--lengths", "100", "--kv-dtypes", "bf16,tq4", "--share-prefill")
    assert r.returncode == 0, r.stderr
    report = json.loads((tmp_path / "bench-cpu.json").read_text())
    assert report["share_prefill"] is True
    for case in report["cases"]:
        full, snap = case["engine"], case["engine_snapkv"]
        assert (full["kv_rows"], snap["kv_rows"]) == (103, 83)
        assert full["snapkv"] is None and snap["snapkv"]["rows_before"] == 100
        assert full["kv_dtype"] == snap["kv_dtype"] == case["kv_dtype"]
        assert 0 < full["prefill_s"] <= snap["prefill_s"] and full["decode_tok_s"] > 0
    assert report["decode_steps"]["tokens"] == 2 * (3 + 1) + 2 * 2 * 3
    r = cli("bench", str(tiny_llama), "--lengths", "40,100", "--no-llama-cpp", "--out", str(tmp_path),
            "--kv-budget", "80", "--share-prefill")
    assert r.returncode != 0 and r.stderr.strip().splitlines()[-1].startswith("error: --share-prefill needs")


def test_bench_reports_decode_replay_on_a_recording_backend(tiny_llama, tmp_path):
    """On Vulkan (lavapipe) decode replays recorded steps: each case's cache records once
    (the warm-up's too) and its other tokens replay, launching nothing; the report and the
    last lines say so."""
    if "vulkan" not in available_backends():
        pytest.skip("no Vulkan device / kp")
    r = cli("bench", str(tiny_llama), "--backend", "vulkan", "--lengths", "40", "--decode-tokens", "5",
            "--no-llama-cpp", "--kv-budget", "0", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    report = json.loads((tmp_path / "bench-vulkan.json").read_text())
    d = report["decode_steps"]
    assert (d["tokens"], d["recordings"], d["replays"]) == (9, 2, 3 + 4)   # warm-up 4 tokens, the case 5
    assert 0 < d["launches_per_token"] < 1e9 and d["host_us_per_token"] > 0
    assert "; 2 recorded, 7 replayed" in r.stdout


def test_bench_compare_replay(tiny_llama, tmp_path):
    """--compare-replay on Vulkan (lavapipe): each case decoded twice from one prefill,
    through recorded steps and with every dispatch issued from Python, the same greedy
    tokens; the replayed decodes' counters are what they are without it, the others'
    reported apart. Where nothing replays (the CPU) it is refused in one line."""
    if "vulkan" not in available_backends():
        pytest.skip("no Vulkan device / kp")
    r = cli("bench", str(tiny_llama), "--backend", "vulkan", "--lengths", "40,100", "--decode-tokens", "5",
            "--no-llama-cpp", "--kv-budget", "80", "--kv-window", "16", "--compare-replay", "--repeats", "2",
            "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    report = json.loads((tmp_path / "bench-vulkan.json").read_text())
    assert report["compare_replay"] is True
    for case in report["cases"]:
        for c in (case["engine"], case["engine_snapkv"]):
            assert c["replay_same_tokens"] == 5 and len(c["runs_decode_fresh_tok_s"]) == 2
            assert c["replay_speedup"] == c["decode_tok_s"] / c["decode_fresh_tok_s"] > 0
    d, f = report["decode_steps"], report["decode_steps_fresh"]
    # a warm-up and a compacting warm-up, then 2 repeats x 2 lengths x 2 cases, each of 5 tokens
    assert (d["tokens"], d["replays"]) == (4 + 1 + 8 * 5, 3 + 8 * 4)
    assert (f["tokens"], f["replays"], f["recordings"], f["replayed_host_us_per_token"]) == (8 * 5, 0, 0, None)
    assert f["launches_per_token"] > 0 and f["host_us_per_token"] > 0
    assert "decode steps without replay: " in r.stdout and " fresh " in r.stdout.splitlines()[0]
    r = cli("bench", str(tiny_llama), "--lengths", "40", "--no-llama-cpp", "--compare-replay", "--out", str(tmp_path))
    assert r.returncode != 0
    assert r.stderr.strip().splitlines()[-1] == ("error: --compare-replay: the cpu backend does not replay "
                                                 "recorded decode steps here")


def test_info_devices_lists_vulkan():
    r = cli("info", "--devices")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("cpu: ") and "vulkan" in r.stdout and "mat-vecs: " in r.stdout


def test_info_devices_without_cupy(tmp_path):
    """cupy not installed: the other backends' devices, one line saying what CUDA
    needs, exit 0 (as for a missing Vulkan), no traceback."""
    shadow = tmp_path / "cupy"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'cupy'\", name='cupy')\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = cli("info", "--devices", env={"PYTHONPATH": os.pathsep.join([str(tmp_path), root])})
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("cpu: ") and any(l.startswith("vulkan") for l in lines)
    assert [l for l in lines if l.startswith("cuda")] == [
        "cuda: unavailable (backend 'cuda' needs cupy (pip install cupy-cuda12x or cupy-cuda13x): "
        "ModuleNotFoundError: No module named 'cupy')"]


def kv_stats(stderr: str) -> tuple[str, float]:
    """The --stats KV line -> (kv dtype, KiB held)."""
    m = re.search(r"-- KV cache: \d+ rows for \d+ positions, (\S+), ([\d.]+) (KiB|MiB)", stderr)
    assert m, stderr
    return m.group(1), float(m.group(2)) * (1024 if m.group(3) == "MiB" else 1)


def test_run_kv_dtype_shows_in_stats(tiny_llama):
    base = ("run", str(tiny_llama), "-p", "hello", "-n", "3", "--ignore-eos", "--stats", "--backend", "reference")
    bf16, tq4 = cli(*base), cli(*base, "--kv-dtype", "tq4")
    assert bf16.returncode == 0 and tq4.returncode == 0, bf16.stderr + tq4.stderr
    assert kv_stats(bf16.stderr) == ("bf16", 16.0)             # 2 layers x 1 page x 64 rows x 2 heads x (32+32) B
    assert kv_stats(tq4.stderr) == ("tq4", 5.0)                # rows of 2 + 16/2 bytes instead of 32
    env = cli(*base, env={"SHARPI_KV_DTYPE": "tq3/tq4"})
    assert env.returncode == 0 and kv_stats(env.stderr)[0] == "tq3/tq4", env.stderr


def test_bench_warms_up_past_the_long_cache_kernels(tmp_path, monkeypatch):
    """The warm-up prompts reach the cases' lengths up to WARM_TOKENS, for the full cache and
    for a compacted one, so the CPU's parallel decode (above 1024 rows) compiles before any
    timer: a fresh install's first SnapKV 4K case decoded at 4.6 instead of 54 tok/s."""
    import engine.bench as bench
    from engine.cli import main
    from tiny_gguf import write_tiny_gguf
    path = write_tiny_gguf(tmp_path / "long.gguf", ctx=2048)
    seen = []
    real = bench._engine_case

    def record(model, ids, n_decode, snapkv=None, kv_dtype=None, fresh=None):
        case = real(model, ids, n_decode, snapkv=snapkv, kv_dtype=kv_dtype, fresh=fresh)
        seen.append((len(ids), case["kv_rows"]))
        return case
    monkeypatch.setattr(bench, "_engine_case", record)
    assert main(["bench", str(path), "--lengths", "1200", "--decode-tokens", "2", "--kv-budget", "1100",
                 "--no-llama-cpp", "--out", str(tmp_path)]) == 0
    (full, full_rows), (evicted, evicted_rows) = seen[:2]          # the two warm-up cases
    assert full == 1200 and full_rows > 1024
    assert evicted == 1164 and 1024 < evicted_rows <= 1100 + 2
