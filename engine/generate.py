"""Sampling, stop conditions and the streaming generation loop."""
from __future__ import annotations

import math
import numbers
import time
from dataclasses import dataclass, field

import numpy as np

from .errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0     # 0 = greedy
    top_k: int = 0               # 0 = off
    top_p: float = 1.0           # 1 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()   # stop strings (not included in the output)
    ignore_eos: bool = False
    presence_penalty: float = 0.0    # OpenAI's: minus this from the logit of every token generated so far
    frequency_penalty: float = 0.0   # ... and this times the number of times it was generated
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias added to its logit)

    def __post_init__(self):
        # numpy's and other numeric scalars as Python's (bools are not numbers here); one stop string as one
        for name, kind, cast in (("max_tokens", numbers.Integral, int), ("top_k", numbers.Integral, int),
                                 ("seed", numbers.Integral, int), ("temperature", numbers.Real, float),
                                 ("top_p", numbers.Real, float), ("presence_penalty", numbers.Real, float),
                                 ("frequency_penalty", numbers.Real, float)):
            v = getattr(self, name)
            if isinstance(v, bool):
                raise ConfigError(f"{name} must be a number, got {v!r}")
            if isinstance(v, kind):
                object.__setattr__(self, name, cast(v))
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if isinstance(self.ignore_eos, np.bool_):
            object.__setattr__(self, "ignore_eos", bool(self.ignore_eos))
        if not isinstance(self.ignore_eos, bool):
            raise ConfigError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise ConfigError(f"max_tokens must be a non-negative integer, got {self.max_tokens!r}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise ConfigError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise ConfigError(f"seed must be a non-negative integer, got {self.seed!r}")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise ConfigError("stop strings must be non-empty strings")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and -2 <= v <= 2):
                raise ConfigError(f"{name} must be a number in [-2, 2], got {v!r}")
        for token, bias in self.logit_bias:
            if not isinstance(token, int) or token < 0:
                raise ConfigError(f"logit_bias: token ids are integers >= 0, got {token!r}")
            if not (isinstance(bias, (int, float)) and -100 <= bias <= 100):
                raise ConfigError(f"logit_bias: a bias is a number in [-100, 100], got {bias!r} for token {token}")


def log_softmax(x: np.ndarray) -> np.ndarray:
    """Log-probabilities over the last axis, in f64 (logits f32 [..., vocab])."""
    x = x.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


class Sampler:
    """Greedy, or temperature with optional top-k / top-p, from a seeded generator;
    logit_bias and OpenAI's presence / frequency penalties over the tokens it has
    returned (the generated ones) first."""

    def __init__(self, params: SamplingParams):
        self.p = params
        self.rng = np.random.default_rng(params.seed)
        self.counts: dict[int, int] = {}          # tokens returned so far -> times
        self._bias = (np.array([t for t, _ in params.logit_bias], dtype=np.int64),
                      np.array([b for _, b in params.logit_bias], dtype=np.float32))

    @property
    def greedy(self) -> bool:
        """The token is the logits' argmax, whatever was generated before (no temperature,
        bias or penalty): ForwardPass.decode_argmax can find it on the device."""
        p = self.p
        return p.temperature == 0 and not p.logit_bias and not p.presence_penalty and not p.frequency_penalty

    def __call__(self, logits: np.ndarray) -> int:
        """logits: f32 [vocab] -> token id."""
        token = self._sample(self._adjusted(logits))
        self.counts[token] = self.counts.get(token, 0) + 1
        return token

    def _adjusted(self, logits: np.ndarray) -> np.ndarray:
        p = self.p
        penalize = (p.presence_penalty or p.frequency_penalty) and self.counts
        if not p.logit_bias and not penalize:
            return logits
        z = np.array(logits, dtype=np.float32)
        ids, bias = self._bias
        np.add.at(z, ids, bias)
        if penalize:
            seen = np.fromiter(self.counts, dtype=np.int64, count=len(self.counts))
            times = np.fromiter(self.counts.values(), dtype=np.float32, count=len(self.counts))
            z[seen] -= times * np.float32(p.frequency_penalty) + np.float32(p.presence_penalty)
        return z

    def _sample(self, logits: np.ndarray) -> int:
        p = self.p
        if p.temperature == 0:
            return int(np.argmax(logits))
        z = logits.astype(np.float64)
        with np.errstate(over="ignore"):       # max first: a tiny temperature gives -inf, never inf - inf
            z = (z - z.max()) / p.temperature
        if p.top_k and p.top_k < z.size:
            cut = np.partition(z, -p.top_k)[-p.top_k]
            z = np.where(z >= cut, z, -np.inf)
        probs = np.exp(z)
        probs /= probs.sum()
        if p.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            cumulative = np.cumsum(probs[order])
            n_keep = int(np.searchsorted(cumulative, p.top_p) + 1)
            mask = np.zeros_like(probs)
            mask[order[:n_keep]] = 1.0
            probs = probs * mask
            probs /= probs.sum()
        return int(self.rng.choice(probs.size, p=probs))


@dataclass
class GenerationResult:
    tokens: list[int]                 # generated ids (prompt excluded)
    text: str
    finish_reason: str                # "stop" (EOS or stop string) | "length"
    stats: dict = field(default_factory=dict)


class StopMatcher:
    """Holds back text that could be the beginning of a stop string."""

    def __init__(self, stops):
        self.stops = tuple(stops)
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """New text -> (text safe to emit, stopped)."""
        self.pending += text
        found = [at for s in self.stops if (at := self.pending.find(s)) >= 0]
        if found:                        # the earliest stop in the text, whatever its place in the list
            out, self.pending = self.pending[:min(found)], ""
            return out, True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        out = self.pending[:len(self.pending) - hold]
        self.pending = self.pending[len(out):]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def generate_stream(model, params: SamplingParams, cache, first_logits,
                    stats: dict):
    """Yield text pieces, sampling from `first_logits` then decoding one token at a
    time. Fills `stats` (tokens, timings, finish reason) as it goes."""
    tok = model.tokenizer
    sampler = Sampler(params)
    decoder = tok.stream(skip_special=True, continuation=True)
    stopper = StopMatcher(params.stop)
    tokens: list[int] = []
    stats.update(tokens=tokens, finish_reason="length")
    logits, best = first_logits, None     # best: the next token, decoded greedily on the device
    t0 = time.perf_counter()
    n_decoded = 0
    stopped_by_string = False
    for i in range(params.max_tokens):
        token = sampler(logits) if best is None else best
        if not params.ignore_eos and token in tok.eot_ids:
            stats["finish_reason"] = "stop"
            break
        tokens.append(token)
        piece, stopped = stopper.feed(decoder.push(token))
        if piece:
            yield piece
        if stopped:
            stats["finish_reason"] = "stop"
            stopped_by_string = True
            break
        if i + 1 == params.max_tokens:
            break
        if cache.logical_length >= cache.max_rows:
            stats["finish_reason"] = "length"     # the context is full (as the server and OpenAI say)
            break
        if sampler.greedy:
            best = model.forward.decode_argmax(token, cache)
        else:
            logits = model.forward.decode(token, cache)
        n_decoded += 1
    if not stopped_by_string:
        rest = stopper.feed(decoder.flush())[0] + stopper.flush()
        if rest:
            yield rest
    elapsed = time.perf_counter() - t0
    stats["decode_s"] = elapsed
    stats["decode_tokens"] = n_decoded
    stats["decode_tok_s"] = n_decoded / elapsed if elapsed > 0 and n_decoded else 0.0
