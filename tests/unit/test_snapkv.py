"""SnapKvConfig / SnapKvSelector against seed 004's worked example, its counter-example
and a plain, loop-based float64 reference of the whole algorithm written here."""
from __future__ import annotations

import dataclasses
import functools
import math
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from engine.errors import ConfigError
from engine.snapkv import SnapKvConfig, SnapKvSelector


# --------------------------------------------------------------------------- reference
def ref_votes(q_window, keys):
    """q_window [n_q, W, D], keys [n_kv, L, D] -> f64 [n_kv, L - W]; one softmax row per query."""
    n_q, W, D = q_window.shape
    n_kv, L, _ = keys.shape
    group = n_q // n_kv
    P = L - W
    scale = 1.0 / math.sqrt(D)
    votes = np.zeros((n_kv, P))
    for h in range(n_q):
        g = h // group
        for w in range(W):
            t = P + w                                   # prompt position of this query
            q = q_window[h, w].astype(np.float64)
            logits = [float(np.dot(q, keys[g, j].astype(np.float64))) * scale for j in range(t + 1)]
            top = max(logits)
            weights = [math.exp(x - top) for x in logits]
            total = math.fsum(weights)                  # the whole causal row, window included
            for j in range(P):
                votes[g, j] += weights[j] / total
    return votes


def ref_pool(row, kernel, pool):
    """row [P] -> pooled [P]; avg: zero padding / kernel; max: padding ignored."""
    r = kernel // 2
    P = len(row)
    out = []
    for j in range(P):
        neighbours = [row[p] for p in range(j - r, j + r + 1) if 0 <= p < P]
        if pool == "avg":
            s = 0.0
            for x in neighbours:                         # left to right, like the engine
                s += x
            out.append(s / kernel)
        else:
            out.append(max(neighbours))
    return out


def ref_keep_row(pooled, L, cfg):
    recent = cfg.window if cfg.recency is None else max(cfg.window, cfg.recency)
    forced = list(range(cfg.sinks)) + list(range(L - recent, L))
    candidates = [j for j in range(cfg.sinks, L - recent)]
    ranked = sorted(candidates, key=lambda j: (-pooled[j], j))
    return sorted(forced + ranked[:cfg.budget - len(forced)])


def ref_keep_from_votes(votes, L, cfg, n_heads):
    """votes: list of per-head rows already reduced as the granularity asks."""
    if L <= cfg.budget or L <= cfg.min_tokens:
        return np.tile(np.arange(L), (n_heads, 1)), None
    rows, scores = [], []
    for v in votes:
        pooled = ref_pool(list(v), cfg.kernel, cfg.pool)
        rows.append(ref_keep_row(pooled, L, cfg))
        scores.append(pooled)
    if len(rows) == 1 and n_heads > 1:
        rows, scores = rows * n_heads, scores * n_heads
    return np.array(rows), scores


def ref_select_model(layers, cfg, votes=None):
    """layers: [(q_window, keys)] -> ([keep per layer], [pooled scores per layer or None]).
    votes: the layers' ref_votes when already computed."""
    L = layers[0][1].shape[1]
    votes = votes or [ref_votes(q, k) for q, k in layers]
    if cfg.granularity == "global":
        total = sum(v.sum(axis=0) for v in votes)
        out = [ref_keep_from_votes([total], L, cfg, k.shape[0]) for _, k in layers]
    elif cfg.granularity == "layer":
        out = [ref_keep_from_votes([v.sum(axis=0)], L, cfg, v.shape[0]) for v in votes]
    else:
        out = [ref_keep_from_votes(list(v), L, cfg, v.shape[0]) for v in votes]
    return [o[0] for o in out], [o[1] for o in out]


def assert_keep_matches(got, want, scores):
    """Exact match, except that positions whose reference pooled scores are equal up to
    rounding (1e-9 relative) may trade places: the engine and the reference sum in
    different orders. Exact ties are checked exactly in the integer-vote tests."""
    assert got.shape == want.shape
    for h in range(want.shape[0]):
        g, w = set(got[h].tolist()), set(want[h].tolist())
        if g == w:
            continue
        diff = sorted(g ^ w)
        assert scores is not None, (got[h], want[h])
        vals = [scores[h][j] for j in diff]
        assert max(vals) - min(vals) <= 1e-9 * max(abs(x) for x in vals), (got[h], want[h], vals)


def check_invariants(keep, L, cfg):
    assert keep.dtype == np.int64 and keep.ndim == 2
    if L <= cfg.budget or L <= cfg.min_tokens:
        assert (keep == np.arange(L)[None, :]).all()
        return
    assert keep.shape[1] == cfg.budget
    recent = cfg.window if cfg.recency is None else max(cfg.window, cfg.recency)
    must = set(range(cfg.sinks)) | set(range(L - recent, L))
    for row in keep:
        assert (np.diff(row) > 0).all()                 # sorted, unique
        assert row[0] >= 0 and row[-1] < L
        assert must <= set(row.tolist())
    if cfg.granularity != "head":
        assert (keep == keep[0:1]).all()


# --------------------------------------------------------------------------- seed 004
A = [1, 2, 10, 8, 1, 1, 2, 1]
B = [1, 1, 8, 12, 1, 1, 1, 1]


def worked_example():
    keys = np.array([[math.log(a), math.log(b)] for a, b in zip(A, B)], np.float32)[None]  # [1, 8, 2]
    q = np.array([[math.sqrt(2), 0.0], [0.0, math.sqrt(2)]], np.float32)[None]             # [1, 2, 2]
    return q, keys


def test_worked_example_votes_and_keep():
    q, keys = worked_example()
    sel = SnapKvSelector(SnapKvConfig(budget=5, window=2, sinks=0, kernel=3, pool="avg", min_tokens=0))
    want = [a / 25 + b / 26 for a, b in zip(A[:6], B[:6])]
    v = sel.votes(q, keys)
    assert v.dtype == np.float32 and v.shape == (1, 6)
    np.testing.assert_allclose(v[0], want, rtol=1e-6)
    keep = sel.select(q, keys)
    assert keep.dtype == np.int64
    assert keep.tolist() == [[2, 3, 4, 6, 7]]
    # Raw votes alone would keep position 3 first; pooling makes 2 the best and lifts 4.
    assert sel.keep_from_votes(np.array([want]), 8).tolist() == [[2, 3, 4, 6, 7]]


def test_counter_example_full_row_softmax_picks_b():
    # Prefix A (0), B (1); window queries at 2 and 3. exp-weights per row (position 3 is
    # masked for query 2): query 2: A 9, B 1, window 90; query 3: A 9, B 27, window 2 + 2.
    w2 = [9, 1, 90, 1]
    w3 = [9, 27, 2, 2]
    keys = np.array([[math.log(a), math.log(b)] for a, b in zip(w2, w3)], np.float32)[None]
    q = np.array([[math.sqrt(2), 0.0], [0.0, math.sqrt(2)]], np.float32)[None]
    sel = SnapKvSelector(SnapKvConfig(budget=3, window=2, sinks=0, kernel=1, min_tokens=0))
    np.testing.assert_allclose(sel.votes(q, keys)[0], [0.315, 0.685], rtol=1e-5)
    # The wrong algorithm (renormalise over the prefix only) would prefer A: 1.15 vs 0.85.
    renorm = [9 / 10 + 9 / 36, 1 / 10 + 27 / 36]
    assert renorm[0] > renorm[1]
    assert sel.select(q, keys).tolist() == [[1, 2, 3]]


# --------------------------------------------------------------------------- reference parity
def random_layers(rng, n_layers, n_q, n_kv, L, W, D):
    return [(rng.standard_normal((n_q, W, D)).astype(np.float32) * 2,
             rng.standard_normal((n_kv, L, D)).astype(np.float32) * 2) for _ in range(n_layers)]


@functools.lru_cache(maxsize=None)
def parity_case(n_q, n_kv, D):
    """Two random layers (L = 97, W = 6) and their reference votes, shared across configs."""
    layers = random_layers(np.random.default_rng([n_q, n_kv, D]), 2, n_q, n_kv, 97, 6, D)
    return layers, [ref_votes(q, k) for q, k in layers]


@pytest.mark.parametrize("n_q,n_kv", [(9, 3), (8, 2), (4, 4)])
@pytest.mark.parametrize("D", [64, 16])
@pytest.mark.parametrize("granularity", ["head", "layer", "global"])
@pytest.mark.parametrize("pool", ["avg", "max"])
@pytest.mark.parametrize("sinks", [0, 4])
def test_matches_reference(n_q, n_kv, D, granularity, pool, sinks):
    L, W = 97, 6
    layers, ref = parity_case(n_q, n_kv, D)
    got_votes = SnapKvSelector(SnapKvConfig(budget=40, window=W, sinks=sinks)).votes(*layers[0])
    np.testing.assert_allclose(got_votes, ref[0], rtol=2e-5, atol=1e-7)
    for kernel in (1, 3, 5, 7):
        for recency in (None, W + 9):
            cfg = SnapKvConfig(budget=40, window=W, sinks=sinks, recency=recency, kernel=kernel,
                               pool=pool, granularity=granularity, min_tokens=16)
            sel = SnapKvSelector(cfg)
            want, scores = ref_select_model(layers, cfg, ref)
            got = sel.select_model(layers)
            for g, w, s in zip(got, want, scores):
                check_invariants(g, L, cfg)
                assert_keep_matches(g, w, s)
            if granularity != "global":
                assert_keep_matches(sel.select(*layers[1]), want[1], scores[1])
            else:
                assert all((g == got[0][0:1]).all() for g in got)


@pytest.mark.parametrize("granularity", ["head", "layer", "global"])
@pytest.mark.parametrize("pool", ["avg", "max"])
@pytest.mark.parametrize("kernel", [1, 3, 5, 7])
@pytest.mark.parametrize("sinks", [0, 4])
def test_integer_votes_ties_go_to_lower_index(granularity, pool, kernel, sinks):
    # Integer votes: every sum is exact, so ties are real ties in both implementations.
    rng = np.random.default_rng([kernel, sinks])
    L, W, n_kv = 60, 4, 3
    cfg = SnapKvConfig(budget=25, window=W, sinks=sinks, recency=7, kernel=kernel, pool=pool,
                       granularity=granularity, min_tokens=0)
    sel = SnapKvSelector(cfg)
    layer_votes = [rng.integers(0, 3, size=(n_kv, L - W)).astype(np.float32) for _ in range(2)]
    if granularity == "global":
        total = sum(v.astype(np.float64).sum(axis=0) for v in layer_votes)
        want = [ref_keep_from_votes([total], L, cfg, n_kv)[0]] * 2
        got = sel.keep_from_model_votes(layer_votes, L)
    elif granularity == "layer":
        want = [ref_keep_from_votes([v.astype(np.float64).sum(axis=0)], L, cfg, n_kv)[0]
                for v in layer_votes]
        got = [sel.keep_from_votes(v, L) for v in layer_votes]
    else:
        want = [ref_keep_from_votes(list(v.astype(np.float64)), L, cfg, n_kv)[0] for v in layer_votes]
        got = sel.keep_from_model_votes(layer_votes, L)
    for g, w in zip(got, want):
        check_invariants(g, L, cfg)
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("pool,expect_first", [("max", 0), ("avg", 1)])
def test_uniform_attention_ties(pool, expect_first):
    # All keys equal: every prefix position gets exactly the same votes. Max pooling keeps
    # them all tied -> the lowest indices win; avg pooling lowers both edges (zero padding).
    L, W = 30, 3
    keys = np.zeros((2, L, 8), np.float32)
    q = np.random.default_rng(0).standard_normal((4, W, 8)).astype(np.float32)
    cfg = SnapKvConfig(budget=10, window=W, sinks=0, kernel=3, pool=pool, min_tokens=0)
    keep = SnapKvSelector(cfg).select(q, keys)
    picked = list(range(expect_first, expect_first + 7))
    assert keep.tolist() == [picked + [27, 28, 29]] * 2


def test_pooling_boundaries():
    # One spike at the first prefix position: avg pads with zeros (score / kernel), max does not.
    votes = np.zeros((1, 12)); votes[0, 0] = 3.0; votes[0, 11] = 2.0
    avg = SnapKvSelector(SnapKvConfig(budget=4, window=2, sinks=0, kernel=5, pool="avg", min_tokens=0))
    mx = SnapKvSelector(SnapKvConfig(budget=4, window=2, sinks=0, kernel=5, pool="max", min_tokens=0))
    np.testing.assert_allclose(avg._pool(votes)[0, :4], [0.6, 0.6, 0.6, 0.0])
    np.testing.assert_allclose(mx._pool(votes)[0, :4], [3.0, 3.0, 3.0, 0.0])
    assert avg.keep_from_votes(votes, 14).tolist() == [[0, 1, 12, 13]]
    assert mx.keep_from_votes(votes, 14).tolist() == [[0, 1, 12, 13]]


# --------------------------------------------------------------------------- hypothesis
@st.composite
def small_cases(draw):
    n_kv = draw(st.integers(1, 3))
    group = draw(st.integers(1, 3))
    D = draw(st.integers(1, 6))
    W = draw(st.integers(1, 4))
    sinks = draw(st.integers(0, 3))
    recency = draw(st.one_of(st.none(), st.integers(0, W + 4)))
    recent = W if recency is None else max(W, recency)
    budget = recent + sinks + 1 + draw(st.integers(0, 6))
    L = draw(st.integers(max(W, 2), budget + 12))
    min_tokens = draw(st.sampled_from([0, 0, L - 1, L]))
    cfg = SnapKvConfig(budget=budget, window=W, sinks=sinks, recency=recency,
                       kernel=draw(st.sampled_from([1, 3, 5, 7])), pool=draw(st.sampled_from(["avg", "max"])),
                       granularity=draw(st.sampled_from(["head", "layer", "global"])), min_tokens=min_tokens)
    n_layers = draw(st.integers(1, 3))
    # Small integers: duplicate keys give exactly tied votes.
    ints = st.integers(-2, 2)
    layers = [(draw(hnp.arrays(np.int8, (n_kv * group, W, D), elements=ints)).astype(np.float32),
               draw(hnp.arrays(np.int8, (n_kv, L, D), elements=ints)).astype(np.float32))
              for _ in range(n_layers)]
    return cfg, layers


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_cases())
def test_hypothesis_matches_reference(case):
    cfg, layers = case
    L = layers[0][1].shape[1]
    sel = SnapKvSelector(cfg)
    np.testing.assert_allclose(sel.votes(*layers[0]), ref_votes(*layers[0]), rtol=2e-5, atol=1e-7)
    want, scores = ref_select_model(layers, cfg)
    got = sel.select_model(layers)
    assert len(got) == len(layers)
    for g, w, s in zip(got, want, scores):
        check_invariants(g, L, cfg)
        assert_keep_matches(g, w, s)
    if cfg.granularity == "global":
        assert all((g == got[0][0:1]).all() for g in got)
    else:
        np.testing.assert_array_equal(sel.select(*layers[0]), got[0])


# --------------------------------------------------------------------------- policy edges
def test_short_prompts_are_not_compacted():
    rng = np.random.default_rng(1)
    cfg = SnapKvConfig(budget=20, window=4, sinks=2, min_tokens=50)
    sel = SnapKvSelector(cfg)
    for L in (3, 20, 50):            # below the window, == budget, == min_tokens (> budget)
        q = rng.standard_normal((4, min(4, L), 8)).astype(np.float32)
        keys = rng.standard_normal((2, L, 8)).astype(np.float32)
        keep = sel.select(q, keys)
        assert keep.tolist() == [list(range(L))] * 2
        assert [k.tolist() for k in sel.select_model([(q, keys)])] == [[list(range(L))] * 2]
        assert cfg.n_keep(L) == L and not cfg.compacts(L)
    L = 51
    keep = sel.select(rng.standard_normal((4, 4, 8)).astype(np.float32),
                      rng.standard_normal((2, L, 8)).astype(np.float32))
    assert keep.shape == (2, 20) and cfg.n_keep(L) == 20
    check_invariants(keep, L, cfg)
    assert SnapKvSelector(dataclasses.replace(cfg, granularity="global")).keep_from_model_votes(
        [np.zeros((2, 16))], 20)[0].tolist() == [list(range(20))] * 2


def test_sinks_and_recency_kept_even_with_zero_votes():
    # Middle rows get huge votes; sinks and the recency tail still survive.
    L, W = 80, 4
    votes = np.full((2, L - W), 1e9); votes[:, :3] = 0.0; votes[:, -20:] = 0.0
    cfg = SnapKvConfig(budget=30, window=W, sinks=3, recency=12, kernel=1, min_tokens=0)
    keep = SnapKvSelector(cfg).keep_from_votes(votes, L)
    check_invariants(keep, L, cfg)
    assert keep[0, :3].tolist() == [0, 1, 2]
    assert keep[0, -12:].tolist() == list(range(68, 80))
    assert keep[0, 3:-12].tolist() == list(range(3, 18))


def test_layer_rows_identical_and_differ_from_head():
    rng = np.random.default_rng(5)
    q, keys = random_layers(rng, 1, 8, 2, 120, 8, 16)[0]
    head = SnapKvSelector(SnapKvConfig(budget=40, window=8, granularity="head", min_tokens=0)).select(q, keys)
    layer = SnapKvSelector(SnapKvConfig(budget=40, window=8, granularity="layer", min_tokens=0)).select(q, keys)
    assert (layer == layer[0]).all()
    assert not (head == head[0]).all()     # random heads choose differently


def test_scoring_memory_is_not_quadratic():
    # An L x L float64 matrix at L = 20000 would be 3.2 GB; the window scores are a few MB.
    rng = np.random.default_rng(2)
    L, W = 20000, 8
    q = rng.standard_normal((2, W, 16)).astype(np.float32)
    keys = rng.standard_normal((1, L, 16)).astype(np.float32)
    sel = SnapKvSelector(SnapKvConfig(budget=512, window=W))
    tracemalloc.start()
    try:
        keep = sel.select(q, keys)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert keep.shape == (1, 512)
    assert peak < 64 * 2**20


def test_input_shape_errors():
    sel = SnapKvSelector(SnapKvConfig(budget=10, window=2, sinks=0, min_tokens=0))
    keys = np.zeros((2, 12, 4), np.float32)
    with pytest.raises(ValueError, match="grouped"):
        sel.votes(np.zeros((3, 2, 4), np.float32), keys)
    with pytest.raises(ValueError, match="head_dim"):
        sel.votes(np.zeros((2, 2, 5), np.float32), keys)
    with pytest.raises(ValueError, match="window"):
        sel.select(np.zeros((2, 3, 4), np.float32), keys)
    with pytest.raises(ValueError, match="votes must be"):
        sel.keep_from_votes(np.zeros((2, 11)), 12)
    with pytest.raises(ValueError, match="NaN"):
        sel.keep_from_votes(np.full((2, 10), np.nan), 12)


def test_summary_is_one_line():
    cfg = SnapKvConfig()
    s = cfg.summary()
    assert "\n" not in s and "2048" in s and "avg" in s
    assert SnapKvSelector(cfg).describe() == s
    assert "no pooling" in SnapKvConfig(kernel=1, granularity="global").summary()


# --------------------------------------------------------------------------- validation
@pytest.mark.parametrize("kwargs,match", [
    (dict(budget=68, window=64, sinks=4), r"budget \(68\) must be larger than window \+ sinks"),
    (dict(budget=10, window=8, sinks=2), "window \\+ sinks"),
    (dict(budget=20, window=4, sinks=4, recency=16), r"recency \+ sinks \(16 \+ 4 = 20\)"),
    (dict(window=0), "window must be >= 1"),
    (dict(kernel=4), "kernel must be an odd integer"),
    (dict(kernel=0), "kernel must be an odd integer"),
    (dict(kernel=-3), "kernel must be an odd integer"),
    (dict(pool="mean"), "pool must be one of avg, max"),
    (dict(granularity="token"), "granularity must be one of head, layer, global"),
    (dict(sinks=-1), "sinks must be >= 0"),
    (dict(min_tokens=-1), "min_tokens must be >= 0"),
    (dict(recency=-2), "recency must be >= 0"),
    (dict(budget=2048.0), "budget must be an integer"),
    (dict(window=True), "window must be an integer"),
    (dict(sinks="4"), "sinks must be an integer"),
    (dict(recency=1.5), "recency must be an integer"),
])
def test_validation_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match) as err:
        SnapKvConfig(**kwargs)
    assert "\n" not in str(err.value)


def test_config_is_frozen_and_validate_is_public():
    cfg = SnapKvConfig(budget=100, window=8, recency=4, kernel=1, pool="max", granularity="layer")
    assert cfg.recent == 8                         # recency below the window has no effect
    cfg.validate()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.budget = 5
    with pytest.raises(ConfigError):
        dataclasses.replace(cfg, budget=10)
    assert SnapKvConfig(budget=np.int64(100), window=8).budget == 100


# -- layer budgets (allocation) ------------------------------------------------------
@pytest.mark.parametrize("budget,merge,n_layers,beta", [(1024, 0, 30, 20), (2048, 64, 3, 20), (96, 0, 2, 20),
                                                       (300, 16, 7, 20), (1024, 0, 30, 5), (2048, 64, 3, 2)])
def test_pyramid_budgets_keep_the_total_and_fall_with_depth(budget, merge, n_layers, beta):
    """PyramidKV as kvpress sizes it: the voted rows fall linearly from 2F - F/beta to
    F/beta (F = budget - sinks - recency - merge; kvpress's beta 20), summing to
    n_layers x budget exactly; beta 1 is uniform."""
    cfg = SnapKvConfig(budget=budget, merge=merge, allocation="pyramid", pyramid_beta=beta)
    got = SnapKvSelector(cfg).layer_budgets(n_layers, 10 ** 6)
    fixed = cfg.sinks + cfg.recent + merge
    free = budget - fixed
    assert sum(got) == n_layers * budget
    assert all(a >= b for a, b in zip(got, got[1:])) and got[0] > got[-1]
    assert abs(got[0] - fixed - (2 * free - free / beta)) <= 1 and abs(got[-1] - fixed - free / beta) <= 1
    flat = SnapKvSelector(dataclasses.replace(cfg, pyramid_beta=1)).layer_budgets(n_layers, 10 ** 6)
    assert flat == [budget] * n_layers
    assert SnapKvSelector(dataclasses.replace(cfg, allocation="uniform")).layer_budgets(n_layers, 10 ** 6) == \
        [budget] * n_layers


def test_pyramid_keeps_a_whole_short_prompt_in_its_first_layers():
    """A layer whose share passes the prompt keeps every row, and the rows it cannot use
    go to the deeper layers: the total stays n_layers x budget, the budgets still fall
    with depth, and none passes the prompt."""
    cfg = SnapKvConfig(budget=600, allocation="pyramid", min_tokens=0)
    sel = SnapKvSelector(cfg)
    L = 800
    budgets = sel.layer_budgets(4, L)
    assert budgets[0] == L and sum(budgets) == 4 * 600 and max(budgets) <= L
    assert all(a >= b for a, b in zip(budgets, budgets[1:]))
    for n_layers, length, budget in [(30, 2100, 2048), (30, 3000, 2048), (7, 700, 600), (24, 2049, 2048)]:
        got = SnapKvSelector(dataclasses.replace(cfg, budget=budget)).layer_budgets(n_layers, length)
        assert sum(got) == n_layers * budget and max(got) <= length, (n_layers, length)
    # every voted pick at least one, the total kept: budget - sinks - window = 4 over 30 layers
    tiny = SnapKvSelector(SnapKvConfig(budget=40, window=32, sinks=4, allocation="pyramid")).layer_budgets(30, 10 ** 6)
    assert sum(tiny) == 30 * 40 and min(tiny) == 37
    votes = [np.random.default_rng(i).random((2, L - cfg.window)) for i in range(4)]
    keeps = sel.keep_from_model_votes(votes, L)
    assert [k.shape for k in keeps] == [(2, b) for b in budgets]
    assert (keeps[0] == np.arange(L)).all()


def test_allocation_is_validated():
    with pytest.raises(ConfigError, match="allocation must be one of uniform, pyramid, adaptive, pyramid-adaptive"):
        SnapKvConfig(allocation="ragged")
    with pytest.raises(ConfigError, match="pyramid needs keep sets per layer or head"):
        SnapKvConfig(allocation="pyramid", granularity="global")
    with pytest.raises(ConfigError, match="pyramid_beta must be >= 1, got 0"):
        SnapKvConfig(allocation="pyramid", pyramid_beta=0)
    with pytest.raises(ConfigError, match="adaptive shares a layer's rows among its KV heads: it needs granularity head"):
        SnapKvConfig(allocation="adaptive", granularity="layer")


def _adaptive_reference(pooled, n_pick, floor, first):
    """Ada-KV by hand: each head's `floor` best candidates, then the best of the rest over
    all heads one at a time (ties: lower head, then lower position)."""
    H, C = pooled.shape
    chosen = [set(np.argsort(-pooled[h], kind="stable")[:floor].tolist()) for h in range(H)]
    rest = sorted(((-pooled[h, j], h, j) for h in range(H) for j in range(C) if j not in chosen[h]))
    for _, h, j in rest[:H * (n_pick - floor)]:
        chosen[h].add(j)
    return [np.array(sorted(c)) + first for c in chosen]


@pytest.mark.parametrize("seed", range(4))
def test_adaptive_shares_a_layers_rows_by_votes_with_a_floor(seed):
    """allocation="adaptive": a layer keeps n_kv_heads x budget rows in all, the voted
    ones chosen by one top-k over every head's pooled scores after each head took its
    floor (ADAPTIVE_ALPHA of its uniform picks); sinks and the window stay per head."""
    from engine.snapkv import ADAPTIVE_ALPHA
    rng = np.random.default_rng(seed)
    L, H = 600, 3
    cfg = SnapKvConfig(budget=100, window=16, sinks=4, kernel=5, allocation="adaptive", min_tokens=0)
    votes = rng.random((H, L - 16)) ** 4
    votes[0] *= 10                                          # head 0 votes far more broadly
    keep = SnapKvSelector(cfg).adaptive_keep(votes, L)
    sizes = [len(k) for k in keep]
    n_pick = 100 - 4 - 16
    floor = int(ADAPTIVE_ALPHA * n_pick)
    assert sum(sizes) == H * 100 and sizes[0] > 100 and min(sizes) >= 4 + 16 + floor
    pooled = SnapKvSelector(cfg)._pool(votes.astype(np.float64))[:, 4:L - 16]
    want = _adaptive_reference(pooled, n_pick, floor, 4)
    for h, k in enumerate(keep):
        assert (np.diff(k) > 0).all()
        assert (k[:4] == np.arange(4)).all() and (k[-16:] == np.arange(L - 16, L)).all()
        np.testing.assert_array_equal(k[4:-16], want[h])
    # equal votes: every head its uniform share, the same rows as uniform
    flat = np.tile(rng.random(L - 16), (H, 1))
    even = SnapKvSelector(cfg).adaptive_keep(flat, L)
    uniform = SnapKvSelector(dataclasses.replace(cfg, allocation="uniform")).keep_from_votes(flat, L)
    np.testing.assert_array_equal(np.stack(even), uniform)


def test_pyramid_adaptive_keeps_each_layers_pyramid_total():
    cfg = SnapKvConfig(budget=200, window=16, allocation="pyramid-adaptive", min_tokens=0)
    sel = SnapKvSelector(cfg)
    L, H, n_layers = 1000, 2, 5
    votes = [np.random.default_rng(i).random((H, L - 16)) ** (i + 1) for i in range(n_layers)]
    keeps = sel.keep_from_model_votes(votes, L)
    budgets = sel.layer_budgets(n_layers, L)
    assert [sum(len(k) for k in layer) for layer in keeps] == [H * b for b in budgets]
    assert sum(budgets) == n_layers * 200


def test_pyramid_budgets_fall_with_depth_when_tiny_shares_take_a_row_from_capped_layers():
    """A layer whose share rounds to no voted row takes one from the largest; among
    several layers capped at the whole prompt, the deepest gives it (the first did,
    so the order broke: 37, 38, 38, ...)."""
    cfg = SnapKvConfig(budget=33, window=19, sinks=4, recency=21, allocation="pyramid", pyramid_beta=27,
                       min_tokens=0)
    got = SnapKvSelector(cfg).layer_budgets(21, 38)
    assert all(a >= b for a, b in zip(got, got[1:])), got
    assert sum(got) == 21 * 33 and max(got) <= 38 and min(got) >= cfg.sinks + cfg.recent + 1
