"""DeMuon-A's multi-extrapolated momentum: the weights cancel the momentum bias to order q."""
import math

import pytest
import torch

from megatron_dmuon.decentralized.demuon import DecentralizedConfig, FlatLayout
from megatron_dmuon.decentralized.extrapolation import extrapolation_scheme, target_moment
from megatron_dmuon.decentralized.topology import complete_graph
from megatron_dmuon.decentralized.simulator import DecentralizedSimulator

D = 6
GEN = torch.Generator().manual_seed(0)
A = 0.5 * torch.randn(9, D, dtype=torch.float64, generator=GEN)
B = torch.randn(9, dtype=torch.float64, generator=GEN)


def smooth_f(x):
    """A smooth non-polynomial objective (all derivatives nonzero)."""
    z = A @ x + B
    return torch.log(torch.cosh(z)).sum() + 0.3 * torch.sin(x).sum() + 0.1 * (x**2).sum() ** 1.5


def grad_of(f, x):
    x = x.detach().clone().requires_grad_(True)
    (g,) = torch.autograd.grad(f(x), x)
    return g


def per_step_bias(f, scheme_or_none, mu, x, delta):
    """B(Δ) = (1−θ)[∇f(X−Δ) − ∇f(X)] + θ[Σ a_s ∇f(X + c_s Δ) − ∇f(X)] (θ = 1 − μ)."""
    theta = 1 - mu
    g_x = grad_of(f, x)
    if scheme_or_none is None:  # plain momentum: G = ∇f(X)
        fresh = g_x
    else:
        fresh = sum(a * grad_of(f, x + c * delta) for a, c in zip(scheme_or_none.weights, scheme_or_none.offsets))
    return (1 - theta) * (grad_of(f, x - delta) - g_x) + theta * (fresh - g_x)


@pytest.mark.parametrize("mu", [0.5, 0.8, 0.9])
@pytest.mark.parametrize("q", [1, 2, 3, 4])
def test_moments_match_to_order_q_and_not_beyond(mu, q):
    scheme = extrapolation_scheme(mu, q)
    residuals = scheme.moment_residuals(q + 1)
    scale = max(abs(target_moment(mu, r)) for r in range(q + 2)) * max(scheme.offsets) ** q
    assert all(abs(r) < 1e-12 * scale for r in residuals[: q + 1]), residuals
    assert abs(residuals[q + 1]) > 1e-3  # order q+1 is generically not cancelled
    assert sum(scheme.weights) == pytest.approx(1.0, abs=1e-12)
    # node condition Π c/(1+c) = μ and offsets proportional to the default ratios 1..q
    assert math.prod(c / (1 + c) for c in scheme.offsets) == pytest.approx(mu, rel=1e-12)
    assert [c / scheme.offsets[0] for c in scheme.offsets] == pytest.approx(list(range(1, q + 1)), rel=1e-12)


def test_one_point_is_cutkosky_mehta_extrapolation():
    for mu in (0.3, 0.8, 0.95):
        scheme = extrapolation_scheme(mu, 1)
        assert scheme.offsets[0] == pytest.approx(mu / (1 - mu), rel=1e-12)
        assert scheme.weights == (pytest.approx(1.0, abs=1e-12),)


def test_two_points_closed_form():
    # q=2, ratios (1,2): t solves 2t² − 3βt − β = 0 (from Π c/(1+c) = μ); a_1 = (c_2 − β)/(c_2 − c_1)
    mu = 0.9
    beta = mu / (1 - mu)
    t = (3 * beta + math.sqrt(9 * beta**2 + 8 * beta)) / 4
    scheme = extrapolation_scheme(mu, 2)
    assert scheme.offsets == pytest.approx((t, 2 * t), rel=1e-12)
    assert scheme.weights[0] == pytest.approx((2 * t - beta) / t, rel=1e-12)


@pytest.mark.parametrize("q", [0, 1, 2, 3])
def test_taylor_bias_is_order_q_plus_one(q):
    """On a smooth function ‖B(εΔ)‖ ∝ ε^{q+1}: the log-log slope is q+1 (q=0: plain momentum)."""
    mu = 0.5
    scheme = extrapolation_scheme(mu, q) if q else None
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(D, dtype=torch.float64, generator=gen)
    direction = torch.randn(D, dtype=torch.float64, generator=gen)
    eps = [2e-3 * 2.0**-j for j in range(4)]
    norms = [float(per_step_bias(smooth_f, scheme, mu, x, e * direction).norm()) for e in eps]
    slopes = [math.log2(norms[i] / norms[i + 1]) for i in range(3)]
    assert all(abs(s - (q + 1)) < 0.1 for s in slopes), (q, norms, slopes)


@pytest.mark.parametrize("q", [1, 2, 3])
def test_bias_vanishes_exactly_for_polynomial_gradients_of_degree_q(q):
    """If ∇f is a polynomial of degree ≤ q its Taylor series stops at order q: B ≡ 0, any Δ."""
    mu = 0.8
    scheme = extrapolation_scheme(mu, q)
    gen = torch.Generator().manual_seed(2)
    coeff = torch.randn(D, dtype=torch.float64, generator=gen)
    M = torch.randn(D, D, dtype=torch.float64, generator=gen)

    def poly_f(x):  # degree q+1 polynomial: gradient of degree q
        return (coeff * x ** (q + 1)).sum() + 0.5 * x @ (M @ x) + (x.sum()) ** (q + 1) / 7

    x = torch.randn(D, dtype=torch.float64, generator=gen)
    delta = 0.3 * torch.randn(D, dtype=torch.float64, generator=gen)
    bias = per_step_bias(poly_f, scheme, mu, x, delta)
    scale = float(grad_of(poly_f, x + max(scheme.offsets) * delta).norm())
    assert float(bias.norm()) < 1e-12 * scale
    # one order more is not cancelled
    if q < 3:
        bias_next = per_step_bias(lambda y: poly_f(y) + (y**4).sum() * (q == 2) + (y**3).sum() * (q == 1), scheme, mu, x, delta)
        assert float(bias_next.norm()) > 1e-3


def test_demuon_a_algorithm_uses_the_points_and_weights():
    mu = 0.8
    layout = FlatLayout([("w", (3, 2))])
    cfg = DecentralizedConfig(method="demuon_a", lr=0.1, momentum=mu, extrapolation_points=2, orthogonalizer="svd")
    sim = DecentralizedSimulator(cfg, complete_graph(1), layout, torch.ones(6, dtype=torch.float64))
    scheme = sim.algorithm.extrapolation
    seen = []

    def grad_fn(pts):
        seen.append(pts.clone())
        return pts * (len(seen) + 1.0)

    sim.step(grad_fn)  # first step: X_prev = X, every point is X
    assert all(torch.equal(p, torch.ones(1, 6, dtype=torch.float64)) for p in seen)
    x1, m1 = sim.params.clone(), sim.algorithm.momentum_buf.clone()
    expected_g = scheme.weights[0] * 2.0 * seen[0] + scheme.weights[1] * 3.0 * seen[1]
    assert torch.allclose(m1, (1 - mu) * expected_g, atol=1e-14)
    seen.clear()
    sim.step(grad_fn)
    x0 = torch.ones(1, 6, dtype=torch.float64)
    for c, p in zip(scheme.offsets, seen):
        assert torch.allclose(p, x1 + c * (x1 - x0), atol=1e-14)


@pytest.mark.parametrize("q", [1, 2, 3])
def test_momentum_error_along_a_trajectory_shrinks_with_order(q):
    """Single agent, fixed msgn step η: ‖M − ∇f(X)‖ at steady state scales like η^{q+1}."""
    mu = 0.5
    gen = torch.Generator().manual_seed(4)
    target = torch.randn(4, 3, dtype=torch.float64, generator=gen)

    def f(x):
        w = x.view(4, 3)
        return torch.log(torch.cosh(w - target)).sum() + 0.2 * torch.sin(w).sum()

    def run(method, lr):
        cfg = DecentralizedConfig(method=method, lr=lr, momentum=mu, extrapolation_points=q, orthogonalizer="svd")
        sim = DecentralizedSimulator(cfg, complete_graph(1), FlatLayout([("w", (4, 3))]), torch.zeros(12, dtype=torch.float64))
        for _ in range(60):
            x_k = sim.params[0].clone()
            sim.step(lambda pts: grad_of(f, pts[0]).unsqueeze(0))
        # M^k estimates ∇f(X^k), the iterate the k-th update started from
        return float((sim.algorithm.momentum_buf[0] - grad_of(f, x_k)).norm())

    errs = {lr: run("demuon_a", lr) for lr in (2e-3, 1e-3)}
    plain = {lr: run("demuon", lr) for lr in (2e-3, 1e-3)}
    assert math.log2(errs[2e-3] / errs[1e-3]) == pytest.approx(q + 1, abs=0.25)
    assert math.log2(plain[2e-3] / plain[1e-3]) == pytest.approx(1, abs=0.1)
    assert errs[1e-3] < 0.05 * plain[1e-3]


def test_bad_extrapolation_arguments():
    with pytest.raises(ValueError, match="num_points"):
        extrapolation_scheme(0.8, 0)
    with pytest.raises(ValueError, match="one ratio per point"):
        extrapolation_scheme(0.8, 2, ratios=(1.0,))
    with pytest.raises(ValueError, match="positive"):
        extrapolation_scheme(0.8, 2, ratios=(1.0, -2.0))
