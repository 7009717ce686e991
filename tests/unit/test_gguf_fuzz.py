"""Fuzz of the GGUF reader, model config and tokenizer metadata (issue 14): ~1000
mutated files (truncations, byte flips, hostile counts/lengths/dims/offsets, type
swaps, hostile metadata values and tensor shapes on tiny models, and the default
model's header). Each must give a one-line EngineError or load and produce finite
logits: never another exception, a hang (10 s per case) or more than 2 GiB of extra
address space (RLIMIT_AS in the worker). The worker is tests/unit/_gguf_fuzz.py."""
import json
import pathlib
import subprocess
import sys

WORKER = pathlib.Path(__file__).with_name("_gguf_fuzz.py")


def test_gguf_fuzz(tmp_path):
    from engine.model_path import smollm2_model_path
    real = smollm2_model_path()
    cmd = [sys.executable, str(WORKER), "0", "900", str(tmp_path)] + ([str(real)] if real else [])
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["failures"] == [], json.dumps(report["failures"][:10], indent=1)
    assert report["counts"]["error"] > 100 and report["counts"]["loaded"] > 10, report["counts"]
    assert report["seconds"] < 60, report
