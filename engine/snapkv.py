"""SnapKV: choose which prompt positions survive in the KV cache after prefill.

Pure numpy, backend-independent. The paper's algorithm (seed 004, DESIGN.md
"Semantics that must hold"):

1. Votes. The last W prompt tokens form the observation window. Window query w
   sits at prompt position L - W + w; its causal softmax runs over positions
   0 .. L - W + w (window columns included, the whole row normalised, never
   the prefix alone). The votes of prefix position j (< L - W) are the sum of
   those probabilities over the window queries and over the query heads of the
   KV group (GQA: query head h belongs to KV head h // (n_q / n_kv)).
2. Pooling along positions (avg with zero padding divided by the kernel width,
   like torch avg_pool1d(count_include_pad=True); or max, padding ignored).
3. Keep set. Always kept: the first `sinks` positions and the last
   max(window, recency) positions. The rest of the budget goes to the highest
   pooled scores among the remaining prefix positions, ties to the lower
   index. Rows sorted ascending, |keep| == budget. A prompt with
   L <= budget or L <= min_tokens is not compacted (keep = 0 .. L-1).

Granularity: "head" (one keep set per KV head, the paper), "layer" (votes
summed over the KV heads of a layer; identical rows) and "global" (votes summed
over every layer and head; one set for the whole model).

Backends that compute votes on device (`Backend.snapkv_votes`) call
`keep_from_votes` / `keep_from_model_votes`, so pooling and top-k live here only.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from numbers import Integral
from typing import Optional, Sequence

import numpy as np

from engine.errors import ConfigError

POOLS = ("avg", "max")
GRANULARITIES = ("head", "layer", "global")
ALLOCATIONS = ("uniform", "pyramid", "adaptive", "pyramid-adaptive")
ADAPTIVE_ALPHA = 0.2   # Ada-KV's floor: every KV head keeps at least this share of its uniform picks


@dataclass(frozen=True)
class SnapKvConfig:
    """The eviction policy. Validated on construction (ConfigError, one line)."""

    budget: int = 2048              # kept positions per KV head after compaction (window and sinks included)
    window: int = 32                # observation window W: the last W prompt tokens, always kept
    sinks: int = 4                  # first positions, always kept (attention sinks)
    recency: Optional[int] = None   # last R positions always kept; None means R = window; R < window has no effect
    kernel: int = 31                # pooling width along positions, odd; 1 = no pooling
    pool: str = "avg"               # "avg" (zero padding, divide by kernel) or "max"
    granularity: str = "head"       # "head" | "layer" | "global"
    min_tokens: int = 128           # prompts of at most this many tokens are never compacted
    merge: int = 0                  # rows of the budget that summarise the evicted rows (engine/kv/merge.py)
    allocation: str = "uniform"     # "uniform" | "pyramid" (layer budgets falling with depth, same total)
                                    # | "adaptive" (a layer's rows shared among its KV heads by votes)
                                    # | "pyramid-adaptive" (both)
    pyramid_beta: int = 20          # pyramid: the last layer keeps 1/beta of a uniform layer's voted rows
                                    # (kvpress's PyramidKV default); 1 = uniform

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        check_values(dataclasses.asdict(self))

    @property
    def recent(self) -> int:
        """Effective number of trailing positions always kept: max(window, recency)."""
        return self.window if self.recency is None else max(self.window, self.recency)

    def compacts(self, n_tokens: int) -> bool:
        """Whether a prompt of n_tokens is compacted (otherwise every position is kept)."""
        return n_tokens > self.budget and n_tokens > self.min_tokens

    def n_keep(self, n_tokens: int) -> int:
        """Rows per KV head after selection for a prompt of n_tokens."""
        return self.budget if self.compacts(n_tokens) else n_tokens

    @property
    def selected(self) -> int:
        """Rows per KV head chosen by the votes: the budget less the merged rows."""
        return self.budget - self.merge

    def summary(self) -> str:
        """One line for `--stats`."""
        pooling = "no pooling" if self.kernel == 1 else f"{self.pool}-pool k={self.kernel}"
        sets = {"head": "per KV head", "layer": "per layer", "global": "one set for the model"}
        merged = f", {self.merge} of them merged rows" if self.merge else ""
        pyramid = f", pyramid layer budgets (beta {self.pyramid_beta})"
        merged += {"uniform": "", "pyramid": pyramid, "adaptive": ", adaptive head budgets",
                   "pyramid-adaptive": pyramid + ", adaptive head budgets"}[self.allocation]
        return (f"SnapKV budget {self.budget} (window {self.window}, recency {self.recent}, "
                f"sinks {self.sinks}{merged}), {pooling}, {sets[self.granularity]}, "
                f"prompts > {self.min_tokens} tokens")


MAX_KERNEL = 1001   # wider pooling smears votes over ~1000 positions and scoring time grows with it


def check_values(v: dict, names: dict | None = None) -> None:
    """Validate SnapKvConfig fields (a dict of them). ConfigError names each field by
    `names[field]` (`engine.model` passes flag and variable names), else "SnapKV <field>"
    as a message's subject and the bare field name where it is referred to."""
    v = {"merge": 0, "allocation": "uniform", "pyramid_beta": 20, **v}
    fields = ("budget", "window", "sinks", "recency", "kernel", "pool", "granularity", "min_tokens", "merge",
              "allocation", "pyramid_beta")
    subj = {k: names[k] if names and k in names else f"SnapKV {k}" for k in fields}
    ref = {k: subj[k].split("/")[0] if names and k in names else k for k in fields}   # "--kv-window"
    for name in ("budget", "window", "sinks", "kernel", "min_tokens", "merge", "pyramid_beta"):
        _require_int(subj[name], v[name])
    if v["pyramid_beta"] < 1:
        raise ConfigError(f"{subj['pyramid_beta']} must be >= 1, got {v['pyramid_beta']}")
    if v["merge"] < 0:
        raise ConfigError(f"{subj['merge']} must be >= 0, got {v['merge']}")
    if v["recency"] is not None:
        _require_int(subj["recency"], v["recency"])
    if v["window"] < 1:
        raise ConfigError(f"{subj['window']} must be >= 1, got {v['window']}")
    if v["sinks"] < 0:
        raise ConfigError(f"{subj['sinks']} must be >= 0, got {v['sinks']}")
    if v["recency"] is not None and v["recency"] < 0:
        raise ConfigError(f"{subj['recency']} must be >= 0, got {v['recency']}")
    if v["min_tokens"] < 0:
        raise ConfigError(f"{subj['min_tokens']} must be >= 0, got {v['min_tokens']}")
    if v["kernel"] < 1 or v["kernel"] % 2 == 0 or v["kernel"] > MAX_KERNEL:
        raise ConfigError(f"{subj['kernel']} must be an odd integer in 1..{MAX_KERNEL} (the pooling width), "
                          f"got {v['kernel']}")
    if v["pool"] not in POOLS:
        raise ConfigError(f"{subj['pool']} must be one of {', '.join(POOLS)}, got {v['pool']!r}")
    if v["allocation"] not in ALLOCATIONS:
        raise ConfigError(f"{subj['allocation']} must be one of {', '.join(ALLOCATIONS)}, got {v['allocation']!r}")
    if v["allocation"] != "uniform" and v["granularity"] == "global":
        raise ConfigError(f"{subj['allocation']} {v['allocation']} needs keep sets per layer or head, "
                          f"not granularity global")
    if v["allocation"].endswith("adaptive") and v["granularity"] != "head":
        raise ConfigError(f"{subj['allocation']} {v['allocation']} shares a layer's rows among its KV heads: "
                          f"it needs granularity head, not {v['granularity']}")
    if v["granularity"] not in GRANULARITIES:
        raise ConfigError(f"{subj['granularity']} must be one of {', '.join(GRANULARITIES)}, "
                          f"got {v['granularity']!r}")
    budget, window, sinks = v["budget"], v["window"], v["sinks"]
    if budget <= window + sinks:
        raise ConfigError(f"{subj['budget']} ({budget}) must be larger than {ref['window']} + {ref['sinks']} "
                          f"({window} + {sinks} = {window + sinks})")
    recent = window if v["recency"] is None else max(window, v["recency"])
    if budget <= recent + sinks:
        raise ConfigError(f"{subj['budget']} ({budget}) must be larger than {ref['recency']} + {ref['sinks']} "
                          f"({recent} + {sinks} = {recent + sinks})")
    if v["merge"] and budget - v["merge"] <= recent + sinks:
        raise ConfigError(f"{subj['budget']} ({budget}) must be larger than {ref['merge']} + {ref['recency']} + "
                          f"{ref['sinks']} ({v['merge']} + {recent} + {sinks} = {v['merge'] + recent + sinks})")


def _require_int(label: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ConfigError(f"{label} must be an integer, got {value!r}")


class SnapKvSelector:
    """Scores prompt positions and returns keep sets. Stateless apart from the config."""

    def __init__(self, cfg: SnapKvConfig):
        self.cfg = cfg

    def describe(self) -> str:
        return self.cfg.summary()

    # -- votes ----------------------------------------------------------------
    def votes(self, q_window: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """Raw (unpooled) votes.

        q_window: f32 [n_q_heads, W, D]  post-RoPE queries of the last W prompt tokens
        keys:     f32 [n_kv_heads, L, D] post-RoPE keys of all L prompt tokens
        returns   f32 [n_kv_heads, L - W]
        W is taken from q_window (1 <= W <= L); `select` requires W == cfg.window.
        """
        return self._votes64(q_window, keys).astype(np.float32)

    def _votes64(self, q_window: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """Votes in float64: f64 [n_kv_heads, L - W]. Transient memory O(W * L) per head."""
        q_window = np.asarray(q_window)
        keys = np.asarray(keys)
        if q_window.ndim != 3 or keys.ndim != 3:
            raise ValueError(f"SnapKV votes need q_window [n_q_heads, W, D] and keys "
                             f"[n_kv_heads, L, D], got shapes {q_window.shape} and {keys.shape}")
        n_q, W, D = q_window.shape
        n_kv, L, Dk = keys.shape
        if D != Dk or D < 1:
            raise ValueError(f"SnapKV head_dim mismatch: q_window has {D}, keys have {Dk}")
        if n_kv < 1 or n_q % n_kv != 0:
            raise ValueError(f"SnapKV: {n_q} query heads cannot be grouped over {n_kv} KV heads")
        if not 1 <= W <= L:
            raise ValueError(f"SnapKV window of {W} queries does not fit a prompt of {L} tokens")
        group = n_q // n_kv
        P = L - W
        scale = 1.0 / math.sqrt(D)
        # Causal mask of the window rows: query w (position P + w) sees columns 0 .. P + w.
        masked = np.arange(L)[None, :] > (P + np.arange(W))[:, None]   # bool [W, L]
        out = np.zeros((n_kv, P), dtype=np.float64)                      # [n_kv, P]
        for g in range(n_kv):
            k = keys[g].astype(np.float64)                                # [L, D]
            for h in range(g * group, (g + 1) * group):
                logits = (q_window[h].astype(np.float64) @ k.T) * scale   # [W, L]
                logits[masked] = -np.inf
                logits -= logits.max(axis=1, keepdims=True)
                np.exp(logits, out=logits)                                # masked -> 0
                logits /= logits.sum(axis=1, keepdims=True)               # full causal row
                out[g] += logits[:, :P].sum(axis=0)
        return out

    # -- selection ------------------------------------------------------------
    def select(self, q_window: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """Keep set of one layer: int64 [n_kv_heads, n_keep], rows sorted ascending."""
        keys = np.asarray(keys)
        if keys.ndim != 3:
            raise ValueError(f"SnapKV keys must be [n_kv_heads, L, D], got shape {keys.shape}")
        n_kv, L, _ = keys.shape
        if not self.cfg.compacts(L):
            return _keep_all(n_kv, L)
        if np.ndim(q_window) == 3:             # other shapes: _votes64 names the problem
            self._check_window(np.shape(q_window)[1])
        return self.keep_from_votes(self._votes64(q_window, keys), L)

    def select_model(self, per_layer: Sequence[tuple[np.ndarray, np.ndarray]]) -> list[np.ndarray]:
        """Keep sets for every layer: per_layer = [(q_window, keys), ...] as in `select`.
        "global": one set for the whole model (identical across layers and heads); pyramid
        and adaptive allocations: each layer's budget and heads' rows as the engine gives
        them (`keep_from_model_votes`)."""
        if self.cfg.granularity != "global" and self.cfg.allocation == "uniform":
            return [self.select(q, k) for q, k in per_layer]
        lengths = {np.shape(k)[1] for _, k in per_layer}
        if len(lengths) != 1:
            raise ValueError(f"SnapKV {self.cfg.granularity} selection with {self.cfg.allocation} budgets needs "
                             f"one prompt length across layers, got {sorted(lengths)}")
        L = lengths.pop()
        if not self.cfg.compacts(L):
            return [_keep_all(np.shape(k)[0], L) for _, k in per_layer]
        for q, _ in per_layer:
            self._check_window(np.shape(q)[1])
        return self.keep_from_model_votes([self._votes64(q, k) for q, k in per_layer], L)

    def keep_from_votes(self, votes: np.ndarray, L: int) -> np.ndarray:
        """The selection step alone (pooling + top-k) for one layer.

        votes: float [n_kv_heads, L - W] raw votes (e.g. from `Backend.snapkv_votes`)
        returns int64 [n_kv_heads, n_keep]. For "layer" (and "global" applied to a
        single layer) the votes are summed over KV heads first and all rows are equal.
        When L is not compacted only votes.shape[0] is read -> all of 0 .. L-1 per head.
        """
        if not self.cfg.compacts(L):
            return _keep_all(np.shape(votes)[0], L)
        votes = self._check_votes(votes, L)
        if self.cfg.granularity == "head":
            return self._top_k(votes, L)
        row = self._top_k(votes.sum(axis=0, keepdims=True), L)           # [1, budget]
        return np.repeat(row, votes.shape[0], axis=0)

    def layer_budgets(self, n_layers: int, L: int) -> list[int]:
        """Rows each of n_layers compacted layers keeps (merged rows included). uniform:
        the budget each. pyramid (PyramidKV, as kvpress sizes it): the rows the votes
        choose beyond sinks, recency and merged rows fall linearly with depth from
        2F - F/beta to F/beta (F: the uniform layer's, beta: cfg.pyramid_beta), each at
        least 1, so the total stays n_layers x budget. A layer's share past the prompt
        keeps the whole prompt, and what it cannot use goes to the other layers in
        proportion to theirs (the total falls short only when every layer keeps the
        whole prompt)."""
        cfg = self.cfg
        if not cfg.allocation.startswith("pyramid") or n_layers == 1:
            return [cfg.budget] * n_layers
        fixed = cfg.sinks + cfg.recent + cfg.merge
        free = cfg.budget - fixed
        cap = L - fixed                        # picks that keep the whole prompt
        if cap <= free:
            return [min(cfg.budget, L)] * n_layers
        spans = np.linspace(2 * free - free / cfg.pyramid_beta, free / cfg.pyramid_beta, n_layers)
        share = spans.copy()
        while (over := share > cap).any():    # water-fill: a capped layer's excess to the others
            excess = (share[over] - cap).sum()
            share[over] = cap
            room = share < cap
            share[room] += excess * spans[room] / spans[room].sum()
        picks = np.floor(share).astype(np.int64)
        short = free * n_layers - int(picks.sum())                        # exact total
        order = [i for i in np.argsort(picks - share, kind="stable") if picks[i] < cap]
        picks[order[:short]] += 1
        for i in np.flatnonzero(picks < 1):    # at least one voted row: taken from the largest,
            top = np.flatnonzero(picks == picks.max())[-1]   # the deepest of equals (falling with depth)
            picks[top] -= 1
            picks[i] = 1
        return [int(fixed + p) for p in picks]

    def keep_from_model_votes(self, votes_per_layer: Sequence[np.ndarray], L: int) -> list[np.ndarray]:
        """Selection step for a whole model: votes_per_layer[i] float [n_kv_heads_i, L - W].
        "global" sums over layers and heads; other granularities select layer by layer,
        with the layers' budgets from `layer_budgets`."""
        if self.cfg.granularity != "global" and self.cfg.allocation == "uniform":
            return [self.keep_from_votes(v, L) for v in votes_per_layer]
        if not self.cfg.compacts(L):
            return [_keep_all(np.shape(v)[0], L) for v in votes_per_layer]
        if self.cfg.granularity != "global":
            adaptive = self.cfg.allocation.endswith("adaptive")
            out = []
            for v, b in zip(votes_per_layer, self.layer_budgets(len(votes_per_layer), L)):
                if b >= L:
                    out.append(_keep_all(np.shape(v)[0], L))
                    continue
                layer = SnapKvSelector(dataclasses.replace(self.cfg, budget=b, allocation="uniform"))
                out.append(layer.adaptive_keep(v, L) if adaptive else layer.keep_from_votes(v, L))
            return out
        checked = [self._check_votes(v, L) for v in votes_per_layer]
        if not checked:
            return []
        total = np.zeros((1, L - self.cfg.window), dtype=np.float64)
        for v in checked:
            total += v.sum(axis=0, keepdims=True)
        row = self._top_k(total, L)
        return [np.repeat(row, v.shape[0], axis=0) for v in checked]

    def adaptive_keep(self, votes: np.ndarray, L: int):
        """Ada-KV's per-head budgets for one layer: the n_kv_heads x (budget - merge)
        rows the votes choose are shared among the KV heads by their pooled scores (one
        top-k over every head's candidates, which compare across heads: each head's votes
        are probabilities summed over the same window and group), each head first taking
        at least ADAPTIVE_ALPHA of its uniform picks from its own top. Sinks, recency and
        merged rows stay per head. Returns one sorted int64 array per KV head (a list;
        lengths differ, their sum is n_kv_heads x the uniform rows)."""
        votes = self._check_votes(votes, L)
        cfg = self.cfg
        pooled = self._pool(votes)
        H = pooled.shape[0]
        first, stop = cfg.sinks, L - cfg.recent
        cand = pooled[:, first:stop]                                      # [H, C]
        n_pick = cfg.selected - cfg.sinks - cfg.recent                   # uniform picks per head
        floor = int(ADAPTIVE_ALPHA * n_pick)
        order = np.argsort(-cand, axis=1, kind="stable")                 # per head, best first
        chosen = np.zeros(cand.shape, dtype=bool)
        rows = np.arange(H)[:, None]
        chosen[rows, order[:, :floor]] = True
        rest = H * n_pick - H * floor
        if rest:
            # the rest by score over all heads; ties to the lower head, then the lower position
            flat = np.where(chosen, -np.inf, cand).ravel()
            top = np.argsort(-flat, kind="stable")[:rest]
            chosen.ravel()[top] = True
        sinks = np.arange(cfg.sinks, dtype=np.int64)
        recent = np.arange(stop, L, dtype=np.int64)
        return [np.concatenate([sinks, np.flatnonzero(chosen[h]).astype(np.int64) + first, recent])
                for h in range(H)]

    # -- internals ------------------------------------------------------------
    def _check_window(self, W: int) -> None:
        if W != self.cfg.window:
            raise ValueError(f"SnapKV selection expects {self.cfg.window} window queries, got {W}")

    def _check_votes(self, votes, L: int) -> np.ndarray:
        votes = np.asarray(votes, dtype=np.float64)
        P = L - self.cfg.window
        if votes.ndim != 2 or votes.shape[1] != P or votes.shape[0] < 1:
            raise ValueError(f"SnapKV votes must be [n_kv_heads, L - window] = [*, {P}], "
                             f"got shape {votes.shape}")
        if not np.isfinite(votes).all():
            raise ValueError("SnapKV votes contain NaN or infinity")
        return votes

    def _pool(self, votes: np.ndarray) -> np.ndarray:
        """votes f64 [H, P] -> pooled f64 [H, P] along positions (left-to-right neighbour sums)."""
        r = self.cfg.kernel // 2
        if r == 0:
            return votes
        H, P = votes.shape
        if self.cfg.pool == "avg":
            padded = np.zeros((H, P + 2 * r), dtype=np.float64)
            padded[:, r:r + P] = votes
            acc = padded[:, 0:P].copy()
            for i in range(1, self.cfg.kernel):
                acc += padded[:, i:i + P]
            return acc / self.cfg.kernel
        padded = np.full((H, P + 2 * r), -np.inf, dtype=np.float64)
        padded[:, r:r + P] = votes
        acc = padded[:, 0:P].copy()
        for i in range(1, self.cfg.kernel):
            np.maximum(acc, padded[:, i:i + P], out=acc)
        return acc

    def _top_k(self, votes: np.ndarray, L: int) -> np.ndarray:
        """votes f64 [H, P] -> keep int64 [H, budget - merge]: sinks + top pooled candidates + recent."""
        cfg = self.cfg
        pooled = self._pool(votes)                                       # [H, P]
        first, stop = cfg.sinks, L - cfg.recent                          # candidates first .. stop-1
        n_pick = cfg.selected - cfg.sinks - cfg.recent                   # > 0 by validation
        # Stable sort of negated scores: highest first, ties keep ascending index order.
        order = np.argsort(-pooled[:, first:stop], axis=1, kind="stable")[:, :n_pick]
        picked = np.sort(order, axis=1) + first                          # [H, n_pick]
        H = votes.shape[0]
        sinks = np.broadcast_to(np.arange(cfg.sinks, dtype=np.int64), (H, cfg.sinks))
        recent = np.broadcast_to(np.arange(stop, L, dtype=np.int64), (H, cfg.recent))
        return np.ascontiguousarray(np.concatenate([sinks, picked.astype(np.int64), recent], axis=1))


def _keep_all(n_kv_heads: int, L: int) -> np.ndarray:
    """int64 [n_kv_heads, L]: every position."""
    return np.repeat(np.arange(L, dtype=np.int64)[None, :], n_kv_heads, axis=0)
