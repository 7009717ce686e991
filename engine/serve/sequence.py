"""One request's generation as explicit steps: the unit the scheduler runs.

A `Job` is what a request asks for, already validated. A `Sequence` runs it:
`prefill_step()` per prompt chunk, then `next_token()` / `feed(logits)` per decode
step. The model compute of a decode step sits between the two calls and is done
by the scheduler, which batches the decode steps of every running sequence into
one forward pass (`ForwardPass.decode_batch`) without touching the per-request
logic here (sampling, end-of-turn, stop strings, max_tokens, context).

The token logic is the same as `engine.generate.generate_stream`, step for step,
so greedy output equals `Model.generate` for the same prompt and policy.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..generate import Sampler, SamplingParams, StopMatcher, log_softmax
from ..snapkv import SnapKvConfig


@dataclass(frozen=True)
class Job:
    ids: list[int]                 # prompt token ids, checked against the vocabulary and the context
    params: SamplingParams
    snapkv: SnapKvConfig | None    # this request's eviction policy (None: full cache)
    kv_dtype: str | None = None    # KV row format of its cache (None: the model's)
    logprobs: int | None = None    # None: no logprobs; k: each token's logprob and its k likeliest
    echo: bool = False             # the output starts with the prompt (and its tokens' logprobs)
    constraint: object = None      # grammar.Constraint: the output's grammar, its matcher's state (one
                                   # job, one sequence; None: free output)


# A token's logprobs (when the job asks): its id, where its text starts in the output,
# its log-probability under the model's distribution (log-softmax of the logits, before
# temperature, top-k and top-p), and the k likeliest tokens as ((id, logprob), ...),
# likeliest first. An echoed prompt's first token has None for both (nothing predicts it).
TokenLogprob = tuple[int, int, float | None, tuple[tuple[int, float], ...] | None]


def token_logprob(logits: np.ndarray, token: int, k: int, offset: int) -> TokenLogprob:
    z = log_softmax(logits)
    k = min(k, z.size)
    top = np.argpartition(-z, k - 1)[:k] if k else np.empty(0, dtype=np.int64)
    top = top[np.argsort(-z[top], kind="stable")]
    def lp(i):                                  # OpenAI's floor for -inf, which JSON cannot carry
        return max(float(z[i]), -9999.0)
    return token, offset, lp(token), tuple((int(i), lp(i)) for i in top)


# -- events, sent from the worker thread to the request's consumer ---------------------------
@dataclass(frozen=True)
class Delta:
    text: str                      # new output text (never a possible start of a stop string)
    logprobs: tuple[TokenLogprob, ...] = ()   # the tokens sampled since the last event, if asked


@dataclass(frozen=True)
class Finished:
    finish_reason: str             # "stop" (end of turn or stop string) | "length" (max_tokens or context)
    usage: dict                    # prompt/completion/total tokens and the KV bytes (see Sequence.usage)
    logprobs: tuple[TokenLogprob, ...] = ()   # logprobs of tokens no Delta carried (text cut by a stop)


@dataclass(frozen=True)
class Failed:
    status: int                    # HTTP status: 400 for an engine error the request caused, 503 for
    message: str                   # device memory or a device fault, else 500
    code: str | None = None        # OpenAI's error code ("device_out_of_memory", "device_fault")
    retry_after: int | None = None  # seconds, sent as Retry-After (a 503 worth retrying)


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
        self._best: int | None = None           # or, fed instead of logits (feed_best), its argmax
        self.tokens: list[int] = []             # generated ids (end-of-turn excluded)
        self.kv_bytes_full = 0                  # KV bytes after prefill, before eviction
        self.kv_bytes = 0                       # KV bytes after eviction
        self.kv_policy: str | None = None       # the eviction applied (None: the prompt kept every row)
        self.finished: Finished | None = None   # set when the sequence ends
        self._sampler = Sampler(job.params)
        self._stopper = StopMatcher(job.params.stop)
        self._decoder = model.tokenizer.stream(skip_special=True, continuation=True)   # as vLLM: no control tokens
        self._eot = model.tokenizer.eot_ids
        self._steps = None                      # the prefill generator while the prompt runs
        self.cached_tokens = 0                  # prompt tokens reused from an earlier request's cache
        self.before_evict = None                # callable(cache, q_window): sees the whole prompt's cache
                                                # before eviction compacts it (the scheduler keeps a branch)
        self.preemptions = 0                    # times its pages were taken back for older requests
        self._logprobs: list = []               # logprobs of tokens not yet sent with an event
        self._text_len = 0                      # characters of output decoded so far (text offsets)
        self._echo: str | None = None           # the echoed prompt's text
        self._prompt_done = False               # the prompt has run once (a resumed one runs again)

    # -- steps ------------------------------------------------------------------------------
    def allocate(self, pool=None) -> None:
        """Make the request's cache in its KV row format: on `pool` (a shared PagePool,
        pages taken as rows arrive) or on a pool of its own for the whole context."""
        self.cache = self.model.new_cache(self.job.kv_dtype, pool=pool)

    def reuse(self, cache, n: int) -> None:
        """Start from an earlier request's cache (same row format) whose first n positions
        hold this prompt's first n tokens: it is truncated to them and only the rest of
        the prompt runs. The prompt is then evicted as a whole, as if run from scratch."""
        cache.truncate(n)
        self.cache, self.cached_tokens = cache, n

    def fed_ids(self) -> list[int]:
        """The token ids whose K/V the cache holds, in order (prompt, then generated
        tokens that went through the model); only meaningful without eviction."""
        return (list(self.job.ids) + self.tokens)[:self.cache.logical_length]

    def pages_needed(self, segment: int | None = None, horizon: int | None = None) -> int:
        """The most pages this sequence can still come to hold: its cache now plus every
        prompt row not yet run and every token it may still generate, or only the next
        `horizon` of those tokens (what the scheduler reserves: eviction shrinks it once
        the prompt is compacted); in one segment of the pool only, when `segment` is given."""
        cache = self.cache                   # (read once: /state reads it from another thread)
        if cache is None:
            return 0
        prefill_to = len(self.job.ids) + len(self.tokens)   # after a preemption, generated tokens too
        prompt_left = prefill_to - cache.logical_length if self.state == "new" else 0
        ahead = max(self.job.params.max_tokens - len(self.tokens), 0)
        if horizon is not None:
            ahead = min(ahead, horizon)
        return cache.pages_needed(prompt_left + ahead, segment)

    def prefill_step(self) -> bool:
        """Run the next prompt chunk (allocating the cache first if needed); after the
        last one, apply the eviction policy. True once the prompt is done."""
        if self.cache is None:
            self.allocate()
        if self._steps is None:
            self._steps = self._prompt_steps()
        done, total = next(self._steps)
        if done < total:
            return False
        try:                                    # the last chunk ran: eviction, then the logits
            next(self._steps)
        except StopIteration as end:
            logits = end.value
        self._steps = None
        self.state = "decode"
        if self._prompt_done:                   # resumed: sampling goes on from the logits it had
            return True
        self._prompt_done = True
        if self._echo is not None:
            self._text_len = len(self._echo)
            self.emit(Delta(self._echo, self._take_logprobs()))
        self.logits = logits
        eviction = self.cache.eviction
        self.kv_bytes = self.cache.bytes
        self.kv_bytes_full = eviction["bytes_before"] if eviction else self.kv_bytes
        self.kv_policy = eviction["policy"] if eviction else None
        return True

    def _prompt_steps(self):
        """The prefill as one generator of (done, total): the prompt past what a reused
        cache holds (evicted as a whole, as a fresh prefill would be), then after a
        preemption the tokens generated before it, run as a continuation (no eviction),
        so the cache is again the one the request had."""
        forward, prompt = self.model.forward, self.job.ids[self.cached_tokens:]
        total = len(prompt) + len(self.tokens)
        on_logits = None
        if self.job.echo and not self._prompt_done:     # (not again after a preemption: it was sent)
            on_logits = self._echo_prompt()
        before_evict = None if self._prompt_done else self.before_evict     # (not again after a preemption)
        logits = yield from _progress(forward.prefill_steps(prompt, self.cache, snapkv=self.job.snapkv,
                                                            compact_continued=self.cached_tokens > 0,
                                                            on_logits=on_logits, before_evict=before_evict),
                                      0, total)
        if self.tokens:
            logits = yield from _progress(forward.prefill_steps(self.tokens, self.cache), len(prompt), total)
        return logits

    def _echo_prompt(self):
        """Decode the prompt as the output's start; with logprobs, return the prefill's
        logits callback that scores each prompt token from the position before it."""
        ids, k = self.job.ids, self.job.logprobs
        self._logprobs.clear()                  # (a prefill preempted midway left some)
        tok = self.model.tokenizer
        decoder, offsets, parts, n = tok.stream(), [], [], 0
        for i, t in enumerate(ids):
            offsets.append(n)
            # the BOS the tokenizer puts first is no text of the prompt (OpenAI and vLLM
            # echo the prompt itself); its logprob entry stays, with no text
            parts.append("" if i == 0 and t == tok.bos_id else decoder.push(t))
            n += len(parts[-1])
        parts.append(decoder.flush())
        self._echo = "".join(parts)
        if k is None:
            return None
        self._logprobs.append((ids[0], 0, None, None))

        def on_logits(start: int, logits: np.ndarray) -> None:
            for j, row in enumerate(logits):
                i = start + j + 1                   # the prompt token this row predicts
                if i < len(ids):
                    self._logprobs.append(token_logprob(row, ids[i], k, offsets[i]))
        return on_logits

    def preempt(self) -> None:
        """Give the cache's pages back mid-request (the scheduler needs them for older
        requests). The request resumes later by prefilling its prompt and the tokens it
        has generated again (recompute, as vLLM preempts); its sampler, stop matcher,
        text already sent and the logits of its next token are kept."""
        if self._steps is not None:
            self._steps.close()
            self._steps = None
        if self.cache is not None:
            self.cache.release()
        self.cache, self.cached_tokens, self.state = None, 0, "new"
        self.preemptions += 1

    def next_token(self) -> int | None:
        """Sample from the current logits and handle what the token means. Returns the
        token to run through the model next, or None when the sequence has finished
        (then `finished` is set; the cache stays until release())."""
        p, grammar = self.job.params, self.job.constraint
        if len(self.tokens) >= p.max_tokens:    # max_tokens 0: the prompt alone (echo)
            return self._finish("length")
        if self.logits is None:                 # a greedy step's argmax (feed_best)
            token = self._best
        else:
            token = self._sampler(self.logits if grammar is None else grammar.apply(self.logits))
        if token in self._eot and (grammar is not None or not p.ignore_eos):   # (a grammar allows it
            return self._finish("stop")                                       # once complete)
        if grammar is not None:
            grammar.consume(token)
        self.tokens.append(token)
        if self.job.logprobs is not None:
            self._logprobs.append(token_logprob(self.logits, token, self.job.logprobs, self._text_len))
        text = self._decoder.push(token)
        self._text_len += len(text)
        piece, stopped = self._stopper.feed(text)
        if piece:
            self.emit(Delta(piece, self._take_logprobs()))
        if stopped:
            return self._finish("stop", flush=False)
        if grammar is not None and grammar.stopped:     # the grammar's output is complete
            return self._finish("stop")
        if len(self.tokens) >= p.max_tokens or self.cache.logical_length >= self.cache.max_rows:
            return self._finish("length")
        return token

    def feed(self, logits: np.ndarray) -> None:
        """The model's logits f32 [vocab] after the token `next_token` returned."""
        self.logits = logits

    @property
    def greedy(self) -> bool:
        """Its next token is its logits' argmax and nothing else reads the logits (no
        temperature, bias, penalty, grammar or logprobs): a step may feed_best it."""
        return self._sampler.greedy and self.job.constraint is None and self.job.logprobs is None

    def feed_best(self, token: int) -> None:
        """The argmax of the logits after the token `next_token` returned, in place of
        the logits (a greedy sequence: ForwardPass.decode_batch with argmax)."""
        self.logits, self._best = None, int(token)

    # -- end ----------------------------------------------------------------------------------
    def _finish(self, reason: str, flush: bool = True) -> None:
        if flush:
            rest = self._stopper.feed(self._decoder.flush())[0] + self._stopper.flush()
            if rest:
                self.emit(Delta(rest, self._take_logprobs()))
        self.finished = Finished(reason, self.usage(), self._take_logprobs())
        self.state = "done"                     # the scheduler keeps or releases the cache
        return None

    def _take_logprobs(self) -> tuple:
        taken, self._logprobs = tuple(self._logprobs), []
        return taken

    def usage(self) -> dict:
        """OpenAI's token counts plus ours: KV bytes of the prompt before and after eviction."""
        n_prompt, n_out = len(self.job.ids), len(self.tokens)
        return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
                "kv_bytes_full": self.kv_bytes_full, "kv_bytes": self.kv_bytes,
                "kv_policy": self.kv_policy}

    def release(self) -> None:
        """Return the cache's pages to their pool, drop the cache and the logits. Idempotent."""
        if self._steps is not None:
            self._steps.close()
            self._steps = None
        if self.cache is not None:
            self.cache.release()
        self.cache, self.logits = None, None
        self.state = "done"


def _progress(steps, before: int, total: int):
    """Re-count a prefill generator's (done, n) progress as (before + done, total); its
    return value (the logits) passes through."""
    while True:
        try:
            done, _ = next(steps)
        except StopIteration as end:
            return end.value
        yield before + done, total
