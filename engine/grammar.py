"""Constrained decoding: a grammar (a JSON schema, or a Lark grammar with JSON schemas
inside) as a token mask per decode step, through llguidance (the grammar engine
llama.cpp uses).

The bridge from our tokenizer (engine/tokenizer.py, built from GGUF metadata) to
llguidance is each token's bytes plus our encode function; control tokens (and tokens
with no bytes) are marked special (a 0xff byte before their text, as llguidance's
llama.cpp bridge does), so no grammar text can produce them; the end-of-turn tokens
are its EOS tokens, allowed once the grammar accepts. Built once per tokenizer (about
a second for a 150k vocabulary) and cached.

A `Constraint` is one request's matcher: `apply(logits)` sets every token the grammar
does not allow next to -inf, `consume(token)` advances it. `fill_masks` computes the
next masks of a whole decode batch at once, in llguidance's own threads (the GIL is
dropped), before the scheduler samples.
"""
from __future__ import annotations

import json
import threading
import weakref

import numpy as np

from .errors import EngineError
from .tokenizer import CONTROL, UNKNOWN

# JSON as the models write it (and as the tests compare): ", " and ": ", no free
# whitespace, so a small model cannot wander off into blank lines inside an object.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_lock = threading.Lock()
_tokenizers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # Tokenizer -> LLTokenizer
_executor = None


class GrammarError(EngineError):
    """A grammar or schema llguidance refuses (a request error: 400)."""


def _llg():
    try:
        import llguidance
    except ImportError:                         # a dependency, but say what is missing
        raise GrammarError("constrained decoding needs the llguidance package (pip install llguidance)") from None
    return llguidance


class _Vocabulary:
    """What llguidance.TokenizerWrapper reads: token bytes, EOS/BOS, and an encoder."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self.eos_token_id = tokenizer.eos_id if tokenizer.eos_id is not None else min(tokenizer.eot_ids, default=0)
        self.bos_token_id = tokenizer.bos_id
        self.tokens: list[bytes] = []           # token id -> bytes (special: 0xff + its text)
        self.special_token_ids: list[int] = []
        for i in range(tokenizer.vocab_size):
            data = tokenizer.token_bytes(i)
            if tokenizer.types[i] in (CONTROL, UNKNOWN) or not data:
                data = b"\xff" + tokenizer.pieces[i].encode()
                self.special_token_ids.append(i)
            self.tokens.append(data)

    def __call__(self, text):
        if isinstance(text, bytes):             # llguidance probes for a bytes encoder: str only
            raise TypeError("str expected")
        return self._tok.encode(text, add_bos=False, special=False)


def lltokenizer(tokenizer):
    """The llguidance tokenizer of one of ours (built on first use, then cached)."""
    with _lock:
        llt = _tokenizers.get(tokenizer)
        if llt is None:
            llg = _llg()
            llt = llg.LLTokenizer(llg.TokenizerWrapper(_Vocabulary(tokenizer)),
                                  eos_token=sorted(tokenizer.eot_ids) or None)
            _tokenizers[tokenizer] = llt
        return llt


def json_schema(schema, strict: bool = True) -> str:
    """A JSON schema (a dict) -> llguidance grammar text. strict: unsupported keywords
    are errors (OpenAI's strict); otherwise they are ignored."""
    if not isinstance(schema, dict):
        raise GrammarError("a JSON schema must be an object")
    options = dict(JSON_STYLE, lenient=not strict)
    try:
        return _llg().LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=options)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"invalid JSON schema: {_one_line(e)}") from None


def lark(text: str) -> str:
    """A Lark grammar (llguidance's dialect: `%json {schema}` embeds a JSON schema)."""
    return _llg().LLMatcher.grammar_from_lark(text)


def inline_schema(schema: dict) -> str:
    """A JSON schema as a Lark `%json` body, in JSON_STYLE (its own x-guidance wins)."""
    return "%json " + json.dumps({**schema, "x-guidance": {**JSON_STYLE, **schema.get("x-guidance", {})}})


class Constraint:
    """One request's grammar state. Not thread-safe: the scheduler's worker owns it."""

    def __init__(self, tokenizer, grammar: str):
        llg = _llg()
        self._llt = lltokenizer(tokenizer)
        self.vocab = self._llt.vocab_size
        self.matcher = llg.LLMatcher(self._llt, grammar, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(f"invalid grammar: {_one_line(self.matcher.get_error())}")
        self.mask = np.zeros((1, (self.vocab + 31) // 32), dtype=np.int32)   # i32 [1, vocab/32] bits
        self._fresh = False                     # mask matches the matcher's state

    @property
    def stopped(self) -> bool:
        """Nothing can follow: the output is complete (or the matcher failed)."""
        return self.matcher.is_stopped()

    def compute_mask(self) -> None:
        if not self._fresh:
            self.matcher.unsafe_compute_mask_ptr(self.mask.ctypes.data, self.mask.nbytes)
            self._fresh = True

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """logits f32 [vocab] -> a copy with the disallowed tokens at -inf. GrammarError
        (the request's grammar, a 400) when the matcher fails or allows no token."""
        self.compute_mask()
        if self.matcher.is_error():
            raise GrammarError(f"the grammar failed while decoding: {_one_line(self.matcher.get_error())}")
        allowed = np.unpackbits(self.mask.view(np.uint8), count=logits.shape[-1], bitorder="little")   # u8 [vocab]
        if not allowed.any():
            raise GrammarError("the grammar allows no token of this vocabulary here")
        with np.errstate(divide="ignore"):      # log(1) = 0, log(0) = -inf: branch-free, ~4x np.where
            return np.log(allowed.astype(np.float32)) + logits

    def consume(self, token: int) -> None:
        self._fresh = False
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"grammar matcher refused token {token}: {_one_line(self.matcher.get_error())}")


def fill_masks(constraints: list[Constraint]) -> None:
    """Compute the next masks of several constraints at once (llguidance's threads)."""
    todo = [c for c in constraints if not c._fresh]
    if len(todo) < 2:
        for c in todo:
            c.compute_mask()
        return
    global _executor
    llg = _llg()
    with _lock:
        if _executor is None:
            _executor = llg.LLExecutor()
    batch = np.zeros((len(todo), todo[0].mask.shape[1]), dtype=np.int32)   # i32 [n, vocab/32]
    import llguidance.numpy as lln
    lln.fill_next_token_bitmask_par(_executor, [(c.matcher, i) for i, c in enumerate(todo)], batch)
    for i, c in enumerate(todo):
        c.mask[0] = batch[i]
        c._fresh = True


def _one_line(e) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
