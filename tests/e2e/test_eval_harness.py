"""`engine eval` end to end on a tiny configuration, and the branching the runner
relies on: one full prefill + evicting a copy with the last W of W_max captured
queries gives the same cache as a SnapKV prefill with window W."""
import argparse
import json

import numpy as np
import pytest

import engine
from engine.errors import EngineError
from engine.eval.cli import add_parser
from engine.eval.policies import DEFAULT, parse_policy
from engine.eval.report import SAMPLE_KEYS
from engine.forward import WindowCapture
from engine.snapkv import SnapKvConfig


def _parse(argv):
    ap = argparse.ArgumentParser(prog="engine")
    add_parser(ap.add_subparsers(dest="command", required=True))
    return ap.parse_args(argv)


def test_branching_equals_direct_snapkv_prefill(tiny_llama):
    m = engine.load(tiny_llama, backend="reference", snapkv_budget=0)
    ids = list(range(3, 250, 2)) + list(range(4, 200, 3))             # 190 tokens
    L, w_max = len(ids), 32
    full = m.new_cache()
    cap = WindowCapture(m.config, w_max, L - w_max)
    m.forward.window_capture = cap
    try:
        m.forward.prefill(ids, full)
    finally:
        m.forward.window_capture = None
    for window, granularity in ((8, "head"), (16, "layer"), (32, "global")):
        cfg = SnapKvConfig(budget=80, window=window, sinks=2, kernel=3, granularity=granularity, min_tokens=0)
        direct, _ = m.prefill(ids, snapkv=cfg)
        branch = full.copy()
        m.forward.evict(branch, np.ascontiguousarray(cap.q[:, :, w_max - window:]), cfg)
        for a, b in zip(direct.layers, branch.layers):
            np.testing.assert_array_equal(a.last_keep, b.last_keep)
            assert (a.length, a.logical_length) == (b.length, b.logical_length) == (80, L)
        np.testing.assert_allclose(m.forward.decode(7, direct), m.forward.decode(7, branch), rtol=1e-5, atol=1e-5)
    assert full.length == L                                          # branching left the original intact


def test_bad_arguments_are_one_line_errors():
    from engine.eval.cli import resolve
    with pytest.raises(EngineError, match="unknown task"):
        resolve(_parse(["eval", "--tasks", "passkey,sudoku"]))
    with pytest.raises(EngineError, match="bad policy name"):
        resolve(_parse(["eval", "--policies", "full,snapkv-1024"]))
    with pytest.raises(EngineError, match="--lengths"):
        resolve(_parse(["eval", "--lengths", "1k"]))
    with pytest.raises(EngineError, match="--depths are percentages"):
        resolve(_parse(["eval", "--depths", "nan"]))
    with pytest.raises(EngineError, match="--budget-fraction and --ablation-budget must be >= 0"):
        resolve(_parse(["eval", "--budget-fraction", "-1"]))
    with pytest.raises(EngineError, match="--lengths lists 1024 twice"):
        resolve(_parse(["eval", "--lengths", "1024,2048,1024"]))
    with pytest.raises(EngineError, match="--seed must be >= 0"):
        resolve(_parse(["eval", "--seed", "-1"]))
    with pytest.raises(EngineError, match="--samples must be 1..10000"):
        resolve(_parse(["eval", "--samples", "1000000000"]))
    r = resolve(_parse(["eval", "--quick"]))
    assert r["lengths"] == [1024] and [p.name for p in r["policies"]][0] == "full"
    assert not any(t.startswith("code") for t in r["tasks"])          # the code questions are asked for
    assert resolve(_parse(["eval", "--tasks", "passkey,code,code_def"]))["tasks"] == \
        ["passkey", "code_def", "code_value", "code_caller"]


def test_code_tasks_end_to_end(smollm2_path, tmp_path):
    """`--tasks code`: one chat prompt per kind, answered to the end of the turn and scored."""
    args = _parse(["eval", str(smollm2_path), "--tasks", "code", "--lengths", "600", "--samples", "1",
                   "--policies", "full,snapkv-b128-head-avg-k31-w32-s4", "--out", str(tmp_path), "--no-progress"])
    assert args.func(args) == 0
    doc = json.loads((tmp_path / "results.json").read_text())
    rows = doc["samples"]
    assert sorted({r["task"] for r in rows}) == ["code_caller", "code_def", "code_value"] and len(rows) == 6
    for r in rows:
        assert 600 - 24 <= r["prompt_tokens"] <= 600 and isinstance(r["correct"], bool) and r["key"]
        assert isinstance(r["generated"], str) and r["generated"].strip()     # a sentence, not cut at a digit
    assert doc["summary"]["full"]["retrieval_acc"] is not None
    md = (tmp_path / "summary.md").read_text()
    assert all(f"## {t}: accuracy" in md for t in ("code_def", "code_value", "code_caller"))


def test_kv_dtype_policies_are_named_and_crossed():
    from engine.eval.cli import resolve
    p = parse_policy("snapkv-bL/8-head-avg-k31-w32-s4+tq4")
    assert (p.kv_dtype, p.fraction, p.name) == ("tq4", 8, "snapkv-bL/8-head-avg-k31-w32-s4+tq4")
    assert parse_policy("full+q8_0/tq4").kv_dtype == "q8_0/tq4" and parse_policy("full+bf16").name == "full"
    with pytest.raises(EngineError, match="KV dtype"):
        parse_policy("full+q5_1")
    r = resolve(_parse(["eval", "--policies", "full,snapkv-b512-head-avg-k31-w32-s4", "--kv-dtypes", "bf16,q4_0"]))
    assert [p.name for p in r["policies"]] == ["full", "snapkv-b512-head-avg-k31-w32-s4",
                                               "full+q4_0", "snapkv-b512-head-avg-k31-w32-s4+q4_0"]
    with pytest.raises(EngineError, match="--kv-dtypes"):
        resolve(_parse(["eval", "--quick", "--kv-dtypes", "fp8"]))


def test_eval_end_to_end(smollm2_path, tmp_path):
    small = "snapkv-b128-head-avg-k5-w32-s4"
    args = _parse(["eval", str(smollm2_path), "--tasks", "passkey,niah,fidelity",
                   "--lengths", "256", "--samples", "1", "--policies", f"full,{small}",
                   "--fidelity-tokens", "16", "--out", str(tmp_path), "--no-progress"])
    assert args.func(args) == 0
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["schema"] == 1 and set(doc["meta"]["policies"]) == {"full", small}
    samples = doc["samples"]
    assert len(samples) == 3 * 2
    for r in samples:
        assert set(SAMPLE_KEYS) <= set(r)
        assert r["prompt_tokens"] <= 256 and r["length"] == 256
        if r["task"] == "fidelity":
            assert r["continuation_tokens"] == 16 and 0.0 <= r["top1"] <= 1.0 and r["kl"] >= 0.0
        else:
            assert isinstance(r["generated"], str) and isinstance(r["correct"], bool)
        if r["policy"] == small:
            assert r["compacted"] and r["kv_rows"] == 128 and r["budget"] == 128
        else:
            assert not r["compacted"] and r["kv_rows"] == r["prompt_tokens"]
    easy = next(r for r in samples if r["task"] == "passkey" and r["policy"] == "full")
    assert easy["correct"], easy
    assert parse_policy(small).compacts(easy["prompt_tokens"])
    assert set(doc["summary"]) == {"full", small}
    md = (tmp_path / "summary.md").read_text()
    assert "| `full` |" in md and "## passkey" in md and "## fidelity" in md
    for png in ("accuracy_heatmap.png", "accuracy_vs_budget.png", "kv_bytes_vs_accuracy.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "## Against the full cache" in md and doc["summary"][small]["vs_full"]["n"] == 2

    # --render rebuilds the same report from the saved samples, with nothing run
    (tmp_path / "summary.md").unlink()
    assert args.func(_parse(["eval", "--render", str(tmp_path / "results.json")])) == 0
    assert (tmp_path / "summary.md").read_text() == md
    rows_file = tmp_path / "samples.partial.jsonl"       # the rows of a run cut short
    rows_file.write_text("".join(json.dumps(r) + "\n" for r in samples))
    out2 = tmp_path / "from_partial"
    assert args.func(_parse(["eval", "--render", str(rows_file), "--out", str(out2)])) == 0
    assert "| `full` |" in (out2 / "summary.md").read_text()
    # a run split by task over two files (one process per core): their union is the whole run
    halves = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    for half, tasks in zip(halves, ({"passkey"}, {"niah", "fidelity"})):
        half.write_text("".join(json.dumps(r) + "\n" for r in samples if r["task"] in tasks))
    out3 = tmp_path / "union"
    assert args.func(_parse(["eval", "--render", *map(str, halves), "--out", str(out3)])) == 0
    union = json.loads((out3 / "results.json").read_text())
    assert union["summary"] == doc["summary"] and union["meta"]["n_samples"] == 3
    other = tmp_path / "other_seed.jsonl"                # not a part of this run
    other.write_text("".join(json.dumps(dict(r, seed=r["seed"] + 1)) + "\n" for r in samples if r["task"] == "niah"))
    with pytest.raises(EngineError, match="not parts of one run"):
        args.func(_parse(["eval", "--render", str(halves[0]), str(other), "--out", str(tmp_path / "u2")]))
    # a finished part (results.json, its model named) and another process's rows cut short
    part_a = tmp_path / "part_a.json"
    part_a.write_text(json.dumps(dict(doc, samples=[r for r in samples if r["task"] == "passkey"])))
    assert args.func(_parse(["eval", "--render", str(part_a), str(halves[1]), "--out", str(tmp_path / "u3")])) == 0
    mixed = json.loads((tmp_path / "u3" / "results.json").read_text())
    assert mixed["summary"] == doc["summary"] and mixed["meta"]["model"] == doc["meta"]["model"]
    with pytest.raises(EngineError, match="needs --out"):
        args.func(_parse(["eval", "--render", *map(str, halves)]))
    with pytest.raises(EngineError, match="more than one file"):
        args.func(_parse(["eval", "--render", str(halves[0]), str(rows_file), "--out", str(out3)]))
    halves[0].write_text("".join(json.dumps(r) + "\n" for r in samples
                                 if r["task"] == "passkey" and r["policy"] == "full"))   # another policy set
    with pytest.raises(EngineError, match="not parts of one run"):
        args.func(_parse(["eval", "--render", *map(str, halves), "--out", str(out3)]))
    out4 = tmp_path / "against_small"                    # every policy against another, prompt by prompt
    assert args.func(_parse(["eval", "--render", str(tmp_path / "results.json"), "--out", str(out4),
                             "--baseline", small])) == 0
    assert f"## Against `{small}`" in (out4 / "summary.md").read_text()
    again = json.loads((out4 / "results.json").read_text())
    assert again["meta"]["baselines"] == [small] and again["summary"]["full"]["vs"][small]["n"] == 2
    with pytest.raises(EngineError, match="not a policy of this run"):
        args.func(_parse(["eval", "--render", str(tmp_path / "results.json"), "--baseline", "snapkv-b7"]))
    with pytest.raises(EngineError, match="not an eval results"):
        args.func(_parse(["eval", "--render", str(tmp_path / "accuracy_heatmap.png")]))


def test_runner_branches_each_kv_dtype_from_its_own_prefill(tmp_path):
    from tiny_gguf import write_tiny_gguf

    from engine.eval.runner import EvalPlan, Runner
    path = write_tiny_gguf(tmp_path / "tiny-hd32.gguf", n_heads=2, n_kv_heads=1)   # head_dim 32: one q8_0 block
    m = engine.load(path, backend="reference", snapkv_budget=0)
    names = ["full", "full+q8_0", "snapkv-b64-head-avg-k5-w16-s4+tq4"]
    plan = EvalPlan(tasks=["passkey", "fidelity"], lengths=[160], policies=[parse_policy(n) for n in names],
                    samples=1, depths=[50], fidelity_tokens=8)
    rows = {(r["task"], r["policy"]): r for r in Runner(m, plan).run(progress=False)}
    assert len(rows) == 6
    for task in ("passkey", "fidelity"):
        full, q8, tq4 = (rows[(task, n)] for n in names)
        assert full["kv_bytes"] == full["kv_bytes_full"] == q8["kv_bytes_full"]
        assert q8["kv_bytes"] * 64 == full["kv_bytes"] * 34           # q8_0 rows: 34 of 64 bytes (head_dim 32)
        assert tq4["compacted"] and tq4["kv_rows"] == 64 and tq4["kv_bytes"] < q8["kv_bytes"]
    f = {n: rows[("fidelity", n)] for n in names}
    assert f["full"]["kl"] == 0.0 and f["full"]["top1"] == 1.0       # the reference itself
    assert 0.0 < f["full+q8_0"]["kl"] < f[names[2]]["kl"]            # quantizing costs a little, evicting more


def test_render_refuses_what_is_not_an_eval_and_writes_nothing(tmp_path):
    """--render of a file that is not an eval's (hand-edited, another tool's): one line,
    and the folder's existing summary is left as it was."""
    unseeded = {"task": "passkey", "length": 300, "index": 0, "policy": "full", "prompt_tokens": 300, "depth": 0}
    for i, text in enumerate(['{"a": 1}', "[1, 2]", '{"meta": {}, "samples": [{"x": 1}]}', '{"meta": [], "samples": [1]}',
                              json.dumps(unseeded)]):
        bad = tmp_path / f"bad{i}.{'jsonl' if 'depth' in text else 'json'}"
        bad.write_text(text)
        args = _parse(["eval", "--render", str(bad), "--out", str(tmp_path / "r")])
        with pytest.raises(EngineError, match="--render: .* (is not an eval|not an eval sample)"):
            args.func(args)
    src = tmp_path / "ok"
    src.mkdir()
    row = {"task": "passkey", "length": 300, "index": 0, "policy": "full", "prompt_tokens": 300, "seed": 0,
           "depth": 50.0}
    (src / "results.json").write_text(json.dumps({"meta": {"policies": {"full": {}}, "lengths": [300]}, "samples": [row]}))
    (src / "summary.md").write_text("old")
    args = _parse(["eval", "--render", str(src / "results.json")])
    with pytest.raises(EngineError, match="cannot be rendered"):
        args.func(args)
    assert (src / "summary.md").read_text() == "old"


def test_resume_runs_only_the_samples_missing(tiny_llama, tmp_path):
    argv = ["eval", str(tiny_llama), "--backend", "reference", "--tasks", "passkey,niah", "--lengths", "300",
            "--samples", "2", "--policies", "full,snapkv-b64-head-avg-k5-w16-s4", "--out", str(tmp_path),
            "--no-progress"]
    args = _parse(argv)
    assert args.func(args) == 0
    first = json.loads((tmp_path / "results.json").read_text())["samples"]
    assert len(first) == 8
    key = lambda r: (r["task"], r["index"], r["policy"])                          # noqa: E731
    whole = [r for r in first if r["index"] == 0]                                 # two whole samples
    cut = [r for r in first if (r["task"], r["index"]) == ("passkey", 1)][:1]      # one cut mid-write
    partial = tmp_path / "samples.partial.jsonl"
    marked = [dict(r, generated="(kept from the partial file)") for r in whole]
    partial.write_text("".join(json.dumps(r) + "\n" for r in marked + cut))
    assert args.func(_parse(argv + ["--resume"])) == 0
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["meta"]["resumed_samples"] == 2 and not partial.exists()
    got = {key(r): r for r in doc["samples"]}
    assert sorted(got) == sorted(key(r) for r in first)
    for r in first:
        g = got[key(r)]
        assert g["generated"] == ("(kept from the partial file)" if r["index"] == 0 else r["generated"])

    for other in (dict(first[0], seed=5), dict(first[0], depth=first[0]["depth"] + 10)):   # another plan's
        partial.write_text(json.dumps(other) + "\n")
        with pytest.raises(EngineError, match="another plan"):
            args.func(_parse(argv + ["--resume"]))

    # the same command without --resume never deletes a run cut short
    partial.write_text(json.dumps(first[0]) + "\n")
    with pytest.raises(EngineError, match="add --resume to continue it, or delete it"):
        args.func(_parse(argv))
    assert partial.read_text() == json.dumps(first[0]) + "\n"
    # a run cut short records what it ran with: resuming with another answer length is refused
    (tmp_path / "samples.meta.json").write_text(json.dumps({"max_new_tokens": 3, "seed": 0}))
    with pytest.raises(EngineError, match="was run with max_new_tokens 3"):
        args.func(_parse(argv + ["--resume"]))
    (tmp_path / "samples.meta.json").unlink()
    # a saved row whose prompt is not the regenerated one (another model's tokenizer)
    partial.write_text(json.dumps(dict(cut[0], prompt_tokens=cut[0]["prompt_tokens"] - 1)) + "\n")
    with pytest.raises(EngineError, match="not the one the saved rows were run on"):
        args.func(_parse(argv + ["--resume"]))
    # a last line cut short (read while its run appends, or a full disk) is left out
    partial.write_text("".join(json.dumps(r) + "\n" for r in whole) + json.dumps(cut[0])[:40])
    assert args.func(_parse(argv + ["--resume"])) == 0
    assert not partial.exists() and not (tmp_path / "samples.meta.json").exists()
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["meta"]["resumed_samples"] == 2 and sorted(map(key, doc["samples"])) == sorted(map(key, first))
    # a resumed run's timings are its rows', over every session: one prefill a sample (one KV type), no wall time
    t = doc["meta"]["timings"]
    assert "wall_s" not in t and "wall " not in (tmp_path / "summary.md").read_text()
    assert t["prefill_s"] == pytest.approx(sum(r["prefill_s"] for r in doc["samples"] if r["policy"] == "full"))
    # a finished run is not resumed (that would start it again and replace its results)
    with pytest.raises(EngineError, match="holds a finished run"):
        args.func(_parse(argv + ["--resume"]))
    # a partial file holding only a line cut short resumes nothing and runs every sample
    partial.write_text(json.dumps(cut[0])[:40])
    assert args.func(_parse(argv + ["--resume"])) == 0
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["meta"]["resumed_samples"] == 0 and sorted(map(key, doc["samples"])) == sorted(map(key, first))
    assert doc["meta"]["timings"]["wall_s"] > 0
    # the context a run cut short had (it sets the prompts' lengths) must be the resumed run's
    partial.write_text(json.dumps(first[0]) + "\n")
    (tmp_path / "samples.meta.json").write_text(json.dumps({"ctx": 4096, "seed": 0}))
    with pytest.raises(EngineError, match="was run with ctx 4096"):
        args.func(_parse(argv + ["--resume"]))


def test_row_timings_count_each_prefill_once():
    """Rows rebuilt into a report (a partial or resumed run) count a sample's prefill once
    per KV type: policies of one KV type share it, another KV type has its own."""
    from engine.eval.cli import _row_timings
    row = {"task": "passkey", "length": 300, "index": 0, "seed": 0, "prompt_tokens": 290, "evict_s": 0.5, "decode_s": 1.0}
    rows = [dict(row, policy="full", prefill_s=10.0, evict_s=0.0),
            dict(row, policy="snapkv-b64-head-avg-k5-w16-s4", prefill_s=10.0),
            dict(row, policy="snapkv-b64-head-avg-k5-w16-s4+tq4", prefill_s=12.0),
            dict(row, index=1, policy="full", prefill_s=11.0, evict_s=0.0)]
    t = _row_timings(rows)
    assert t["prefill_s"] == 33.0 and t["prefill_tokens"] == 870
    assert t["evict_s"] == 1.0 and t["decode_s"] == 4.0


def test_two_spellings_of_one_kv_layout_are_one_policy(tmp_path):
    """Policies are named by the model's name of their KV layout: two spellings of one
    layout are refused as a policy listed twice, and one spelling is saved as the model
    names it (the name stats, bench and the server show)."""
    from tiny_gguf import write_tiny_gguf
    model = write_tiny_gguf(tmp_path / "m.gguf", dim=128, n_heads=4)        # head_dim 32: q8_0 and tq4 rows
    base = ["eval", str(model), "--backend", "reference", "--tasks", "passkey", "--lengths", "300",
            "--samples", "1", "--out", str(tmp_path), "--no-progress"]
    with pytest.raises(EngineError, match="twice"):
        args = _parse(base + ["--policies", "full,full+tq4:0=q8_0,full+q8_0:1=tq4"])
        args.func(args)
    args = _parse(base + ["--policies", "full,full+tq4:0-1=q8_0"])
    assert args.func(args) == 0
    doc = json.loads((tmp_path / "results.json").read_text())
    assert set(doc["summary"]) == {"full", "full+q8_0"}


def test_a_kv_type_the_model_cannot_hold_fails_before_any_prefill(tiny_llama, tmp_path, monkeypatch):
    """A policy's KV type naming a layer the model lacks is a one-line error at once,
    not after the full cache's prefill of the first prompt."""
    from engine.eval.runner import Runner

    def no_prefill(*a, **k):
        raise AssertionError("prefill ran")
    monkeypatch.setattr(Runner, "_prefill", no_prefill)
    args = _parse(["eval", str(tiny_llama), "--backend", "reference", "--tasks", "passkey", "--lengths", "300",
                   "--samples", "1", "--policies", "full,full+tq4:5=tq3", "--out", str(tmp_path), "--no-progress"])
    with pytest.raises(EngineError, match=r"names layer 5, but the model has 2 layers"):
        args.func(args)


def test_resume_with_a_policy_added_runs_only_its_prefill(tiny_llama, tmp_path, monkeypatch):
    """A policy added to a resumed plan runs on the samples already done with only its KV
    type's prefill (the full cache's rows and bytes are kept), and the rows equal a fresh
    run's of the whole plan."""
    from engine.eval.runner import Runner

    base = ["eval", str(tiny_llama), "--backend", "reference", "--tasks", "passkey,niah", "--lengths", "300",
            "--samples", "2", "--no-progress"]
    args = _parse(base + ["--policies", "full,snapkv-b64-head-avg-k5-w16-s4+tq4", "--out", str(tmp_path / "fresh")])
    assert args.func(args) == 0
    fresh = json.loads((tmp_path / "fresh" / "results.json").read_text())["samples"]
    out = tmp_path / "grown"
    args = _parse(base + ["--policies", "full", "--out", str(out)])
    assert args.func(args) == 0
    first = json.loads((out / "results.json").read_text())["samples"]
    (out / "samples.partial.jsonl").write_text("".join(json.dumps(r) + "\n" for r in first[:3]))   # 3 of 4
    prefills = []
    real = Runner._prefill

    def counted(self, sample, kv_dtype, compacting):
        prefills.append(kv_dtype)
        return real(self, sample, kv_dtype, compacting)
    monkeypatch.setattr(Runner, "_prefill", counted)
    args = _parse(base + ["--policies", "full,snapkv-b64-head-avg-k5-w16-s4+tq4", "--out", str(out), "--resume"])
    assert args.func(args) == 0
    assert sorted(prefills) == ["bf16"] + ["tq4"] * 4        # the sample missing its full row runs both
    got = json.loads((out / "results.json").read_text())["samples"]
    key = lambda r: (r["task"], r["index"], r["policy"])     # noqa: E731
    drop = ("prefill_s", "evict_s", "decode_s")
    assert sorted(({k: v for k, v in r.items() if k not in drop} for r in got), key=key) == \
        sorted(({k: v for k, v in r.items() if k not in drop} for r in fresh), key=key)


def test_lengths_the_context_cannot_tell_apart_or_hold_are_refused_before_any_prompt(tiny_llama):
    """On a 512-token context 600 and 700 both clip to the same prompts (counted twice
    otherwise); a fidelity continuation of 480 leaves no prompt: one line before any run."""
    from engine.eval.runner import EvalPlan, Runner
    m = engine.load(tiny_llama, backend="reference", snapkv_budget=0)
    full = [parse_policy("full")]
    Runner(m, EvalPlan(tasks=["passkey"], lengths=[400, 600], policies=full))
    with pytest.raises(EngineError, match="lengths 700 clip to the same passkey prompts as a shorter one"):
        Runner(m, EvalPlan(tasks=["passkey"], lengths=[600, 700], policies=full))
    with pytest.raises(EngineError, match="a fidelity prompt has 31 tokens left .* lower --fidelity-tokens"):
        Runner(m, EvalPlan(tasks=["fidelity"], lengths=[128], policies=full, fidelity_tokens=480))


def test_a_render_that_fails_midway_leaves_every_output_as_it_was(tmp_path, monkeypatch):
    """The last plot failing: results.json, summary.md and the plots before it unchanged,
    no temporary file left; and variants of a budget (+q8_0, merged rows) are not points of
    the budget sweep's line (a partial run's missing mean no longer breaks its sort)."""
    from engine.eval import report
    src = tmp_path / "run"
    src.mkdir()
    rows = [{"task": "passkey", "length": 300, "index": 0, "policy": p, "prompt_tokens": 300, "seed": 0,
             "depth": 50.0, "correct": True, "answer": "1", "expected": ["1"]}
            for p in ("full", "snapkv-b256-head-avg-k31-w32-s4", "snapkv-b256-head-avg-k31-w32-s4+q8_0")]
    (src / "samples.partial.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name in ("results.json", "summary.md", "accuracy_heatmap.png"):
        (src / name).write_text("old")
    monkeypatch.setattr(report, "plot_bytes_vs_accuracy", lambda *a: (_ for _ in ()).throw(RuntimeError("disk")))
    args = _parse(["eval", "--render", str(src / "samples.partial.jsonl")])
    with pytest.raises(EngineError, match="cannot be rendered"):
        args.func(args)
    assert {p.name for p in src.iterdir()} == {"samples.partial.jsonl", "results.json", "summary.md",
                                               "accuracy_heatmap.png"}
    assert all((src / n).read_text() == "old" for n in ("results.json", "summary.md", "accuracy_heatmap.png"))
    meta = {"defaults": {k: getattr(DEFAULT, k) for k in ("granularity", "pool", "kernel", "window", "sinks")},
            "policies": {r["policy"]: parse_policy(r["policy"]).describe() for r in rows}}
    assert list(report.budget_sweep(meta)) == ["snapkv-b256-head-avg-k31-w32-s4"]
