"""Validation of what users hand the engine: prompt text, prompt files, token ids,
stop strings, model paths and output folders. Each check turns a bad value into
a one-line ConfigError (an EngineError) naming the argument, before it reaches
the tokenizer, numpy or the file system."""
from __future__ import annotations

import os
from numbers import Integral
import numpy as np

from .errors import ConfigError, EngineError


def text(value, what: str = "prompt") -> str:
    """`value` as a str that encodes to UTF-8: not bytes, not None, no lone surrogates
    (a command-line argument with non-UTF-8 bytes arrives holding U+DC80..U+DCFF)."""
    if isinstance(value, (bytes, bytearray)):
        raise ConfigError(f"{what} must be a str, got {type(value).__name__} (decode it first)")
    if not isinstance(value, str):
        raise ConfigError(f"{what} must be a str, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = value[e.start]
        if "\udc80" <= bad <= "\udcff":          # surrogateescape: an undecodable byte
            raise ConfigError(f"{what} is not valid UTF-8: byte 0x{ord(bad) - 0xDC00:02x} at character "
                              f"{e.start}") from None
        raise ConfigError(f"{what} holds a lone surrogate U+{ord(bad):04X} at character {e.start}, "
                          f"which is not text") from None
    return value


def prompt_file(path: str) -> str:
    """The text of a UTF-8 prompt file, "-" for standard input (a leading byte-order
    mark is dropped)."""
    import sys
    try:
        if path == "-":
            data = sys.stdin.buffer.read()
        else:
            with open(path, "rb") as f:
                data = f.read()
    except OSError as e:
        raise EngineError(f"cannot read prompt file {path}: {e.strerror or e}") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise EngineError(f"prompt file {path} is not UTF-8 text: byte 0x{data[e.start]:02x} at offset "
                          f"{e.start} (convert it, e.g. iconv -t UTF-8)") from None


def token_ids(value, vocab_size: int, what: str = "token ids") -> list[int]:
    """A 1-D sequence of integer ids in [0, vocab_size) as a list of ints. Floats,
    bools, bytes and nested sequences are refused rather than converted."""
    if isinstance(value, (bytes, bytearray, str)) or value is None:
        raise ConfigError(f"{what} must be a sequence of integers, got {type(value).__name__}")
    if isinstance(value, np.ndarray):
        if value.ndim != 1:
            raise ConfigError(f"{what} must be one-dimensional, got an array of shape {value.shape}")
        if value.dtype == np.bool_ or not np.issubdtype(value.dtype, np.integer):
            raise ConfigError(f"{what} must be integers, got an array of {value.dtype}")
        ids = value.tolist()
    else:
        try:
            ids = list(value)
        except TypeError:
            raise ConfigError(f"{what} must be a sequence of integers, got {type(value).__name__}") from None
        for i, t in enumerate(ids):
            if isinstance(t, (bool, np.bool_)) or not isinstance(t, Integral):
                raise ConfigError(f"{what} must be integers, got {type(t).__name__} {t!r} at index {i}")
        ids = [int(t) for t in ids]
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise ConfigError(f"token id {t} (index {i}) is out of range for a vocabulary of {vocab_size}")
    return ids


def stop_strings(value) -> tuple[str, ...]:
    """stop=None, one string, or a sequence of strings -> a tuple of non-empty strings."""
    if value is None:
        return ()
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, (list, tuple, set, frozenset)):
        raise ConfigError(f"stop must be a string or a list of strings, got {type(value).__name__}")
    out = tuple(text(s, "stop string") for s in value)
    if any(s == "" for s in out):
        raise ConfigError("stop strings must be non-empty")
    return out


def logit_bias(value, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """logit_bias=None or {token id: bias} (ids as ints or, as JSON sends them, digit
    strings) -> ((id, bias), ...) with ids in the vocabulary; the bias range is
    SamplingParams' check."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise ConfigError(f"logit_bias must be a mapping of token id to bias, got {type(value).__name__}")
    out: dict[int, float] = {}
    for key, bias in value.items():
        if isinstance(key, str) and key.strip().isascii() and key.strip().isdigit() and len(key.strip()) <= 18:
            key = int(key)
        if isinstance(key, (bool, np.bool_)) or not isinstance(key, Integral) or not 0 <= key < vocab_size:
            shown = repr(key) if len(repr(key)) <= 40 else repr(key)[:37] + "..."
            raise ConfigError(f"logit_bias: {shown} is not a token id of this vocabulary (0 .. {vocab_size - 1})")
        if isinstance(bias, (bool, np.bool_)) or not isinstance(bias, (Integral, float)):
            raise ConfigError(f"logit_bias: the bias of token {key} must be a number, got {type(bias).__name__}")
        if int(key) in out:                  # "5" and "05": one token biased twice
            raise ConfigError(f"logit_bias: token {int(key)} is given more than once")
        out[int(key)] = float(bias)
    return tuple(out.items())


def model_path(value):
    """A model path: None (the default model), a str or an os.PathLike."""
    if value is None or isinstance(value, (str, os.PathLike)):
        return value
    raise ConfigError(f"model path must be a str or os.PathLike, got {type(value).__name__} {value!r}")


def output_dir(path: str, flag: str = "--out") -> str:
    """Create (if needed) a writable output folder; one line when that cannot be done."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise EngineError(f"{flag} {path}: exists and is not a folder")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise EngineError(f"{flag} {path}: cannot create the folder ({e.strerror or e})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise EngineError(f"{flag} {path}: the folder is not writable")
    return path


def messages(value) -> list[dict]:
    """Chat input: a str (one user message) or a list of {"role": str, "content": str}."""
    if isinstance(value, str):
        return [{"role": "user", "content": text(value)}]
    if not isinstance(value, (list, tuple)) or not value:
        raise ConfigError(f"chat prompt must be a str or a non-empty list of messages, got {type(value).__name__}")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise ConfigError(f"chat message {i} must be a dict with 'role' and 'content'")
        if isinstance(m["content"], str):
            text(m["content"], f"chat message {i}")
    return list(value)


__all__ = ["text", "prompt_file", "token_ids", "stop_strings", "model_path", "output_dir", "messages"]
