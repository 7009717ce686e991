"""Structured output and tools: a request's `response_format`, `tools` and `tool_choice`
-> the grammar its output is held to (engine/grammar.py) and, for tools, how calls are
rendered into the prompt and parsed back out of the output.

Tools follow the chat template: it renders `tools` itself (the request's list, as
HF's apply_chat_template passes it) and the calls it expects back are Hermes-style
blocks, `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (Qwen2.5,
Hermes, ...): a template that does not render tools that way is refused for tools.
- tool_choice "auto" (the default with tools): free output; `<tool_call>` blocks are
  parsed out of it into `tool_calls` (finish_reason "tool_calls"), the rest is content.
- "required" or a named function: the output is held to such blocks (a Lark grammar
  around each tool's JSON schema of {"name", "arguments"}), then parsed the same way.
- "none": the tools are not rendered and nothing is parsed.
Every refusal is an ApiError(400) naming its field.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from ..errors import EngineError
from .. import grammar
from .protocol import ApiError, tool_call

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolPlan:
    choice: str                         # "none" | "auto" | "required" | "function" (a named one)
    tools: list[dict] | None            # what the template renders (None: no tools)
    grammar: str | None                 # Lark grammar of the calls (required / named)
    parse: bool                         # parse <tool_call> blocks out of the output


NO_TOOLS = ToolPlan("none", None, None, False)


def tool_plan(req, template: str | None) -> ToolPlan:
    if not req.tools:
        if req.tool_choice not in (None, "none"):
            raise ApiError(400, "tool_choice needs tools", "tool_choice")
        return NO_TOOLS
    names = [t.function.name for t in req.tools]
    if len(set(names)) != len(names):
        raise ApiError(400, "tools: two functions have the same name", "tools")
    choice = req.tool_choice or "auto"
    if choice == "none":
        return NO_TOOLS
    if not template or "tools" not in template or OPEN not in template:
        raise ApiError(400, "tools are not supported with this model: its chat template does not render tools "
                            "with <tool_call> blocks", "tools")
    tools = [t.model_dump(exclude_none=True, by_alias=True) for t in req.tools]
    if choice == "auto":
        return ToolPlan("auto", tools, None, True)
    if choice == "required":
        chosen = req.tools
    else:
        chosen = [t for t in req.tools if t.function.name == choice.function.name]
        if not chosen:
            raise ApiError(400, f"tool_choice names function {choice.function.name!r}, which is not in tools "
                                f"({', '.join(names)})", "tool_choice")
    parallel = req.parallel_tool_calls and choice == "required"
    return ToolPlan("required" if choice == "required" else "function", tools, _calls_grammar(chosen, parallel), True)


def _calls_grammar(tools, parallel: bool) -> str:
    """Lark: one call block (or several, one a line), each a JSON object naming one tool
    with arguments that follow its parameters' schema. Each tool's definitions ($defs,
    definitions) move to the root under its own prefix, and its references with them, so
    a `$ref` (pydantic writes one for every nested model) still resolves there. Keywords
    llguidance does not implement are errors only when every tool says strict, as in
    OpenAI's API (`strict` defaults to false)."""
    bodies, defs = [], {}
    for i, t in enumerate(tools):
        params = t.function.parameters or {"type": "object"}
        if not isinstance(params, dict):
            raise ApiError(400, f"tools: function {t.function.name!r}: parameters must be a JSON schema", "tools")
        if _has_ref(params):
            params, defs[f"tool{i}"] = {"$ref": f"#/$defs/tool{i}"}, _rebased(params, f"tool{i}", defs)
        bodies.append({"type": "object", "properties": {"name": {"const": t.function.name}, "arguments": params},
                       "required": ["name", "arguments"], "additionalProperties": False})
    schema = bodies[0] if len(bodies) == 1 else {"anyOf": bodies}
    if defs:
        schema = {**schema, "$defs": defs}
    if not all(t.function.strict for t in tools):
        schema["x-guidance"] = {"lenient": True}
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    return grammar.lark(f'{start}\ncall: "{OPEN}\\n" body "\\n{CLOSE}"\nbody: {grammar.inline_schema(schema)}\n')


def _has_ref(node) -> bool:
    if isinstance(node, dict):
        return "$ref" in node or any(_has_ref(v) for v in node.values())
    return isinstance(node, list) and any(_has_ref(v) for v in node)


def _rebased(params: dict, name: str, defs: dict) -> dict:
    """A tool's parameters schema to sit at #/$defs/<name>: its own definitions go to
    #/$defs/<name>.<def> (added to defs), and every local reference follows ("#" and
    "#/properties/..." point into <name>)."""
    def ref(target: str) -> str:
        for head in ("#/$defs/", "#/definitions/"):
            if target.startswith(head):
                return f"#/$defs/{name}.{target[len(head):]}"
        return f"#/$defs/{name}{target[1:]}" if target.startswith("#") else target

    def walk(node):
        if isinstance(node, dict):
            return {k: ref(v) if k == "$ref" and isinstance(v, str) else walk(v) for k, v in node.items()}
        return [walk(v) for v in node] if isinstance(node, list) else node

    params = walk(params)
    for key in ("$defs", "definitions"):
        for def_name, schema in (params.pop(key, None) or {}).items():
            defs[f"{name}.{def_name}"] = schema
    return params


def response_grammar(response_format) -> str | None:
    """`response_format` -> grammar text (None for text)."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return grammar.json_schema({"type": "object"})
    spec = response_format.json_schema
    if spec is None or spec.schema_ is None:
        raise ApiError(400, "response_format json_schema needs json_schema.schema", "response_format")
    try:
        return grammar.json_schema(spec.schema_, strict=spec.strict is True)   # OpenAI's default: false
    except EngineError as e:
        raise ApiError(400, f"response_format: {e}", "response_format") from None


def constraint(model, req, plan: ToolPlan = NO_TOOLS):
    """The request's Constraint (None: free output)."""
    text = response_grammar(getattr(req, "response_format", None))
    if plan.grammar is not None:
        if text is not None:
            raise ApiError(400, "response_format cannot be combined with tool_choice required or a named function",
                           "response_format")
        text, param = plan.grammar, "tools"
    else:
        param = "response_format"
    if text is None:
        return None
    try:
        return grammar.Constraint(model.tokenizer, text)
    except EngineError as e:
        raise ApiError(400, f"{param}: {e}", param) from None


def template_messages(messages: list[dict], request_messages) -> list[dict]:
    """Add the assistant's earlier tool calls (arguments as objects, which templates
    `tojson`) and a tool message's call id to the messages the template sees."""
    for m, r in zip(messages, request_messages):
        if r.tool_calls:
            m["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                               for c in r.tool_calls]
        if r.tool_call_id is not None:
            m["tool_call_id"] = r.tool_call_id
    return messages


def _arguments(arguments):
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except (ValueError, RecursionError):    # not JSON, or nested past the parser's depth
            return arguments
    return arguments


def _encodable(text: str) -> bool:
    """True unless `text` holds a lone surrogate (UTF-8 cannot encode it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def parse_calls(text: str) -> tuple[str | None, list[dict]]:
    """Output text -> (content, calls): every well-formed block (a JSON object with a
    string "name" between OPEN and the next CLOSE) becomes a call; the text around them,
    and any block that is not well-formed, stays content (None when nothing is left).
    One pass over the text, whatever it holds. An OPEN never closed is content, unless
    calls came before it: then it is a call cut short (max_tokens), dropped."""
    calls, rest, at, pos = [], [], 0, 0
    while (start := text.find(OPEN, pos)) >= 0 and (end := text.find(CLOSE, start + len(OPEN))) >= 0:
        pos = end + len(CLOSE)
        try:
            obj = json.loads(text[start + len(OPEN):end])
        except (ValueError, RecursionError):
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not _encodable(obj["name"]):
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        # a "\ud800" escape in the model's JSON is a lone surrogate no response can encode: such
        # arguments stay escaped (ASCII JSON), the rest as the model wrote them
        dumped = json.dumps(args, ensure_ascii=False)
        calls.append(tool_call(obj["name"], dumped if _encodable(dumped) else json.dumps(args)))
        rest.append(text[at:start])
        at = pos
    tail = text[at:]
    if calls and (cut := tail.find(OPEN)) >= 0 and tail.find(CLOSE, cut) < 0:
        tail = tail[:cut]
    rest.append(tail)
    content = "".join(rest).strip() if calls else text
    return (content or None), calls


def calls_finish_reason(reason: str, choice: str) -> str:
    """The finish_reason of an answer holding tool calls, as OpenAI's API gives it:
    "tool_calls", but "stop" for a function `tool_choice` named, and "length" when
    max_tokens or the context cut the answer (a last call may then be missing)."""
    return "length" if reason == "length" else "stop" if choice == "function" else "tool_calls"


class CallStream:
    """A stream's text with tool calls held back: `feed(text)` returns the text safe to
    send as content (nothing from the first `<tool_call>` on, nor a possible start of
    one); `finish()` returns (the rest as content, the calls parsed)."""

    def __init__(self, choice: str = "auto"):
        self.sent, self.held = [], ""
        self.calling = False
        self.choice = choice                # the request's tool_choice (ToolPlan.choice)

    def feed(self, text: str) -> str:
        self.held += text
        if self.calling:
            return ""
        at = self.held.find(OPEN)
        if at >= 0:
            out, self.held, self.calling = self.held[:at], self.held[at:], True
        else:
            keep = next((k for k in range(min(len(OPEN) - 1, len(self.held)), 0, -1)
                         if self.held.endswith(OPEN[:k])), 0)
            out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        self.sent.append(out)
        return out

    def finish(self) -> tuple[str, list[dict]]:
        content, calls = parse_calls(self.held)
        if not calls:
            return self.held, []
        return ("" if content is None else content), calls
