"""The documentation: the README stays a short front page whose commands work, and the
MkDocs site under docs/ builds strictly (broken links, missing pages, stale generated
tables fail it)."""
from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
README_LIMIT = 15_000


def _gen():
    spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "tools" / "gen_config_docs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _code_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced code block."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)]


def _shell_commands(text: str) -> list[list[str]]:
    """The shell commands of the README's plain code blocks, comments dropped, `\\` lines joined."""
    out = []
    for lang, body in _code_blocks(text):
        if lang not in ("", "sh", "bash", "shell"):
            continue
        for line in body.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if argv:
                out.append(argv)
    return out


def test_readme_is_short():
    assert len(README) < README_LIMIT, f"README.md has {len(README)} characters (limit {README_LIMIT})"


def test_readme_engine_commands_parse():
    from engine.cli import build_parser

    commands = [argv for argv in _shell_commands(README) if argv[0] == "engine"]
    assert len(commands) >= 5, commands
    for argv in commands:
        try:
            args = build_parser().parse_args(argv[1:])
        except SystemExit as e:      # argparse's usage error
            pytest.fail(f"README command does not parse ({e.code}): {shlex.join(argv)}")
        assert callable(args.func), argv


def test_readme_other_commands_exist():
    make_targets = set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), re.M))
    for argv in _shell_commands(README):
        if argv[0] == "make":
            targets = [a for a in argv[1:] if "=" not in a]
            assert set(targets) <= make_targets, f"unknown make target in {shlex.join(argv)}"
        elif argv[0] == "python":
            assert (ROOT / argv[1]).is_file(), f"README runs a missing script: {shlex.join(argv)}"
        else:
            assert argv[0] == "engine", f"README shows a command this test does not check: {shlex.join(argv)}"
    # the eval commands of the results table (inline code) parse too
    from engine.cli import build_parser
    for cmd in re.findall(r"`(engine (?:eval|bench) [^`]+)`", README):
        argv = shlex.split(cmd)
        try:
            build_parser().parse_args(argv[1:])
        except SystemExit:
            pytest.fail(f"README command does not parse: {cmd}")


def test_readme_python_examples_compile():
    blocks = [body for lang, body in _code_blocks(README) if lang == "python"]
    assert blocks
    for body in blocks:
        compile(body, "README.md", "exec")


def test_readme_links_resolve():
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        if "://" in target:
            continue
        assert (ROOT / target).exists(), f"README links to a missing file: {target}"


def test_generated_tables_are_current():
    stale = _gen().stale_pages()
    assert not stale, f"stale generated tables in {stale}: run python tools/gen_config_docs.py"


def test_settings_table_covers_every_setting():
    from engine.config import SETTINGS

    text = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    for spec in SETTINGS:
        assert f"| `{spec.field}` |" in text
        assert getattr(spec.parse, "range", ""), f"{spec.field}: its parser has no .range for the docs"


def test_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs extra is not installed (pip install -e .[docs])")
    pytest.importorskip("material", reason="mkdocs-material is not installed (pip install -e .[docs])")
    pytest.importorskip("mkdocstrings", reason="mkdocstrings is not installed (pip install -e .[docs])")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", str(tmp_path / "site")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**__import__("os").environ, "NO_MKDOCS_2_WARNING": "1"})
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout}\n{r.stderr}"
    assert (tmp_path / "site" / "configuration" / "index.html").is_file()
