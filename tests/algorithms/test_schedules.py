"""Polar Express schedule design (algorithms.schedules): reproduces the published sets, the
6-step schedule for square matrices, the schedules designed for the quartic normalisation, and the
per-shape choice (float64 SVD checks)."""

import pytest
import torch

from megatron_dmuon.algorithms.coefficients import POLAR_EXPRESS, get_coefficients
from megatron_dmuon.algorithms.newton_schulz import msgn_svd, newton_schulz
from megatron_dmuon.algorithms.schedules import (
    POLAR_EXPRESS_6,
    QUARTIC_SQUARE_5,
    QUARTIC_WIDE_4,
    design_polar_express,
    schedule_for_shape,
    spectrum_error,
)


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
    for shape in [(3584, 3584), (3584, 3600), (100, 110), (100, 199)]:
        assert schedule_for_shape(*shape) == {"coefficients": QUARTIC_SQUARE_5, "steps": 5, "normalisation": "quartic"}
    for shape in [(512, 3584), (18944, 3584), (3584, 18944), (100, 200)]:
        assert schedule_for_shape(*shape) == {"coefficients": QUARTIC_WIDE_4, "steps": 4, "normalisation": "quartic"}
    # What it returns is accepted by the NS functions as is.
    x = torch.randn(8, 8, dtype=torch.float64)
    assert torch.equal(newton_schulz(x, compute_dtype=torch.float64, **schedule_for_shape(8, 8)),
                       newton_schulz(x, QUARTIC_SQUARE_5, 5, compute_dtype=torch.float64, normalisation="quartic"))
    with pytest.raises(ValueError, match="rows and cols"):
        schedule_for_shape(0, 8)


def test_quartic_schedules_are_the_design():
    assert _max_rel_diff(design_polar_express(4, lower=0.01, cushion=0.005), QUARTIC_WIDE_4) < 1e-12
    assert _max_rel_diff(design_polar_express(5, lower=1e-3, cushion=0.005), QUARTIC_SQUARE_5) < 1e-12


def _with_spectrum(s: torch.Tensor, rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    U = torch.linalg.qr(torch.randn(rows, len(s), generator=g, dtype=torch.float64))[0]
    V = torch.linalg.qr(torch.randn(cols, len(s), generator=g, dtype=torch.float64))[0]
    return (U * s) @ V.T


def test_spectrum_error_is_the_matrix_error_in_float64():
    s = torch.logspace(0, -3, 48, dtype=torch.float64)
    x = _with_spectrum(s, 64, 160, 0)
    exact = msgn_svd(x)
    for schedule, normalisation in [(QUARTIC_WIDE_4, "quartic"), (get_coefficients("polar_express", 5), "frobenius")]:
        out = newton_schulz(x, schedule, len(schedule), compute_dtype=torch.float64, normalisation=normalisation)
        # the 48 nonzero singular values are the matrix's whole rank: both errors use 48 directions
        assert abs(float((out - exact).norm() / exact.norm()) - spectrum_error(s, schedule, normalisation)) < 1e-10


@pytest.mark.parametrize("rows,cols", [(96, 512), (512, 96), (256, 256)])
def test_quartic_steps_beat_the_frobenius_schedules_with_fewer_steps(rows, cols):
    # float64 SVD check: the per-shape quartic schedule (4 steps wide, 5 square) lands closer to the
    # polar factor than the Frobenius schedules it replaces (5-step published / 6-step designed).
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows + cols), dtype=torch.float64)
    exact = msgn_svd(x)

    def err(**kw):
        return float((newton_schulz(x, compute_dtype=torch.float64, **kw) - exact).norm() / exact.norm())

    quartic = err(**schedule_for_shape(rows, cols))
    published = err(coefficients="polar_express", steps=5)
    # measured: 0.0090 / 0.0093 / 0.081 (published 5 Frobenius steps: 0.089 / 0.088 / 0.114)
    if rows == cols:
        assert quartic < 0.09 < published
    else:
        assert quartic < published / 5


def test_quartic_errors_on_gradient_like_spectra():
    # rank-32 signal 30x above a Gaussian bulk, a 1/sqrt(i) power law, Gaussian: the wide design
    # stays within 0.05 (measured <= 0.01 at Qwen2.5-7B sizes; bench/ns.py schedules)
    g = torch.Generator().manual_seed(0)
    bulk = torch.linalg.svdvals(torch.randn(256, 1024, generator=g, dtype=torch.float64))
    spiked = bulk / bulk[0]
    spiked[:32] = (30 * torch.arange(1, 33, dtype=torch.float64) ** -0.5).clamp(min=1.0)
    power = torch.arange(1, 257, dtype=torch.float64) ** -0.5
    for s in (bulk, spiked, power):
        assert spectrum_error(s, QUARTIC_WIDE_4, "quartic") < 0.05
        assert spectrum_error(s, get_coefficients("polar_express", 4), "frobenius") > 0.3  # 4 Frobenius steps fall short


def test_design_argument_errors():
    with pytest.raises(ValueError, match="steps"):
        design_polar_express(0)
    with pytest.raises(ValueError, match="lower"):
        design_polar_express(3, lower=1.5)
    with pytest.raises(ValueError, match="cushion"):
        design_polar_express(3, cushion=-0.1)
    with pytest.raises(ValueError, match="safety"):
        design_polar_express(3, safety=0.9)
