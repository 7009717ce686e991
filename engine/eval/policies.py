"""Eviction policies compared by the evaluation, named so a run can pick a subset.

Names: `full` (no eviction) or `snapkv-b<B>-<granularity>-<pool>-k<K>-w<W>-s<S>[-m<M>]`
where <B> is a row budget (`b1024`) or a fraction of the prompt (`bL/8`), e.g.
`snapkv-b1024-head-avg-k31-w32-s4` (the SnapKvConfig defaults at budget 1024);
`-m64`: 64 of the budget's rows are merged rows (engine/kv/merge.py); `-pyramid` (layer
budgets falling with depth; `-pyramid5`: with beta 5 instead of 20), `-adaptive` (a
layer's rows shared among its KV heads by their votes) or `-pyramid-adaptive`:
SnapKvConfig.allocation, after any `-m`.
A `+<kv dtype>` suffix stores the cache quantized (backends/kvformat.py), e.g.
`full+q8_0`, `snapkv-bL/8-head-avg-k31-w32-s4+tq4`, `full+q8_0/tq4` (keys/values);
no suffix is the bf16 cache.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

from backends.kvformat import KvSpec

from ..errors import ConfigError, EngineError
from ..snapkv import GRANULARITIES, POOLS, SnapKvConfig

DEFAULT = SnapKvConfig()
_NAME = re.compile(r"^snapkv-b(?P<budget>\d+|L/\d+)-(?P<gran>[a-z]+)-(?P<pool>[a-z]+)"
                   r"-k(?P<kernel>\d+)-w(?P<window>\d+)-s(?P<sinks>\d+)(?:-m(?P<merge>\d+))?"
                   r"(?:-(?P<alloc>pyramid(?P<beta>\d+)?(?:-adaptive)?|adaptive))?$")


@dataclass(frozen=True)
class Policy:
    """One cache policy. budget: rows (int) or, with `fraction`, L // fraction."""
    name: str
    budget: int | None = None          # None: full cache
    fraction: int | None = None        # budget = prompt_len // fraction (the `bL/8` policies)
    granularity: str = DEFAULT.granularity
    pool: str = DEFAULT.pool
    kernel: int = DEFAULT.kernel
    window: int = DEFAULT.window
    sinks: int = DEFAULT.sinks
    merge: int = 0                     # merged rows within the budget
    allocation: str = "uniform"        # SnapKvConfig.allocation
    pyramid_beta: int = DEFAULT.pyramid_beta
    kv_dtype: str = "bf16"             # KV storage, "tq4" or keys/values "q8_0/tq4"

    @property
    def is_full(self) -> bool:
        return self.budget is None and self.fraction is None

    def budget_for(self, n_tokens: int) -> int | None:
        if self.is_full:
            return None
        if self.fraction is not None:
            return max(n_tokens // self.fraction, self.window + self.sinks + self.merge + 1)
        return self.budget

    def config(self, n_tokens: int) -> SnapKvConfig | None:
        """The SnapKvConfig for a prompt of n_tokens (None for the full cache)."""
        if self.is_full:
            return None
        return SnapKvConfig(budget=self.budget_for(n_tokens), window=self.window, sinks=self.sinks,
                            kernel=self.kernel, pool=self.pool, granularity=self.granularity, merge=self.merge,
                            allocation=self.allocation, pyramid_beta=self.pyramid_beta)

    def compacts(self, n_tokens: int) -> bool:
        cfg = self.config(n_tokens)
        return cfg is not None and cfg.compacts(n_tokens)

    def describe(self) -> dict:
        return {"name": self.name, "budget": self.budget, "budget_fraction": self.fraction,
                "granularity": self.granularity, "pool": self.pool, "kernel": self.kernel,
                "window": self.window, "sinks": self.sinks, "merge": self.merge, "allocation": self.allocation,
                "pyramid_beta": self.pyramid_beta, "kv_dtype": self.kv_dtype}

    def with_kv_dtype(self, kv_dtype: str) -> "Policy":
        """This policy over a cache stored as `kv_dtype` (the name gains `+<dtype>`)."""
        kv_dtype = KvSpec.parse(kv_dtype).name
        base = self.name.split("+")[0]
        return replace(self, name=base if kv_dtype == "bf16" else f"{base}+{kv_dtype}", kv_dtype=kv_dtype)


FULL = Policy("full")


def snapkv(budget: int | None = None, fraction: int | None = None, granularity: str = DEFAULT.granularity,
           pool: str = DEFAULT.pool, kernel: int = DEFAULT.kernel, window: int = DEFAULT.window,
           sinks: int = DEFAULT.sinks, merge: int = 0, allocation: str = "uniform",
           pyramid_beta: int = DEFAULT.pyramid_beta) -> Policy:
    b = f"L/{fraction}" if fraction is not None else str(budget)
    alloc = "" if allocation == "uniform" else f"-{allocation}"
    if allocation.startswith("pyramid") and pyramid_beta != DEFAULT.pyramid_beta:
        alloc = alloc.replace("pyramid", f"pyramid{pyramid_beta}")
    name = (f"snapkv-b{b}-{granularity}-{pool}-k{kernel}-w{window}-s{sinks}" + (f"-m{merge}" if merge else "")
            + alloc)
    return Policy(name, budget, fraction, granularity, pool, kernel, window, sinks, merge, allocation, pyramid_beta)


def parse_policy(name: str) -> Policy:
    """`full` or a snapkv-... name, optionally +<kv dtype> (see the module docstring)."""
    name = name.strip()
    base, plus, dtype = name.partition("+")
    if plus:
        try:
            return parse_policy(base).with_kv_dtype(dtype)
        except ConfigError as e:
            raise EngineError(f"policy {name!r}: {e}") from None
    if name == "full":
        return FULL
    m = _NAME.match(name)
    if not m:
        raise EngineError(f"bad policy name {name!r}: expected 'full' or like "
                          f"'snapkv-b1024-head-avg-k31-w32-s4' (budget b<N> or bL/<N>)")
    if m["gran"] not in GRANULARITIES:
        raise EngineError(f"policy {name!r}: granularity must be one of {', '.join(GRANULARITIES)}")
    if m["pool"] not in POOLS:
        raise EngineError(f"policy {name!r}: pool must be one of {', '.join(POOLS)}")
    b = m["budget"]
    fraction = int(b[2:]) if b.startswith("L/") else None
    if fraction is not None and fraction < 1:
        raise EngineError(f"policy {name!r}: budget fraction L/{fraction} must divide by at least 1")
    p = snapkv(None if fraction else int(b), fraction, m["gran"], m["pool"], int(m["kernel"]),
               int(m["window"]), int(m["sinks"]), int(m["merge"] or 0),
               re.sub(r"\d+", "", m["alloc"] or "uniform"), int(m["beta"] or DEFAULT.pyramid_beta))
    try:
        p.config(10 ** 6)                           # validates kernel, window, budget vs window + sinks
    except ConfigError as e:
        raise EngineError(f"policy {name!r}: {e}") from None
    return p


def default_policies(budgets, ablation_budget: int | None = 1024, fraction: int | None = 8) -> list[Policy]:
    """full; SnapKV defaults at each budget (and at L/fraction); and, at `ablation_budget`,
    one change at a time: granularity layer/global, max pooling, kernel 1/5/7/15, window 16/64,
    sinks 0 (variants equal to the defaults collapse into them)."""
    out = [FULL] + [snapkv(int(b)) for b in budgets]
    if fraction:
        out.append(snapkv(fraction=fraction))
    if ablation_budget:
        b = int(ablation_budget)
        out += [snapkv(b, granularity="layer"), snapkv(b, granularity="global"), snapkv(b, pool="max"),
                *(snapkv(b, kernel=k) for k in (1, 5, 7, 15)), snapkv(b, window=16), snapkv(b, window=64),
                snapkv(b, sinks=0)]
    seen, unique = set(), []
    for p in out:
        if p.name not in seen:
            seen.add(p.name)
            unique.append(p)
    for p in unique:
        try:
            p.config(10 ** 6)
        except ConfigError as e:
            raise EngineError(f"policy {p.name}: {e}") from None
    return unique
