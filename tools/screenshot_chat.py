"""A screenshot of `engine serve`'s chat page with a streamed answer on it, for the
README (docs/chat_page.png). Starts the server in-process on a loopback port with
the given model, opens `GET /` in the system's headless Chromium (playwright, as
tests/e2e/test_chat_page.py), asks one question and waits for the answer.

    python tools/screenshot_chat.py [--model smollm2] [--out docs/chat_page.png]
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import engine                                    # noqa: E402
from engine.serve import build_app, serve_in_thread  # noqa: E402

QUESTION = "Write two sentences about lighthouses."


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a .gguf path or an installed model's name "
                    "(`engine models`; default: qwen2.5-coder-0.5b)")
    ap.add_argument("--out", default="docs/chat_page.png")
    ap.add_argument("--max-tokens", dest="max_tokens", type=int, default=48)
    a = ap.parse_args(argv)
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("no system chromium on PATH (apt-get install chromium; tools/setup.sh does)")
    from playwright.sync_api import sync_playwright

    model = engine.load(a.model, ctx=2048, snapkv_budget=0)
    server = serve_in_thread(build_app(model))
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, headless=True)
            page = browser.new_page(viewport={"width": 900, "height": 640})
            page.set_default_timeout(120_000)
            page.goto(server.url + "/")
            page.wait_for_function("document.getElementById('model').textContent !== ''")
            page.fill("#max_tokens", str(a.max_tokens))
            page.fill("#temperature", "0")
            page.fill("#prompt", QUESTION)
            page.press("#prompt", "Enter")
            page.wait_for_function("document.getElementById('status').dataset.state === 'done'")
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=a.out)
            browser.close()
    finally:
        server.stop()
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
