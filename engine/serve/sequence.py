"""One request's generation as explicit steps: the unit the scheduler runs.

A `Job` is what a request asks for, already validated. A `Sequence` runs it:
`prefill()` once, then `next_token()` / `feed(logits)` per decode step. The model
compute of a decode step (`model.forward.decode`) sits between the two calls and
is done by the scheduler, so a later scheduler can batch the decode steps of many
sequences into one forward pass without touching the per-request logic here
(sampling, end-of-turn, stop strings, max_tokens, context).

The token logic is the same as `engine.generate.generate_stream`, step for step,
so greedy output equals `Model.generate` for the same prompt and policy.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..generate import Sampler, SamplingParams, StopMatcher
from ..snapkv import SnapKvConfig


@dataclass(frozen=True)
class Job:
    ids: list[int]                 # prompt token ids, checked against the vocabulary and the context
    params: SamplingParams
    snapkv: SnapKvConfig | None    # this request's eviction policy (None: full cache)
    kv_dtype: str | None = None    # KV row format of its cache (None: the model's)


# -- events, sent from the worker thread to the request's consumer ---------------------------
@dataclass(frozen=True)
class Delta:
    text: str                      # new output text (never a possible start of a stop string)


@dataclass(frozen=True)
class Finished:
    finish_reason: str             # "stop" (end of turn or stop string) | "length" (max_tokens or context)
    usage: dict                    # prompt/completion/total tokens and the KV bytes (see Sequence.usage)


@dataclass(frozen=True)
class Failed:
    status: int                    # HTTP status: 400 for an engine error the request caused, else 500
    message: str


class Cancelled(Exception):
    """Raised inside prefill (between chunks) when the request was cancelled."""


class Sequence:
    """A job's cache, sampler, stop matcher and incremental detokenizer.

    States: "new" -> "decode" (after prefill) -> "done". `emit(event)` receives
    Delta events as text becomes safe to show; at the end `finished` holds the
    Finished event, for the scheduler to send once it has retired the request."""

    def __init__(self, model, job: Job, emit):
        self.model, self.job, self.emit = model, job, emit
        self.state = "new"
        self.cache = None                       # KvCache, from prefill until release()
        self.logits: np.ndarray | None = None   # f32 [vocab]: the distribution of the next token
        self.tokens: list[int] = []             # generated ids (end-of-turn excluded)
        self.kv_bytes_full = 0                  # KV bytes after prefill, before eviction
        self.kv_bytes = 0                       # KV bytes after eviction
        self.kv_policy: str | None = None       # the eviction applied (None: the prompt kept every row)
        self.finished: Finished | None = None   # set when the sequence ends
        self._sampler = Sampler(job.params)
        self._stopper = StopMatcher(job.params.stop)
        self._decoder = model.tokenizer.stream()
        self._eot = model.tokenizer.eot_ids

    # -- steps ------------------------------------------------------------------------------
    def allocate(self) -> None:
        """Make the request's cache (the whole context's pages, in its KV row format)."""
        self.cache = self.model.new_cache(self.job.kv_dtype)

    def prefill(self, should_stop=None) -> None:
        """Run the prompt into the cache (allocated first if needed) and apply the
        eviction policy. `should_stop()` is asked after every prefill chunk; True
        raises Cancelled."""
        def on_chunk(done, total):
            if should_stop is not None and should_stop():
                raise Cancelled()

        if self.cache is None:
            self.allocate()
        self.logits = self.model.forward.prefill(self.job.ids, self.cache, snapkv=self.job.snapkv,
                                                 on_chunk=on_chunk)
        eviction = self.cache.eviction
        self.kv_bytes = self.cache.bytes
        self.kv_bytes_full = eviction["bytes_before"] if eviction else self.kv_bytes
        self.kv_policy = eviction["policy"] if eviction else None
        self.state = "decode"

    def next_token(self) -> int | None:
        """Sample from the current logits and handle what the token means. Returns the
        token to run through the model next, or None when the sequence has finished
        (then `finished` is set and the cache released)."""
        p = self.job.params
        token = self._sampler(self.logits)
        if not p.ignore_eos and token in self._eot:
            return self._finish("stop")
        self.tokens.append(token)
        piece, stopped = self._stopper.feed(self._decoder.push(token))
        if piece:
            self.emit(Delta(piece))
        if stopped:
            return self._finish("stop", flush=False)
        if len(self.tokens) >= p.max_tokens or self.cache.logical_length >= self.cache.max_rows:
            return self._finish("length")
        return token

    def feed(self, logits: np.ndarray) -> None:
        """The model's logits f32 [vocab] after the token `next_token` returned."""
        self.logits = logits

    def decode_step(self) -> bool:
        """next_token + the model's decode, for one sequence alone. False when finished."""
        token = self.next_token()
        if token is None:
            return False
        self.feed(self.model.forward.decode(token, self.cache))
        return True

    # -- end ----------------------------------------------------------------------------------
    def _finish(self, reason: str, flush: bool = True) -> None:
        if flush:
            rest = self._stopper.feed(self._decoder.flush())[0] + self._stopper.flush()
            if rest:
                self.emit(Delta(rest))
        self.finished = Finished(reason, self.usage())
        self.release()
        return None

    def usage(self) -> dict:
        """OpenAI's token counts plus ours: KV bytes of the prompt before and after eviction."""
        n_prompt, n_out = len(self.job.ids), len(self.tokens)
        return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out,
                "kv_bytes_full": self.kv_bytes_full, "kv_bytes": self.kv_bytes,
                "kv_policy": self.kv_policy}

    def release(self) -> None:
        """Drop the cache (its pages go back with it) and the logits. Idempotent."""
        self.cache, self.logits = None, None
        self.state = "done"
