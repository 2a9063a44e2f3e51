"""``orthogonalize(x, method=...)``: one entry point over the Newton–Schulz variants.

Kept apart from both variants so the dependency runs one way: ``gram_newton_schulz`` builds on
``newton_schulz`` (shared validation, starting iterate, fallback), and only this module knows both.
"""

from __future__ import annotations

from torch import Tensor

from .gram_newton_schulz import gram_newton_schulz
from .newton_schulz import newton_schulz

__all__ = ["orthogonalize", "ORTHOGONALIZE_METHODS"]

ORTHOGONALIZE_METHODS: tuple[str, ...] = ("standard", "gram")


def orthogonalize(x: Tensor, method: str = "standard", **kwargs) -> Tensor:
    """Dispatch to ``newton_schulz`` (``'standard'``) or ``gram_newton_schulz`` (``'gram'``).

    ``kwargs`` go to the chosen function (each keeps its own ``compute_dtype`` default:
    bf16 for standard, fp16 for Gram).
    """
    if method == "standard":
        return newton_schulz(x, **kwargs)
    if method == "gram":
        return gram_newton_schulz(x, **kwargs)
    raise ValueError(
        f"unknown orthogonalization method {method!r}; valid: {', '.join(ORTHOGONALIZE_METHODS)}"
    )
