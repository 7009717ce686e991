#!/usr/bin/env python3
"""Generate the documentation's reference tables from the code, so they cannot drift.

  docs/configuration.md  every setting of engine/config.py's SETTINGS registry:
                         env var, CLI flag, Python API argument, server request field,
                         default, accepted range, meaning
  docs/cli.md            every `engine` subcommand's arguments, from the argparse
                         parser that `engine` itself runs (engine.cli.build_parser)

Each table sits between `<!-- BEGIN generated: NAME -->` and `<!-- END generated: NAME -->`
in its page; the rest of the page is hand-written.

  python tools/gen_config_docs.py           rewrite the tables in place
  python tools/gen_config_docs.py --check   exit 1 (naming the pages) if a table is stale

`mkdocs build --strict` runs the same check (tools/mkdocs_hooks.py), and so does
tests/unit/test_docs.py.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BEGIN = "<!-- BEGIN generated: {name} (tools/gen_config_docs.py; do not edit by hand) -->"
END = "<!-- END generated: {name} -->"


def _cell(text) -> str:
    """One markdown table cell: pipes escaped, no newlines."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def _code(text) -> str:
    return f"`{text}`" if text not in (None, "") else ""


def settings_table() -> str:
    from engine.config import ENV_ONLY, SETTINGS
    from engine.serve.protocol import KV_FIELDS

    read = {m for d in ("engine", "backends") for f in (ROOT / d).rglob("*.py")
            for m in re.findall(r'env_setting\("(\w+)"', f.read_text(encoding="utf-8"))}
    if read != set(ENV_ONLY):
        raise SystemExit(f"gen_config_docs: env_setting() reads {sorted(read)}, ENV_ONLY names {sorted(ENV_ONLY)}")
    request_field = {field: name for name, field in KV_FIELDS.items()}
    request_field["kv_dtype"] = "kv_dtype"           # ChatRequest/CompletionRequest.kv_dtype
    rows = ["| setting | env var | CLI flag | Python API | server request field | default | range | meaning |",
            "|---|---|---|---|---|---|---|---|"]
    for spec in SETTINGS:
        # engine.load(**overrides) takes any Settings field; serve_* ones only mean something to `engine serve`
        if spec.field in ENV_ONLY:
            api = f"none: environment only ({ENV_ONLY[spec.field]})"
        else:
            api = "" if spec.field.startswith("serve_") else f"`engine.load({spec.field}=...)`"
        default = "unset" if spec.default is None else _code(spec.default)
        rows.append("| " + " | ".join(_cell(c) for c in (
            f"`{spec.field}`", _code(spec.env), _code(spec.flag), api,
            _code(request_field.get(spec.field)), default, getattr(spec.parse, "range", ""), spec.doc)) + " |")
    return "\n".join(rows) + "\n"


def _subcommands():
    from engine.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {a.dest: a.help for a in sub._choices_actions}
    return [(name, helps.get(name, ""), p) for name, p in sub.choices.items()]


def _action_row(action) -> str | None:
    if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
        return None
    if action.option_strings:
        metavar = "" if action.nargs == 0 else " " + (action.metavar or action.dest.upper())
        metavar += f" [{metavar.strip()} ...]" if action.nargs in ("+", "*") else ""
        names = ", ".join(f"`{o}{metavar}`" for o in action.option_strings)
    else:
        names = f"`{action.metavar or action.dest}`" + (" (optional)" if action.nargs in ("?", "*") else "")
    default = action.default
    if default is None:                         # a setting's flag: None lets the env var through
        from engine.config import SETTINGS
        default = next((spec.default for spec in SETTINGS if spec.flag in action.option_strings), None)
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)) or default in (None, argparse.SUPPRESS):
        default = ""
    elif isinstance(default, (list, tuple)):
        default = ",".join(map(str, default))
    choices = ", ".join(map(str, action.choices)) if action.choices else ""
    helptext = (action.help or "") % dict(vars(action), default=action.default)    # as argparse: %% is %
    if choices:
        helptext = f"{helptext} (one of {choices})" if helptext else f"one of {choices}"
    return "| " + " | ".join(_cell(c) for c in (names, _code(default), helptext)) + " |"


def cli_tables() -> str:
    out = []
    for name, helptext, parser in _subcommands():
        out.append(f"### `engine {name}`\n\n{_cell(helptext[:1].upper() + helptext[1:])}.\n")
        out.append("| argument | default | meaning |\n|---|---|---|")
        out.extend(r for r in map(_action_row, parser._actions) if r)
        out.append("")
    return "\n".join(out)


GENERATED = {
    "docs/configuration.md": {"settings": settings_table},
    "docs/cli.md": {"cli": cli_tables},
}


def render(text: str, name: str, body: str) -> str:
    """`text` with the block `name` replaced by `body` (an error if the markers are missing)."""
    begin, end = BEGIN.format(name=name), END.format(name=name)
    pattern = re.compile(re.escape(begin) + r"\n.*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise SystemExit(f"gen_config_docs: the markers of block '{name}' are missing")
    return pattern.sub(lambda _: f"{begin}\n{body}{end}", text, count=1)


def fresh(path: str, text: str) -> str:
    """The page `path` (its current text) with its generated blocks made afresh."""
    for name, make in GENERATED.get(path, {}).items():
        text = render(text, name, make())
    return text


def stale_pages() -> list[str]:
    out = []
    for path in GENERATED:
        text = (ROOT / path).read_text(encoding="utf-8")
        if fresh(path, text) != text:
            out.append(path)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only report stale pages (exit 1)")
    args = ap.parse_args(argv)
    if args.check:
        stale = stale_pages()
        for path in stale:
            print(f"{path}: generated tables are stale; run python tools/gen_config_docs.py", file=sys.stderr)
        return 1 if stale else 0
    for path in GENERATED:
        p = ROOT / path
        text = p.read_text(encoding="utf-8")
        new = fresh(path, text)
        if new != text:
            p.write_text(new, encoding="utf-8")
            print(f"updated {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
