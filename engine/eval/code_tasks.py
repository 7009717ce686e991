"""Seeded long-code questions: a generated Python project (several files, each opened
by a `# file: PATH` line, with docstrings, constants, classes and calls between
functions) and one question about it, in the model's chat format (system + user
message: the code, then the question, asking for a short answer).

    code_def     In which file is the function F defined?               -> the file's path
    code_value   What is the value of the constant C? /
                 What value does the function F return?                 -> the literal
    code_caller  Which function calls G?                                 -> the one caller

Every name is defined once, the asked literal appears once, and G is called exactly
once, so each question has one answer (tests/unit/test_eval_tasks.py parses the files
with `ast` to check it). The asked definition (F, C, or G's caller) sits at depth d%
of the code's tokens, on a definition boundary; G's own definition goes to a random
depth. Lengths are counted in tokens of the model's tokenizer, the chat template
included; a prompt never exceeds its target and falls short of it by at most
`LENGTH_SLACK` tokens (one-line constants top it up).

Scoring (`score_code`) is an exact match that tolerates formatting, not hedging: a
path answer must name exactly one `.py` path, the expected one (backticks, quotes,
a leading `./` and case do not matter); a number answer must mention exactly one
number, the expected one (`4,096` and `4_096` count); a string answer must hold the
literal as a whole word (quotes and backticks do not matter, case does) and no other
string of the prompt; a caller
answer must name the expected function and no other function of the project.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from ..errors import EngineError

CODE_TASKS = ("code_def", "code_value", "code_caller")
CODE_ANSWER_UNITS = 3        # answer tokens: 3 x --max-new-tokens (a path or a name is longer than a number)
LENGTH_SLACK = 24            # a prompt falls short of its target by at most this many tokens

SYSTEM = ("You are a coding assistant. You answer questions about the source code the user gives you. "
          "Reply with only the answer: no explanation, no code.")
INTRO = ("Here is the source code of a Python project, file by file; each file starts with a "
         "`# file: PATH` line.\n\n```python\n")

_VERBS = ("load", "parse", "build", "resolve", "fetch", "merge", "render", "validate", "normalize", "encode",
          "decode", "compute", "collect", "format", "flush", "apply", "split", "scan", "sync", "read", "write",
          "update", "register", "lookup", "compress", "schedule", "filter", "sort", "count", "check", "convert",
          "prepare", "emit", "drain", "refresh", "index", "estimate", "rotate", "trim", "wrap", "extract",
          "publish", "archive", "restore", "score", "rank", "group", "dispatch", "retry", "expire")
_NOUNS = ("config", "record", "header", "token", "batch", "buffer", "page", "chunk", "entry", "request",
          "response", "session", "ledger", "invoice", "route", "payload", "schema", "cursor", "segment",
          "manifest", "snapshot", "checksum", "queue", "worker", "job", "report", "metric", "sample", "event",
          "message", "packet", "account", "order", "price", "inventory", "shipment", "profile", "template",
          "column", "row", "table", "window", "frame", "channel", "bucket", "policy", "rule", "quota", "tag",
          "label", "node", "edge", "graph", "user", "tenant", "lease", "ticket", "invoice", "device", "region")
_QUALS = ("raw", "pending", "active", "cached", "default", "local", "remote", "partial", "stale", "nested",
          "primary", "shared", "next", "last", "total", "daily", "merged", "sorted", "signed", "unique",
          "visible", "hidden", "current", "initial")
_CLASS_SUFFIX = ("Store", "Manager", "Client", "Builder", "Parser", "Cache", "Registry", "Index", "Queue",
                 "Pool", "Tracker", "Router", "Writer", "Reader", "Scheduler", "Validator")
_NUM_SUFFIX = ("SIZE", "LIMIT", "TIMEOUT", "COUNT", "RETRIES", "PORT", "WIDTH", "DEPTH", "INTERVAL", "CAPACITY",
               "THRESHOLD", "BACKLOG")
_STR_SUFFIX = ("PREFIX", "NAME", "MODE", "ENCODING", "KEY", "LABEL", "FORMAT", "CHANNEL", "SUFFIX", "TOPIC")
_PACKAGES = ("ledgerly", "tidepool", "orbitdesk", "quillstack", "harborlight", "fernweb", "copperline",
             "mintrail", "driftwood", "stonepath", "bluefinch", "lanternkit")
_SUBPACKAGES = ("core", "io", "utils", "net", "storage", "api", "models", "jobs", "cli", "services", "common")
_MODULE_SUFFIX = ("utils", "store", "io", "helpers", "service", "models")
_STDLIB = ("os", "re", "json", "time", "math", "hashlib", "itertools", "functools", "pathlib", "collections")
_DOC = ("{Verb} the {qual} {noun} and return the result.",
        "{Verb} every {noun} in the {noun2} list.",
        "Helper to {verb} the {noun} for the {noun2} layer.",
        "{Verb} the {noun} of the {noun2}, skipping empty values.",
        "Return the {qual} {noun}; {verb} it first when needed.",
        "{Verb} the {noun} entries; used by the {noun2} pipeline.",
        "Small wrapper around the {noun2} logic to {verb} the {noun}.",
        "{Verb} the {qual} {noun}. Raises ValueError on bad input.",
        "Compute and {verb} the {noun} for one {noun2}.",
        "{Verb} the {noun2} {noun} values in place.",
        "{Verb} the {noun}.\n\n    Args:\n        {noun2}: the {qual} {noun2} to read from.\n    ",
        "Try to {verb} the {qual} {noun}; return None when the {noun2} is empty.")
_COMMENT = tuple(t for t in _DOC if "\n" not in t)
_MODULE_DOC = ("Utilities for {noun} handling.", "The {noun} and {noun2} services.",
               "{Noun} storage and lookup helpers.", "Functions to {verb} the {noun} and {noun2} data.",
               "Glue code between the {noun} and the {noun2} layers.", "{Noun} models and their helpers.")
_PARAMS = ("items", "values", "records", "entries", "rows", "options", "payload", "path", "key", "name",
           "limit", "source", "target", "mapping", "data", "context", "settings", "batch", "text", "prefix")
_ATTRS = ("name", "size", "priority", "created", "kind", "status", "weight", "owner", "version", "region")

# Function bodies (4-space indented). {f}: a function it calls; {C}: a numeric constant;
# {a} {b}: parameters; {v}: a local; {n}: a small int; {s}: a short string.
_BODIES_CALL = (
    "    result = {{}}\n    for key, value in {a}.items():\n        result[key.lower()] = {f}(value)\n"
    "    return result",
    "    if {a} is None:\n        raise ValueError(\"{a} must not be None\")\n    {v} = {f}({a}, {b})\n"
    "    return {v}",
    "    try:\n        {v} = {f}({a})\n    except (KeyError, ValueError) as exc:\n"
    "        logger.warning(\"{s} failed: %s\", exc)\n        {v} = None\n    return {v}",
    "    {v} = [{f}(x) for x in {a} if x is not None]\n    logger.debug(\"{s}: %d\", len({v}))\n"
    "    return {v}",
)
_BODIES_PLAIN = (
    "    total = 0\n    for item in {a}:\n        if item is None:\n            continue\n"
    "        total += len(str(item))\n    return total",
    "    parts = [str(p) for p in {a} if p]\n    return \"{sep}\".join(parts)",
    "    {v} = max({a}, 0)\n    if {v} > {C}:\n        {v} = {C}\n    return {v}",
    "    return [x for x in {a} if x.{attr} == {b}]",
    "    with open({a}, \"r\", encoding=\"utf-8\") as handle:\n        lines = handle.read().splitlines()\n"
    "    return [line.strip() for line in lines if line.strip()]",
    "    ordered = sorted({a}, key=lambda x: x.{attr}, reverse={flag})\n    return ordered[:{n}]",
    "    counts = {{}}\n    for item in {a}:\n        counts[item] = counts.get(item, 0) + 1\n    return counts",
    "    if not {a}:\n        return {{}}\n    return {{k: v for k, v in {a}.items() if k.startswith(\"{s}\")}}",
    "    {v} = {a} * {n} + {b}\n    if {v} % {n2} == 0:\n        {v} //= {n2}\n    return {v}",
    "    seen = set()\n    out = []\n    for item in {a}:\n        if item.{attr} in seen:\n            continue\n"
    "        seen.add(item.{attr})\n        out.append(item)\n    return out",
)


def _plural(noun: str) -> str:
    if noun.endswith("y") and noun[-2] not in "aeiou":
        return noun[:-1] + "ies"
    return noun + ("es" if noun.endswith(("ch", "sh", "s", "x")) else "s")


@dataclass
class _Item:
    text: str
    kind: str                  # "head" (a file's first lines) | "block" | "needle"
    tokens: int = 0            # estimated, with the separator before it


@dataclass
class _Project:
    """Names and literals drawn so far: each one is used once."""
    rng: np.random.Generator
    names: set = field(default_factory=set)        # identifiers (functions, classes, constants)
    callable: list = field(default_factory=list)   # functions filler may call
    constants: list = field(default_factory=list)  # numeric constants filler may read
    literals: set = field(default_factory=set)     # numbers >= 10 and strings used anywhere
    paths: list = field(default_factory=list)

    def pick(self, seq):
        return seq[int(self.rng.integers(len(seq)))]

    def _fresh(self, make) -> str:
        for _ in range(1000):
            name = make()
            if name not in self.names:
                self.names.add(name)
                return name
        raise EngineError("code task generator ran out of names")

    def func_name(self) -> str:
        def make():
            form = int(self.rng.integers(3))
            if form == 0:
                return f"{self.pick(_VERBS)}_{self.pick(_NOUNS)}"
            if form == 1:
                return f"{self.pick(_VERBS)}_{self.pick(_QUALS)}_{self.pick(_NOUNS)}"
            return f"{self.pick(_VERBS)}_{self.pick(_NOUNS)}_{_plural(self.pick(_NOUNS))}"
        return self._fresh(make)

    def class_name(self) -> str:
        return self._fresh(lambda: self.pick(_QUALS).capitalize() + self.pick(_NOUNS).capitalize()
                           + self.pick(_CLASS_SUFFIX))

    def const_name(self, numeric: bool) -> str:
        def make():
            suffix = self.pick(_NUM_SUFFIX if numeric else _STR_SUFFIX)
            noun = self.pick([n for n in _NOUNS if n != suffix.lower()])
            return f"{self.pick(_QUALS)}_{noun}_{suffix}".upper()
        return self._fresh(make)

    def number(self, min_digits: int = 2) -> int:
        while True:
            digits = int(self.rng.integers(min_digits, 6))
            v = int(self.rng.integers(10 ** (digits - 1), 10 ** digits))
            if v not in self.literals:
                self.literals.add(v)
                return v

    def string(self) -> str:
        while True:
            sep = self.pick(("-", "_", "."))
            v = f"{self.pick(_QUALS)}{sep}{self.pick(_NOUNS)}"
            if v not in self.literals:
                self.literals.add(v)
                return v

    def literal(self, numeric: bool, min_digits: int = 2) -> str:
        return str(self.number(min_digits)) if numeric else f'"{self.string()}"'

    def path(self, package: str) -> str:
        while True:
            plural, noun, suffix, single = (_plural(self.pick(_NOUNS)), self.pick(_NOUNS), self.pick(_MODULE_SUFFIX),
                                            self.pick(_NOUNS))
            module = self.pick((plural, f"{noun}_{suffix}", single))
            p = f"{package}/{self.pick(_SUBPACKAGES)}/{module}.py"
            if p not in self.paths and all(not q.endswith("/" + module + ".py") for q in self.paths):
                self.paths.append(p)
                return p

    # -- text --------------------------------------------------------------------------
    def doc(self, templates=_DOC) -> str:
        verb, noun, noun2 = self.pick(_VERBS), self.pick(_NOUNS), self.pick(_NOUNS)
        return self.pick(templates).format(verb=verb, Verb=verb.capitalize(), noun=noun, Noun=noun.capitalize(),
                                           noun2=noun2, qual=self.pick(_QUALS))

    def file_head(self, path: str) -> str:
        mods = sorted({str(m) for m in self.rng.choice(_STDLIB, int(self.rng.integers(1, 4)), replace=False)})
        imports = "\n".join(["import logging"] + [f"import {m}" for m in mods])
        return (f"# file: {path}\n\"\"\"{self.doc(_MODULE_DOC)}\"\"\"\n{imports}\n\n"
                "logger = logging.getLogger(__name__)")

    def body(self, callee: str | None = None, indent: str = "", calls: bool = True) -> tuple[str, list[str]]:
        """A function body and its parameters. The body calls `callee`, or (None, with
        `calls`) at random one of the functions defined so far, or nothing."""
        a, b = (str(p) for p in self.rng.choice(_PARAMS, 2, replace=False))
        calls = callee is not None or (calls and bool(self.callable) and self.rng.random() < 0.45)
        template = self.pick(_BODIES_CALL if calls else _BODIES_PLAIN)
        if not self.constants and "{C}" in template:
            template = _BODIES_PLAIN[0]
        text = template.format(a=a, b=b, f=callee or (self.pick(self.callable) if calls else ""),
                               C=self.pick(self.constants) if self.constants else "", v=self.pick(_NOUNS),
                               s=self.pick(_NOUNS), sep=self.pick((", ", "/", ":", "-", " ")),
                               attr=self.pick(_ATTRS), flag=self.pick(("True", "False")),
                               n=int(self.rng.integers(2, 10)), n2=int(self.rng.integers(2, 10)))
        params = [a] + ([b] if re.search(rf"\b{b}\b", text) else [])
        return "\n".join(indent + line if line else line for line in text.split("\n")), params

    def function(self, name: str, callee: str | None = None, calls: bool = True) -> str:
        """def `name`: its body calls `callee`, or (calls) maybe a function defined before."""
        body, params = self.body(callee, calls=calls)
        return f"def {name}({', '.join(params)}):\n    \"\"\"{self.doc()}\"\"\"\n{body}"

    def returns_literal(self, name: str, literal: str) -> str:
        """A function whose only return statement returns `literal`."""
        lines = [f"def {name}():", f"    \"\"\"{self.doc()}\"\"\""]
        if self.rng.random() < 0.5:
            lines.append(f"    logger.debug(\"{self.pick(_NOUNS)} {self.pick(_VERBS)}\")")
        lines.append(f"    return {literal}")
        return "\n".join(lines)

    def constant_line(self) -> str:
        numeric = self.rng.random() < 0.6
        name = self.const_name(numeric)
        if numeric:
            self.constants.append(name)
        return f"{name} = {self.literal(numeric)}"

    def constant_block(self) -> str:
        lines = [f"# {self.doc(_COMMENT)}"] if self.rng.random() < 0.5 else []
        return "\n".join(lines + [self.constant_line() for _ in range(int(self.rng.integers(1, 4)))])

    def klass(self) -> str:
        name = self.class_name()
        a, b = (str(p) for p in self.rng.choice(_PARAMS, 2, replace=False))
        lines = [f"class {name}:", f"    \"\"\"{self.doc()}\"\"\"", "",
                 f"    def __init__(self, {a}, {b}={int(self.rng.integers(0, 10))}):",
                 f"        self.{a} = {a}", f"        self.{b} = {b}", f"        self._{self.pick(_NOUNS)}s = []"]
        for _ in range(int(self.rng.integers(1, 3))):
            method = self.func_name()
            body, params = self.body(indent="    ")
            lines += ["", f"    def {method}(self, {', '.join(params)}):", f"        \"\"\"{self.doc()}\"\"\"", body]
        return "\n".join(lines)

    def filler_block(self) -> str:
        r = self.rng.random()
        if r < 0.2:
            return self.constant_block()
        if r < 0.35:
            return self.klass()
        name = self.func_name()
        text = self.function(name)
        self.callable.append(name)
        return text


SEP = "\n\n\n"


def _render(tok, items: list[_Item], topup: list[str], question: str) -> str:
    code = SEP.join(it.text for it in items)
    if topup:
        code += SEP + "\n".join(topup)
    user = INTRO + code + "\n```\n\n" + question
    try:
        return tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
                                       add_generation_prompt=True)
    except EngineError as e:
        raise EngineError(f"the code tasks ask in chat format: {e}") from None


def _count(tok, text: str) -> int:
    return len(tok.encode(text, add_bos=False, special=False))


@dataclass
class CodeQuestion:
    question: str
    expected: str
    key: str                            # the asked name
    answer_kind: str                    # path | number | string | identifier
    needle: str                         # the block at the asked depth
    extra: str | None = None            # code_caller: the callee's definition, at a random depth


def _question(task: str, proj: _Project, rng: np.random.Generator) -> CodeQuestion:
    if task == "code_def":
        name = proj.func_name()
        return CodeQuestion(f"In which file is the function `{name}` defined? Answer with the file path only.",
                            "", name, "path", proj.function(name, calls=False))
    if task == "code_value":
        numeric = bool(rng.random() < 0.5)
        literal = proj.literal(numeric, min_digits=3)
        value = literal.strip('"')
        if rng.random() < 0.5:
            name = proj.const_name(numeric)
            lines = [f"{name} = {literal}"]
            if rng.random() < 0.5:
                lines.insert(0, f"# {proj.doc(_COMMENT)}")
            if rng.random() < 0.5:
                lines.append(proj.constant_line())
            return CodeQuestion(f"What is the value of the constant `{name}`? Answer with the value only.",
                                value, name, "number" if numeric else "string", "\n".join(lines))
        name = proj.func_name()
        return CodeQuestion(f"What value does the function `{name}` return? Answer with the value only.",
                            value, name, "number" if numeric else "string", proj.returns_literal(name, literal))
    if task == "code_caller":
        callee = proj.func_name()
        caller = proj.func_name()
        return CodeQuestion(f"Which function calls `{callee}`? Answer with the function name only.",
                            caller, callee, "identifier", proj.function(caller, callee=callee),
                            extra=proj.function(callee, calls=False))
    raise EngineError(f"unknown code task {task!r}")


def make_code(tok, target: int, depth: float, seed: int, index: int, task: str):
    """One code question about a generated project, the prompt at most `target` tokens."""
    from .tasks import Sample, _sample_rng, _slot
    rng = _sample_rng(seed, task, target, index)
    proj = _Project(rng)
    package = proj.pick(_PACKAGES)
    # The question first: filler only calls filler, so the asked names are called by the needle alone.
    q = _question(task, proj, rng)
    budget = (target - len(tok.encode(_render(tok, [], [], q.question)))
              - sum(_count(tok, SEP + t) for t in (q.needle, q.extra) if t))
    items: list[_Item] = []
    total, left_in_file = 0, 0
    while total < budget or not items:
        if left_in_file == 0:
            text, kind, left_in_file = proj.file_head(proj.path(package)), "head", int(rng.integers(3, 9))
        else:
            text, kind, left_in_file = proj.filler_block(), "block", left_in_file - 1
        n = _count(tok, SEP + text)
        if total + n > budget and items:
            break
        items.append(_Item(text, kind, n))
        total += n
    counts = [it.tokens for it in items]
    needles = [(depth, q.needle)] + ([(float(rng.uniform(0, 100)), q.extra)] if q.extra else [])
    slots = [max(1, _slot(counts, d)) for d, _ in needles]          # never before the first file's head
    for slot, (_, text) in sorted(zip(slots, needles), key=lambda x: -x[0]):
        items.insert(slot, _Item(text, "needle", _count(tok, SEP + text)))
    # exact length: drop trailing filler while too long, then top up with one-line constants
    topup: list[str] = []
    adding = True
    while True:
        prompt = _render(tok, items, topup, q.question)
        n = len(tok.encode(prompt))
        if n > target:
            if topup:
                topup.pop()
                adding = False
                continue
            drop = [i for i, it in enumerate(items) if it.kind != "needle" and i > 0]
            if not drop:
                raise EngineError(f"{task}: {target} tokens cannot hold a code question (it needs about {n})")
            items.pop(drop[-1])
            continue
        if not adding or target - n <= LENGTH_SLACK // 2:
            break
        room, added = target - n - 4, False
        while True:
            line = proj.constant_line()
            room -= _count(tok, "\n" + line)
            if room < 0:
                break
            topup.append(line)
            added = True
        adding = added
    ids = tok.encode(prompt)
    expected = q.expected
    if task == "code_def":                  # the file whose head comes last before the needle
        at = next(i for i, it in enumerate(items) if it.text == q.needle)
        head = next(it.text for it in reversed(items[:at]) if it.kind == "head")
        expected = head.split("\n", 1)[0].removeprefix("# file: ")
    distractors = []
    if task == "code_caller":               # the project's other names: giving one is a wrong answer
        distractors = sorted(proj.names - {q.expected, q.key})
    elif q.answer_kind == "string":         # the prompt's other strings: naming one too is hedging
        distractors = sorted(v for v in proj.literals - {q.expected} if isinstance(v, str) and f'"{v}"' in prompt)
    pos = len(tok.encode(prompt[:prompt.index(q.needle)]))
    return Sample(task, target, index, depth, seed, prompt, ids, [expected], q.key, pos,
                  answer_kind=q.answer_kind, distractors=distractors)


# -- scoring ------------------------------------------------------------------------
_PATH = re.compile(r"(?<![\w/.-])(?:\./|/)?((?:[\w-]+/)*[\w-]+\.py)(?![\w/])")
_NUMBER = re.compile(r"(?<![\w.])-?\d(?:[\d_]|,(?=\d{3}(?!\d)))*(?:\.\d+)?(?![\w])")
_IDENT = re.compile(r"[A-Za-z_]\w*")


def _numbers(text: str) -> set[float]:
    return {float(m.replace("_", "").replace(",", "")) for m in _NUMBER.findall(text)}


def score_code(kind: str, expected: str, generated: str, distractors=()) -> float:
    """1.0 when `generated` gives exactly the expected answer (see the module doc), else 0.0."""
    if kind == "path":
        return float({p.lower() for p in _PATH.findall(generated)} == {expected.lower()})
    if kind == "number":
        return float(_numbers(generated) == {float(expected)})
    if kind == "string":
        said = lambda v: re.search(rf"(?<![\w.-]){re.escape(v)}(?![\w-]|\.\w)", generated) is not None  # noqa: E731
        return float(said(expected) and not any(said(d) for d in distractors))
    if kind == "identifier":
        names = set(_IDENT.findall(generated))
        return float(expected in names and not names & set(distractors))
    raise EngineError(f"unknown answer kind {kind!r}")
