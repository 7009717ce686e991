"""SnapKV policy resolution: env < CLI < API, auto-on, explicit off."""
import subprocess
import sys

import pytest

import engine
from engine.errors import ConfigError
from engine.snapkv import SnapKvConfig


def test_unset_budget_small_ring_is_off(tiny_llama, monkeypatch):
    monkeypatch.delenv("SHARPI_SNAPKV_BUDGET", raising=False)
    assert engine.load(tiny_llama, backend="reference").snapkv is None


def test_auto_on_when_ring_exceeds_threshold(tiny_llama, monkeypatch, capsys):
    monkeypatch.delenv("SHARPI_SNAPKV_BUDGET", raising=False)
    monkeypatch.setenv("SHARPI_SNAPKV_AUTO_MIB", "0")
    m = engine.load(tiny_llama, backend="reference")
    assert m.snapkv is not None and m.snapkv.budget == 2048
    err = capsys.readouterr().err
    assert err.count("SnapKV auto-on") == 1 and "SHARPI_SNAPKV_BUDGET=0" in err


def test_budget_zero_disables_auto(tiny_llama, monkeypatch, capsys):
    monkeypatch.setenv("SHARPI_SNAPKV_AUTO_MIB", "0")
    monkeypatch.setenv("SHARPI_SNAPKV_BUDGET", "0")
    assert engine.load(tiny_llama, backend="reference").snapkv is None
    assert "auto-on" not in capsys.readouterr().err


def test_env_then_api(tiny_llama, monkeypatch):
    monkeypatch.setenv("SHARPI_SNAPKV_BUDGET", "300")
    monkeypatch.setenv("SHARPI_SNAPKV_WINDOW", "8")
    monkeypatch.setenv("SHARPI_SNAPKV_GRANULARITY", "layer")
    m = engine.load(tiny_llama, backend="reference")
    assert (m.snapkv.budget, m.snapkv.window, m.snapkv.granularity) == (300, 8, "layer")
    m = engine.load(tiny_llama, backend="reference", snapkv_budget=200, snapkv_pool="max")
    assert (m.snapkv.budget, m.snapkv.window, m.snapkv.pool) == (200, 8, "max")
    cfg = SnapKvConfig(budget=100, window=4, min_tokens=0)
    assert engine.load(tiny_llama, backend="reference", snapkv=cfg).snapkv is cfg


def test_budget_not_above_window_plus_sinks(tiny_llama, monkeypatch):
    monkeypatch.delenv("SHARPI_SNAPKV_BUDGET", raising=False)
    with pytest.raises(ConfigError, match=r"--kv-budget/SHARPI_SNAPKV_BUDGET \(36\) must be larger than "
                                          r"--kv-window \+ --kv-sinks"):
        engine.load(tiny_llama, backend="reference", snapkv_budget=36)     # window 32 + sinks 4


def test_cli_flag_beats_env_and_stats_print_eviction(tiny_llama):
    env = {"SHARPI_SNAPKV_BUDGET": "5000", "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-m", "engine.cli", "run", str(tiny_llama), "-p", "abcdefgh" * 40,
                        "-n", "4", "--kv-budget", "100", "--kv-window", "8", "--kv-min-tokens", "16",
                        "--ignore-eos", "--stats"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "SnapKV budget 100" in r.stderr and "KV cache: 103 rows for 323 positions" in r.stderr
    assert "scoring+compaction" in r.stderr


def test_cli_budget_too_small_is_one_line(tiny_llama):
    r = subprocess.run([sys.executable, "-m", "engine.cli", "run", str(tiny_llama), "-p", "hi",
                        "--kv-budget", "10"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and r.stderr.strip().count("\n") == 0 and "budget" in r.stderr


def test_merge_from_env_flag_and_argument(tiny_llama, monkeypatch):
    """Merged rows: env, then the API; too large for the budget is one line naming the flags;
    the CLI's --stats count the merged rows within the budget."""
    monkeypatch.setenv("SHARPI_SNAPKV_BUDGET", "300")
    monkeypatch.setenv("SHARPI_SNAPKV_MERGE", "16")
    assert engine.load(tiny_llama, backend="reference").snapkv.merge == 16
    assert engine.load(tiny_llama, backend="reference", snapkv_merge=32).snapkv.merge == 32
    with pytest.raises(ConfigError, match=r"--kv-budget/SHARPI_SNAPKV_BUDGET \(300\) must be larger than "
                                          r"--kv-merge"):
        engine.load(tiny_llama, backend="reference", snapkv_merge=270)
    r = subprocess.run([sys.executable, "-m", "engine.cli", "run", str(tiny_llama), "-p", "abcdefgh" * 40,
                        "-n", "4", "--kv-budget", "100", "--kv-window", "8", "--kv-min-tokens", "16",
                        "--kv-merge", "10", "--ignore-eos", "--stats"],
                       capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "10 of them merged rows" in r.stderr and "KV cache: 103 rows for 323 positions" in r.stderr


def test_pyramid_beta_from_env_flag_and_argument(tiny_llama, monkeypatch):
    monkeypatch.setenv("SHARPI_SNAPKV_BUDGET", "300")
    monkeypatch.setenv("SHARPI_SNAPKV_ALLOCATION", "pyramid")
    assert engine.load(tiny_llama, backend="reference").snapkv.pyramid_beta == 20
    monkeypatch.setenv("SHARPI_SNAPKV_PYRAMID_BETA", "5")
    assert engine.load(tiny_llama, backend="reference").snapkv.pyramid_beta == 5
    assert engine.load(tiny_llama, backend="reference", snapkv_pyramid_beta=2).snapkv.pyramid_beta == 2
    with pytest.raises(ConfigError, match=r"snapkv_pyramid_beta must be >= 1, got 0"):
        engine.load(tiny_llama, backend="reference", snapkv_pyramid_beta=0)
    r = subprocess.run([sys.executable, "-m", "engine.cli", "run", str(tiny_llama), "-p", "abcdefgh" * 40,
                        "-n", "2", "--kv-budget", "100", "--kv-window", "8", "--kv-min-tokens", "16",
                        "--kv-allocation", "pyramid", "--kv-pyramid-beta", "4", "--ignore-eos", "--stats"],
                       capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "pyramid layer budgets (beta 4)" in r.stderr
