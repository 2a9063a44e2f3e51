"""FLOP counts of one matrix's Newton–Schulz orthogonalization (for the planner's cost model).

Units: FLOPs with one multiply-add = 2 FLOPs (an ``m×k @ k×n`` GEMM costs ``2mkn``), the
convention of ``torch.utils.flop_counter``. Only matrix products are counted; the elementwise
work (normalisation, scaling, symmetrising, identity adds) is O(mn) and ignored. For a stack
of B matrices multiply by B.

Notation: ``m = min(rows, cols)`` (the iteration runs on the wide orientation), ``α =
max(rows, cols)/m``, T steps, r restarts.

* standard NS, full GEMMs:        ``2T(2α+1) m³``    (per step: X Xᵀ, A², B X)
* standard NS, symmetric outputs:  ``T(3α+1) m³``     (X Xᵀ and A² at half cost, SYRK-style)
* Gram NS, full GEMMs:             ``[8T − 6(r+1)] m³ + 4(r+1)·α m³``
* Gram NS, symmetric outputs:      ``[4T − 3(r+1)] m³ + 3(r+1)·α m³``;
  with one restart this is the ``(4T + 6α − 6) m³`` of Dao-AILab/gram-newton-schulz's count.

Gram term by term (per segment of L steps between restarts): ``R²`` every step, ``Q Z'`` on all
but the segment's first step, the two ``R`` update products on all but its last step; plus
``R₀ = X Xᵀ``, one ``Q X`` per segment and one ``X Xᵀ`` per restart. Every product whose
result is mathematically symmetric (all m×m ones and ``X Xᵀ``) counts half when
``symmetric=True``; ``Q X`` never does.

With ``symmetric=False`` these equal what ``torch.utils.flop_counter.FlopCounterMode``
measures for ``newton_schulz`` / ``gram_newton_schulz`` (tested).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, get_args

from .gram_newton_schulz import GRAM_MIN_ASPECT_RATIO, default_restarts, gram_applies, restart_points

__all__ = ["newton_schulz_flops", "ns_method_for", "FLOP_METHODS", "NS_METHODS"]

FLOP_METHODS: tuple[str, ...] = ("standard", "gram")
NSMethod = Literal["standard", "gram", "auto"]  # what a caller may ask for ('auto': ns_method_for decides)
NS_METHODS: tuple[str, ...] = get_args(NSMethod)


def _check_dim(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def newton_schulz_flops(
    rows: int,
    cols: int,
    steps: int,
    method: str = "standard",
    symmetric: bool = False,
    restarts: int | None = None,
    *,
    restart_after: Iterable[int] | None = None,
    min_aspect_ratio: float = GRAM_MIN_ASPECT_RATIO,
) -> float:
    """FLOPs (multiply-add = 2) of orthogonalizing one ``rows × cols`` matrix.

    Args:
        method: ``'standard'`` or ``'gram'``.
        symmetric: count products with symmetric results at half cost (SYRK/symmetric kernels).
        restarts: number of Gram restarts performed. ``None`` (default) = what
            ``gram_newton_schulz``'s default ``restart_after=(2,)`` does: 1 when
            ``steps >= 3``, else 0. Clamped to ``steps − 1``.
        restart_after: alternatively the restart positions, as passed to
            ``gram_newton_schulz`` (overrides ``restarts``).
        min_aspect_ratio: as in ``gram_newton_schulz``: a ``'gram'`` request for a matrix with
            ``max/min < min_aspect_ratio`` is counted as standard NS, because that is what runs.
            Pass 1.0 to count the Gram algorithm regardless.
    """
    _check_dim("rows", rows)
    _check_dim("cols", cols)
    _check_dim("steps", steps)
    if method not in FLOP_METHODS:
        raise ValueError(f"unknown method {method!r}; valid: {', '.join(FLOP_METHODS)}")
    m, n = min(rows, cols), max(rows, cols)
    half = 0.5 if symmetric else 1.0
    square = 2 * m * m * m  # one m×m @ m×m product (integers: exact for any real shape)
    wide = 2 * m * m * n  # one m×m @ m×n product, or X Xᵀ

    if method == "gram" and not gram_applies(m, n, min_aspect_ratio):
        method = "standard"
    if method == "standard":
        return float(steps * (half * wide + half * square + wide))  # X Xᵀ, A², B X

    if restart_after is not None:
        r = len(restart_points(restart_after, steps))
    elif restarts is None:
        r = 1 if steps >= 3 else 0
    else:
        if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 0:
            raise ValueError(f"restarts must be an int >= 0, got {restarts!r}")
        r = min(restarts, steps - 1)
    segments = r + 1
    square_products = 4 * steps - 3 * segments  # R² each step, Q Z', two R-update products
    wide_symmetric = 1 + r  # R₀ and one X Xᵀ per restart
    wide_full = segments  # one Q X per segment
    return float(half * square_products * square + (half * wide_symmetric + wide_full) * wide)


def ns_method_for(rows: int, cols: int, steps: int = 5, ns_method: str = "auto",
                  restart_after: Iterable[int] | None = None, min_aspect_ratio: float = GRAM_MIN_ASPECT_RATIO,
                  normalisation: str = "frobenius", measured: str | None = None) -> str:
    """The NS variant that runs on one ``rows x cols`` matrix: 'gram' or 'standard'. The one
    place a request is resolved, for the run (``planning.ns_choice.NSResolver``, the kernels'
    own ``method='auto'``) and for every NS cost of the planner alike.

    ``'standard'``: standard. ``'gram'``: Gram where it applies (``gram_applies``; below
    ``min_aspect_ratio`` Gram NS runs standard NS). ``'auto'``: ``measured`` (the autotune cache's
    choice for this stack on this GPU) where there is one, else Gram when it needs fewer FLOPs than
    standard NS on symmetric kernels, with its restarts at ``restart_after`` (None:
    ``default_restarts(normalisation)``), else standard."""
    if ns_method not in NS_METHODS:
        raise ValueError(f"ns_method must be one of {', '.join(NS_METHODS)}; got {ns_method!r}")
    if ns_method == "standard":
        return "standard"
    if ns_method == "gram":
        return "gram" if gram_applies(rows, cols, min_aspect_ratio) else "standard"
    if measured is not None:
        if measured not in ("gram", "standard"):
            raise ValueError(f"a measured NS choice is 'gram' or 'standard', got {measured!r}")
        return measured
    if restart_after is None:
        restart_after = default_restarts(normalisation)
    gram = newton_schulz_flops(rows, cols, steps, "gram", symmetric=True, restart_after=restart_after,
                               min_aspect_ratio=min_aspect_ratio)
    return "gram" if gram < newton_schulz_flops(rows, cols, steps, "standard", symmetric=True) else "standard"
