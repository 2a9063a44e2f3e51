"""Newton–Schulz polynomial coefficient schedules.

Every NS step applies the odd quintic ``p(x) = a x + b x^3 + c x^5`` to the singular values
of the (normalised) matrix. A *schedule* is the list of ``(a, b, c)`` used at steps 1..T.

Named schedules (``COEFFICIENT_SETS``):

``'keller'``
    Keller Jordan's quintic (3.4445, -4.7750, 2.0315), the same at every step. It does not
    converge to 1: singular values end in roughly [0.7, 1.2]. Used by torch.optim.Muon.
``'polar_express'``
    The five per-step minimax polynomials of Polar Express (arXiv 2505.16932). A safety
    factor ``s`` is applied as ``(a/s, b/s^3, c/s^5)`` to every set except the fifth (the last
    one of the published list), which keeps singular values safely below the region where
    the next polynomial would overshoot under rounding. For ``steps < 5`` the first ``steps``
    sets are used (with their safety factor); for ``steps > 5`` the fifth set (no safety
    factor) repeats.
``'you'``
    The 5-step per-step set from modded-nanogpt (You Jiacheng). ``steps < 5`` uses the first
    ``steps`` sets, ``steps > 5`` repeats the fifth.

An explicit schedule is accepted too: a single ``(a, b, c)`` (repeated ``steps`` times, as
torch.optim.Muon's ``ns_coefficients``) or a list of tuples (shorter than ``steps``: the last
one repeats; longer: error).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, get_args

Coefficients = tuple[float, float, float]

KELLER: Coefficients = (3.4445, -4.7750, 2.0315)

POLAR_EXPRESS: tuple[Coefficients, ...] = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
)

YOU: tuple[Coefficients, ...] = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)

CoefficientSet = Literal["keller", "polar_express", "you"]
COEFFICIENT_SETS: tuple[str, ...] = get_args(CoefficientSet)

CoefficientSpec = str | Coefficients | Sequence[Coefficients]


def _check_steps(steps: int) -> None:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")


def _as_triple(item, where: str) -> Coefficients:
    try:
        triple = tuple(float(v) for v in item)
    except TypeError as exc:
        raise ValueError(f"{where} must be a tuple (a, b, c) of 3 numbers, got {item!r}") from exc
    if len(triple) != 3:
        raise ValueError(f"{where} must have exactly 3 numbers (a, b, c), got {len(triple)}: {item!r}")
    if not all(math.isfinite(v) for v in triple):
        raise ValueError(f"{where} must be finite numbers, got {item!r}")
    return triple  # type: ignore[return-value]


def _extend(base: Sequence[Coefficients], steps: int) -> list[Coefficients]:
    """First ``steps`` entries of ``base``, then its last entry repeated."""
    head = list(base[:steps])
    return head + [base[-1]] * (steps - len(head))


def get_coefficients(name: CoefficientSpec, steps: int, safety: float = 1.01) -> list[Coefficients]:
    """Return the ``steps`` per-step ``(a, b, c)`` of a schedule.

    Args:
        name: one of ``COEFFICIENT_SETS``, a single ``(a, b, c)`` or a list of them.
        steps: number of NS iterations (>= 1).
        safety: Polar Express safety factor ``s >= 1`` (ignored by the other sets).

    Raises:
        ValueError: unknown name (the message lists the valid names), malformed tuples,
            ``steps < 1``, ``safety < 1``, or an explicit list longer than ``steps``.
    """
    _check_steps(steps)
    if isinstance(name, str):
        if name == "keller":
            return [KELLER] * steps
        if name == "polar_express":
            s = float(safety)
            if not math.isfinite(s) or s < 1.0:
                raise ValueError(f"safety must be a finite float >= 1.0, got {safety!r}")
            damped = [(a / s, b / s**3, c / s**5) for a, b, c in POLAR_EXPRESS[:-1]]
            return _extend(damped + [POLAR_EXPRESS[-1]], steps)
        if name == "you":
            return _extend(YOU, steps)
        raise ValueError(
            f"unknown Newton-Schulz coefficient set {name!r}; valid names: "
            f"{', '.join(COEFFICIENT_SETS)} (or pass (a, b, c) tuples)"
        )
    items = list(name)
    if len(items) == 3 and all(isinstance(v, (int, float)) for v in items):
        return [_as_triple(items, "coefficients")] * steps
    if not items:
        raise ValueError("coefficients list is empty; pass a set name or (a, b, c) tuples")
    if len(items) > steps:
        raise ValueError(
            f"coefficients list has {len(items)} entries but steps={steps}; "
            f"pass steps={len(items)} or a shorter list"
        )
    triples = [_as_triple(item, f"coefficients[{i}]") for i, item in enumerate(items)]
    return _extend(triples, steps)
