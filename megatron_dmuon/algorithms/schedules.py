"""Polar Express coefficient schedules for any step count, and the per-shape choice.

Polar Express (arXiv 2505.16932) builds its schedule greedily: singular values start in
``[lower, 1]``; each step takes the odd quintic ``p(x) = a x + b x³ + c x⁵`` closest to 1 in the
max norm on the current interval (with a *cushion*: the lower end used for the fit is at
least ``cushion · upper``), rescales it so that ``p(lower)`` and ``p(upper)`` sit symmetrically
around 1, and continues on ``[p(lower), 2 − p(lower)]``. ``design_polar_express(5)`` reproduces
the published five sets to ~4e-7 (relative) (tests check this); asking for more steps continues the same
greedy design instead of repeating the fifth set (which is what ``get_coefficients`` does).

Per-shape schedules (``schedule_for_shape``, the optimizer's ``coefficients='adaptive'``) start
from the tighter scale ``‖(X Xᵀ)²‖_F^(1/4)`` (``newton_schulz.quartic_rescale``) instead of ‖X‖_F.
That bound sits close to σ_max (0.46–0.58 of it on Gaussian matrices, ~0.99 on gradient-like
spectra with a dominant direction, against 0.024–0.06 for ‖X‖_F), so the small singular values
start an order of magnitude higher and the greedy design can aim at a narrower interval:

* wide/tall (aspect ≥ 2, the Gram NS shapes): 4 steps, ``design_polar_express(4, lower=0.01,
  cushion=0.005)``;
* nearer square: 5 steps, ``design_polar_express(5, lower=1e-3, cushion=0.005)``.

Their measured errors vs the polar factor (bench/ns.py schedules): docs/algorithms.md, "Fewer steps".
``POLAR_EXPRESS_6`` (6 steps for ‖X‖_F) stays available as explicit coefficients.
"""

from __future__ import annotations

import functools

import torch

__all__ = [
    "PUBLISHED_CUSHION",
    "POLAR_EXPRESS_6",
    "QUARTIC_SQUARE_5",
    "QUARTIC_WIDE_4",
    "spectrum_error",
    "design_polar_express",
    "schedule_for_shape",
]

# The cushion the published Polar Express schedule was designed with (found by matching it).
PUBLISHED_CUSHION = 0.02407327424182761

# design_polar_express(6): the published five sets (safety 1.01 on all but the last step)
# followed by one more greedy step; tests regenerate it.
POLAR_EXPRESS_6: tuple[tuple[float, float, float], ...] = (
    (8.205160474410976, -22.90193510348313, 16.460724966206868),
    (4.066396619424687, -2.861154912825053, 0.5183996373231555),
    (3.909595584021815, -2.8233521716918757, 0.5250370462428191),
    (3.2855636571005795, -2.4153018392901444, 0.4852940776288071),
    (2.2778731078045116, -1.61982150561106, 0.3984807383590635),
    (1.8913013660611102, -1.267995786512612, 0.37680408969701423),
)

# Designed for the quartic normalisation (module docstring); tests regenerate both.
QUARTIC_WIDE_4: tuple[tuple[float, float, float], ...] = (
    (8.013238129431333, -22.92577193437688, 16.59942752304673),
    (3.600580310187476, -2.64187587108095, 0.5105055033092896),
    (2.63495018567613, -1.9190065542311632, 0.4306489893594579),
    (1.956171569783251, -1.3375077415978989, 0.38385274318668416),
)
QUARTIC_SQUARE_5: tuple[tuple[float, float, float], ...] = (
    (8.35520280718895, -24.112181181684186, 17.50279249629136),
    (4.13877556615874, -3.0113693008876536, 0.5511216906725713),
    (3.9238221481142403, -2.8680088747797465, 0.535744549011644),
    (3.2570264980177868, -2.3944182603322983, 0.48297597438712636),
    (2.2762344202540072, -1.6469082193101259, 0.4164331671558199),
)
WIDE_ASPECT = 2.0  # from here on 4 steps keep a 30x-signal spectrum under 0.05 (0.2 at aspect 1.2)


def _quintic(coeffs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    a, b, c = coeffs.unbind()
    return x * (a + x * x * (b + c * x * x))


def _minimax_quintic(low: float, high: float, grid_points: int = 8000, iterations: int = 100) -> torch.Tensor:
    """The odd quintic with the smallest max |1 − p(x)| on [low, high] (discrete Remez exchange)."""
    grid = torch.logspace(torch.log10(torch.tensor(low)), torch.log10(torch.tensor(high)), grid_points, dtype=torch.float64)
    points = grid[torch.linspace(0, grid_points - 1, 4).round().long()]
    signs = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    coeffs = None
    for _ in range(iterations):
        system = torch.stack([points, points**3, points**5, signs], dim=1)
        solution = torch.linalg.solve(system, torch.ones(4, dtype=torch.float64))
        coeffs = solution[:3]
        error = 1.0 - _quintic(coeffs, grid)
        # Local extrema of the error (ends included), merged to alternate in sign.
        slope = torch.diff(error)
        turning = (slope[:-1] * slope[1:] <= 0).nonzero().flatten() + 1
        candidates = [0] + turning.tolist() + [grid_points - 1]
        alternating: list[int] = []
        for i in candidates:
            if alternating and (error[alternating[-1]] > 0) == (error[i] > 0):
                if abs(error[i]) > abs(error[alternating[-1]]):
                    alternating[-1] = i
            else:
                alternating.append(i)
        if len(alternating) < 4:
            break
        if len(alternating) > 4:
            start = max(range(len(alternating) - 3), key=lambda s: float(error[alternating[s:s + 4]].abs().min()))
            alternating = alternating[start:start + 4]
        new_points = grid[alternating]
        if torch.allclose(new_points, points):
            break
        points = new_points
    return coeffs


@functools.lru_cache(maxsize=None)
def design_polar_express(
    steps: int, lower: float = 1e-3, cushion: float = PUBLISHED_CUSHION, safety: float = 1.01
) -> tuple[tuple[float, float, float], ...]:
    """Greedy Polar Express schedule of ``steps`` quintics for singular values in [lower, 1].

    The safety factor ``s`` damps every step but the last as ``(a/s, b/s³, c/s⁵)``, the same
    convention as ``algorithms.get_coefficients('polar_express', ...)``. Pass the result as
    ``coefficients=`` (with ``steps=len(result)``) to any NS function.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    if not 0.0 < lower < 1.0:
        raise ValueError(f"lower must be in (0, 1), got {lower!r}")
    if not 0.0 <= cushion < 1.0:
        raise ValueError(f"cushion must be in [0, 1), got {cushion!r}")
    if not safety >= 1.0:
        raise ValueError(f"safety must be >= 1.0, got {safety!r}")
    low, high = float(lower), 1.0
    schedule = []
    for _ in range(steps):
        coeffs = _minimax_quintic(max(low, cushion * high), high)
        ends = _quintic(coeffs, torch.tensor([low, high], dtype=torch.float64))
        coeffs = coeffs * (2.0 / ends.sum())
        low = float(_quintic(coeffs, torch.tensor(low, dtype=torch.float64)))
        high = 2.0 - low
        schedule.append(tuple(float(v) for v in coeffs))
    damped = [(a / safety, b / safety**3, c / safety**5) for a, b, c in schedule[:-1]]
    return tuple(damped + schedule[-1:])


def spectrum_error(singular_values: torch.Tensor, schedule, normalisation: str = "frobenius") -> float:
    """Relative Frobenius error ``‖NS(X) − U Vᵀ‖_F / ‖U Vᵀ‖_F`` that ``schedule`` reaches in exact
    arithmetic on a matrix with these (nonzero) singular values: the RMS of ``p(σ/scale) − 1``."""
    s = singular_values.to(torch.float64)
    top = s.max()
    if normalisation == "quartic":
        scale = (s / top).pow(8).sum().pow(0.125) * top
    elif normalisation == "frobenius":
        scale = s.square().sum().sqrt()
    else:
        raise ValueError(f"normalisation must be 'frobenius' or 'quartic', got {normalisation!r}")
    x = s / scale
    for coeffs in schedule:
        x = _quintic(torch.tensor(coeffs, dtype=torch.float64), x)
    return float((x - 1.0).square().mean().sqrt())


def schedule_for_shape(rows: int, cols: int) -> dict:
    """NS keyword arguments of the per-shape (``'adaptive'``) choice: the quartic normalisation with
    ``QUARTIC_WIDE_4`` when ``max/min >= WIDE_ASPECT``, else ``QUARTIC_SQUARE_5``. Returns
    ``{'coefficients', 'steps', 'normalisation'}``."""
    if rows < 1 or cols < 1:
        raise ValueError(f"rows and cols must be >= 1, got {rows}x{cols}")
    coefficients = QUARTIC_WIDE_4 if max(rows, cols) / min(rows, cols) >= WIDE_ASPECT else QUARTIC_SQUARE_5
    return {"coefficients": coefficients, "steps": len(coefficients), "normalisation": "quartic"}
