"""Gram Newton–Schulz: the same polynomial iteration, run in the small m×m Gram space.

For a wide ``X`` (m ≤ n) every NS iterate is ``X_t = Q_t X_0`` with ``Q_t`` a polynomial in
``R_0 = X_0 X_0ᵀ``. Writing step t as ``X <- Z X`` with ``Z = a I + Z'``, ``Z' = b R + c R²``
and ``R = X Xᵀ``, the iteration only needs m×m products:

* ``Z' = b R + c R²``                          (1 GEMM; the ``a I`` term is kept implicit)
* ``Q <- a Q + Q Z'``                          (1 GEMM; ``Q = a I + Z'`` on a segment's 1st step)
* ``R <- Z R Z`` as ``RZ = a R + R Z'``, ``R = a RZ + Z' RZ``  (2 GEMMs; ``Z'`` commutes with ``R``),
  then symmetrised, and skipped on the last step of a segment (R is not needed afterwards).

After the iterations listed in ``restart_after`` (1-based) the iterate is rebuilt from
scratch — ``X <- Q X``, ``R <- X Xᵀ``, ``Q <- I`` — which removes the spurious negative
eigenvalues that half-precision ``R`` accumulates. The result is ``Q X``.

The m×n products are only ``R_0``, one ``Q X`` per segment and one ``X Xᵀ`` per restart, so
for aspect ratio ``α = n/m`` well above 1 this costs far less than standard NS (see
``flops.py``). When ``max(m,n)/min(m,n) < min_aspect_ratio`` the function falls back to
``newton_schulz`` with the same schedule and compute dtype (square matrices gain nothing).

Its measured agreement with standard NS per dtype (bench/ns.py accuracy) and the bounds the tests
assert: docs/algorithms.md, "Error metrics and bounds".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from .coefficients import CoefficientSpec, get_coefficients
from .newton_schulz import (
    NS_EPS,
    as_stack,
    newton_schulz,
    normalised_wide,
    quartic_rescale,
    validate_compute_dtype,
    validate_eps,
    validate_matrix_input,
    validate_normalisation,
)

__all__ = ["gram_newton_schulz", "gram_newton_schulz_sharded", "gram_segments", "gram_space_polynomial",
           "default_restarts", "restart_points", "GRAM_MIN_ASPECT_RATIO", "gram_applies", "validate_min_aspect_ratio"]

GRAM_MIN_ASPECT_RATIO = 2.0  # below this max(m,n)/min(m,n), Gram NS runs standard NS (square matrices gain nothing)


def gram_applies(rows: int, cols: int, min_aspect_ratio: float = GRAM_MIN_ASPECT_RATIO) -> bool:
    """Whether a Gram NS request on a ``rows x cols`` matrix runs the Gram iteration: aspect ratio
    ``max/min >= min_aspect_ratio`` (else ``gram_newton_schulz`` and the kernels run standard NS)."""
    return max(rows, cols) / min(rows, cols) >= min_aspect_ratio


def validate_min_aspect_ratio(min_aspect_ratio: float) -> None:
    if not (float(min_aspect_ratio) >= 1.0):
        raise ValueError(f"min_aspect_ratio must be >= 1.0, got {min_aspect_ratio!r}")


def default_restarts(normalisation: str) -> tuple[int, ...]:
    """Where the Gram iterate is rebuilt when the caller does not say: after step 2, for every
    normalisation. The first steps (a ≈ 8, then 4) multiply half-precision rounding in ``R``'s
    near-zero eigenvalues by a² per step. The quartic schedules once ran without a restart (fine on
    Gaussian test matrices: error ≤ 0.022); on real momenta, low-rank with a heavy tail, fp16 Gram NS
    without it returned largest singular values of 1.16-1.46 where exact arithmetic gives 1.013, and
    training with it diverged (docs/quality.md, bench/momentum_spectra.py). The restart costs one
    more ``Q X`` and ``X Xᵀ``."""
    validate_normalisation(normalisation)
    return (2,)


def restart_points(restart_after: Iterable[int], steps: int) -> frozenset[int]:
    """The restarts that actually happen: positions ``1 <= p < steps`` (a restart after the
    last step would be a no-op). Raises ValueError for non-int or < 1 positions."""
    points = set()
    for p in restart_after:
        if isinstance(p, bool) or not isinstance(p, int) or p < 1:
            raise ValueError(
                f"restart_after must hold ints >= 1 (1-based iteration numbers), got {p!r}"
            )
        if p < steps:
            points.add(p)
    return frozenset(points)


def gram_segments(schedule, restarts: frozenset[int]) -> list[list[tuple[float, float, float]]]:
    """The schedule cut into segments: a segment ends after each restart position."""
    segments, current = [], []
    for t, abc in enumerate(schedule, start=1):
        current.append(tuple(abc))
        if t in restarts:
            segments.append(current)
            current = []
    if current:
        segments.append(current)
    return segments


def gram_space_polynomial(R: Tensor, segment, normalise: bool = False) -> Tensor:
    """``Q`` of one segment (``X <- Q X``) from ``R = X Xᵀ`` alone: m×m work only.

    Each step: ``Z' = b R + c R²``, ``Q <- a Q + Q Z'`` (``Q = a I + Z'`` first), and except on
    the segment's last step ``R <- Z R Z`` (symmetrised). ``R`` is a [B, m, m] stack.
    ``normalise``: ``X`` is only Frobenius-normalised; the quartic bound (``quartic_rescale``)
    rescales ``R`` first and is folded into the returned ``Q`` (so ``Q X`` is that of ``γ X``)."""
    gamma = square = None
    if normalise:
        R, square, gamma = quartic_rescale(R)
    Q = None  # None stands for the identity at the start of a segment
    for i, (a, b, c) in enumerate(segment):
        if square is not None:  # R² is already there from the rescale
            Z_rest, square = R * b + square * c, None
        else:
            Z_rest = torch.baddbmm(R, R, R, beta=b, alpha=c)  # Z' = b R + c R^2
        if i < len(segment) - 1:
            RZ = torch.baddbmm(R, R, Z_rest, beta=a)  # R Z = a R + R Z'
            R = torch.baddbmm(RZ, Z_rest, RZ, beta=a)  # Z R Z = a RZ + Z' RZ
            R = (R + R.mT).mul_(0.5)  # rounding breaks symmetry; keep R symmetric
        if Q is None:
            Q = _add_identity_(Z_rest, a)  # Q = a I + Z' (Z_rest is not needed any more)
        else:
            Q = torch.baddbmm(Q, Q, Z_rest, beta=a)  # Q Z = a Q + Q Z'
    return Q if gamma is None else Q * gamma


def gram_newton_schulz_sharded(
    x: Tensor,
    sum_over_shards: Callable[[Tensor], Tensor],
    gram_to_q: Callable[[Tensor, list], Tensor],
    coefficients: CoefficientSpec = "keller",
    steps: int = 5,
    compute_dtype: torch.dtype = torch.float16,
    eps: float = NS_EPS,
    safety: float = 1.01,
    restart_after: Iterable[int] | None = None,
    normalisation: str = "frobenius",
    max_over_shards: Callable[[Tensor], Tensor] | None = None,
    gram: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """Gram NS of a wide matrix ``W = [x_0 x_1 ... x_{t-1}]`` whose column blocks live on t ranks:
    this rank passes its block ``x`` ([B, m, n_i] or [m, n_i]; m <= the full n) and gets back
    its block of the result. Only m×m Gram matrices (and one norm) cross ranks:

    * ``sum_over_shards(t)``: the sum of ``t`` over all ranks (an all-reduce; for the norm);
    * ``max_over_shards(t)`` (optional): the max of ``t`` over all ranks. With it the norm is the
      scaled one (``M = max |x|`` over all shards, then the sum of ``(x / M)²`` in float32: right
      at every scale, two [B] all-reduces); without it the squares are summed in float64;
    * ``gram_to_q(partial_R, segment, normalise)``: from this rank's ``x_i x_iᵀ``, the segment's
      ``Q`` on every rank (e.g. reduce to one owner, ``gram_space_polynomial(R, segment,
      normalise)`` there, broadcast ``Q``); ``normalise`` is true for the first segment under the
      quartic normalisation (the full ``R`` is needed for it, so it runs where ``Q`` is made);
    * ``gram(X)`` (optional): this rank's ``X Xᵀ`` (e.g. a symmetric kernel; default ``X @ X.mT``).

    With one shard and local callbacks this is ``gram_newton_schulz`` (same op order for the
    m×m part; the norm is taken as sqrt(sum of squares))."""
    validate_compute_dtype(compute_dtype)
    validate_eps(eps)
    quartic = validate_normalisation(normalisation)
    schedule = get_coefficients(coefficients, steps, safety)
    if restart_after is None:
        restart_after = default_restarts(normalisation)
    segments = gram_segments(schedule, restart_points(restart_after, steps))
    stack = x if x.ndim == 3 else x.unsqueeze(0)
    stage_dtype = torch.float32 if compute_dtype == torch.float16 else compute_dtype
    X = stack.to(stage_dtype)
    if max_over_shards is None:
        # the sum of squares in float64 (one [B, 1, 1] all-reduce): exact at every scale, as frobenius_norm
        squares = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True, dtype=torch.float64).square()
        norm = sum_over_shards(squares).sqrt().clamp(min=eps).to(X.dtype)
    else:
        norm = _scaled_sharded_norm(X, sum_over_shards, max_over_shards).clamp(min=eps).to(X.dtype)
    X = (X / norm).to(compute_dtype)
    for i, segment in enumerate(segments):
        X = gram_to_q(gram(X) if gram is not None else X @ X.mT, segment, quartic and i == 0) @ X
    return X.reshape(x.shape).to(x.dtype)


def _scaled_sharded_norm(X: Tensor, sum_over_shards, max_over_shards) -> Tensor:
    """‖W‖_F ([B, 1, 1], float32) of the matrices whose column blocks the shards hold: the global
    max |x| first, then each shard's sum of (x / max)² (<= its numel: no overflow; what underflows
    is below 2^-126 of the largest entry squared), summed; finite entries at every scale."""
    top = max_over_shards(X.abs().amax(dim=(-2, -1), keepdim=True).float().contiguous())
    inv = torch.where(top > 0, top.reciprocal(), torch.zeros_like(top))
    scaled = sum_over_shards(torch.linalg.vector_norm(X.float() * inv, dim=(-2, -1), keepdim=True).square())
    return top * scaled.sqrt()


def _add_identity_(m: Tensor, alpha: float) -> Tensor:
    m.diagonal(dim1=-2, dim2=-1).add_(alpha)
    return m


def gram_newton_schulz(
    x: Tensor,
    coefficients: CoefficientSpec = "keller",
    steps: int = 5,
    compute_dtype: torch.dtype = torch.float16,
    eps: float = NS_EPS,
    safety: float = 1.01,
    restart_after: Iterable[int] | None = None,
    min_aspect_ratio: float = GRAM_MIN_ASPECT_RATIO,
    check_finite: bool = True,
    normalisation: str = "frobenius",
) -> Tensor:
    """Gram-space NS; same contract as ``newton_schulz`` (shape/dtype kept, zeros → zeros).

    Args:
        restart_after: 1-based iterations after which ``X, R, Q`` are rebuilt (default
            ``default_restarts(normalisation)``: after iteration 2). Positions ``>= steps`` are
            ignored.
        min_aspect_ratio: below this ``max(m,n)/min(m,n)`` use standard NS instead (must be >= 1;
            pass 1.0 to force the Gram path, e.g. in tests).
        Other arguments as in ``newton_schulz`` (note fp16 default: fp16 beats bf16 here).
    """
    validate_matrix_input(x, check_finite)
    validate_compute_dtype(compute_dtype)
    validate_eps(eps)
    quartic = validate_normalisation(normalisation)
    schedule = get_coefficients(coefficients, steps, safety)
    restarts = restart_points(default_restarts(normalisation) if restart_after is None else restart_after, steps)
    validate_min_aspect_ratio(min_aspect_ratio)
    if x.numel() == 0:
        return torch.zeros_like(x)

    if not gram_applies(x.size(-2), x.size(-1), min_aspect_ratio):
        return newton_schulz(
            x, schedule, steps=steps, compute_dtype=compute_dtype, eps=eps, check_finite=False,
            normalisation=normalisation,
        )

    stack = as_stack(x)
    X, transposed = normalised_wide(stack if stack.ndim == 3 else stack.unsqueeze(0), compute_dtype, eps)
    segments = gram_segments(schedule, restarts)
    R = X @ X.mT
    for i, segment in enumerate(segments):
        X = gram_space_polynomial(R, segment, quartic and i == 0) @ X
        if i < len(segments) - 1:  # restart: rebuild R from the iterate
            R = X @ X.mT
    if transposed:
        X = X.mT
    return X.reshape(x.shape).to(x.dtype)
