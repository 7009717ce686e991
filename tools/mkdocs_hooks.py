"""MkDocs hooks (mkdocs.yml `hooks:`): a page whose generated tables (tools/gen_config_docs.py)
no longer match the code is a warning, so `mkdocs build --strict` fails on it."""
from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

log = logging.getLogger("mkdocs.hooks.gen_config_docs")

_spec = importlib.util.spec_from_file_location("gen_config_docs", Path(__file__).with_name("gen_config_docs.py"))
gen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen)


def on_page_markdown(markdown, page, config, files, **kwargs):
    path = f"docs/{page.file.src_uri}"
    if path in gen.GENERATED and gen.fresh(path, markdown) != markdown:
        log.warning("%s: its generated tables are stale (the code changed); run python tools/gen_config_docs.py",
                    path)
    return markdown
