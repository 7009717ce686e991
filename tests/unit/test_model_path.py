"""Installed models by short name (engine/model_path.py)."""
import pytest

from engine import model_path
from engine.errors import EngineError


def test_short_names_resolve_to_the_installed_files(monkeypatch, tmp_path):
    fake = tmp_path / "gemma-3-270m-q4_k_m.gguf"
    fake.write_bytes(b"GGUF")
    monkeypatch.setattr(model_path, "GEMMA3_FILE", fake)
    monkeypatch.chdir(tmp_path)
    assert model_path.model_path_or_default("gemma3") == fake
    assert model_path.model_path_or_default("some/file.gguf") == "some/file.gguf"   # paths pass through
    (tmp_path / "gemma3").write_bytes(b"")                                           # a file of that name wins
    assert model_path.model_path_or_default("gemma3") == "gemma3"


def test_a_short_name_not_installed_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setattr(model_path, "GEMMA3_FILE", tmp_path / "absent.gguf")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(EngineError, match=r"^model 'gemma3' is not installed: run `make setup`$"):
        model_path.model_path_or_default("gemma3")
