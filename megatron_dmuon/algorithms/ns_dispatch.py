"""``orthogonalize(x, method=...)``: one entry point over the Newton–Schulz variants.

Kept apart from both variants so the dependency runs one way: ``gram_newton_schulz`` builds on
``newton_schulz`` (shared validation, starting iterate, fallback), and only this module knows both.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .gram_newton_schulz import gram_newton_schulz
from .newton_schulz import newton_schulz

__all__ = ["orthogonalize", "method_compute_dtype", "ORTHOGONALIZE_METHODS"]

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


def method_compute_dtype(method: str, precision: torch.dtype) -> torch.dtype:
    """The dtype ``method`` runs an NS of requested ``precision`` in (what an optimizer passes as
    ``compute_dtype``): the precision itself, except that Gram NS runs a bfloat16 request in float16.
    bf16's 8-bit mantissa rounds ``R = X Xᵀ`` so coarsely that its near-zero eigenvalues turn
    negative, and the Gram recurrence multiplies those by about ``a²`` per step: on real momenta
    bf16 Gram NS without a restart returned singular values of 41-185 (fp16: 1.01-1.46 without a
    restart, 1.013 with one; docs/quality.md). fp16 runs at bf16's speed, and the unit-normalised
    Gram iterates stay far inside its range."""
    if method == "gram" and precision == torch.bfloat16:
        return torch.float16
    return precision
