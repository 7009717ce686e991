"""Structured output and tools through `engine serve`, driven with the official `openai`
client against servers on loopback: `response_format` json_object / json_schema (every
answer validated with `jsonschema`), tools with the chat template rendering them and
the server parsing calls into `tool_calls`, constrained and free requests batched
together, and constrained output under SnapKV eviction.

smollm2 (135M) takes the 50 sampled requests (10 per schema); qwen2.5-coder-0.5b, the
chat-tuned default whose template renders tools, takes a greedy and a sampled answer
per schema and the tool round trip.
"""
import concurrent.futures
import json

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

import engine  # noqa: E402
from engine.serve import build_app, serve_in_thread  # noqa: E402
from engine.serve.structured import CallStream, calls_finish_reason, parse_calls  # noqa: E402

CTX = 1024
MAX_TOKENS = 160           # enough for every schema's longest object (strings are bounded)
NAME = {"type": "string", "maxLength": 24}

SCHEMAS = {
    "person": {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
               "required": ["name", "age"], "additionalProperties": False},
    "color": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "bright": {"type": "boolean"}},
              "required": ["color", "bright"], "additionalProperties": False},
    "list": {"type": "object", "properties": {"fruits": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}},
             "required": ["fruits"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "city": {"type": "object", "properties": {"name": NAME, "population": {"type": "integer", "minimum": 0,
                                                                              "maximum": 100000000}},
                 "required": ["name", "population"], "additionalProperties": False},
        "country": NAME}, "required": ["city", "country"], "additionalProperties": False},
    "weather": {"type": "object", "properties": {"unit": {"enum": ["C", "F"]}, "high": {"type": "integer", "minimum": -60,
                                                                                      "maximum": 60},
                                                 "sunny": {"type": "boolean"}, "note": NAME},
                "required": ["unit", "high", "sunny"], "additionalProperties": False},
}
PROMPTS = {
    "person": "Describe a person as JSON: name and age.",
    "color": "Pick a color and say whether it is bright, as JSON.",
    "list": "List up to three fruits as JSON.",
    "nested": "Describe a big city and its country as JSON.",
    "weather": "Give tomorrow's weather forecast as JSON.",
}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                   "required": ["city"], "additionalProperties": False}}}]


class Served:
    def __init__(self, model, max_running: int = 4):
        self.model = model
        self.app = build_app(model, max_queue=16, max_running=max_running)
        self.server = serve_in_thread(self.app)
        self.url = self.server.url

    def client(self):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    s = Served(engine.load(smollm2_path, ctx=CTX, snapkv_budget=0))
    yield s
    s.server.stop()


@pytest.fixture(scope="module")
def qwen():
    from engine.model_path import default_model_path
    path = default_model_path()
    if path is None:
        pytest.skip("qwen2.5-coder-0.5b not installed (run `make setup`)")
    s = Served(engine.load(path, ctx=CTX, snapkv_budget=0), max_running=2)
    yield s
    s.server.stop()


def schema_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


def ask(client, name: str, **kw):
    return client.chat.completions.create(model=None, messages=[{"role": "user", "content": PROMPTS[name]}],
                                          response_format=schema_format(name), max_tokens=MAX_TOKENS, **kw)


def valid(r, name: str) -> dict:
    choice = r.choices[0]
    assert choice.finish_reason == "stop", (name, choice.message.content)
    obj = json.loads(choice.message.content)
    jsonschema.validate(obj, SCHEMAS[name])
    return obj


# -- schema-valid every time ------------------------------------------------------------------------
def test_fifty_sampled_objects_are_schema_valid(smollm2):
    """5 schemas x 10 sampled answers (temperature 1, seeds 0..9), 4 decoded per batch."""
    c = smollm2.client()
    jobs = [(name, seed) for name in SCHEMAS for seed in range(10)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda job: (job[0], ask(c, job[0], temperature=1.0, seed=job[1])), jobs))
    for name, r in answers:
        valid(r, name)
    assert len(answers) == 50
    assert len({r.choices[0].message.content for _, r in answers}) > 10     # sampled, not one answer


def test_chat_model_schema_valid(qwen):
    """Per schema: the greedy answer and one sampled (temperature 0.8), two per batch."""
    c = qwen.client()
    jobs = [(name, temp) for name in SCHEMAS for temp in (0.0, 0.8)]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda job: (job[0], ask(c, job[0], temperature=job[1], seed=7)), jobs))
    for name, r in answers:
        valid(r, name)


def test_json_object_and_completions(smollm2):
    c = smollm2.client()
    r = c.chat.completions.create(model=None, messages=[{"role": "user", "content": "Tell me about cats in JSON."}],
                                  response_format={"type": "json_object"}, max_tokens=MAX_TOKENS, temperature=0)
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = c.completions.create(model=None, prompt="A person, as JSON:", max_tokens=MAX_TOKENS, temperature=0,
                             extra_body={"response_format": schema_format("person")})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMAS["person"])


def test_streamed_constrained_output(smollm2):
    stream = smollm2.client().chat.completions.create(
        model=None, messages=[{"role": "user", "content": PROMPTS["nested"]}], response_format=schema_format("nested"),
        max_tokens=MAX_TOKENS, temperature=0, stream=True)
    pieces, reason = [], None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            reason = chunk.choices[0].finish_reason or reason
    assert reason == "stop" and sum(1 for p in pieces if p) > 3      # token by token
    jsonschema.validate(json.loads("".join(pieces)), SCHEMAS["nested"])


def test_constrained_and_free_batched_together(smollm2):
    """Free requests decoded in the same batches as constrained ones answer exactly as
    alone (greedy), and the constrained ones stay valid."""
    model, c = smollm2.model, smollm2.client()
    messages = [{"role": "user", "content": "Name three colors."}]
    want = model.generate(messages, chat=True, max_tokens=24, temperature=0.0).text
    sizes = []
    real = model.forward.decode_batch

    def decode_batch(tokens, caches, **kw):
        sizes.append(len(tokens))
        return real(tokens, caches, **kw)

    model.forward.decode_batch = decode_batch
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            free = [pool.submit(c.chat.completions.create, model=None, messages=messages, max_tokens=24, temperature=0)
                    for _ in range(2)]
            bound = [pool.submit(ask, c, name, temperature=0) for name in ("person", "list")]
            for f in free:
                assert f.result().choices[0].message.content == want
            for f, name in zip(bound, ("person", "list")):
                valid(f.result(), name)
    finally:
        del model.forward.decode_batch
    assert max(sizes) >= 3                      # constrained and free rows in one forward pass


def test_constrained_output_with_eviction(smollm2):
    doc = ("The harbour office lists the ships of the spring: the Marigold from Lisbon with wine, the Heron "
           "from Bergen with dried fish, the Starling from Genoa with paper and glass. ") * 4
    r = smollm2.client().chat.completions.create(
        model=None, messages=[{"role": "user", "content": doc + "\nList up to three fruits as JSON."}],
        response_format=schema_format("list"), max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"kv_budget": 64, "kv_window": 16, "kv_min_tokens": 64})
    valid(r, "list")
    usage = r.usage.model_extra
    assert usage["kv_policy"] is not None and usage["kv_bytes"] < usage["kv_bytes_full"]


# -- tools ------------------------------------------------------------------------------------------
def test_tool_call_round_trip(qwen):
    c = qwen.client()
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = c.chat.completions.create(model=None, messages=messages, tools=TOOLS, tool_choice="required",
                                  max_tokens=64, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, TOOLS[0]["function"]["parameters"])
    assert "paris" in args["city"].lower()
    # the answer to the call goes back as a tool message; the template renders both
    follow = messages + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                         {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 18})}]
    r = c.chat.completions.create(model=None, messages=follow, tools=TOOLS, max_tokens=48, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "tool_calls", "length")
    assert r.choices[0].message.content or r.choices[0].message.tool_calls
    # the same call by name, streamed: the call comes as a tool_calls delta
    stream = c.chat.completions.create(model=None, messages=messages, tools=TOOLS, max_tokens=64, temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       stream=True)
    deltas, reason, content = [], None, ""
    for chunk in stream:
        d = chunk.choices[0].delta
        deltas += d.tool_calls or []
        content += d.content or ""
        reason = chunk.choices[0].finish_reason or reason
    assert reason == "stop" and content == ""           # a named function: "stop", as OpenAI answers
    assert [d.function.name for d in deltas] == ["get_weather"]
    assert json.loads(deltas[0].function.arguments) == args


def test_bad_requests_are_400(smollm2, qwen):
    c = smollm2.client()
    base = dict(model=None, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    bad = [
        dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}),
        dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
        dict(response_format={"type": "yaml"}),
        dict(tools=TOOLS),                                   # smollm2's template renders no tools
        dict(tool_choice="required"),                        # no tools
    ]
    for extra in bad:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(**base, **extra)
        assert e.value.body["type"] == "invalid_request_error" and e.value.body["message"], extra
    with pytest.raises(openai.BadRequestError) as e:
        qwen.client().chat.completions.create(**base, tools=TOOLS,
                                              tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.body["param"] == "tool_choice" and "nope" in e.value.body["message"]


# -- parsing (no model) -----------------------------------------------------------------------------
def test_a_grammar_that_allows_no_token_is_the_requests_error():
    """A matcher that fails or allows no token mid-answer is the request's grammar's
    doing: GrammarError (an EngineError, so the server answers 400), not a 500."""
    import numpy as np

    from engine.grammar import Constraint, GrammarError

    class Matcher:
        def __init__(self, error):
            self.error = error

        def is_error(self):
            return self.error is not None

        def get_error(self):
            return self.error
    c = object.__new__(Constraint)
    c.mask, c._fresh = np.zeros((1, 4), dtype=np.int32), True
    for error, match in ((None, "allows no token"), ("lexer: too many items", "failed while decoding")):
        c.matcher = Matcher(error)
        with pytest.raises(GrammarError, match=match):
            c.apply(np.zeros(128, dtype=np.float32))
    c.matcher, c.mask[0, 0] = Matcher(None), 1 << 5
    out = c.apply(np.zeros(128, dtype=np.float32))
    assert out[5] == 0 and np.isneginf(np.delete(out, 5)).all()


def test_parse_calls():
    text = 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n{"name": "g"}\n</tool_call>'
    content, calls = parse_calls(text)
    assert content == "Sure."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("f", {"x": 1}),
                                                                                                ("g", {})]
    assert parse_calls("<tool_call>\nnot json\n</tool_call>") == ("<tool_call>\nnot json\n</tool_call>", [])
    # a block that never closes is content; JSON nested past the parser's depth is content, not a 500
    opened = "<tool_call>" * 20000 + '{"name": "f"}'
    assert parse_calls(opened) == (opened, [])
    deep = "<tool_call>" + "[" * 100000 + "</tool_call>"
    assert parse_calls(deep) == (deep, [])
    content, calls = parse_calls('a <tool_call>{"name": "f"}</tool_call> b <tool_call> c')
    assert content == "a  b" and calls[0]["function"]["name"] == "f"     # a call cut short: dropped
    content, calls = parse_calls('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "f", "argu')
    assert content is None and len(calls) == 1
    # a "\ud800" escape is a lone surrogate once parsed: arguments stay escaped, a name is no call
    content, calls = parse_calls('<tool_call>{"name": "f", "arguments": {"x": "\\ud800 \u00e9"}}</tool_call>')
    args = calls[0]["function"]["arguments"]
    assert json.loads(args) == {"x": "\ud800 \u00e9"} and args.isascii()
    assert parse_calls('<tool_call>{"name": "\\ud800"}</tool_call>')[1] == []
    assert json.loads(parse_calls('<tool_call>{"name": "f", "arguments": {"x": "\u00e9"}}</tool_call>')[1][0]
                      ["function"]["arguments"]) == {"x": "\u00e9"}
    assert [calls_finish_reason(r, c) for r, c in (("length", "required"), ("stop", "auto"), ("stop", "required"),
                                                   ("stop", "function"))] == ["length", "tool_calls", "tool_calls",
                                                                              "stop"]      # (OpenAI's)
    s = CallStream()
    sent = "".join(s.feed(p) for p in ["Hi <", "tool", "_call>\n{\"name\": ", "\"f\", \"arguments\": {}}\n</tool_call>"])
    rest, calls = s.finish()
    assert sent == "Hi " and rest == "" and calls[0]["function"]["name"] == "f"
    s = CallStream()
    assert s.feed("a <to") == "a " and s.feed("x>") == "<tox>" and s.finish() == ("", [])


def test_tool_schemas_with_definitions_and_unsupported_keywords_compile():
    """Tools whose parameters use $defs / definitions and $ref (every nested pydantic
    model) keep their references when wrapped into the calls' grammar; keywords llguidance
    does not implement (oneOf) are ignored unless every tool says strict (OpenAI's default
    is false), and then refused."""
    import llguidance
    from types import SimpleNamespace as NS

    from engine.serve.structured import _calls_grammar

    def tool(name, params, strict=None):
        return NS(function=NS(name=name, parameters=params, strict=strict))
    nested = {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}, "q": {"$ref": "#/properties/p"}},
              "$defs": {"P": {"type": "object", "properties": {"x": {"type": "integer"},
                                                                "again": {"$ref": "#/$defs/P"}}}}}
    legacy = {"type": "object", "properties": {"p": {"$ref": "#/definitions/P"}}, "definitions": {"P": {"type": "string"}}}
    union = {"oneOf": [{"type": "object", "properties": {"k": {"const": "a"}}},
                       {"type": "object", "properties": {"k": {"const": "b"}}}]}
    for tools in ([tool("f", nested)], [tool("f", nested), tool("g", legacy), tool("h", union)]):
        assert llguidance.LLMatcher.validate_grammar(_calls_grammar(tools, True)) == ""
    assert "oneOf" in llguidance.LLMatcher.validate_grammar(_calls_grammar([tool("h", union, strict=True)], False))
