"""SOAK TEST (about 30 s, smollm2): `engine serve` under a 2 GiB memory cap against hostile
clients, through tools/soak_serve.py (issue 36's acceptance: "Under a 2 GiB memory cap the
server survives a 200 MB body, a 1M-entry stop list, 40 hostile templates and 1000
half-open connections, answering others within 2x their unloaded latency").

Scaled down here (a 20 MB body, 100k stop strings, 10 looping templates, 200 half-open
connections); the full-size run is `.venv/bin/python tools/soak_serve.py` (about 25 s).
The real `engine serve` runs as a subprocess under RLIMIT_AS = 2 GiB (the idle smollm2
server holds ~1.7 GiB of address space, ~0.4 GiB resident), on loopback, with the model's
chat template replaced by a loop that never ends.

test_half_open_connections_over_the_cap_do_not_lock_others_out is an expected failure
(strict) until GuardedH11 makes room for a new connection by closing the oldest one still
waiting for its request headers: today connections past --max-connections are closed at
once, so half-open ones holding every slot refuse everyone else until --header-timeout.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("uvicorn")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "soak_serve.py")


def soak(tmp_path, *args) -> tuple[int, dict, str]:
    out = tmp_path / "soak.json"
    r = subprocess.run([sys.executable, TOOL, "--json", str(out), *args], capture_output=True, text=True,
                       timeout=150, cwd=ROOT)
    result = json.loads(out.read_text()) if out.exists() else {}
    return r.returncode, result, r.stdout + r.stderr


def test_the_server_survives_hostile_clients_under_a_2_gib_cap(smollm2_path, tmp_path):
    """Every check of the tool passes: the server stays up, each hostile request gets its
    refusal (413 for the bodies, 400 for the stop list, 400/503 for the looping
    templates), the server closes every half-open connection, the probe's median under
    load is within 2x of its unloaded median, and peak memory stays under the cap."""
    rc, result, output = soak(tmp_path, "--model", str(smollm2_path), "--cap-gib", "2", "--body-mb", "20",
                              "--stops", "100000", "--templates", "10", "--half-open", "200")
    assert rc == 0, output
    checks = result["checks"]
    assert len(checks) == 9 and all(ok for ok, _ in checks.values()), output
    assert result["mem_peak"]["VmHWM"] < 2 << 30 and result["ratio"] <= 2.0
    assert result["answers"]["stops"]["status"] == 400 and result["answers"]["stops"]["param"] == "stop"
    assert all(result["answers"][k]["status"] == 413 for k in ("body_chunked", "body_length"))
    assert result["exit_status"] == 0, result["log_tail"]      # SIGTERM still drains and exits 0


def test_half_open_connections_over_the_cap_do_not_lock_others_out(smollm2_path, tmp_path):
    """200 half-open connections against --max-connections 100 (the full-size run's 1000
    against the default 512): requests from others must still be answered."""
    rc, result, output = soak(tmp_path, "--model", str(smollm2_path), "--body-mb", "0", "--stops", "0",
                              "--templates", "0", "--half-open", "200", "--probes", "10", "--hold", "4",
                              "--", "--max-connections", "100", "--header-timeout", "3")
    assert "error" not in result, output
    probe = result["probe"]
    assert probe["failed"] == 0, f"{probe['failed']} of {probe['n']} probes refused: {probe['failures'][:2]}"
    assert rc == 0, output
