"""Polar Express coefficient schedules for any step count, and the per-shape choice.

Polar Express (arXiv 2505.16932) builds its schedule greedily: singular values start in
``[lower, 1]``; each step takes the odd quintic ``p(x) = a x + b x³ + c x⁵`` closest to 1 in the
max norm on the current interval (with a *cushion*: the lower end used for the fit is at
least ``cushion · upper``), rescales it so that ``p(lower)`` and ``p(upper)`` sit symmetrically
around 1, and continues on ``[p(lower), 2 − p(lower)]``. ``design_polar_express(5)`` reproduces
the published five sets to ~4e-7 (relative) (tests check this); asking for more steps continues the same
greedy design instead of repeating the fifth set (which is what ``get_coefficients`` does).

Why six steps for square matrices: NS output error is measured as ``‖NS(X) − polar(X)‖_F /
‖polar(X)‖_F`` (relative Frobenius error vs the float64 polar factor ``U Vᵀ``; the benchmark
metric). After Frobenius normalisation the singular values of a Gaussian n×n matrix spread
down to ~1/n^1.5, so a few percent of them stay far below 1 after five steps: 0.146 for
n = 3584 with the published schedule. One more *designed* step brings it to 0.087 (the fifth
set repeated gives 0.106); rectangular matrices (aspect ≥ 1.1) reach ~0.09 in five steps
already. ``schedule_for_shape`` encodes exactly this choice.
"""

from __future__ import annotations

import functools

import torch

__all__ = [
    "PUBLISHED_CUSHION",
    "POLAR_EXPRESS_6",
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


def schedule_for_shape(rows: int, cols: int, square_tolerance: float = 1.05) -> dict:
    """NS keyword arguments that keep a Gaussian-like matrix of this shape within 0.10 of its
    polar factor: the published 5-step Polar Express schedule, or ``POLAR_EXPRESS_6`` for
    (near-)square shapes, ``max/min < square_tolerance``. Returns ``{'coefficients', 'steps'}``."""
    if rows < 1 or cols < 1:
        raise ValueError(f"rows and cols must be >= 1, got {rows}x{cols}")
    if max(rows, cols) / min(rows, cols) < square_tolerance:
        return {"coefficients": POLAR_EXPRESS_6, "steps": len(POLAR_EXPRESS_6)}
    return {"coefficients": "polar_express", "steps": 5}
