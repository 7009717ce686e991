"""The chat page at `GET /` (engine/serve/static/chat.html), driven in headless
Chromium through playwright against the server test_server.py starts (its fixtures
and helpers, imported). The browser is the system's (`apt-get install chromium`,
tools/setup.sh), never playwright's own download.

Every wait is bounded: each page wait has a timeout of WAIT_S, the server's waits
are test_server's, and a held worker is released after HOLD_S at most.
"""
import json
import shutil
import urllib.request

import pytest

from test_server import _idle_after, served  # noqa: F401  (fixtures too)
from waiting import held_worker, wait_until

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright not installed (pip install -e .[test])")

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
WAIT_S = 30.0              # longest any page wait takes (a few tokens of smollm2)
MODEL = "SmolLM2-135M-Instruct.Q4_1"


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.skip("no system chromium on PATH (apt-get install chromium; tools/setup.sh does)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        yield b
        b.close()


@pytest.fixture(scope="module")
def warm(served):
    """One chat request before any page waits: a cold numba cache compiles the kernels
    on first use, which must not count against a page's WAIT_S."""
    served.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=2, temperature=0)


@pytest.fixture
def page(browser, served, warm):
    """The chat page, loaded and showing the model's name; no request may leave the server."""
    context = browser.new_context()
    pg = context.new_page()
    pg.set_default_timeout(WAIT_S * 1000)
    urls = []
    pg.on("request", lambda r: urls.append(r.url))
    pg.goto(served.url + "/")
    pg.wait_for_function(f"document.getElementById('model').textContent === {json.dumps(MODEL)}")
    yield pg
    context.close()
    assert urls and all(u.startswith(served.url + "/") or u.startswith("data:") for u in urls), urls


def settings(page, max_tokens, temperature=0, kv_budget=""):
    page.fill("#max_tokens", str(max_tokens))
    page.fill("#temperature", str(temperature))
    page.fill("#kv_budget", str(kv_budget))


def send(page, prompt: str) -> dict:
    """Type a prompt and press Enter; the JSON body the page posted."""
    page.fill("#prompt", prompt)
    with page.expect_request("**/v1/chat/completions") as request:
        page.press("#prompt", "Enter")
    return request.value.post_data_json


def settled(page) -> str:
    """Wait until the page is no longer generating; its state (done, stopped, error)."""
    page.wait_for_function("document.getElementById('status').dataset.state !== 'busy'")
    return page.get_attribute("#status", "data-state")


def last_answer(page) -> str:
    return page.locator(".msg.assistant .text").last.text_content()


def test_get_root_serves_the_page(served):
    with urllib.request.urlopen(served.url + "/", timeout=10) as r:
        assert r.status == 200 and r.headers["Content-Type"] == "text/html; charset=utf-8"
        html = r.read().decode()
    assert "<title>" in html and "/v1/chat/completions" in html
    assert "http://" not in html and "https://" not in html          # nothing fetched from elsewhere


def test_streamed_answer_equals_the_plain_response(page, served):
    c = served.client()
    settings(page, max_tokens=12)
    body = send(page, "Name three colors.")
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 12 and body["temperature"] == 0 and "kv_budget" not in body
    assert body["model"] == MODEL
    assert settled(page) == "done", page.text_content("#error")
    messages = [{"role": "user", "content": "Name three colors."}]
    want = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert last_answer(page) == want.choices[0].message.content != ""
    usage = page.text_content("#usage")
    assert f"prompt {want.usage.prompt_tokens} tokens, completion {want.usage.completion_tokens} tokens" in usage
    assert "KV " in usage

    # the next turn sends the whole conversation, and kv_budget when one is given
    settings(page, max_tokens=6, kv_budget=0)
    body = send(page, "One more?")
    messages += [{"role": "assistant", "content": want.choices[0].message.content},
                 {"role": "user", "content": "One more?"}]
    assert body["messages"] == messages and body["kv_budget"] == 0
    assert settled(page) == "done", page.text_content("#error")
    want = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                     extra_body={"kv_budget": 0})
    assert last_answer(page) == want.choices[0].message.content
    assert page.locator(".msg").count() == 4


def test_an_error_is_shown_and_the_prompt_kept(page, served):
    prompt = "Say <b>hi</b> & bye"
    settings(page, max_tokens=0)
    body = send(page, prompt)
    assert settled(page) == "error"
    status, answer = served.post_raw("/v1/chat/completions", json.dumps(body).encode())
    assert status == 400 and answer["error"]["message"]
    assert page.text_content("#error") == "error: " + answer["error"]["message"]
    assert page.locator(".msg").count() == 0 and page.input_value("#prompt") == prompt

    settings(page, max_tokens=2)                      # fixed: the kept prompt goes again
    page.press("#prompt", "Enter")
    assert settled(page) == "done" and page.text_content("#error") == ""
    assert page.locator(".msg.user .text").text_content() == prompt          # shown as text, not HTML
    assert page.locator("#log b").count() == 0


def test_stop_aborts_a_long_generation(page, served):
    before = served.get("/state")["cancelled"]
    settings(page, max_tokens=500)
    with held_worker(served.model):                   # one token, then the worker waits
        send(page, "Tell me a long story about a dragon.")
        page.wait_for_function("document.querySelector('.msg.assistant .text').textContent !== ''")
        assert page.get_attribute("#status", "data-state") == "busy" and page.is_disabled("#send")
        page.click("#stop")
        assert settled(page) == "stopped"
        assert page.is_enabled("#send") and page.is_disabled("#stop")
    # released: the worker drops the request (cancelled when its connection closed) before its next step
    wait_until(served.idle, "the stopped request's cache to be freed")
    assert served.get("/state")["cancelled"] == before + 1
    partial = last_answer(page)
    assert partial and page.locator(".msg.assistant.partial").count() == 1

    settings(page, max_tokens=2)                      # ready again; the partial answer is in the conversation
    body = send(page, "Thanks.")
    assert body["messages"][1] == {"role": "assistant", "content": partial}
    assert settled(page) == "done"
