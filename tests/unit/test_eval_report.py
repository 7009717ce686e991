"""The paired comparison in `engine eval` reports: lost/gained counts against the full
cache and Tango's score interval for the difference of paired proportions."""
import math

import numpy as np
import pytest

from engine.eval import report
from engine.eval.report import Z95, paired_against, tango_interval


def _score_by_grid(n12, n21, n, delta, steps=200_001):
    """Tango's score statistic with the constrained MLE found by brute force on a grid."""
    lo, hi = max(0.0, -delta), (1.0 - delta) / 2.0
    p21 = np.linspace(lo, hi, steps)
    p12 = p21 + delta
    conc = 1.0 - p12 - p21
    with np.errstate(divide="ignore", invalid="ignore"):
        ll = (n12 * np.log(p12) if n12 else 0) + (n21 * np.log(p21) if n21 else 0) \
            + ((n - n12 - n21) * np.log(conc) if n - n12 - n21 else 0)
    ll = np.where(np.isnan(ll), -np.inf, ll)
    best = p21[int(np.argmax(ll))]
    return (n12 - n21 - n * delta) / math.sqrt(n * (2 * best + delta - delta ** 2))


def test_no_discordant_pairs_has_the_closed_form_width():
    for n in (10, 108, 500):
        lo, hi = tango_interval(0, 0, n)
        w = Z95 ** 2 / (n + Z95 ** 2)
        assert lo == pytest.approx(-w, abs=1e-9) and hi == pytest.approx(w, abs=1e-9)


@pytest.mark.parametrize("n12,n21,n", [(3, 1, 40), (0, 3, 108), (7, 2, 30), (1, 0, 12)])
def test_interval_edges_are_where_the_score_reaches_z(n12, n21, n):
    lo, hi = tango_interval(n12, n21, n)
    est = (n12 - n21) / n
    assert -1 <= lo < est < hi <= 1
    for edge in (lo, hi):
        if abs(edge) < 1:
            assert abs(_score_by_grid(n12, n21, n, edge)) == pytest.approx(Z95, abs=2e-3)


def test_interval_mirrors_when_the_sides_swap():
    lo, hi = tango_interval(5, 2, 60)
    lo2, hi2 = tango_interval(2, 5, 60)
    assert lo == pytest.approx(-hi2, abs=1e-9) and hi == pytest.approx(-lo2, abs=1e-9)


def _row(policy, index, correct, generated, task="niah"):
    return {"task": task, "length": 1024, "index": index, "seed": 0, "policy": policy,
            "correct": correct, "generated": generated, "score": None if correct is None else float(correct),
            "compacted": policy != "full", "kv_bytes": 100 if policy == "full" else 25, "kv_bytes_full": 100}


def test_paired_counts_lost_gained_and_same_text():
    full = [True, True, True, False, False]
    pol = [True, False, True, True, False]
    rows = [_row("full", i, c, f"a{i}") for i, c in enumerate(full)]
    rows += [_row("p", i, c, f"a{i}" if c == full[i] else "x") for i, c in enumerate(pol)]
    rows.append(_row("full", 0, None, None, task="fidelity"))            # not a retrieval task: ignored
    d = paired_against(rows, ["full", "p"])
    assert set(d) == {"p"}
    d = d["p"]
    assert (d["n"], d["lost"], d["gained"]) == (5, 1, 1)
    assert d["acc"] == pytest.approx(0.6) and d["acc_full"] == pytest.approx(0.6)
    assert d["same_text"] == pytest.approx(0.6) and d["diff"] == 0.0
    assert d["ci"] == pytest.approx(tango_interval(1, 1, 5))


def test_summary_markdown_has_the_paired_table():
    rows = [_row("full", i, True, "1") for i in range(4)] + [_row("p", i, i > 0, "1" if i else "2") for i in range(4)]
    summary = report.summarize(rows, ["full", "p"])
    summary["p"]["vs_full"] = paired_against(rows, ["full", "p"])["p"]
    md = report.markdown({"n_samples": 4}, summary, [1024], ["niah"])
    line = next(x for x in md.splitlines() if x.startswith("| `p` | 4 |"))
    assert "| 1 | 0 | 75% |" in line and "-25.0 [" in line


def test_paired_against_a_baseline_compares_fidelity_kl_too():
    """--baseline: each policy against another policy (say uniform against adaptive budgets):
    retrieval as against the full cache, and the fidelity KL as a paired geometric-mean ratio."""
    def fid(policy, index, kl):
        return {**_row(policy, index, None, None, task="fidelity"), "kl": kl, "top1": 1.0}
    rows = [_row("u", 0, True, "1"), _row("a", 0, False, "2"), _row("full", 0, True, "1")]
    rows += [fid("full", i, 0.0) for i in range(3)]
    rows += [fid("u", i, kl) for i, kl in enumerate((0.4, 0.2, 0.1))]
    rows += [fid("a", i, kl) for i, kl in enumerate((0.1, 0.1, 0.2))]
    d = paired_against(rows, ["full", "u", "a"], reference="u")
    assert (d["a"]["n"], d["a"]["lost"], d["a"]["gained"]) == (1, 1, 0)
    assert d["a"]["kl_ratio"] == pytest.approx((0.25 * 0.5 * 2.0) ** (1 / 3)) and d["a"]["kl_lower"] == 2
    assert d["full"]["kl_ratio"] is None and d["full"]["kl_lower"] == 3   # KL 0: lower everywhere, no ratio
    assert "kl_ratio" not in paired_against(rows, ["full", "u", "a"])["a"]   # nor against the full cache
    # a policy that keeps every row (KL 0) is lower on those prompts; the ratio leaves them out, and says so
    rows_z = rows + [fid("z", i, kl) for i, kl in enumerate((0.0, 0.0, 0.8))]
    z = paired_against(rows_z, ["full", "u", "z"], reference="u")["z"]
    assert (z["kl_lower"], z["n_fidelity"], z["n_kl_ratio"]) == (2, 3, 1) and z["kl_ratio"] == pytest.approx(8.0)
    assert report._kl_ratio(z) == "8.00x (1 of 3)"
    rows_0 = rows + [fid("z", i, 0.0) for i in range(3)]
    z0 = paired_against(rows_0, ["full", "u", "z"], reference="u")["z"]
    assert (z0["kl_lower"], z0["kl_ratio"]) == (3, None) and report._kl_ratio(z0) == "- (0 of 3)"
    summary = report.summarize(rows, ["full", "u", "a"])
    for p, x in d.items():
        summary[p]["vs"] = {"u": x}
    md = report.markdown({"n_samples": 4, "baselines": ["u"]}, summary, [1024], ["niah", "fidelity"])
    assert "## Against `u`, prompt by prompt" in md
    assert next(x for x in md.splitlines() if x.startswith("| `a` | 1 |")).endswith("| 0.63x | 2/3 |")
    fid_only = [r for r in rows if r["task"] == "fidelity"]                # no retrieval: no retrieval columns
    summary = report.summarize(fid_only, ["full", "u", "a"])
    summary["a"]["vs"] = {"u": paired_against(fid_only, ["full", "u", "a"], reference="u")["a"]}
    md = report.markdown({"n_samples": 3, "baselines": ["u"]}, summary, [1024], ["fidelity"])
    assert "| policy | KL ratio | KL lower on |" in md and "| `a` | 0.63x | 2/3 |" in md
