"""Runs the evaluation: one full prefill per sample and KV dtype, branched into every
policy over that dtype (the bf16 full cache always runs: it is the reference the KV
ratios and the fidelity KL are measured against).

Prefill once with the full cache while capturing the post-RoPE queries of the
last W_max prompt positions of every layer (W_max = the largest window among
the policies that compact this prompt). A policy with window W <= W_max then
evicts a copy of the cache with the last W of those rows: the captured row w
is the query of position L - W_max + w, so rows W_max - W .. W_max - 1 are
exactly the queries of positions L - W .. L - 1 that a prefill capturing W
would hold (queries do not depend on the capture). `tests/e2e/test_eval_harness`
checks that the keep sets match a direct SnapKV prefill.

Retrieval tasks decode greedily from each branch and parse digits (code questions:
decode to the end of the turn and match the answer, `tasks.score`); the
fidelity task teacher-forces a continuation through the full and the evicted
cache and compares the next-token distributions.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..errors import EngineError
from ..forward import WindowCapture
from ..generate import log_softmax
from . import tasks as T
from .policies import Policy

DEPTHS = tuple(range(0, 101, 10))


@dataclass(frozen=True)
class EvalPlan:
    """What to run: every (task, length, sample) crossed with every policy."""
    tasks: Sequence[str]
    lengths: Sequence[int]
    policies: Sequence[Policy]
    samples: int = 1                         # per (task, length); depths spread over them
    depths: Sequence[float] = DEPTHS         # percent
    seed: int = 0
    max_new_tokens: int = 12                 # per expected number (niah_multivalue asks several; code: x3)
    fidelity_tokens: int = 64                # teacher-forced continuation length

    def validate(self) -> None:
        bad = [t for t in self.tasks if t not in T.TASKS]
        if bad or not self.tasks:
            raise EngineError(f"unknown task {bad[0] if bad else '(none)'!r}: choose from {', '.join(T.TASKS)}")
        if not self.lengths or min(self.lengths) < 64:
            raise EngineError("lengths must be at least 64 tokens")
        if self.samples < 1:
            raise EngineError(f"samples must be >= 1, got {self.samples}")
        if not self.policies:
            raise EngineError("no policies to evaluate")
        if not self.depths or min(self.depths) < 0 or max(self.depths) > 100:
            raise EngineError("depths must lie in 0..100 (percent)")

    def margin(self, task: str) -> int:
        """Positions needed after the prompt."""
        if task == "fidelity":
            return self.fidelity_tokens
        return self.max_new_tokens * T.answer_units(task)

    def context(self, model_ctx: int) -> int:
        """Context to run with: the longest prompt plus its answer, at most the model's
        (smaller cache pools to copy per policy)."""
        need = max(self.lengths) + max(self.margin(t) for t in T.TASKS) + 1
        return min(model_ctx, need)

    def cases(self):
        """(task, length, index, depth), shortest lengths first and tasks interleaved,
        so a run cut short still covers every task."""
        for length in sorted(self.lengths):
            for i in range(self.samples):
                for task in self.tasks:
                    yield task, length, i, T.sample_depth(self.depths, i, self.samples)


@dataclass
class Timings:
    prefill_s: float = 0.0
    prefill_tokens: int = 0
    evict_s: float = 0.0
    decode_s: float = 0.0
    decode_tokens: int = 0
    teacher_s: float = 0.0
    samples: int = 0
    wall_s: float = 0.0
    per_length: dict = field(default_factory=dict)   # length -> seconds per sample (all policies)

    def as_dict(self) -> dict:
        d = dict(vars(self))
        d["prefill_tok_s"] = self.prefill_tokens / self.prefill_s if self.prefill_s else None
        d["decode_tok_s"] = self.decode_tokens / self.decode_s if self.decode_s else None
        d["per_length"] = {str(k): v for k, v in self.per_length.items()}
        return d


def greedy_numbers(logits: np.ndarray, step, detokenize, eot: set, max_new: int,
                   expected: Sequence[str] | None) -> tuple[str, int]:
    """Greedy decode until the answer holds as many finished numbers as `expected` has
    (tasks.answer_complete; None: no such stop, for the code questions' chat answers),
    an end-of-text token, or `max_new` tokens.
    logits: f32 [vocab] after the prompt; step(token) -> the next logits. Returns
    (text, tokens decoded). tools/eval_llamacpp.py drives llama.cpp through the same rule."""
    out: list[int] = []
    token = int(np.argmax(logits))
    for _ in range(max_new):
        if token in eot:
            break
        out.append(token)
        if len(out) == max_new or (expected is not None and T.answer_complete(detokenize(out), expected)):
            break
        token = int(np.argmax(step(token)))
    return detokenize(out), len(out)


def greedy_answer(model, cache, logits: np.ndarray, max_new: int, expected: Sequence[str] | None) -> tuple[str, int]:
    """greedy_numbers on our engine, advancing `cache` in place."""
    eot = set(getattr(model.tokenizer, "eot_ids", ()) or ()) | {model.tokenizer.eos_id}
    return greedy_numbers(logits, lambda t: model.forward.decode(t, cache), model.detokenize, eot,
                          max_new, expected)


def fidelity_metrics(full_logits: np.ndarray, test_logits: np.ndarray) -> dict:
    """Mean KL(full || test) in nats and top-1 agreement over rows ([n, vocab] each)."""
    lp, lq = log_softmax(full_logits), log_softmax(test_logits)
    kl = (np.exp(lp) * (lp - lq)).sum(axis=1)                              # [n]
    top1 = full_logits.argmax(axis=1) == test_logits.argmax(axis=1)        # [n]
    return {"kl": float(kl.mean()), "kl_max": float(kl.max()), "top1": float(top1.mean())}


class Runner:
    """Evaluates an EvalPlan on a loaded engine Model."""

    def __init__(self, model, plan: EvalPlan):
        plan.validate()
        self.model, self.plan = model, plan
        self.timings = Timings()
        for task in plan.tasks:                  # what the model's context leaves of each length
            targets = [self.target_for(task, n) for n in sorted(plan.lengths)]
            if targets[0] < 64:
                raise EngineError(f"a {task} prompt has {targets[0]} tokens left of the model's {model.ctx}-token "
                                  f"context after its answer ({plan.margin(task)} tokens): lower "
                                  f"{'--fidelity-tokens' if task == 'fidelity' else '--max-new-tokens'}")
            same = [n for n, t, prev in zip(sorted(plan.lengths)[1:], targets[1:], targets) if t == prev]
            if same:
                raise EngineError(f"lengths {', '.join(map(str, same))} clip to the same {task} prompts as a "
                                  f"shorter one ({targets[-1]} tokens fit the {model.ctx}-token context with "
                                  f"the answer): drop them")

    def target_for(self, task: str, length: int) -> int:
        """The prompt length actually generated: `length`, unless the context cannot
        also hold the answer (8192 on an 8192-token model)."""
        return min(length, self.model.ctx - self.plan.margin(task) - 1)

    def run(self, progress: bool = True, partial_path: str | None = None,
            done: Sequence[dict] = ()) -> list[dict]:
        """Every case x policy -> one row per (sample, policy). With `partial_path`, rows
        are also appended there as JSON lines as each sample finishes. `done`: rows
        already run (a resumed run), kept: a sample with every policy is skipped, one with
        some runs only the others (their KV types' prefills; the bf16 one only when it has
        a missing policy or the task needs its logits). If `partial_path` holds anything
        but `done`, it is rewritten to hold exactly it."""
        import json

        from tqdm import tqdm

        known: dict[tuple, list[dict]] = {}
        for r in done:
            known.setdefault((r["task"], r["length"], r["index"]), []).append(r)
        names = {p.name for p in self.plan.policies}
        cases = [c for c in self.plan.cases() if not names <= {r["policy"] for r in known.get(c[:3], ())}]
        t0 = time.perf_counter()
        rows: list[dict] = list(done)
        if partial_path and os.path.exists(partial_path):   # drop a sample cut short mid-write
            with open(partial_path + ".tmp", "w") as f:
                f.writelines(json.dumps(r, default=str) + "\n" for r in done)
            os.replace(partial_path + ".tmp", partial_path)
        bar = tqdm(cases, desc="eval", unit="sample", file=sys.stderr, disable=not progress, dynamic_ncols=True)
        for task, length, index, depth in bar:
            bar.set_postfix_str(f"{task} {length}")
            ts = time.perf_counter()
            new = self.run_sample(task, length, index, depth, known.get((task, length, index), ()))
            rows += new
            if partial_path:
                with open(partial_path, "a") as f:
                    f.writelines(json.dumps(r, default=str) + "\n" for r in new)
            self.timings.per_length.setdefault(length, []).append(time.perf_counter() - ts)
        bar.close()
        self.timings.wall_s = time.perf_counter() - t0
        self.timings.per_length = {k: float(np.mean(v)) for k, v in self.timings.per_length.items()}
        return rows

    # -- one sample ---------------------------------------------------------------------
    def make_sample(self, task: str, length: int, index: int, depth: float) -> T.Sample:
        return T.make_sample(task, self.model.tokenizer, self.target_for(task, length), depth,
                             self.plan.seed, index, self.plan.fidelity_tokens)

    def run_sample(self, task: str, length: int, index: int, depth: float, known: Sequence[dict] = ()) -> list[dict]:
        """The rows of one sample's policies but those `known` has rows of."""
        sample = self.make_sample(task, length, index, depth)
        L = sample.n_tokens
        have = {r["policy"] for r in known}
        todo = [p for p in self.plan.policies if p.name not in have]
        # kv dtype -> its policies; bf16 first, run for the KV bytes of the full cache and the
        # fidelity reference, unless known rows give those
        groups: dict[str, list[Policy]] = {"bf16": []} if task == "fidelity" or not known else {}
        for p in todo:
            groups.setdefault(p.kv_dtype, []).append(p)
        base = {"task": task, "length": length, "prompt_tokens": L, "index": index, "seed": sample.seed,
                "depth": depth, "depth_actual": sample.depth_actual, "key": sample.key,
                "expected": sample.expected}
        if known:
            if (known[0]["prompt_tokens"], list(known[0]["expected"])) != (L, list(sample.expected)):
                raise EngineError(f"--resume: sample {task} {length} #{index} is not the one the saved rows "
                                  f"were run on (another model or task generator): start again without --resume")
            base["kv_bytes_full"] = known[0]["kv_bytes_full"]
        self.timings.samples += 1
        rows: dict[str, dict] = {}
        reference = None                 # the bf16 full cache's teacher-forced logits (fidelity)
        for dtype, policies in groups.items():
            compacting = [p for p in policies if p.compacts(L)]
            cache, capture, logits, prefill_s = self._prefill(sample, dtype, compacting)
            if dtype == "bf16":
                base["kv_bytes_full"] = cache.bytes
            if task == "fidelity":
                out, full_logits = self._fidelity(sample, cache, capture, compacting, reference)
                reference = full_logits if reference is None else reference
            else:
                out = self._retrieval(sample, cache, capture, compacting, logits)
            for p in policies:
                r = out.get(p.name) or dict(out["full"], budget=p.budget_for(L))   # not compacted: the full answer
                rows[p.name] = {**r, "prefill_s": prefill_s}
        return [{**base, "policy": p.name, **rows[p.name]} for p in todo]

    def _prefill(self, sample: T.Sample, kv_dtype: str, compacting: list[Policy]):
        """One full-cache prefill of the sample into a `kv_dtype` cache, capturing the
        window queries the compacting policies need -> (cache, capture, logits, seconds)."""
        m, tm = self.model, self.timings
        L = sample.n_tokens
        w_max = max((p.window for p in compacting), default=0)
        cache = m.new_cache(kv_dtype=kv_dtype)
        capture = WindowCapture(m.config, w_max, L - w_max) if w_max else None
        t0 = time.perf_counter()
        m.forward.window_capture = capture
        try:
            logits = m.forward.prefill(sample.ids, cache)        # f32 [vocab], full cache
        finally:
            m.forward.window_capture = None
        prefill_s = time.perf_counter() - t0
        tm.prefill_s += prefill_s
        tm.prefill_tokens += L
        return cache, capture, logits, prefill_s

    def _retrieval(self, sample: T.Sample, cache, capture, compacting: list[Policy], logits) -> dict:
        """policy name -> row fields for each compacting policy, and "full" for `cache` itself."""
        out: dict[str, dict] = {}
        for p in compacting:                       # branches first: the full run advances `cache`
            branch = cache.copy()
            out[p.name] = self._evict(branch, capture, p, sample.n_tokens)
            out[p.name].update(self._answer(sample, branch, logits))
        out["full"] = {"budget": None, "compacted": False, "kv_rows": cache.length, "kv_bytes": cache.bytes,
                       "evict_s": 0.0}
        out["full"].update(self._answer(sample, cache, logits))
        return out

    def _evict(self, branch, capture: WindowCapture, p: Policy, L: int) -> dict:
        cfg = p.config(L)
        q = np.ascontiguousarray(capture.q[:, :, capture.window - cfg.window:])   # [layers, heads, W, D]
        rep = self.model.forward.evict(branch, q, cfg)
        self.timings.evict_s += rep["seconds"]
        return {"budget": cfg.budget, "compacted": True, "kv_rows": branch.length, "kv_bytes": branch.bytes,
                "evict_s": rep["seconds"]}

    def _answer(self, sample: T.Sample, cache, logits) -> dict:
        expected = None if sample.task in T.CODE_TASKS else sample.expected    # code: until end of turn
        t0 = time.perf_counter()
        text, n_tok = greedy_answer(self.model, cache, logits, self.plan.margin(sample.task), expected)
        dt = time.perf_counter() - t0
        self.timings.decode_s += dt
        self.timings.decode_tokens += n_tok
        s = T.score(sample, text)
        return {"generated": text, "score": s, "correct": s == 1.0, "decode_s": dt}

    def _fidelity(self, sample: T.Sample, cache, capture, compacting: list[Policy], reference) -> tuple[dict, np.ndarray]:
        """Teacher-forces the continuation through each compacting policy's branch and
        through `cache` itself ("full"), each compared with `reference` (the bf16 full
        cache's logits; None: this cache is that reference). Returns (policy name -> row
        fields, this cache's full logits)."""
        m = self.model
        cont = sample.continuation

        def teacher(c) -> np.ndarray:
            t0 = time.perf_counter()
            out = m.forward.prefill(cont, c, all_logits=True)    # f32 [n_cont, vocab]
            self.timings.teacher_s += time.perf_counter() - t0
            return out

        branches = {}
        for p in compacting:
            branch = cache.copy()
            branches[p.name] = (self._evict(branch, capture, p, sample.n_tokens), teacher(branch))
        full = {"budget": None, "compacted": False, "kv_rows": cache.length, "kv_bytes": cache.bytes,
                "evict_s": 0.0}
        full_logits = teacher(cache)
        ref = full_logits if reference is None else reference
        out = {"full": {**full, **fidelity_metrics(ref, full_logits)}}
        for name, (r, logits) in branches.items():
            out[name] = {**r, **fidelity_metrics(ref, logits)}
        for r in out.values():
            r.update(continuation_tokens=len(cont), generated=None, score=None, correct=None)
        return out, full_logits
