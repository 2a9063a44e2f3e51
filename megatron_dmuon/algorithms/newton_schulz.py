"""Standard Newton–Schulz orthogonalization (the Muon "zeroth power") and its exact oracles.

``newton_schulz(x)`` approximates the polar factor ``msgn(x) = U V^T`` of ``x = U S V^T``.
Each step maps ``X <- a X + (b A + c A^2) X`` with ``A = X X^T``, i.e. applies the odd quintic
``p(s) = a s + b s^3 + c s^5`` to every singular value. The input is first scaled by its
Frobenius norm (``frobenius_norm``: exact at every scale the dtype holds; clamped below by
``eps``, default 1e-30, so only a zero matrix meets it) so all singular values lie in ``(0, 1]``.
Orthogonalization is scale-invariant, and so is the result: gradients of entries ~1e20 or ~1e-20
get the same update as those of entries ~1 (torch.optim.Muon's fp32 norm gives both a zero update).

For a 2-D input the operation sequence is that of ``torch.optim.Muon``'s
``_zeropower_via_newtonschulz`` (torch 2.13): cast to ``compute_dtype``, transpose tall
matrices to wide, ``X / X.norm().clamp(min=eps)`` (wherever that norm is finite and above 1e-10),
then per step ``A = X @ X.T``,
``B = addmm(A, A, A, beta=b, alpha=c)``, ``X = addmm(X, B, X, beta=a)``. With the default
``'keller'`` set and bf16 the result is bitwise that of torch.optim.Muon. Stacks
``[..., rows, cols]`` run as ONE batched call (``bmm``/``baddbmm``) over the flattened
leading dims.

Documented results for special inputs: a zero matrix (or a zero slice of a stack) gives zeros
(the norm is clamped to ``eps``, so ``0 / eps = 0`` and every step keeps 0); an empty matrix
gives an empty result. With ``compute_dtype=torch.float16`` the normalisation is done in
float32 before the cast (fp16's range would overflow ``‖X‖_F`` of real gradients).

Convergence caveat: NS does not move singular values that start far below 1; a singular value
``s`` of ``x`` enters as ``s/‖x‖_F`` and grows only by about ``a`` per step while small. So
errors are reported with three metrics (``megatron_dmuon.algorithms.ns_metrics``):

* ``fro``   ``‖NS(x) − UVᵀ‖_F / ‖UVᵀ‖_F`` over the whole matrix (includes unconverged values),
* ``wc``    well-conditioned part: ``‖U_kᵀ NS(x) V_k − I_k‖_2`` over the singular pairs with
  ``s_i ≥ 0.01·‖x‖_F`` (all named sets lift these into their final band in 5 steps); its
  exact-arithmetic value is the schedule's ``band``,
* ``round`` rounding error ``‖NS(x) − NS_exact(x)‖_F / ‖NS_exact(x)‖_F`` against the same
  polynomials applied to the exact singular values in float64 (``newton_schulz_reference``).

Measured accuracy of every coefficient set per dtype (bench/ns.py accuracy) and the bounds the tests
assert (``ns_metrics.DOCUMENTED_BOUNDS``): docs/algorithms.md, "Error metrics and bounds".
"""

from __future__ import annotations

import torch
from torch import Tensor

from .coefficients import CoefficientSpec, get_coefficients

__all__ = [
    "NORMALISATIONS",
    "newton_schulz",
    "quartic_rescale",
    "msgn_svd",
    "newton_schulz_reference",
]


def validate_matrix_input(x: Tensor, check_finite: bool, name: str = "x") -> None:
    """Raise a clear error for inputs NS cannot orthogonalize (shared by both NS variants)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim < 2:
        raise ValueError(
            f"{name} must be a matrix or a stack of matrices [..., rows, cols]; got shape "
            f"{tuple(x.shape)} (ndim={x.ndim}). Reshape vectors/scalars or optimise them with AdamW."
        )
    if not x.is_floating_point():
        raise TypeError(f"{name} must have a floating dtype, got {x.dtype}; cast it with .float()")
    if check_finite and x.numel() > 0 and not bool(torch.isfinite(x).all()):
        raise ValueError(
            f"{name} (shape {tuple(x.shape)}) contains NaN or Inf; NS would spread it over the "
            "whole matrix. Fix the gradient (or pass check_finite=False to skip this check)."
        )


def validate_compute_dtype(compute_dtype: torch.dtype) -> None:
    if not isinstance(compute_dtype, torch.dtype) or not compute_dtype.is_floating_point:
        raise TypeError(
            f"compute_dtype must be a floating torch.dtype (e.g. torch.bfloat16), got {compute_dtype!r}"
        )


def validate_eps(eps: float) -> None:
    if not (float(eps) > 0.0):
        raise ValueError(f"eps must be > 0, got {eps!r}")


NS_EPS = 1e-30  # only an all-zero matrix meets it: frobenius_norm is exact at every scale
PLAIN_NORM_MIN = 1e-10  # above this a norm in the tensor's own dtype lost nothing to underflow


def frobenius_norm(X: Tensor) -> Tensor:
    """‖X‖_F of a matrix (a 0-d tensor), or of each matrix of a [B, m, n] stack ([B, 1, 1]), at
    every scale X's dtype holds. Where the norm in X's dtype is finite and not tiny it is used as
    is (torch.optim.Muon's, bit for bit); elsewhere the one accumulated in float64, whose squares
    neither overflow nor underflow for fp32/bf16/fp16 entries (in fp32, entries ~1e20 overflow
    the plain norm to inf and ~1e-20 underflow their squares: both gave a zero update)."""
    stacked = X.ndim != 2
    plain = X.norm(dim=(-2, -1), keepdim=True) if stacked else X.norm()
    if X.dtype == torch.float64:
        return plain
    wide = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=stacked, dtype=torch.float64)
    return torch.where(torch.isfinite(plain) & (plain >= PLAIN_NORM_MIN), plain, wide.to(plain.dtype))


NORMALISATIONS: tuple[str, ...] = ("frobenius", "quartic")


def validate_normalisation(normalisation: str) -> bool:
    """Whether the quartic bound is asked for; ValueError for an unknown name."""
    if normalisation not in NORMALISATIONS:
        raise ValueError(f"normalisation must be one of {', '.join(NORMALISATIONS)}; got {normalisation!r}")
    return normalisation == "quartic"


def quartic_rescale(gram: Tensor, square=None) -> tuple[Tensor, Tensor, Tensor]:
    """Tighten the starting scale from ‖X‖_F to ``s = ‖(X Xᵀ)²‖_F^(1/4)``, given ``gram = X Xᵀ``
    of a Frobenius-normalised ``X`` ([m, m] or [B, m, m]).

    ``s ≥ σ_max(X)`` (‖R²‖_F ≥ ‖R²‖₂ = σ_max⁴), so ``X / s`` still has every singular value in
    (0, 1], but ``s`` sits far closer to σ_max than ‖X‖_F does (a Gaussian n×n matrix: σ_max/‖X‖_F
    = 2/√n = 0.033 at n = 3584, σ_max/s = 0.52), so the small singular values start ~16x higher
    and the schedule needs fewer steps. Returns ``(R, R², γ)`` of the rescaled iterate ``γ X``
    (γ = 1/s, shaped to broadcast over the stack): the first NS step's ``b R + c R²`` comes from
    them, and the caller scales ``X`` (or ``Q``) by γ.

    Overflow/underflow safety: ``gram`` of a unit-Frobenius ``X`` has entries ≤ 1; it is first
    scaled to unit Frobenius norm itself, so its square has norm in [1/√m, 1] (never subnormal in
    fp16, where ``(X Xᵀ)²`` of a flat spectrum would sit near 1e-7). Norms accumulate in float32.
    ``square`` computes ``u @ u`` of a symmetric stack (the kernels pass their symmetric product);
    a zero matrix gives zeros (γ = 0)."""
    dims = (-2, -1)
    acc = torch.float64 if gram.dtype == torch.float64 else torch.float32
    f = torch.linalg.vector_norm(gram, dim=dims, keepdim=True, dtype=acc)
    # reciprocals in float32 with 0 for a zero matrix (an eps would round to 0 in fp16: 0/0)
    unit = gram * safe_reciprocal(f).to(gram.dtype)
    squared = square(unit) if square is not None else unit @ unit
    g = torch.linalg.vector_norm(squared, dim=dims, keepdim=True, dtype=acc)
    inv_g = safe_reciprocal(g)
    gamma = safe_reciprocal(f * g.sqrt()).sqrt()  # 1/s, s² = ‖R²‖_F^(1/2) = f·√g
    return unit * inv_g.sqrt().to(gram.dtype), squared * inv_g.to(gram.dtype), gamma.to(gram.dtype)


def safe_reciprocal(t: Tensor) -> Tensor:
    return torch.where(t > 0, t.reciprocal(), torch.zeros_like(t))


def normalised_wide(x: Tensor, compute_dtype: torch.dtype, eps: float) -> tuple[Tensor, bool]:
    """Cast, transpose tall→wide and scale by the Frobenius norm: NS's starting iterate.

    ``x`` is 2-D or 3-D. The op order for 2-D inputs is torch.optim.Muon's (cast, transpose,
    divide by ``norm().clamp(min=eps)``). Returns the iterate and whether it was transposed.
    """
    # fp16 cannot hold ‖X‖_F (or even the entries) of large gradients: scale in fp32 first.
    stage_dtype = torch.float32 if compute_dtype == torch.float16 else compute_dtype
    X = x.to(stage_dtype)
    transposed = x.size(-2) > x.size(-1)
    if transposed:
        X = X.mT
    X = X / frobenius_norm(X).clamp(min=eps)
    return X.to(compute_dtype), transposed


def _addmm(bias: Tensor, m1: Tensor, m2: Tensor, beta: float, alpha: float = 1.0) -> Tensor:
    """``beta*bias + alpha*(m1 @ m2)``: addmm for matrices, baddbmm for [B, r, c] stacks."""
    if bias.ndim == 2:
        return torch.addmm(bias, m1, m2, beta=beta, alpha=alpha)
    return torch.baddbmm(bias, m1, m2, beta=beta, alpha=alpha)


def as_stack(x: Tensor) -> Tensor:
    """View any [..., r, c] input as 2-D (unchanged) or one flattened 3-D batch."""
    if x.ndim <= 3:
        return x
    return x.reshape(-1, x.size(-2), x.size(-1))


def newton_schulz(
    x: Tensor,
    coefficients: CoefficientSpec = "keller",
    steps: int = 5,
    compute_dtype: torch.dtype = torch.bfloat16,
    eps: float = NS_EPS,
    safety: float = 1.01,
    check_finite: bool = True,
    normalisation: str = "frobenius",
) -> Tensor:
    """Approximate the polar factor ``U Vᵀ`` of ``x`` (or of each matrix of a stack).

    Args:
        x: ``[rows, cols]`` or ``[..., rows, cols]`` floating tensor (never modified).
        coefficients: a name in ``COEFFICIENT_SETS`` or explicit ``(a, b, c)`` tuple(s).
        steps: number of iterations T.
        compute_dtype: dtype of the iterate and the GEMMs (bf16 = torch.optim.Muon).
        eps: lower clamp of the Frobenius norm used to scale ``x``.
        safety: Polar Express safety factor (see ``get_coefficients``).
        check_finite: raise ``ValueError`` on NaN/Inf input (one reduction + host sync).
        normalisation: ``'frobenius'`` (torch.optim.Muon's ``X / ‖X‖_F``) or ``'quartic'``: after
            that, rescale by ``‖(X Xᵀ)²‖_F^(1/4)`` inside step 1 (``quartic_rescale``; one more
            m×m product), for the schedules designed for it (``algorithms.schedules``).

    Returns:
        A tensor of ``x``'s shape and dtype. Zero matrices map to zeros.

    Raises:
        ValueError: ``x.ndim < 2``, non-finite input, bad coefficients/steps/eps.
        TypeError: non-floating ``x`` or ``compute_dtype``.
    """
    validate_matrix_input(x, check_finite)
    validate_compute_dtype(compute_dtype)
    validate_eps(eps)
    quartic = validate_normalisation(normalisation)
    schedule = get_coefficients(coefficients, steps, safety)
    if x.numel() == 0:
        return torch.zeros_like(x)

    X, transposed = normalised_wide(as_stack(x), compute_dtype, eps)
    for t, (a, b, c) in enumerate(schedule):
        gram = X @ X.mT
        if quartic and t == 0:
            gram, gram_squared, gamma = quartic_rescale(gram)
            X = X * gamma
            gram_update = gram * b + gram_squared * c
        elif c == 0.0:  # a cubic step (Emerging-Optimizers' cubic5): a X + b A X, as it computes it, no A²
            X = _addmm(X, gram, X, beta=a, alpha=b)
            continue
        else:
            gram_update = _addmm(gram, gram, gram, beta=b, alpha=c)
        X = _addmm(X, gram_update, X, beta=a)
    if transposed:
        X = X.mT
    return X.reshape(x.shape).to(x.dtype)


def _svd64(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return torch.linalg.svd(x.to(torch.float64), full_matrices=False)


def _rank_mask(S: Tensor, rows: int, cols: int) -> Tensor:
    """Singular values above the float64 numerical-rank threshold (LAPACK's usual choice)."""
    tol = max(rows, cols) * torch.finfo(torch.float64).eps * S[..., :1]
    return S > tol


def msgn_svd(x: Tensor) -> Tensor:
    """Exact polar factor ``U Vᵀ`` via float64 SVD (batched); returned in float64.

    Singular directions whose value is numerically zero (below
    ``max(rows, cols)·eps64·s_max``) are dropped, as NS maps them to 0; hence
    ``msgn_svd(0) == 0``. Meant as a test oracle, not for training.
    """
    validate_matrix_input(x, check_finite=True)
    if x.numel() == 0:
        return torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    U, S, Vh = _svd64(x)
    keep = _rank_mask(S, x.size(-2), x.size(-1)).to(torch.float64)
    return (U * keep.unsqueeze(-2)) @ Vh


def newton_schulz_reference(
    x: Tensor,
    coefficients: CoefficientSpec = "keller",
    steps: int = 5,
    eps: float = NS_EPS,
    safety: float = 1.01,
    normalisation: str = "frobenius",
) -> Tensor:
    """What NS computes in exact arithmetic: ``U p_T(...p_1(S/‖x‖_F)) Vᵀ`` in float64 (with
    ``normalisation='quartic'`` the scale is ``(Σ sᵢ⁸)^(1/8) = ‖(x xᵀ)²‖_F^(1/4)``).

    The rounding error of any NS implementation is its distance to this reference.
    """
    validate_matrix_input(x, check_finite=True)
    validate_eps(eps)
    quartic = validate_normalisation(normalisation)
    schedule = get_coefficients(coefficients, steps, safety)
    if x.numel() == 0:
        return torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    U, S, Vh = _svd64(x)
    if quartic:  # scale-free form: (Σ (s/s_max)⁸)^(1/8) s_max
        top = S[..., :1].clamp(min=eps)
        norm = (S / top).pow(8).sum(-1, keepdim=True).pow(0.125) * top
    else:
        norm = torch.linalg.matrix_norm(x.to(torch.float64)).clamp(min=eps).unsqueeze(-1)
    s = S / norm
    for a, b, c in schedule:
        s2 = s * s
        s = s * (a + s2 * (b + c * s2))
    return (U * s.unsqueeze(-2)) @ Vh

