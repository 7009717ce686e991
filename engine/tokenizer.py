"""Tokenizer built from GGUF metadata (`tokenizer.ggml.*`), giving llama.cpp's token ids.

Two vocab types, as llama.cpp names them:
  gpt2   byte-level BPE: a regex pre-tokenizer chosen by `tokenizer.ggml.pre`, GGUF merges.
  llama  SentencePiece BPE: `▁` for spaces, merges ranked by token score, `<0xNN>` byte fallback.

The BPE merging itself runs in HF `tokenizers` (Rust). Special tokens are split out here,
in Python, with llama.cpp's algorithm (`tokenizer_st_partition`), so `special=True/False`
behave like llama.cpp's `parse_special`. Decoding maps each token to its raw bytes here too.
"""

import codecs
import dataclasses
import datetime
import json
import re

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Regex, Tokenizer as HfTokenizer, models, normalizers, pre_tokenizers

from engine.errors import ConfigError, EngineError, ModelFileError, UnsupportedError, cut

# tokenizer.ggml.token_type values (llama.cpp `llama_token_type`)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Token texts llama.cpp treats as end-of-generation whatever their type (llama-vocab.cpp).
EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
    "<|end_of_text|>", "<EOT>", "_<EOT>", "<end_of_utterance>",
    # fill-in-the-middle padding, repository and file separators end generation too (llama.cpp:
    # a code model's completion stops at the next file, not in it)
    "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>",
    "<reponame>", "<|file_sep|>", "<file_sep>",
})
EOG_ID_KEYS = ("eot_token_id", "eom_token_id", "fim_pad_token_id", "fim_rep_token_id", "fim_sep_token_id")

# Pre-tokenizer regexes, from llama.cpp src/llama-vocab.cpp (llm_tokenizer_bpe). Applied in
# sequence: each one splits the pieces the previous one produced; unmatched text stays a piece.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = _CONTRACTIONS + (r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")


@dataclasses.dataclass(frozen=True)
class PreTokenizer:
    regexes: tuple[str, ...]     # applied in order
    ignore_merges: bool = False  # a whole pre-token found in the vocab is taken as is
    add_bos: bool = False        # llama.cpp's default when tokenizer.ggml.add_bos_token is absent


_DEFAULT = PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))
_GPT2_PRE = PreTokenizer((_GPT2,))
_DIGITS_GPT2 = PreTokenizer((r"\p{N}", _GPT2))
_LLAMA3_PRE = PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
_QWEN2_PRE = PreTokenizer((_QWEN2,))

# tokenizer.ggml.pre -> pre-tokenizer, grouped as llama.cpp groups them.
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": _DEFAULT,
    **dict.fromkeys(["gpt-2", "phi-2", "mpt", "olmo", "jais"], _GPT2_PRE),
    **dict.fromkeys(["starcoder", "refact", "command-r", "smollm", "codeshell", "exaone",
                     "minerva-7b"], _DIGITS_GPT2),
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"], _LLAMA3_PRE),
    **dict.fromkeys(["dbrx", "smaug-bpe"], PreTokenizer((_LLAMA3,))),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "megrez", "stablelm2"], _QWEN2_PRE),
}


def _byte_to_char() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes map to themselves, the rest to U+0100.."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    extra = 0x100
    for b in range(256):
        if b not in table:
            table[b] = chr(extra)
            extra += 1
    return table


_CHAR_TO_BYTE = {c: b for b, c in _byte_to_char().items()}


def _typed_list(meta: dict, key: str, kind) -> list:
    """A metadata array whose elements are all `kind` ([] when absent); ModelFileError otherwise."""
    value = meta.get(key)
    if value is None:
        return []
    if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, kind) for v in value):
        raise ModelFileError(f"GGUF metadata {key} is not an array of "
                             f"{'strings' if kind is str else 'numbers'}")
    return value


class PieceFinder:
    """Which of a fixed set of strings occur in a text, in one regex pass (a vocabulary's
    special pieces: Gemma 3 has 6,414, and testing each with `in` cost 0.5 s on a 32K-token
    text). The pattern is the pieces' trie inside a lookahead, so it finds at every position
    the longest piece starting there; every other piece starting there is a prefix of that
    one, added from the set. Compiled on first use."""

    def __init__(self, pieces):
        self.pieces = frozenset(p for p in pieces if p)
        self._regex: re.Pattern | bool | None = None       # False: the pattern would not compile
        self._prefixes: dict[str, list[str]] = {}

    def present(self, text: str) -> set[str]:
        if not self.pieces:
            return set()
        if self._regex is None:
            try:
                self._regex = re.compile("(?=(" + self._trie(self.pieces) + "))", re.DOTALL)
            except (RecursionError, re.error, OverflowError):   # a pathological vocabulary: test each
                self._regex = False
        if self._regex is False:
            return {piece for piece in self.pieces if piece in text}
        found = {m.group(1) for m in self._regex.finditer(text)}
        for piece in list(found):
            if piece not in self._prefixes:
                self._prefixes[piece] = [piece[:k] for k in range(1, len(piece)) if piece[:k] in self.pieces]
            found.update(self._prefixes[piece])
        return found

    @staticmethod
    def _trie(pieces) -> str:
        """A regex matching the longest of `pieces` at a position: a trie whose optional
        tails are greedy (tried before the shorter piece ends)."""
        root: dict = {}
        for piece in pieces:
            node = root
            for ch in piece:
                node = node.setdefault(ch, {})
            node[None] = None                      # a piece ends here

        def emit(node) -> str:
            alts = []
            for ch, child in node.items():
                if ch is None:
                    continue
                run = re.escape(ch)
                while len(child) == 1 and None not in child:     # one way on: no group needed
                    (ch, child), = child.items()
                    run += re.escape(ch)
                alts.append(run + emit(child))
            if not alts:
                return ""
            body = "(?:" + "|".join(alts) + ")"
            return body + "?" if None in node else body
        return emit(root)


class Tokenizer:
    """Encode/decode text for one model. Build with `from_metadata` or `from_gguf`."""

    def __init__(self, meta: dict):
        tokens = _typed_list(meta, "tokenizer.ggml.tokens", str)
        if not tokens:
            raise ModelFileError("GGUF metadata has no tokenizer.ggml.tokens list")
        self.kind = str(meta.get("tokenizer.ggml.model", ""))
        if self.kind not in ("gpt2", "llama"):
            raise UnsupportedError(f"tokenizer model {self.kind!r} is not supported (supported: gpt2, llama)")
        n = len(tokens)
        # llama.cpp renames empty tokens so every text is unique and non-empty
        self.pieces: list[str] = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        self.types: list[int] = _typed_list(meta, "tokenizer.ggml.token_type", int) or [NORMAL] * n
        if len(self.types) < n:
            raise ModelFileError(f"tokenizer.ggml.token_type has {len(self.types)} entries for {n} tokens")
        self.token_to_id: dict[str, int] = {}  # piece text -> id
        for i, piece in enumerate(self.pieces):
            if self.token_to_id.setdefault(piece, i) != i:
                first = self.token_to_id[piece]
                raise ModelFileError(f"duplicate token {piece!r} in vocabulary (ids {first} and {i})")

        spm = self.kind == "llama"
        pre = self._pre_tokenizer(meta) if not spm else None

        def special_id(key: str, default: int | None) -> int | None:
            value = meta.get(f"tokenizer.ggml.{key}", default)
            return value if isinstance(value, int) and 0 <= value < n else default

        self.bos_id = special_id("bos_token_id", 1 if spm else None)
        self.eos_id = special_id("eos_token_id", 2 if spm else None)
        self.unk_id = special_id("unknown_token_id", 0 if spm else None)
        self.add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True if spm else pre.add_bos))
        self.add_space_prefix = spm and bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        if self.add_bos and self.bos_id is None:
            raise ModelFileError("tokenizer.ggml.add_bos_token is true, but tokenizer.ggml.bos_token_id is not set")
        template = meta.get("tokenizer.chat_template")
        self.chat_template: str | None = template if isinstance(template, str) else None

        eog = {i for i in (self.eos_id, *(special_id(k, None) for k in EOG_ID_KEYS)) if i is not None}
        for text in EOG_TEXTS & self.token_to_id.keys():
            eog.add(self.token_to_id[text])
            self.types[self.token_to_id[text]] = CONTROL  # llama.cpp forces these to CONTROL
        self.eot_ids: frozenset[int] = frozenset(eog)

        # special-token partition order: longest text first, as llama.cpp
        by_length = sorted((i for i in range(n) if self.types[i] in (UNKNOWN, CONTROL, USER_DEFINED)),
                           key=lambda i: -len(self.pieces[i]))
        self._specials = [(i, self.pieces[i]) for i in by_length]
        self._user_defined = [(i, p) for i, p in self._specials if self.types[i] == USER_DEFINED]
        self._finders = {key: PieceFinder(p for i, p in self._specials if keep(i)) for key, keep in (
            ("special", lambda i: True), ("user", lambda i: self.types[i] == USER_DEFINED),
            ("control", lambda i: self.types[i] != USER_DEFINED))}

        self._hf = self._build_spm(meta) if spm else self._build_bpe(meta, pre)
        self._template: jinja2.Template | None = None

    @classmethod
    def from_metadata(cls, meta: dict) -> "Tokenizer":
        return cls(meta)

    @classmethod
    def from_gguf(cls, path) -> "Tokenizer":
        from engine.gguf import GgufFile
        return cls(GgufFile(path).metadata)

    @property
    def vocab_size(self) -> int:
        return len(self.pieces)

    # ---- building -------------------------------------------------------------------------

    @staticmethod
    def _pre_tokenizer(meta: dict) -> PreTokenizer:
        name = str(meta.get("tokenizer.ggml.pre") or "default")  # llama.cpp: missing -> default
        if name not in PRE_TOKENIZERS:
            raise UnsupportedError(
                f"pre-tokenizer {name!r} is not supported (supported: {', '.join(sorted(PRE_TOKENIZERS))})")
        return PRE_TOKENIZERS[name]

    def _build_bpe(self, meta: dict, pre: PreTokenizer) -> HfTokenizer:
        merges = []
        for line in _typed_list(meta, "tokenizer.ggml.merges", str):
            cut = line.find(" ", 1)  # llama.cpp splits at the first space after position 0
            if cut < 0:
                raise ModelFileError(f"malformed BPE merge {line!r} in tokenizer.ggml.merges")
            merges.append((line[:cut], line[cut + 1:]))
        if not merges:
            raise ModelFileError("gpt2 tokenizer has no tokenizer.ggml.merges")
        try:
            hf = HfTokenizer(models.BPE(self.token_to_id, merges, ignore_merges=pre.ignore_merges))
        except Exception as e:
            raise ModelFileError(f"cannot build BPE tokenizer: {e}") from None
        splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        return hf

    def _build_spm(self, meta: dict) -> HfTokenizer:
        scores = _typed_list(meta, "tokenizer.ggml.scores", (int, float)) or [0.0] * len(self.pieces)
        if len(scores) < len(self.pieces):
            raise ModelFileError(f"tokenizer.ggml.scores has {len(scores)} entries for {len(self.pieces)} tokens")
        # llama.cpp merges the adjacent pair whose joined text is the highest-scoring token;
        # ranking every (left, right) split of every token by that score is the same rule.
        # only cuts where both halves have a token's length: linear in a (corrupt) huge token
        lengths = {len(p) for p in self.pieces}
        cuts = sorted(lengths)
        ranked = []
        for i, piece in enumerate(self.pieces):
            if self.types[i] == BYTE:
                continue
            n = len(piece)
            for cut in cuts:
                if cut >= n:
                    break
                if n - cut not in lengths:
                    continue
                left, right = piece[:cut], piece[cut:]
                if left in self.token_to_id and right in self.token_to_id:
                    ranked.append((-scores[i], i, self.token_to_id[left], (left, right)))
        ranked.sort()
        unk = self.pieces[self.unk_id] if self.unk_id is not None else None
        try:
            model = models.BPE(self.token_to_id, [m[-1] for m in ranked], unk_token=unk, byte_fallback=True, fuse_unk=True)
        except Exception as e:
            raise ModelFileError(f"cannot build SentencePiece tokenizer: {e}") from None
        hf = HfTokenizer(model)
        hf.normalizer = normalizers.Replace(" ", "\u2581")
        return hf

    # ---- encoding -------------------------------------------------------------------------

    def encode(self, text: str, add_bos: bool | None = None, special: bool = True) -> list[int]:
        """Token ids of `text`. add_bos None follows the model; special=True parses control tokens."""
        return self._encode_fragments(self._partition(text, special), add_bos)

    def encode_parts(self, parts, add_bos: bool | None = None) -> list[int]:
        """Token ids of the concatenation of `parts`, [(text, special)]: special-token text
        is parsed in the parts whose flag is true only (a chat template's own markup, not
        the messages' content). Adjacent text is tokenized together, so the ids equal
        encode(joined text) wherever no unparsed part holds special-token text."""
        fragments: list[str | int] = []
        for text, special in parts:
            for piece in self._partition(text, special):
                if isinstance(piece, str) and fragments and isinstance(fragments[-1], str):
                    fragments[-1] += piece
                else:
                    fragments.append(piece)
        return self._encode_fragments(fragments, add_bos)

    def control_text_in(self, text: str) -> bool:
        """Whether `text` holds the text of a control or unknown token (which encode with
        special=True turns into that token, and special=False leaves as text)."""
        return bool(self._finders["control"].present(text))

    @property
    def max_piece_chars(self) -> int:
        """The most text characters one token can stand for (a bound: a text of n
        characters has at least n / max_piece_chars tokens)."""
        if getattr(self, "_max_piece_chars", None) is None:
            self._max_piece_chars = max(max(len(p) for p in self.pieces), 1)
        return self._max_piece_chars

    def _encode_fragments(self, fragments, add_bos: bool | None) -> list[int]:
        if add_bos is None:
            add_bos = self.add_bos
        if add_bos and self.bos_id is None:
            raise ConfigError("add_bos=True, but this model has no BOS token")
        ids = [self.bos_id] if add_bos else []
        prev_special = True  # SPM: a space is prefixed to the first fragment and after specials
        for part in fragments:
            if isinstance(part, int):
                ids.append(part)
                prev_special = True
                continue
            if self.add_space_prefix and prev_special:
                part = " " + part
            ids.extend(self._hf.encode(part, add_special_tokens=False).ids)
            prev_special = False
        return ids

    def _partition(self, text: str, special: bool) -> list[str | int]:
        """Split out special tokens: each (longest first) cuts every remaining text fragment."""
        parts: list[str | int] = [text] if text else []
        present = self._finders["special" if special else "user"].present(text)
        for token_id, piece in self._specials if special else self._user_defined:
            if piece not in present:
                continue
            out: list[str | int] = []
            for part in parts:
                if isinstance(part, int) or piece not in part:
                    out.append(part)
                    continue
                for k, chunk in enumerate(part.split(piece)):
                    if k:
                        out.append(token_id)
                    if chunk:
                        out.append(chunk)
            parts = out
        return parts

    # ---- decoding -------------------------------------------------------------------------

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes of one token (special tokens as their text)."""
        if not 0 <= token_id < len(self.pieces):
            raise ConfigError(f"token id {token_id} is outside the vocabulary (size {len(self.pieces)})")
        piece, kind = self.pieces[token_id], self.types[token_id]
        if kind in (UNKNOWN, CONTROL, USER_DEFINED):
            return piece.encode()
        if kind == BYTE and piece.startswith("<0x"):
            return bytes([int(piece[3:5], 16)])
        if kind != NORMAL:  # UNUSED / UNDEFINED render as nothing, as in llama.cpp
            return b""
        if self.kind == "llama":
            return piece.replace("\u2581", " ").encode()
        return b"".join(bytes([_CHAR_TO_BYTE[c]]) if c in _CHAR_TO_BYTE else c.encode() for c in piece)

    def _piece(self, token_id: int, skip_special: bool, first: bool) -> bytes:
        """Bytes of one token in a decode; `first`: no text token has been seen yet."""
        data = self.token_bytes(token_id)
        if skip_special and self.types[token_id] in (UNKNOWN, CONTROL):
            return b""
        if first and self.add_space_prefix and data.startswith(b" "):
            return data[1:]  # undo the space SPM encoding prefixes to the text
        return data

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        stream = StreamDecoder(self, skip_special)
        return "".join(stream.push(i) for i in ids) + stream.flush()

    def stream(self, skip_special: bool = False, continuation: bool = False) -> "StreamDecoder":
        """An incremental decoder. `continuation`: the ids continue text already decoded
        (a generated answer): its first piece keeps its leading space, which SPM strips
        only at a text's start; `skip_special`: control and unknown tokens decode to nothing."""
        return StreamDecoder(self, skip_special, continuation)

    def chat_add_bos(self, text: str) -> bool | None:
        """add_bos for a rendered chat prompt: False when the template already wrote the
        BOS (no double BOS, as vLLM and llama.cpp's server), else the model's default."""
        bos = self.pieces[self.bos_id] if self.bos_id is not None else None
        return False if bos and text.startswith(bos) else None

    # ---- chat template --------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        """Render `tokenizer.chat_template` (jinja2, sandboxed, HF settings) to a prompt string."""
        if not self.chat_template:
            raise EngineError("this model has no chat template (tokenizer.chat_template is missing)")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        bos = self.pieces[self.bos_id] if self.bos_id is not None else ""
        eos = self.pieces[self.eos_id] if self.eos_id is not None else ""
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=bos, eos_token=eos, **extra)
        except jinja2.TemplateError as e:
            raise EngineError(f"chat template failed: {cut(str(e), 200)}") from None
        except Exception as e:               # the template's own bug (RecursionError, MemoryError, ...)
            raise EngineError(f"chat template failed: {type(e).__name__}: {cut(str(e), 200)}") from None


class StreamDecoder:
    """Feed ids one at a time; get back the newly completed text (incomplete UTF-8 is held)."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False, continuation: bool = False):
        self._tok = tokenizer
        self._skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._first = not continuation

    def push(self, token_id: int) -> str:
        data = self._tok._piece(token_id, self._skip_special, self._first)
        self._first = self._first and self._tok.types[token_id] == CONTROL  # a leading BOS keeps it
        return self._utf8.decode(data)

    def flush(self) -> str:
        """Whatever is still held back (an incomplete sequence becomes U+FFFD)."""
        return self._utf8.decode(b"", final=True)


def _compile_template(source: str) -> jinja2.Template:
    """Compile a chat template the way HF transformers does (sandboxed, trimmed blocks)."""

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):   # HF's signature
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    try:
        return env.from_string(source)
    except Exception as e:                   # TemplateError; RecursionError, SyntaxError on junk
        raise EngineError(f"chat template does not compile: {type(e).__name__}: {cut(str(e), 200)}") from None


MAX_TEMPLATE_VALUE = 1 << 24     # items or characters a template's `*` may make (16M; a prompt is far less)


class _Sandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """HF's sandbox, where `'x' * n` and `n ** m` cannot make values past MAX_TEMPLATE_VALUE
    (the sandbox already bounds `range`)."""
    intercepted_binops = frozenset(["*", "**"])

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            seq, n = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_TEMPLATE_VALUE:
                raise jinja2.sandbox.SecurityError(f"a value of {len(seq)} x {n} items is past the template limit")
        elif isinstance(left, int) and isinstance(right, int) and right > 0 and \
                left.bit_length() * right > MAX_TEMPLATE_VALUE:
            raise jinja2.sandbox.SecurityError(f"{left} ** {right} is past the template limit")
        return super().call_binop(context, operator, left, right)

