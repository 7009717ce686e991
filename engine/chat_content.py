"""Chat messages -> token ids where only the chat template's own markup becomes control
tokens (the server's default, `--content-special-tokens text`, and the Python API's and
`engine run --chat`'s always).

Special-token text inside a message's content (`<|im_end|>\\n<|im_start|>system` in a
user's message, or in a source file a coding question quotes) is tokenized as plain
text. Where some content holds such text, the template renders the chat a second time
with each content replaced by its mark: this skeleton says where each content is, and
the text around the marks is the template's own markup, parsed for special tokens. So
content that repeats the template's markup (after a default system prompt, say) cannot
take its place. A template that repeats, reorders or changes content cannot keep it as
text: refused. Special-token text anywhere else a template may print (a role, a name, a
tool call, a tool's definition) is refused too. Errors are EngineError.
"""
from __future__ import annotations

from .errors import EngineError

CONTENT_MARK = "\ue000content {}\ue001"     # stands for message i's content in a skeleton


def marked_messages(tok, messages: list[dict]) -> list[dict] | None:
    """Where some message's content holds special-token text: the messages with every
    non-empty content replaced by its CONTENT_MARK, to render the skeleton; None where
    no content holds any (the rendered text then tokenizes as it is)."""
    if not any(isinstance(m.get("content"), str) and tok.control_text_in(m["content"]) for m in messages):
        return None
    return [dict(m, content=CONTENT_MARK.format(i)) if isinstance(m.get("content"), str) and m["content"] else m
            for i, m in enumerate(messages)]


def check_fields(tok, messages: list[dict], tools: list[dict] | None = None) -> None:
    """Special-token text anywhere a template may print it but a message's content is
    refused. Walked without recursion (tool arguments nest as deep as JSON does)."""
    stack: list = [(f"messages[{i}] (outside its content)", {k: v for k, v in m.items() if k != "content"})
                   for i, m in enumerate(messages)]
    stack += [("tools", tools or [])]
    while stack:
        where, value = stack.pop()
        if isinstance(value, str):
            if tok.control_text_in(value):
                raise EngineError(f"special-token text (such as <|im_start|>) in {where} is refused: only a "
                                  f"message's content may hold it (as plain text)")
        elif isinstance(value, dict):
            stack += [(where, k) for k in value if isinstance(k, str)] + [(where, v) for v in value.values()]
        elif isinstance(value, (list, tuple)):
            stack += [(where, v) for v in value]


def content_parts(text: str, skeleton: str | None, messages: list[dict]) -> list[tuple[str, bool]]:
    """The rendered `text` as [(part, special)] for Tokenizer.encode_parts: the skeleton's
    markup (special-token text parsed) around each content (plain text), checked to
    join into exactly `text`."""
    refusal = EngineError("a message's content holds special-token text (such as <|im_start|>) and the chat "
                          "template changes, repeats or reorders content, so it cannot be kept as plain "
                          "text: remove it")
    if skeleton is None:
        raise refusal
    parts, at = [], 0
    for i, m in enumerate(messages):
        mark = CONTENT_MARK.format(i)
        count = skeleton.count(mark)
        if count == 0:                         # no content, or a message the template leaves out
            continue
        found = skeleton.find(mark, at)
        if count > 1 or found < 0:
            raise refusal
        parts += [(skeleton[at:found], True), (m["content"], False)]
        at = found + len(mark)
    parts.append((skeleton[at:], True))
    if "".join(p for p, _ in parts) != text:
        raise refusal
    return parts
