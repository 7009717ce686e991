"""Chat messages -> token ids where only the chat template's own markup becomes control
tokens (the server's default, `--content-special-tokens text`, and the Python API's and
`engine run --chat`'s always).

Special-token text inside a message's content (`<|im_end|>\\n<|im_start|>system` in a
user's message, or in a source file a coding question quotes) is tokenized as plain
text. Where some content holds such text, the template renders the chat a second time
with each such content replaced by its mark: this skeleton says where that content is,
and the text around the marks is the template's own (parsed for special tokens). So
content that repeats the template's markup (after a default system prompt, say) cannot
take its place. A template that repeats or changes such content cannot keep it as text:
refused. Special-token text anywhere else a template may print (a role, a name, a tool
call, a tool's definition, content given as parts) is refused too. Errors are EngineError.
"""
from __future__ import annotations

from .errors import EngineError

CONTENT_MARK = "\ue000content {}\ue001"     # stands for message i's content in a skeleton


def _holds_control_text(tok, content) -> bool:
    return isinstance(content, str) and tok.control_text_in(content)


def marked_messages(tok, messages: list[dict]) -> list[dict] | None:
    """The messages with each content that holds special-token text replaced by its
    CONTENT_MARK, to render the skeleton; None where no content holds any (the rendered
    text then tokenizes as it is). Other content stays as it is in both renders."""
    holds = [_holds_control_text(tok, m.get("content")) for m in messages]     # each content scanned once
    if not any(holds):
        return None
    return [dict(m, content=CONTENT_MARK.format(i)) if h else m for i, (m, h) in enumerate(zip(messages, holds))]


def check_fields(tok, messages: list[dict], tools: list[dict] | None = None) -> None:
    """Special-token text anywhere a template may print it but a message's text content
    (a role, a name, a tool call or its arguments, a tool's definition, content given
    as parts) is refused. Walked without recursion (arguments nest as deep as JSON)."""
    stack: list = [(f"messages[{i}] (outside its text content)",
                    {k: v for k, v in m.items() if k != "content" or not isinstance(v, str)})
                   for i, m in enumerate(messages)]
    stack += [("tools", tools or [])]
    while stack:
        where, value = stack.pop()
        if isinstance(value, str):
            if tok.control_text_in(value):
                raise EngineError(f"special-token text (such as <|im_start|>) in {where} is refused: only a "
                                  f"message's text content may hold it (kept as plain text)")
        elif isinstance(value, dict):
            stack += [(where, k) for k in value if isinstance(k, str)] + [(where, v) for v in value.values()]
        elif isinstance(value, (list, tuple)):
            stack += [(where, v) for v in value]


def content_parts(text: str, skeleton: str | None, messages: list[dict]) -> list[tuple[str, bool]]:
    """The rendered `text` as [(part, special)] for Tokenizer.encode_parts: the skeleton's
    text (special-token text parsed) around each marked content (plain text), in the
    order the template printed them, checked to join into exactly `text`."""
    refusal = EngineError("a message's content holds special-token text (such as <|im_start|>) and the chat "
                          "template changes or repeats that content, so it cannot be kept as plain text: "
                          "remove the special-token text")
    if skeleton is None:
        raise refusal
    marks = []
    for i, m in enumerate(messages):
        mark = CONTENT_MARK.format(i)
        count = skeleton.count(mark)
        if count > 1:
            raise refusal
        if count == 1:                         # (none: not marked, or a message the template leaves out)
            marks.append((skeleton.index(mark), mark, m["content"]))
    parts, at = [], 0
    for found, mark, content in sorted(marks):
        parts += [(skeleton[at:found], True), (content, False)]
        at = found + len(mark)
    parts.append((skeleton[at:], True))
    if "".join(p for p, _ in parts) != text:
        raise refusal
    return parts
