"""Multi-extrapolated momentum for DeMuon-A: extrapolation offsets and weights.

The momentum ``M^k = μ M^{k−1} + θ G^k`` (``θ = 1 − μ``) lags behind the moving iterate: with
``G^k = ∇f(X^k)`` its per-step bias ``(1−θ)(∇f(X^{k−1}) − ∇f(X^k))`` is first order in the step
``Δ = X^k − X^{k−1}``. DeMuon-A instead evaluates gradients at ``q`` extrapolation points
``Z^{(k,s)} = X^k + c_s Δ`` and feeds ``G^k = Σ_s a_s ∇f(Z^{(k,s)})``. The per-step bias
``B(Δ) = (1−θ)[∇f(X−Δ) − ∇f(X)] + θ[Σ_s a_s ∇f(X + c_s Δ) − ∇f(X)]`` expands, with
``D_r = ∇^{r+1}f(X)[Δ,…,Δ]``, as ``B = θ Σ_{r≥0} (D_r / r!) (Σ_s a_s c_s^r − m_r)`` where
``m_r = (1+β) δ_{r0} − β (−1)^r`` and ``β = (1−θ)/θ = μ/θ``: the moments of the signed measure
``(1+β)δ_0 − β δ_{−1}``. Cancelling the orders ``r = 0..q`` (order 0 keeps the estimator
unbiased at Δ = 0) leaves ``B = O(‖Δ‖^{q+1})``, the bias allowed by ``(q+1)``-th order
smoothness (p = q + 1).

That is ``q+1`` moment equations for ``q`` weights, so the offsets carry one constraint:

* For fixed distinct offsets, the weights solving orders ``0..q−1`` are the interpolatory ones,
  ``a_s = (1+β) ℓ_s(0) − β ℓ_s(−1)`` with ``ℓ_s`` the Lagrange basis on ``{c_s}`` (equivalently,
  the transposed Vandermonde system ``Σ_s a_s c_s^r = m_r``, ``r < q``). Exactness then extends to
  every polynomial of degree ≤ q iff it holds for the node polynomial ``ω(x) = Π (x − c_s)``:
  ``(1+β) ω(0) = β ω(−1)``, i.e. ``Π_s c_s / (1 + c_s) = μ``.
* With offsets ``c_s = t ρ_s`` (user ratios ``ρ_s > 0``, default ``ρ_s = s``) the left side rises
  strictly from 0 to 1 as ``t`` runs over ``(0, ∞)``, so a unique scale ``t > 0`` exists; it is
  found by bisection in float64.

``q = 1`` recovers the extrapolated momentum of Cutkosky & Mehta (2020): ``c = μ/(1−μ)``,
``a = 1``. For ``q ≥ 2`` some weights are negative (order 2 needs ``Σ a_s c_s² = −β < 0``); all
points share one minibatch so their noise is correlated and the signed combination stays tame.
The full derivation is in docs/demuon.md.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

__all__ = ["ExtrapolationScheme", "extrapolation_scheme", "target_moment"]


def target_moment(momentum: float, order: int) -> float:
    """``m_r``: what ``Σ_s a_s c_s^r`` must equal for the order-``r`` bias term to vanish."""
    beta = momentum / (1.0 - momentum)
    return (1.0 + beta if order == 0 else 0.0) - beta * (-1.0) ** order


@dataclasses.dataclass(frozen=True)
class ExtrapolationScheme:
    momentum: float  # μ (θ = 1 − μ)
    offsets: tuple[float, ...]  # c_s: Z_s = X + c_s (X − X_prev)
    weights: tuple[float, ...]  # a_s: G = Σ_s a_s ∇f(Z_s)

    @property
    def num_points(self) -> int:
        return len(self.offsets)

    def moment_residuals(self, max_order: int) -> list[float]:
        """``Σ_s a_s c_s^r − m_r`` for r = 0..max_order (zero up to order q by construction)."""
        return [
            math.fsum(a * c**r for a, c in zip(self.weights, self.offsets)) - target_moment(self.momentum, r)
            for r in range(max_order + 1)
        ]

    def noise_gain(self) -> float:
        """``Σ a_s²``: variance factor of the combined gradient if the points' noises were independent."""
        return math.fsum(a * a for a in self.weights)

    def points(self, x: torch.Tensor, x_prev: torch.Tensor) -> list[torch.Tensor]:
        step = x - x_prev
        return [x + c * step for c in self.offsets]

    def combine(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        if len(grads) != self.num_points:
            raise ValueError(f"expected {self.num_points} gradients (one per extrapolation point), got {len(grads)}")
        out = grads[0] * self.weights[0]
        for a, g in zip(self.weights[1:], grads[1:]):
            out = out + a * g
        return out


def _node_scale(momentum: float, ratios: Sequence[float]) -> float:
    """The unique t > 0 with Π_s tρ_s/(1 + tρ_s) = μ (strictly increasing in t)."""

    def excess(t: float) -> float:
        return math.fsum(math.log(t * r / (1.0 + t * r)) for r in ratios) - math.log(momentum)

    lo, hi = 1e-300, 1.0
    while excess(hi) < 0.0:
        hi *= 2.0
        if hi > 1e300:
            raise ValueError(f"no extrapolation scale found for momentum={momentum!r}")
    for _ in range(2000):
        mid = math.sqrt(lo * hi) if hi / lo > 4.0 else 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        if excess(mid) < 0.0:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def extrapolation_scheme(
    momentum: float, num_points: int, ratios: Sequence[float] | None = None
) -> ExtrapolationScheme:
    """Offsets ``c_s`` and weights ``a_s`` cancelling the momentum bias up to order ``num_points``.

    Args:
        momentum: μ in ``M ← μ M + (1−μ) G``, strictly between 0 and 1.
        num_points: q ≥ 1 extrapolation points (exploits smoothness of order p = q + 1).
        ratios: positive, distinct shape of the offsets (``c_s = t ρ_s``); default ``1, 2, …, q``.
    """
    if not (isinstance(momentum, (int, float)) and 0.0 < float(momentum) < 1.0):
        raise ValueError(
            f"momentum must lie strictly between 0 and 1 for extrapolated momentum, got {momentum!r} "
            "(with momentum 0 there is no lag to correct: use method='demuon')"
        )
    if isinstance(num_points, bool) or not isinstance(num_points, int) or num_points < 1:
        raise ValueError(f"num_points (q) must be an int ≥ 1, got {num_points!r}")
    rho = [float(r) for r in (ratios if ratios is not None else range(1, num_points + 1))]
    if len(rho) != num_points:
        raise ValueError(f"ratios has {len(rho)} entries but num_points={num_points}; give one ratio per point")
    if any(not (r > 0.0 and math.isfinite(r)) for r in rho):
        raise ValueError(f"ratios must be positive and finite, got {rho}")
    if len(set(rho)) != len(rho):
        raise ValueError(f"ratios must be distinct (equal offsets make the Vandermonde system singular), got {rho}")
    mu = float(momentum)
    beta = mu / (1.0 - mu)
    scale = _node_scale(mu, rho)
    nodes = [scale * r for r in rho]

    def lagrange(s: int, x: float) -> float:
        return math.prod((x - nodes[j]) / (nodes[s] - nodes[j]) for j in range(num_points) if j != s)

    weights = [(1.0 + beta) * lagrange(s, 0.0) - beta * lagrange(s, -1.0) for s in range(num_points)]
    return ExtrapolationScheme(momentum=mu, offsets=tuple(nodes), weights=tuple(weights))
