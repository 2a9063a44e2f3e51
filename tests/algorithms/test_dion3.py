"""NorMuon and Dion3 rules (algorithms/dion3.py), single process, float64."""
import math

import pytest
import torch

from megatron_dmuon.algorithms.dion3 import (
    normuon_normalize,
    piece_rows,
    select_rows_,
    selected_row_count,
)
from megatron_dmuon.algorithms.ns_dispatch import orthogonalize
from megatron_dmuon.algorithms.splitting import SplitRule
from megatron_dmuon.testing.reference import row_step_

F64 = torch.float64


def ns64(m):
    return orthogonalize(m, method="standard", compute_dtype=F64, coefficients="keller", steps=5)


def _grads(shape, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=F64) for _ in range(steps)]


def _independent_normuon(w, grads, *, lr, beta, beta2, wd):
    """NorMuon written out from its definition (no project rule code but NS): Muon momentum,
    NS, per-row second moment of the NS output, row normalization rescaled to the NS output's
    Frobenius norm, Keller's lr scale sqrt(max(1, rows/cols)), decoupled weight decay."""
    m = torch.zeros_like(w)
    v = torch.zeros(w.size(0), dtype=F64)
    for g in grads:
        m = beta * m + (1 - beta) * g
        o = ns64(m)
        v = beta2 * v + (1 - beta2) * (o * o).mean(dim=1)
        n = o / (v.sqrt() + 1e-8)[:, None]
        n = n * (o.norm() / n.norm())
        w = w * (1 - lr * wd) - lr * math.sqrt(max(1, w.size(0) / w.size(1))) * n
    return w


@pytest.mark.parametrize("shape", [(24, 40), (40, 24)], ids=["wide", "tall"])
def test_dion3_at_f1_equals_normuon(shape):
    grads = _grads(shape, 6)
    w0 = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    kw = dict(lr=0.02, beta=0.9, beta2=0.95, weight_decay=0.1, orthogonalize_fn=ns64)
    runs = {}
    for rule, fraction in (("normuon", 1.0), ("dion3", 1.0), ("dion3", 0.5)):
        w, m, v = w0.clone(), torch.zeros(shape, dtype=F64), torch.zeros(shape[0], dtype=F64)
        for g in grads:
            row_step_(w, g, m, v, rule=rule, fraction=fraction, **kw)
        runs[(rule, fraction)] = w
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    independent = _independent_normuon(w0.clone(), grads, lr=0.02, beta=0.9, beta2=0.95, wd=0.1)
    assert rel(runs[("normuon", 1.0)], independent) <= 1e-12
    # Dion3's momentum is NorMuon's / (1 - beta): NS is scale invariant up to rounding
    assert rel(runs[("dion3", 1.0)], independent) <= 1e-10
    assert rel(runs[("dion3", 0.5)], independent) > 1e-3  # the fraction is really used


@pytest.mark.parametrize("fraction", [0.25, 0.5, 1.0])
def test_error_feedback_conserves_the_unapplied_momentum(fraction):
    # every gradient either still sits in the momentum or left it as (1 - mu) x a row fed to NS
    shape, mu = (32, 20), 0.9
    grads = _grads(shape, 7, seed=3)
    m = torch.zeros(shape, dtype=F64)
    applied = torch.zeros(shape, dtype=F64)
    pieces = piece_rows(None, shape[0])
    for g in grads:
        before = m + g
        sels = select_rows_(m, g, pieces, rule="dion3", beta=mu, fraction=fraction)
        (sel,) = sels
        k = selected_row_count(shape[0], fraction)
        assert sel.rows.shape == (k,) and torch.equal(sel.rows, sel.rows.sort().values)
        assert torch.equal(sel.values, before[sel.rows])  # the NS input is the accumulated rows
        l1 = before.abs().sum(1)
        assert l1[sel.rows].min() >= l1[[r for r in range(shape[0]) if r not in set(sel.rows.tolist())]].max() \
            if k < shape[0] else True
        others = torch.ones(shape[0], dtype=torch.bool)
        others[sel.rows] = False
        assert torch.equal(m[others], before[others])  # unselected rows keep accumulating
        torch.testing.assert_close(m[sel.rows], mu * before[sel.rows], rtol=0, atol=0)
        applied[sel.rows] += (1 - mu) * sel.values
    torch.testing.assert_close(m + applied, sum(grads), rtol=1e-13, atol=1e-13)


def test_selection_is_per_split_piece():
    # QKV with 4 heads / 2 groups, head_dim 2: q has 8 rows, k and v 4 each; per head: 2 rows each
    rule = SplitRule("qkv", num_attention_heads=4, num_query_groups=2, head_dim=2)
    rows = piece_rows(rule, 16)
    assert [tuple(r.shape) for r in rows] == [(8,), (4,), (4,)]
    assert sorted(torch.cat(rows).tolist()) == list(range(16))
    m = torch.zeros(16, 6, dtype=F64)
    sels = select_rows_(m, torch.randn(16, 6, dtype=F64), rows, rule="dion3", beta=0.9, fraction=0.25)
    for r, s in zip(rows, sels):
        assert s.rows.numel() == selected_row_count(r.numel(), 0.25)
        assert set(s.rows.tolist()) <= set(r.tolist())
    heads = SplitRule("qkv", per_head=True, num_attention_heads=4, num_query_groups=2, head_dim=2)
    per_head_rows = piece_rows(heads, 16)
    sels = select_rows_(torch.zeros(16, 6, dtype=F64), torch.randn(16, 6, dtype=F64), per_head_rows,
                        rule="dion3", beta=0.9, fraction=0.5)
    assert [tuple(s.rows.shape) for s in sels] == [(4, 1), (2, 1), (2, 1)]  # one row of every head


def test_normalization_keeps_the_frobenius_norm_and_equalizes_rows():
    o = torch.randn(3, 8, 12, dtype=F64) * torch.tensor([1.0, 5.0, 0.1], dtype=F64)[:, None, None]
    normalized, v = normuon_normalize(o, torch.zeros(3, 8, dtype=F64), beta2=0.0)
    torch.testing.assert_close(normalized.norm(dim=(-2, -1)), o.norm(dim=(-2, -1)))
    torch.testing.assert_close(v, (o * o).mean(-1))
    row_norms = normalized.norm(dim=-1)
    torch.testing.assert_close(row_norms, row_norms[..., :1].expand_as(row_norms), rtol=1e-6, atol=0)


@pytest.mark.parametrize("rule", ["normuon", "dion3"])
def test_zero_gradient_only_decays(rule):
    w = torch.randn(6, 10, dtype=F64)
    expect = w * (1 - 0.1 * 0.5)
    m, v = torch.zeros_like(w), torch.zeros(6, dtype=F64)
    row_step_(w, torch.zeros_like(w), m, v, rule=rule, lr=0.1, beta=0.9, weight_decay=0.5, fraction=0.5,
              orthogonalize_fn=ns64)
    assert torch.equal(w, expect) and not v.any()


def test_fraction_lr_and_tall_selection():
    # a tall 48x16 matrix at f=1/4 orthogonalizes a 12x16 (wide) block: its rows are orthonormal
    # up to NS's band; 'inverse_sqrt' doubles the step at f=1/4
    g = _grads((48, 16), 1, seed=5)[0]
    sel = select_rows_(torch.zeros(48, 16, dtype=F64), g, piece_rows(None, 48), rule="dion3", beta=0.9,
                       fraction=0.25)[0]
    assert sel.values.shape == (12, 16)
    steps = {}
    for mode in ("none", "inverse_sqrt"):
        w = torch.zeros(48, 16, dtype=F64)
        row_step_(w, g, torch.zeros_like(w), torch.zeros(48, dtype=F64), rule="dion3", lr=1.0, beta=0.9,
                  fraction=0.25, fraction_lr=mode, orthogonalize_fn=ns64)
        steps[mode] = w
    torch.testing.assert_close(steps["inverse_sqrt"], 2 * steps["none"])
    assert int((steps["none"].abs().sum(1) > 0).sum()) == 12


def test_bad_rule_inputs_raise():
    m = torch.zeros(4, 4)
    with pytest.raises(ValueError, match="fraction must be in"):
        selected_row_count(4, 0.0)
    with pytest.raises(ValueError, match="fraction must be in"):
        select_rows_(m, m, piece_rows(None, 4), rule="dion3", beta=0.9, fraction=1.5)
    with pytest.raises(ValueError, match="no Nesterov"):
        select_rows_(m, m, piece_rows(None, 4), rule="dion3", beta=0.9, nesterov=True)
    with pytest.raises(ValueError, match="unknown row update rule"):
        select_rows_(m, m, piece_rows(None, 4), rule="adam", beta=0.9)
