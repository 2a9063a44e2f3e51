"""Polar Express schedule design (algorithms.schedules): reproduces the published sets, the
6-step schedule for square matrices, and the per-shape choice."""

import pytest
import torch

from megatron_dmuon.algorithms.coefficients import POLAR_EXPRESS, get_coefficients
from megatron_dmuon.algorithms.newton_schulz import msgn_svd, newton_schulz
from megatron_dmuon.algorithms.schedules import POLAR_EXPRESS_6, design_polar_express, schedule_for_shape


def _max_rel_diff(a, b):
    return max(abs(x - y) / abs(y) for sa, sb in zip(a, b, strict=True) for x, y in zip(sa, sb, strict=True))


def test_design_reproduces_the_published_polar_express_sets():
    # Without a safety factor the greedy design gives the published numbers...
    assert _max_rel_diff(design_polar_express(5, safety=1.0), POLAR_EXPRESS) < 1e-6
    # ...and with it the same damped schedule as algorithms.get_coefficients.
    assert _max_rel_diff(design_polar_express(5), get_coefficients("polar_express", 5)) < 1e-6


def test_six_step_constant_is_the_continued_design():
    assert len(POLAR_EXPRESS_6) == 6
    assert _max_rel_diff(design_polar_express(6), POLAR_EXPRESS_6) < 1e-12
    # The first five steps are the published ones; the sixth is new (not the fifth repeated).
    assert _max_rel_diff(POLAR_EXPRESS_6[:4], get_coefficients("polar_express", 5)[:4]) < 1e-6
    damped_fifth = tuple(v / 1.01**p for v, p in zip(POLAR_EXPRESS[4], (1, 3, 5)))
    assert _max_rel_diff(POLAR_EXPRESS_6[4:5], [damped_fifth]) < 1e-6
    assert abs(POLAR_EXPRESS_6[5][0] - POLAR_EXPRESS[4][0]) > 0.3


def test_six_steps_bring_a_square_gaussian_within_the_error_goal():
    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    exact = msgn_svd(x)

    def err(coefficients, steps):
        out = newton_schulz(x, coefficients, steps, compute_dtype=torch.float64)
        return float((out - exact).norm() / exact.norm())

    five, repeated, designed = err("polar_express", 5), err("polar_express", 6), err(POLAR_EXPRESS_6, 6)
    # Measured: 0.0988, 0.0699, 0.0213 (n = 256; the error grows with n: 0.087 at n = 3584).
    assert five > 0.095 and repeated > 0.06
    assert designed < 0.03


def test_schedule_for_shape():
    assert schedule_for_shape(3584, 3584) == {"coefficients": POLAR_EXPRESS_6, "steps": 6}
    assert schedule_for_shape(3584, 3600)["steps"] == 6  # near-square
    for shape in [(512, 3584), (18944, 3584), (3584, 18944), (100, 110)]:
        assert schedule_for_shape(*shape) == {"coefficients": "polar_express", "steps": 5}
    # What it returns is accepted by the NS functions as is.
    s = schedule_for_shape(8, 8)
    assert get_coefficients(s["coefficients"], s["steps"]) == list(POLAR_EXPRESS_6)
    with pytest.raises(ValueError, match="rows and cols"):
        schedule_for_shape(0, 8)


def test_design_argument_errors():
    with pytest.raises(ValueError, match="steps"):
        design_polar_express(0)
    with pytest.raises(ValueError, match="lower"):
        design_polar_express(3, lower=1.5)
    with pytest.raises(ValueError, match="cushion"):
        design_polar_express(3, cushion=-0.1)
    with pytest.raises(ValueError, match="safety"):
        design_polar_express(3, safety=0.9)
