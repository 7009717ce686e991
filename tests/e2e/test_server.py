"""`engine serve`: the OpenAI-compatible server, driven with the official `openai`
client against a server started here on a loopback port (in-process, so a test can
hold the worker still; one test starts the real `engine serve` command).

Every wait is bounded: `wait_until` polls at most WAIT_S seconds, every client
call has a timeout, and a held worker is released after HOLD_S seconds at most.
"""
import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from waiting import held_worker, wait_until

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

import engine  # noqa: E402
from engine.serve import build_app, serve_in_thread  # noqa: E402
from engine.snapkv import SnapKvConfig  # noqa: E402

CTX = 1024
MAX_RUNNING = 2        # the served fixture decodes two requests per batch
WAIT_S = 20.0          # longest any poll waits
DOC = ("The archive of the harbour office lists every ship that arrived in the spring. "
       "The Marigold came from Lisbon with wine, the Heron from Bergen with dried fish, "
       "and the Starling from Genoa with paper and glass. ") * 3 + \
      "The harbour master's secret code is 4711. Question: what is the secret code? Answer: the code is"
KV = dict(kv_budget=64, kv_window=32, kv_sinks=4, kv_kernel=31, kv_pool="avg", kv_granularity="head",
          kv_min_tokens=128)
KV_POLICY = SnapKvConfig(budget=64, window=32, sinks=4, kernel=31, pool="avg", granularity="head", min_tokens=128)




class Served:
    def __init__(self, url: str, app, model):
        self.url, self.app, self.model = url, app, model
        self.scheduler = app.state.scheduler

    def client(self, **kw):
        return openai.OpenAI(**{"base_url": self.url + "/v1", "api_key": "unused", "max_retries": 0,
                                "timeout": 120, **kw})

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=10) as r:
            return json.loads(r.read())

    def post_raw(self, path: str, data: bytes, content_type: str = "application/json"):
        """(status, JSON body) of a POST with this exact body."""
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": content_type})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def idle(self) -> bool:
        s = self.get("/state")
        return not s["running"] and s["waiting"] == 0 and s["kv_bytes_held"] == 0


@pytest.fixture(scope="module")
def served(smollm2_path):
    model = engine.load(smollm2_path, ctx=CTX, snapkv_budget=0)
    app = build_app(model, max_queue=1, max_running=MAX_RUNNING)
    server = serve_in_thread(app)
    yield Served(server.url, app, model)
    server.stop()


class Reference:
    """A second, independent model: what `engine.load(...).generate` says (each answer
    computed once per module)."""

    def __init__(self, model):
        self.model, self._answers = model, {}

    def generate(self, prompt, **kw):
        key = repr((prompt, sorted(kw.items())))
        if key not in self._answers:
            self._answers[key] = self.model.generate(prompt, **kw)
        return self._answers[key]

    def tokenize(self, text, **kw):
        return self.model.tokenize(text, **kw)


@pytest.fixture(scope="module")
def reference(smollm2_path):
    return Reference(engine.load(smollm2_path, ctx=CTX, snapkv_budget=0))


@pytest.fixture(autouse=True)
def _idle_after(request):
    yield
    if "served" in request.fixturenames:
        s = request.getfixturevalue("served")
        wait_until(s.idle, "the server to be idle")      # no test leaves a request or cache behind


def stream_text(stream, chat: bool):
    """(text, finish_reason, pieces) of a streamed response."""
    pieces, reason = [], None
    for chunk in stream:
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        piece = (c.delta.content or "") if chat else c.text
        if piece:
            pieces.append(piece)
        reason = c.finish_reason or reason
    return "".join(pieces), reason, pieces


# -- endpoints ------------------------------------------------------------------------------------
def test_health_and_models(served):
    assert served.get("/health") == {"status": "ok"}
    models = served.client().models.list()
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct.Q4_1"]


def test_completion_matches_generate(served, reference):
    prompt = "The capital of France is"
    want = reference.generate(prompt, max_tokens=8, temperature=0.0)
    c = served.client()
    r = c.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt=prompt, max_tokens=8, temperature=0)
    assert r.choices[0].text == want.text
    assert r.choices[0].finish_reason == ("length" if want.finish_reason == "length" else "stop")
    assert r.usage.prompt_tokens == len(reference.tokenize(prompt))
    assert r.usage.completion_tokens == len(want.tokens)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    extra = r.usage.model_extra
    assert extra["kv_bytes"] == extra["kv_bytes_full"] > 0 and extra["kv_policy"] is None
    chunks = list(c.completions.create(prompt=prompt, max_tokens=8, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, model="SmolLM2-135M-Instruct.Q4_1.gguf"))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == want.text
    assert chunks[-1].usage.completion_tokens == len(want.tokens) and not chunks[-1].choices
    # token ids as the prompt give the same answer
    r = c.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt=reference.tokenize(prompt),
                             max_tokens=8, temperature=0)
    assert r.choices[0].text == want.text


def test_chat_matches_generate(served, reference):
    messages = [{"role": "user", "content": "Name three colors."}]
    want = reference.generate(messages, chat=True, max_tokens=12, temperature=0.0)
    c = served.client()
    r = c.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", messages=messages, max_tokens=12,
                                  temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.text
    assert r.choices[0].finish_reason == ("stop" if want.finish_reason == "stop" else "length")
    stream = c.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", messages=messages, max_tokens=12,
                                       temperature=0, stream=True)
    first = next(iter(stream))
    assert first.choices[0].delta.role == "assistant"
    text, reason, _ = stream_text(stream, chat=True)
    assert text == want.text and reason == r.choices[0].finish_reason
    # content as a list of text parts, the same conversation
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name three "}, {"type": "text", "text": "colors."}]}]
    r = c.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", messages=parts, max_tokens=12, temperature=0)
    assert r.choices[0].message.content == want.text


def test_the_next_chat_turn_reuses_the_cache(served, reference):
    """A chat request that extends a finished one runs only its new tokens (usage says how
    many were reused) and answers as a fresh prefill does; with eviction on, the reused
    prompt is still evicted as a whole."""
    c = served.client()
    kw = dict(model="SmolLM2-135M-Instruct.Q4_1", max_tokens=10, temperature=0)
    turn1 = [{"role": "user", "content": "What colour is the sky on a clear day?"}]
    first = c.chat.completions.create(messages=turn1, **kw)
    turn2 = turn1 + [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And what colour is fresh grass?"}]
    second = c.chat.completions.create(messages=turn2, **kw)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    assert second.choices[0].message.content == reference.generate(turn2, chat=True, max_tokens=10,
                                                                   temperature=0.0).text
    assert served.get("/state")["prompt_cache"]["caches"] >= 1
    evicting = c.chat.completions.create(messages=turn2 + [{"role": "user", "content": "Thanks."}],
                                         extra_body=KV, **kw)
    u = evicting.usage.model_extra
    assert evicting.usage.prompt_tokens_details.cached_tokens > 0 and u["kv_policy"] is None    # < min_tokens
    long = [{"role": "user", "content": DOC}]
    want = reference.generate(long, chat=True, max_tokens=10, temperature=0.0, snapkv=KV_POLICY)
    cached = []
    for _ in range(2):      # 1st: from the chat's cache (the system prompt), evicted as a whole
        r = c.chat.completions.create(messages=long, extra_body=KV, **kw)
        assert r.usage.model_extra["kv_bytes"] < r.usage.model_extra["kv_bytes_full"]
        assert r.choices[0].message.content == want.text
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
    # 2nd: from the 1st's whole prompt, kept before its eviction with its window's queries: only
    # the last token runs again
    assert cached[0] > 0 and cached[1] == r.usage.prompt_tokens - 1


def test_a_follow_up_to_an_evicted_conversation_continues_its_whole_prompt(served, reference):
    """After an evicting request, the server keeps a branch of its whole prompt's cache
    (taken before compaction): the next turn runs only its new tokens and is evicted as a
    whole with its own question as the window, answering as a fresh prefill does."""
    c = served.client()
    kw = dict(model="SmolLM2-135M-Instruct.Q4_1", max_tokens=10, temperature=0, extra_body=KV)
    turn1 = [{"role": "user", "content": DOC + " What is the first word of the text?"}]
    first = c.chat.completions.create(messages=turn1, **kw)
    assert first.usage.model_extra["kv_bytes"] < first.usage.model_extra["kv_bytes_full"]
    assert served.get("/state")["prompt_cache"]["caches"] >= 1
    turn2 = turn1 + [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And the last word?"}]
    before = _metrics(served)
    second = c.chat.completions.create(messages=turn2, **kw)
    after = _metrics(served)
    u = second.usage.model_extra
    # reused: turn 1's whole prompt (the window's queries over its last tokens were kept with it)
    assert second.usage.prompt_tokens - KV_POLICY.window < first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens
    assert after["snapkv_prompt_tokens_cached_total"] - before["snapkv_prompt_tokens_cached_total"] == \
        first.usage.prompt_tokens
    assert after["snapkv_prompt_tokens_total"] - before["snapkv_prompt_tokens_total"] == \
        second.usage.prompt_tokens - first.usage.prompt_tokens
    assert u["kv_policy"] is not None and u["kv_bytes"] < u["kv_bytes_full"]
    assert second.choices[0].message.content == reference.generate(turn2, chat=True, max_tokens=10, temperature=0.0,
                                                                   snapkv=KV_POLICY).text


def test_a_follow_up_to_an_adaptive_conversation_is_evicted_again(served, reference):
    """Adaptive head budgets leave a cache that SnapKV cannot score again, but the next
    turn reuses the branch kept before compaction, so it is evicted as a whole as with
    uniform budgets, and answers as a fresh prefill does."""
    c = served.client()
    adaptive = dataclasses.replace(KV_POLICY, allocation="adaptive")
    kw = dict(model="SmolLM2-135M-Instruct.Q4_1", max_tokens=10, temperature=0,
              extra_body={**KV, "kv_allocation": "adaptive"})
    turn1 = [{"role": "user", "content": DOC + " Which word comes second?"}]
    first = c.chat.completions.create(messages=turn1, **kw)
    turn2 = turn1 + [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And the third?"}]
    second = c.chat.completions.create(messages=turn2, **kw)
    u = second.usage.model_extra
    assert second.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens
    assert "adaptive head budgets" in u["kv_policy"] and u["kv_bytes"] < u["kv_bytes_full"]
    assert second.choices[0].message.content == reference.generate(turn2, chat=True, max_tokens=10, temperature=0.0,
                                                                   snapkv=adaptive).text


def test_seeded_sampling_is_reproducible(served):
    c = served.client()
    kw = dict(model="SmolLM2-135M-Instruct.Q4_1", prompt="Once upon a time", max_tokens=6, temperature=0.9,
              top_p=0.9, seed=7, extra_body={"top_k": 40})
    assert c.completions.create(**kw).choices[0].text == c.completions.create(**kw).choices[0].text


def test_stop_strings(served, reference):
    prompt = "The capital of France is"
    full = reference.generate(prompt, max_tokens=16, temperature=0.0, ignore_eos=True).text
    k = len(full) // 3
    stop = full[k:k + 8]
    assert len(reference.tokenize(stop, add_bos=False)) >= 2          # the stop string spans tokens
    want = full[:full.find(stop)]
    c = served.client()
    common = dict(model="SmolLM2-135M-Instruct.Q4_1", prompt=prompt, max_tokens=16, temperature=0,
                  extra_body={"ignore_eos": True})
    r = c.completions.create(stop=stop, **common)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop")
    text, reason, pieces = stream_text(c.completions.create(stop=["never appears", stop], stream=True, **common),
                                       chat=False)
    # nothing that could be the stop string's start was sent before it was ruled out
    assert (text, reason) == (want, "stop") and len(pieces) >= 2
    # a stop string whose start appears but not the rest: the held-back text comes out in the end
    near = full[k:k + 3] + "\x01never"
    text, reason, _ = stream_text(c.completions.create(stop=near, stream=True, **common), chat=False)
    assert (text, reason) == (full, "length")


def test_logprobs(served, reference):
    """Completions (`logprobs: k`) and chat (`logprobs: true, top_logprobs: k`), plain and
    streamed: one entry per generated token, the token's log-probability under the model
    (log-softmax of the logits, checked against the engine's own for the first token),
    its k likeliest alternatives (greedy: the chosen token first), token texts that add
    up to the answer; out-of-range values give 400s."""
    c = served.client()
    prompt = "The capital of France is"
    model = reference.model
    _, logits = model.prefill(reference.tokenize(prompt), snapkv=False)
    z = logits.astype(np.float64)
    log_softmax = z - (z.max() + np.log(np.exp(z - z.max()).sum()))
    kw = dict(model="SmolLM2-135M-Instruct.Q4_1", prompt=prompt, max_tokens=6, temperature=0)
    r = c.completions.create(logprobs=3, **kw)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.tokens) == r.usage.completion_tokens
    first = int(np.argmax(z))
    assert lp.tokens[0] == model.tokenizer.token_bytes(first).decode()
    # 3e-4: a server step may hold other tokens than a lone prefill does, and steps of more
    # than 8 tokens quantize activations to 2 int8 planes instead of 3 (~1e-5 relative)
    assert abs(lp.token_logprobs[0] - log_softmax[first]) < 3e-4
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and value <= 0 and max(top.values()) == value and top[tok] == value
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    chunks = [ch for ch in c.completions.create(logprobs=3, stream=True, **kw) if ch.choices]
    streamed = [e for ch in chunks if ch.choices[0].logprobs for e in ch.choices[0].logprobs.tokens]
    assert streamed == lp.tokens
    assert [o for ch in chunks if ch.choices[0].logprobs for o in ch.choices[0].logprobs.text_offset] == lp.text_offset
    assert c.completions.create(**kw).choices[0].logprobs is None

    messages = [{"role": "user", "content": "Name three colors."}]
    ckw = dict(model="SmolLM2-135M-Instruct.Q4_1", messages=messages, max_tokens=8, temperature=0)
    r = c.chat.completions.create(logprobs=True, top_logprobs=2, **ckw)
    content = r.choices[0].logprobs.content
    assert "".join(e.token for e in content) == r.choices[0].message.content
    assert len(content) == r.usage.completion_tokens
    for e in content:
        assert bytes(e.bytes).decode() == e.token and len(e.top_logprobs) == 2
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob
        assert e.top_logprobs[1].logprob <= e.logprob
    stream = c.chat.completions.create(logprobs=True, stream=True, **ckw)
    entries = [e for ch in stream if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [e.token for e in entries] == [e.token for e in content]       # (its prompt partly from the cache)
    # the cached prompt prefix came from a step of other tokens (2 or 3 activation planes, bf16
    # K/V roundings): whole vs token-by-token prefill of SmolLM2 differ by up to ~0.02 in logprob
    assert np.allclose([e.logprob for e in entries], [e.logprob for e in content], atol=3e-2)
    assert all(e.top_logprobs == [] for e in entries)
    assert c.chat.completions.create(**ckw).choices[0].logprobs is None

    for path, body, param in [("/v1/completions", dict(kw, logprobs=21), "logprobs"),
                              ("/v1/completions", dict(kw, logprobs=-1), "logprobs"),
                              ("/v1/chat/completions", dict(ckw, top_logprobs=2), "top_logprobs"),
                              ("/v1/chat/completions", dict(ckw, logprobs=True, top_logprobs=99), "top_logprobs")]:
        status, answer = served.post_raw(path, json.dumps(body).encode())
        assert status == 400 and answer["error"]["param"] == param, (body, answer)


def test_tokenize_detokenize_and_metrics(served, reference):
    """/tokenize and /detokenize (vLLM's and llama.cpp's field names) agree with the
    engine's tokenizer and chat template; /metrics counts requests and tokens in
    Prometheus' text format."""
    text = "Hello world, 12345 ünïcode"
    ids = reference.tokenize(text)
    post = lambda path, body: served.post_raw(path, json.dumps(body).encode())      # noqa: E731
    assert post("/tokenize", {"prompt": text}) == (200, {"tokens": ids, "count": len(ids), "max_model_len": CTX})
    assert post("/tokenize", {"content": text, "add_special": False})[1]["tokens"] == \
        reference.tokenize(text, add_bos=False)
    messages = [{"role": "user", "content": "Name three colors."}]
    chat_ids = reference.tokenize(reference.model.render_chat(messages))
    assert post("/tokenize", {"messages": messages})[1]["tokens"] == chat_ids
    assert post("/detokenize", {"tokens": ids})[1] == {"prompt": reference.model.detokenize(ids),
                                                       "content": reference.model.detokenize(ids)}
    for body, param in [({"prompt": "a", "content": "b"}, "prompt"), ({}, "prompt")]:
        status, answer = post("/tokenize", body)
        assert status == 400 and answer["error"]["param"] == param
    status, answer = post("/detokenize", {"tokens": [10 ** 9]})
    assert status == 400 and answer["error"]["param"] == "tokens"

    before = _metrics(served)
    r = served.client().completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt="Hi", max_tokens=3,
                                           temperature=0, extra_body={"ignore_eos": True})
    after = _metrics(served)
    assert after['snapkv_requests_total{outcome="completed"}'] == before['snapkv_requests_total{outcome="completed"}'] + 1
    assert after["snapkv_generation_tokens_total"] - before["snapkv_generation_tokens_total"] == 3
    assert after["snapkv_prompt_tokens_total"] - before["snapkv_prompt_tokens_total"] == r.usage.prompt_tokens
    assert after["snapkv_requests_running"] == 0 and 'snapkv_kv_pool_pages{format="bf16"}' in after


def _metrics(served) -> dict:
    with urllib.request.urlopen(served.url + "/metrics", timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        lines = r.read().decode().splitlines()
    return {name: float(value) for name, value in (line.rsplit(" ", 1) for line in lines if not line.startswith("#"))}


def test_api_key(tiny_llama):
    """With an API key, /v1 routes (and /state, /tokenize) need `Authorization: Bearer
    <key>`: the openai client with the key works, without it gets 401 in OpenAI's shape;
    /health, /metrics and the chat page stay open."""
    app = build_app(engine.load(tiny_llama, snapkv_budget=0), max_running=1, api_key="s3cret")
    server = serve_in_thread(app)
    try:
        kw = dict(base_url=server.url + "/v1", max_retries=0, timeout=60)
        good = openai.OpenAI(api_key="s3cret", **kw)
        assert good.completions.create(model="tiny-llama", prompt=[5, 6, 7], max_tokens=2).usage.completion_tokens >= 1
        with pytest.raises(openai.AuthenticationError) as e:
            openai.OpenAI(api_key="wrong", **kw).models.list()
        assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
        for path in ("/state", "/v1/models"):
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(server.url + path, timeout=10)
            assert e.value.code == 401
        for path in ("/health", "/metrics", "/"):
            with urllib.request.urlopen(server.url + path, timeout=10) as r:
                assert r.status == 200
    finally:
        server.stop()


def test_logit_bias_and_penalties(served, reference):
    """OpenAI's logit_bias (token ids as JSON string keys) and presence / frequency
    penalties give the engine's own answer for the same values."""
    c = served.client()
    prompt = "List the days of the week:"
    kw = dict(model="SmolLM2-135M-Instruct.Q4_1", prompt=prompt, max_tokens=8, temperature=0,
              extra_body={"ignore_eos": True})
    token = reference.tokenize(" Sunday", add_bos=False)[0]
    r = c.completions.create(logit_bias={str(token): 100}, **kw)
    assert r.choices[0].text == reference.model.tokenizer.token_bytes(token).decode() * 8
    plain = c.completions.create(**kw).choices[0].text
    for penalties in (dict(frequency_penalty=1.5), dict(presence_penalty=2.0)):
        want = reference.generate(prompt, max_tokens=8, temperature=0.0, ignore_eos=True, **penalties).text
        assert want != plain and c.completions.create(**penalties, **kw).choices[0].text == want


def test_echo_scores_the_prompt(served, reference):
    """`echo` with `logprobs` and `max_tokens` 0 scores a prompt, as evaluation harnesses
    (lm-evaluation-harness's loglikelihood) ask: the text is the prompt, every token but
    the first has the log-probability the model gives it after the tokens before it
    (checked against the engine's own logits), and text_offset locates each token in
    the text. With tokens to generate, they follow the prompt, as without echo; with
    eviction, the prompt is scored before it is evicted."""
    c = served.client()
    prompt = "The quick brown fox jumps over the lazy dog. The capital of France is"
    ids = reference.tokenize(prompt)
    m = reference.model
    logits = m.forward.prefill(ids, m.new_cache(), all_logits=True).astype(np.float64)
    log_softmax = logits - (logits.max(1, keepdims=True) +
                            np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)))
    kw = dict(model="SmolLM2-135M-Instruct.Q4_1", prompt=prompt, temperature=0, echo=True)
    r = c.completions.create(max_tokens=0, logprobs=1, **kw)
    text, lp = r.choices[0].text, r.choices[0].logprobs
    assert text == prompt and r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 0
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [log_softmax[i - 1, ids[i]] for i in range(1, len(ids))]
    assert np.allclose(lp.token_logprobs[1:], want, atol=1e-3)
    assert all(len(top) == 1 for top in lp.top_logprobs[1:])
    assert [text[a:b] for a, b in zip(lp.text_offset, lp.text_offset[1:] + [len(text)])] == lp.tokens

    plain = c.completions.create(max_tokens=4, **dict(kw, echo=False)).choices[0].text
    r = c.completions.create(max_tokens=4, logprobs=2, **kw)
    text, lp = r.choices[0].text, r.choices[0].logprobs
    assert text == prompt + plain and len(lp.tokens) == len(ids) + r.usage.completion_tokens
    assert lp.text_offset[len(ids)] == len(prompt) and "".join(lp.tokens[len(ids):]) == plain
    chunks = [ch.choices[0].text for ch in c.completions.create(max_tokens=4, stream=True, **kw) if ch.choices]
    assert chunks[0] == prompt and "".join(chunks) == prompt + plain

    evicted = c.completions.create(max_tokens=4, extra_body=KV, **dict(kw, prompt=DOC, echo=False)).choices[0].text
    r = c.completions.create(max_tokens=4, logprobs=0, extra_body=KV, **dict(kw, prompt=DOC))
    assert r.choices[0].text == DOC + evicted and r.usage.model_extra["kv_policy"]
    assert len(r.choices[0].logprobs.tokens) == r.usage.prompt_tokens + r.usage.completion_tokens
    status, answer = served.post_raw("/v1/completions", json.dumps(dict(kw, echo=False, max_tokens=0)).encode())
    assert status == 400 and answer["error"]["param"] == "max_tokens"


def test_per_request_kv_budget(served, reference):
    want = reference.generate(DOC, max_tokens=8, temperature=0.0, snapkv=KV_POLICY, ignore_eos=True)
    full = reference.generate(DOC, max_tokens=8, temperature=0.0, ignore_eos=True)
    c = served.client()
    kw = dict(model="SmolLM2-135M-Instruct.Q4_1", prompt=DOC, max_tokens=8, temperature=0,
              extra_body={"ignore_eos": True})
    r = c.completions.create(**dict(kw, extra_body={**kw["extra_body"], **KV}))
    u = r.usage.model_extra
    assert r.usage.prompt_tokens > 128
    assert u["kv_bytes"] < u["kv_bytes_full"] and u["kv_policy"].startswith("SnapKV budget 64")
    assert r.choices[0].text == want.text
    assert want.stats["snapkv"]["bytes_after"] == u["kv_bytes"]
    off = c.completions.create(**dict(kw, extra_body={**kw["extra_body"], "kv_budget": 0}))
    assert off.usage.model_extra["kv_bytes"] == off.usage.model_extra["kv_bytes_full"] == u["kv_bytes_full"]
    assert off.choices[0].text == full.text
    merged = dataclasses.replace(KV_POLICY, merge=8, allocation="pyramid", pyramid_beta=5)   # other kv_* fields
    want = reference.generate(DOC, max_tokens=8, temperature=0.0, snapkv=merged, ignore_eos=True)
    r = c.completions.create(**dict(kw, extra_body={**kw["extra_body"], **KV, "kv_merge": 8,
                                                    "kv_allocation": "pyramid", "kv_pyramid_beta": 5}))
    assert "8 of them merged rows, pyramid layer budgets (beta 5)" in r.usage.model_extra["kv_policy"]
    assert r.choices[0].text == want.text
    adaptive = dataclasses.replace(KV_POLICY, allocation="adaptive")   # ragged heads on the shared pool
    want = reference.generate(DOC, max_tokens=8, temperature=0.0, snapkv=adaptive, ignore_eos=True)
    r = c.completions.create(**dict(kw, extra_body={**kw["extra_body"], **KV, "kv_allocation": "adaptive"}))
    assert "adaptive head budgets" in r.usage.model_extra["kv_policy"]
    assert r.choices[0].text == want.text and r.usage.model_extra["kv_bytes"] == want.stats["snapkv"]["bytes_after"]


# -- scheduling -----------------------------------------------------------------------------------
def test_concurrent_streams(served, reference):
    """Two streams at once, one evicting, one not: both complete with their sequential answers."""
    kw = dict(model="SmolLM2-135M-Instruct.Q4_1", prompt=DOC, max_tokens=8, temperature=0,
              extra_body={"ignore_eos": True})
    want = {"evict": reference.generate(DOC, max_tokens=8, temperature=0.0, snapkv=KV_POLICY, ignore_eos=True).text,
            "full": reference.generate(DOC, max_tokens=8, temperature=0.0, ignore_eos=True).text}
    got, errors = {}, []

    def run(name, extra):
        try:
            body = dict(kw, extra_body={**kw["extra_body"], **extra})
            got[name] = stream_text(served.client().completions.create(stream=True, **body), chat=False)[0]
        except Exception as e:      # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=("evict", KV)), threading.Thread(target=run, args=("full", {}))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and got == want


def test_disconnect_mid_stream_frees_the_cache(served):
    before = served.get("/state")["cancelled"]
    stream = served.client().completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt=DOC, max_tokens=400,
                                                temperature=0, stream=True, extra_body={"ignore_eos": True})
    it = iter(stream)
    next(it), next(it)
    assert served.get("/state")["kv_bytes_held"] > 0
    stream.close()
    wait_until(served.idle, "the cancelled request's cache to be freed")
    s = served.get("/state")
    assert s["cancelled"] == before + 1 and s["kv_bytes_held"] == 0


def test_a_plain_request_whose_client_leaves_is_cancelled(served):
    before = served.get("/state")["cancelled"]
    with held_worker(served.model):
        with pytest.raises(openai.APITimeoutError):
            served.client(timeout=1.0).completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt="Hello",
                                                          max_tokens=50, temperature=0)
        wait_until(lambda: any(r["cancelled"] for r in served.get("/state")["running"]),
                   "the server to notice the client left")
    wait_until(served.idle, "the cancelled request's cache to be freed")
    assert served.get("/state")["cancelled"] == before + 1


def test_queue_full_gives_503_and_a_queued_client_can_leave(served):
    c = served.client()
    kw = dict(model="SmolLM2-135M-Instruct.Q4_1", prompt="Hello", max_tokens=3, temperature=0,
              extra_body={"ignore_eos": True})
    results = {}
    with held_worker(served.model) as gate:
        running = threading.Thread(target=lambda: results.update(a=c.completions.create(**kw)))
        running.start()
        wait_until(lambda: served.get("/state")["running"], "the first request to run")
        # the worker is held inside the first decode step, so later requests wait: the
        # server holds max_running + max_queue (1) requests in all
        waiting = [c.completions.create(stream=True, **kw) for _ in range(MAX_RUNNING)]
        assert served.get("/state")["waiting"] == MAX_RUNNING
        t0 = time.monotonic()
        assert served.get("/health") == {"status": "ok"}                # the event loop is not blocked
        assert time.monotonic() - t0 < 5
        with pytest.raises(openai.APIStatusError) as e:
            c.completions.create(**kw)
        assert e.value.status_code == 503 and e.value.body["code"] == "queue_full"
        assert e.value.response.headers["retry-after"] == "1"
        waiting.pop().close()                                            # leaves the queue at once
        wait_until(lambda: served.get("/state")["waiting"] == MAX_RUNNING - 1, "the queued request to leave")
        queued = threading.Thread(target=lambda: results.update(b=c.completions.create(**kw)))
        queued.start()                                                   # room again
        wait_until(lambda: served.get("/state")["waiting"] == MAX_RUNNING, "the next request to queue")
        gate.set()
        running.join(60)
        queued.join(60)
        rest = [stream_text(w, chat=False)[0] for w in waiting]
    assert results["a"].usage.completion_tokens == 3 and results["b"].choices[0].text == results["a"].choices[0].text
    assert rest == [results["a"].choices[0].text] * len(rest)
    assert served.get("/state")["rejected"] >= 1


@pytest.mark.parametrize("logprobs", [None, 2])
def test_scheduler_batches_running_requests(tiny_llama, logprobs):
    """Three requests with different prompts, eviction budgets and KV row formats run
    together: prefill chunks interleave with decode steps, the decode steps are batched,
    and each answer equals generate's for the same request alone. The requests decode
    greedily, so the batched steps send back argmax ids, not logits, unless a request in
    the step reads its logits (the third, asking for logprobs)."""
    from engine.generate import SamplingParams
    from engine.serve.scheduler import Scheduler
    from engine.serve.sequence import Delta, Finished, Job

    model = engine.load(tiny_llama, snapkv_budget=0)
    evict = SnapKvConfig(budget=24, window=8, sinks=2, min_tokens=16)
    reqs = [(list(range(5, 70)), evict, None), ([40, 41, 42], None, "tq4:1=tq3"), (list(range(3, 40)), None, None)]
    want = [model.generate(ids, max_tokens=6, ignore_eos=True, snapkv=snap or False, kv_dtype=dt).text
            for ids, snap, dt in reqs]
    batches = []
    real = model.forward.decode_batch

    def decode_batch(tokens, caches, **kw):
        batches.append((len(caches), kw.get("argmax", False)))
        return real(tokens, caches, **kw)

    model.forward.decode_batch = decode_batch
    sched = Scheduler(model, max_queue=0, max_running=3)
    texts, finished = [""] * len(reqs), threading.Semaphore(0)

    def emit_for(i):
        def emit(event):
            if isinstance(event, Delta):
                texts[i] += event.text
            elif isinstance(event, Finished):
                finished.release()
        return emit

    for i, (ids, snap, dt) in enumerate(reqs):
        sched.submit(Job(ids, SamplingParams(max_tokens=6, ignore_eos=True), snap, dt,
                         logprobs=logprobs if i == 2 else None), emit_for(i))
    sched.start()
    try:
        assert all(finished.acquire(timeout=WAIT_S) for _ in reqs)
    finally:
        sched.stop()
    assert texts == want
    sizes = [n for n, _ in batches]
    assert max(sizes) == 3 and sizes[0] < 3              # decode started before the last prompt ran
    assert any(argmax for _, argmax in batches)          # (the first two decode without the third at first)
    if logprobs is None:
        assert all(argmax for _, argmax in batches)
    else:
        assert not any(argmax for n, argmax in batches if n == 3)
    s = sched.state()
    assert s["kv_bytes_held"] == 0 and s["completed"] == 3
    assert set(s["kv_pools"]) == {"bf16", "tq4:1=tq3"} and all(p["pages_used"] == 0 for p in s["kv_pools"].values())
    mixed = s["kv_pools"]["tq4:1=tq3"]          # layer 1 in a segment of its own
    assert [g["kv_dtype"] for g in mixed["segments"]] == ["tq4", "tq3"]
    assert mixed["bytes"] == sum(g["pages"] * g["page_bytes"] for g in mixed["segments"])


def test_a_worker_failure_outside_a_step_ends_requests_and_marks_the_fault(tiny_llama, monkeypatch):
    """A bug in the worker's own bookkeeping (here: making room before admitting) does
    not leave a dead thread behind a healthy-looking server: the requests held fail with
    503, the fault is set (GET /health says so), on_fault is called (engine serve exits
    1) and new requests are refused."""
    from engine.generate import SamplingParams
    from engine.serve.scheduler import QueueFull, Scheduler
    from engine.serve.sequence import Failed, Finished, Job

    model = engine.load(tiny_llama, snapkv_budget=0)
    sched = Scheduler(model, max_queue=4, max_running=2)
    faults, events, done = [], [], threading.Semaphore(0)
    sched.on_fault = faults.append

    def emit(event):
        if isinstance(event, (Finished, Failed)):
            events.append(event)
            done.release()

    def broken(self):
        raise RuntimeError("boom")
    monkeypatch.setattr(Scheduler, "_make_room", broken)
    sched.submit(Job([5, 6, 7], SamplingParams(max_tokens=2), None, None), emit)
    sched.start()
    try:
        assert done.acquire(timeout=WAIT_S)
        wait_until(lambda: faults, "on_fault")
    finally:
        sched.stop()
    assert isinstance(events[0], Failed) and events[0].status == 503 and "boom" in events[0].message
    assert faults == [sched.fault] and "the server's worker failed (RuntimeError: boom)" in sched.fault
    with pytest.raises(QueueFull):
        sched.submit(Job([5], SamplingParams(max_tokens=1), None, None), emit)


def test_kv_pools_are_capped_and_idle_ones_dropped(tiny_llama, monkeypatch):
    """Each KV row layout a request names has a pool of its own, of --kv-pool-tokens
    pages; the server holds at most MAX_KV_POOLS: a request for another layout drops
    the least recently used pool no request is using (its kept caches released), never
    the server's own layout's; while every pool is in use it fails at once with 503
    kv_pools_busy (retry), the others unharmed. A pool larger than the memory available
    is a 503 before anything is dropped or allocated."""
    from engine.generate import SamplingParams
    from engine.serve.scheduler import MAX_KV_POOLS, Scheduler
    from engine.serve.sequence import Failed, Finished, Job

    model = engine.load(tiny_llama, snapkv_budget=0)
    layouts = ["bf16", "tq4", "tq3", "tq4:1=tq3", "tq3:1=tq4"]      # head_dim 16: the tq formats
    assert len(layouts) == MAX_KV_POOLS + 1

    def run(sched, jobs, start=False):
        events = [None] * len(jobs)
        done = threading.Semaphore(0)
        for i, (ids, dt) in enumerate(jobs):
            def emit(event, i=i):
                if isinstance(event, (Finished, Failed)):
                    events[i] = event
                    done.release()
            sched.submit(Job(ids, SamplingParams(max_tokens=4, ignore_eos=True), None, dt), emit)
        if start:
            sched.start()
        try:
            assert all(done.acquire(timeout=WAIT_S) for _ in jobs)
        finally:
            if start:
                sched.stop()
        return events

    sched = Scheduler(model, max_queue=8, max_running=5)
    sched.start()
    try:
        for i, dt in enumerate(layouts):      # one at a time: the fifth layout drops the oldest idle pool
            assert isinstance(run(sched, [(list(range(3, 30 + i)), dt)])[0], Finished)
            assert len(sched.state()["kv_pools"]) <= MAX_KV_POOLS
        s = sched.state()
        assert set(s["kv_pools"]) == {"bf16", "tq3", "tq4:1=tq3", "tq3:1=tq4"} and s["prompt_cache"]["caches"] == 4
        assert isinstance(run(sched, [(list(range(3, 50)), "tq4")])[0], Finished)   # tq3 is now the oldest
        assert set(sched.state()["kv_pools"]) == {"bf16", "tq4:1=tq3", "tq3:1=tq4", "tq4"}
        import engine.serve.scheduler as sched_mod
        with monkeypatch.context() as mp:
            mp.setattr(sched_mod, "available_memory_bytes", lambda: 1000)
            got = run(sched, [(list(range(3, 20)), "tq4:0=bf16"), (list(range(3, 20)), None)])   # > the oldest idle pool
        assert isinstance(got[0], Failed) and got[0].status == 503 and "more than the memory available" in got[0].message
        assert isinstance(got[1], Finished)                   # the server's own layout still serves
        assert set(sched.state()["kv_pools"]) == {"bf16", "tq4:1=tq3", "tq3:1=tq4", "tq4"}   # nothing dropped
    finally:
        sched.stop()
    # all five admitted together (submitted before the worker starts): four pools in use
    got = run(Scheduler(model, max_queue=8, max_running=5), [(list(range(3, 40)), dt) for dt in layouts], start=True)
    assert all(isinstance(e, Finished) for e in got[:-1])
    assert isinstance(got[-1], Failed) and got[-1].status == 503 and got[-1].code == "kv_pools_busy"
    assert got[-1].retry_after and "retry later" in got[-1].message


def test_a_new_kv_pool_fits_beside_the_unwritten_pages_of_those_held(tiny_llama, monkeypatch):
    """On the CPU a pool's pages take host memory only when first written, so the memory
    available does not show what the pools held take as they fill: a pool for a client's
    new layout must fit beside all of it (else one client's few layouts, then long
    prompts, commit several times what the server was sized for)."""
    from engine.serve.scheduler import Scheduler
    import engine.serve.scheduler as sched_mod
    model = engine.load(tiny_llama, snapkv_budget=0)
    sched = Scheduler(model, max_running=2)
    with sched._cv:
        pool = sched._pool(None)                          # the server's own layout, nothing written yet
    assert pool.untouched_bytes == pool.bytes
    model.forward.prefill(list(range(3, 100)), model.forward.new_cache(pool=pool))
    assert 0 < pool.untouched_bytes < pool.bytes
    need = model.forward.pool_bytes(sched.pool_tokens, "tq4")
    monkeypatch.setattr(sched_mod, "available_memory_bytes", lambda: need + pool.untouched_bytes - 1)
    assert "more than the memory available" in sched._short_of_memory("tq4")
    monkeypatch.setattr(sched_mod, "available_memory_bytes", lambda: need + pool.untouched_bytes)
    assert sched._short_of_memory("tq4") is None


def test_a_kv_pool_that_cannot_fit_is_refused_when_the_server_starts(tiny_llama, monkeypatch):
    """The server's own pool (--kv-pool-tokens, by default --parallel whole contexts) is
    checked against the memory free when the server starts, on the CPU the host's, on
    CUDA the device's, not at the first request: one line naming what to lower."""
    from engine.serve.scheduler import Scheduler
    import engine.serve.scheduler as sched_mod
    model = engine.load(tiny_llama, snapkv_budget=0)
    need = model.forward.pool_bytes(4 * model.ctx)
    monkeypatch.setattr(sched_mod, "available_memory_bytes", lambda: need - 1)
    with pytest.raises(engine.EngineError, match=r"needs .* MiB, more than the memory available .*lower --kv-pool-tokens"):
        Scheduler(model, max_running=4)
    Scheduler(model, max_running=2)                       # half the pool fits
    monkeypatch.setattr(model.backend, "free_memory_bytes", lambda: need // 8, raising=False)
    with pytest.raises(engine.EngineError, match="more than the device memory free"):
        Scheduler(model, max_running=1)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_pages_run_short_preempt_the_newest_request_and_refuse_what_never_fits(tiny_llama, arch, tmp_path):
    """A pool of 128 positions (two 64-row pages per layer): two requests of 60 prompt +
    20 generated rows each start together (a reservation covers the next step, not all
    of max_tokens); when both need their second page, the newer one is preempted, waits,
    and resumes by prefilling its prompt and tokens again after the older finishes;
    both answers equal generate's alone, with eviction too, and with Gemma 3's
    sliding-window layers. One that needs more than the whole pool fails with 400 at
    once. The pool is never over-committed."""
    from tiny_gguf import write_tiny_gguf

    from engine.generate import SamplingParams
    from engine.serve.scheduler import Scheduler
    from engine.serve.sequence import Delta, Failed, Finished, Job

    path = tiny_llama if arch == "llama" else write_tiny_gguf(
        tmp_path / "gemma3.gguf", arch="gemma3", dim=64, n_heads=4, n_kv_heads=1, head_dim=32, ffn_dim=128, ctx=1024)
    model = engine.load(path, snapkv_budget=0)
    sched = Scheduler(model, max_queue=4, max_running=4, pool_tokens=128)
    pool_pages = model.new_pool(128).n_pages
    evict = SnapKvConfig(budget=40, window=8, sinks=2, min_tokens=16)
    reqs = {"a": (list(range(3, 63)), None), "b": (list(range(5, 65)), None),
            "c": (list(range(9, 69)), evict), "never": (list(range(3, 123)), None)}
    want = {name: model.generate(ids, max_tokens=20, ignore_eos=True, snapkv=snap or False).text
            for name, (ids, snap) in reqs.items() if name != "never"}
    events, texts, done = {}, dict.fromkeys(reqs, ""), threading.Semaphore(0)
    steps = []
    real = model.forward.decode_batch

    def decode_batch(tokens, caches, **kw):
        steps.append((len(caches), sched.state()["kv_pools"]["bf16"]["pages_used"]))
        return real(tokens, caches, **kw)

    model.forward.decode_batch = decode_batch

    def emit_for(name):
        def emit(event):
            if isinstance(event, Delta):
                texts[name] += event.text
            else:
                events[name] = event
                done.release()
        return emit

    p = SamplingParams(max_tokens=20, ignore_eos=True)
    for name, (ids, snap) in reqs.items():          # a, b: 80 rows (2 pages a layer) each
        sched.submit(Job(ids, p, snap), emit_for(name))     # never: 140 rows, 3 pages
    sched.start()
    try:
        assert all(done.acquire(timeout=WAIT_S) for _ in reqs)
    finally:
        sched.stop()
    assert isinstance(events["never"], Failed) and events["never"].status == 400
    assert "--kv-pool-tokens 128" in events["never"].message
    for name in want:
        assert isinstance(events[name], Finished) and events[name].usage["completion_tokens"] == 20
        assert texts[name] == want[name], name
    assert events["c"].usage["kv_policy"]                 # c's prompt was evicted
    assert sched.counts["preempted"] >= 1 and sched.counts["completed"] == 3
    assert max(n for n, _ in steps) >= 2                  # they did decode together
    assert max(used for _, used in steps) <= pool_pages
    assert sched.state()["kv_pools"]["bf16"]["pages_used"] == 0


def test_an_engine_error_fails_one_request_not_the_server(served):
    c = served.client()
    kw = dict(model="SmolLM2-135M-Instruct.Q4_1", prompt="Hello", max_tokens=4, temperature=0)

    def broken(tokens, caches, **kw):
        raise RuntimeError("injected failure")

    served.model.forward.decode_batch = broken
    try:
        with pytest.raises(openai.InternalServerError) as e:
            c.completions.create(**kw)
        assert "injected failure" in e.value.body["message"]
        with pytest.raises(openai.APIError):
            stream_text(c.completions.create(stream=True, **kw), chat=False)
        # on the wire: the first token's chunk, the error object, then [DONE] as always
        req = urllib.request.Request(served.url + "/v1/completions", data=json.dumps({**kw, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            events = [line[len("data: "):] for line in r.read().decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and len(events) >= 3
        assert "injected failure" in json.loads(events[-2])["error"]["message"]
        assert json.loads(events[0])["choices"][0]["text"]
    finally:
        del served.model.forward.decode_batch
    assert c.completions.create(**kw).usage.completion_tokens >= 1
    assert served.get("/state")["failed"] >= 2


# -- errors ---------------------------------------------------------------------------------------
def test_bad_requests_get_openai_shaped_400s(served):
    ok = {"model": "SmolLM2-135M-Instruct.Q4_1", "prompt": "Hi", "max_tokens": 2}
    cases = [
        (b'{"prompt": "Hi", ', None),                                    # malformed JSON
        (b'[1, 2]', None),
        (json.dumps(dict(ok, max_tokens="2")).encode(), "max_tokens"),   # wrong types
        (json.dumps(dict(ok, temperature="hot")).encode(), "temperature"),
        (json.dumps(dict(ok, stream=1)).encode(), "stream"),
        (json.dumps(dict(ok, prompt=7)).encode(), "prompt"),
        (json.dumps({"max_tokens": 2}).encode(), "prompt"),              # missing
        (json.dumps(dict(ok, temperature=-1)).encode(), "temperature"),  # bad values
        (json.dumps(dict(ok, top_p=0)).encode(), "top_p"),
        (json.dumps(dict(ok, max_tokens=0)).encode(), "max_tokens"),
        (json.dumps(dict(ok, n=2)).encode(), "n"),
        (json.dumps(dict(ok, presence_penalty=3)).encode(), "presence_penalty"),
        (json.dumps(dict(ok, frequency_penalty=-2.5)).encode(), "frequency_penalty"),
        (json.dumps(dict(ok, logit_bias={"abc": 1})).encode(), "logit_bias"),
        (json.dumps(dict(ok, logit_bias={"5": 101})).encode(), "logit_bias"),
        (json.dumps(dict(ok, logit_bias={"99999999": 1})).encode(), "logit_bias"),
        (json.dumps(dict(ok, logit_bias={"\u00b2": 1})).encode(), "logit_bias"),     # a digit, not ASCII
        (json.dumps(dict(ok, stop=[""])).encode(), "stop"),
        (json.dumps(dict(ok, prompt=[1, 10 ** 9])).encode(), "prompt"),
        (json.dumps(dict(ok, prompt=["a", "b"])).encode(), "prompt"),
        (json.dumps(dict(ok, kv_kernel=4)).encode(), "kv_kernel"),       # SnapKV rules, as the flags
        (json.dumps(dict(ok, kv_budget=30)).encode(), "kv_budget"),
        (json.dumps(dict(ok, kv_budget=-1)).encode(), "kv_budget"),
        (json.dumps(dict(ok, kv_pool="median")).encode(), "kv_pool"),
        (json.dumps(dict(ok, kv_merge=-1)).encode(), "kv_merge"),
        (json.dumps(dict(ok, kv_allocation="ragged")).encode(), "kv_allocation"),
        (json.dumps(dict(ok, kv_budegt=100)).encode(), "kv_budegt"),
        (json.dumps(dict(ok, kv_dtype="q2")).encode(), "kv_dtype"),
        (json.dumps(dict(ok, min_p=0.05)).encode(), "min_p"),                # refused, not silently ignored
        (json.dumps(dict(ok, repetition_penalty=1.1)).encode(), "repetition_penalty"),
        (json.dumps(dict(ok, kv_dtype="tq4:30=q8_0")).encode(), "kv_dtype"),  # layers 0-29 only
        (json.dumps(dict(ok, prompt="word " * (CTX + 10))).encode(), "prompt"),   # longer than the context
    ]
    for body, param in cases:
        status, answer = served.post_raw("/v1/completions", body)
        assert status == 400, (body[:60], answer)
        err = answer["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
        assert err["param"] == param and err["message"], (body[:60], err)
    status, answer = served.post_raw("/v1/completions", json.dumps(dict(ok, prompt="word " * 2000)).encode())
    assert answer["error"]["code"] == "context_length_exceeded"
    defaults = dict(ok, min_p=0, repetition_penalty=1.0, skip_special_tokens=True)   # what some clients always send
    assert served.post_raw("/v1/completions", json.dumps(defaults).encode())[0] == 200
    status, answer = served.post_raw("/v1/chat/completions", json.dumps({"messages": []}).encode())
    assert status == 400 and answer["error"]["param"] == "messages"
    many = [{"role": "x", "content": "b"}] * (CTX + 1)                  # more messages than the context holds
    for route in ("/v1/chat/completions", "/tokenize"):
        status, answer = served.post_raw(route, json.dumps({"messages": many}).encode())
        assert status == 400 and answer["error"]["param"] == "messages" and "1025 messages" in answer["error"]["message"]
    status, answer = served.post_raw("/detokenize", json.dumps({"tokens": [5] * (CTX + 1)}).encode())
    assert status == 400 and answer["error"]["param"] == "tokens"
    hostile = [{"role": "assistant", "content": "",
                "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "[" * 100000}}]},
               {"role": "user", "content": "hi"}]
    status, answer = served.post_raw("/v1/chat/completions", json.dumps({"messages": hostile, "max_tokens": 1}).encode())
    assert status in (200, 400), answer                                 # arguments too deep stay a string
    c = served.client()
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", max_tokens=2,
                                  messages=[{"role": "user", "content": "x " * (CTX + 10)}])
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="gpt-4", prompt="Hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    status, answer = served.post_raw("/v1/no-such-route", b"{}")
    assert status == 404 and answer["error"]["type"] == "not_found_error"
    assert c.completions.create(**ok).usage.completion_tokens >= 1     # still serving


# -- the command -----------------------------------------------------------------------------------
def test_engine_serve_command(tiny_llama, tmp_path):
    """The real `engine serve` in a subprocess: mlx-lm's flag spellings, eviction in usage."""
    cmd = [sys.executable, "-m", "engine.cli", "serve", str(tiny_llama), "--port", "0", "--kv-eviction", "snapkv",
           "--kv-budget", "48", "--kv-window", "8", "--kv-sink-tokens", "2", "--kv-min-tokens", "16"]
    log = tmp_path / "serve.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=dict(os.environ))
    try:
        line = wait_until(lambda: next((l for l in log.read_text().splitlines() if "listening on" in l), None),
                          "engine serve to listen", timeout=60)
        url = line.split("listening on ", 1)[1].strip()
        c = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
        r = c.completions.create(model="tiny-llama", prompt=list(range(3, 200)), max_tokens=3, temperature=0,
                                 extra_body={"ignore_eos": True})
        u = r.usage.model_extra
        assert r.usage.completion_tokens == 3 and u["kv_bytes"] < u["kv_bytes_full"]
        assert "budget 48 (window 8, recency 8, sinks 2)" in u["kv_policy"]
        taken = url.rsplit(":", 1)[1].split("/")[0]
        again = subprocess.run([sys.executable, "-m", "engine.cli", "serve", str(tiny_llama), "--port", taken],
                               capture_output=True, text=True, timeout=60)
        assert again.returncode == 1 and again.stderr.startswith(f"error: cannot listen on 127.0.0.1:{taken}")
        assert again.stderr.count("\n") == 1
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
