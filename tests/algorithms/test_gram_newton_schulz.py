"""Gram Newton–Schulz: equality with standard NS, half-precision bounds, restarts, fallback,
batching, bad inputs, and the FLOP model (checked against torch's FLOP counter)."""
import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megatron_dmuon.algorithms.coefficients import COEFFICIENT_SETS
from megatron_dmuon.algorithms.flops import newton_schulz_flops
from megatron_dmuon.algorithms.gram_newton_schulz import gram_newton_schulz
from megatron_dmuon.algorithms.newton_schulz import newton_schulz
from megatron_dmuon.algorithms.ns_metrics import (
    documented_bound,
    ill_conditioned_matrix,
    orthogonalization_errors,
)

F64 = torch.float64


def _gauss(*shape, seed=0):
    return torch.randn(*shape, dtype=F64, generator=torch.Generator().manual_seed(seed))


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("coefficients", COEFFICIENT_SETS)
def test_float64_gram_equals_standard(coefficients):
    cases = [_gauss(48, 200), _gauss(200, 48, seed=1), _gauss(64, 64, seed=2), _gauss(2, 3, 16, 70, seed=3),
             ill_conditioned_matrix(40, 160, 1e4, torch.Generator().manual_seed(4))]
    for x in cases:
        for steps in (3, 5, 7):
            standard = newton_schulz(x, coefficients, steps=steps, compute_dtype=F64)
            for restarts in ((), (2,), (1, 3), (1, 2, 3, 4, 5, 6)):
                gram = gram_newton_schulz(x, coefficients, steps=steps, compute_dtype=F64,
                                          restart_after=restarts, min_aspect_ratio=1.0)
                assert gram.shape == x.shape and gram.dtype == F64
                assert _rel(gram, standard) <= 1e-10, (tuple(x.shape), steps, restarts)


@pytest.fixture(scope="module")
def test_matrices():
    g = torch.Generator().manual_seed(0)
    return {
        "gauss": [_gauss(64, 256), _gauss(160, 96, seed=1)],
        "cond": [ill_conditioned_matrix(96, 192, 1e4, g), ill_conditioned_matrix(192, 96, 1e4, g)],
    }


@pytest.mark.parametrize("coefficients", COEFFICIENT_SETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_half_precision_within_documented_bounds(coefficients, dtype, test_matrices):
    for kind, mats in test_matrices.items():
        for x in mats:
            y = gram_newton_schulz(x, coefficients, compute_dtype=dtype, min_aspect_ratio=1.0)
            e = orthogonalization_errors(x, y, coefficients)
            assert e["wc"] <= e["band"] + documented_bound("gram", dtype, "wc_excess"), e
            assert e["round"] <= documented_bound("gram", dtype, f"round_{kind}"), e
            standard = newton_schulz(x, coefficients, compute_dtype=F64)
            # Gram in half precision vs exact-arithmetic standard NS, same bound as 'round'
            assert _rel(y.double(), standard) <= documented_bound("gram", dtype, f"round_{kind}")


def test_restart_is_what_keeps_half_precision_stable():
    """Without a restart, bf16 R picks up spurious eigenvalues and the result blows up on an
    ill-conditioned matrix; the default restart after iteration 2 keeps it bounded."""
    x = ill_conditioned_matrix(64, 1024, 1e6, torch.Generator().manual_seed(2))
    no_restart = gram_newton_schulz(x, "polar_express", compute_dtype=torch.bfloat16, restart_after=())
    default = gram_newton_schulz(x, "polar_express", compute_dtype=torch.bfloat16)
    assert orthogonalization_errors(x, no_restart, "polar_express")["round"] > 10.0
    assert orthogonalization_errors(x, default, "polar_express")["round"] < 0.5
    fp16 = gram_newton_schulz(x, "polar_express", compute_dtype=torch.float16)
    assert orthogonalization_errors(x, fp16, "polar_express")["round"] < 0.06  # fp16 beats bf16


def test_near_square_falls_back_to_standard_ns():
    x = _gauss(64, 100).float()  # aspect 1.56 < 2
    for dtype in (torch.float16, torch.bfloat16):
        assert torch.equal(gram_newton_schulz(x, "you", compute_dtype=dtype),
                           newton_schulz(x, "you", compute_dtype=dtype))
    forced = gram_newton_schulz(x, "you", compute_dtype=F64, min_aspect_ratio=1.0)
    assert _rel(forced.double(), newton_schulz(x, "you", compute_dtype=F64).double()) < 1e-10


def test_batched_equals_per_matrix():
    x = _gauss(3, 2, 24, 100)
    for dtype, tol in ((F64, 1e-13), (torch.float16, 0.0)):
        batched = gram_newton_schulz(x, "polar_express", compute_dtype=dtype)
        for i in range(3):
            for j in range(2):
                single = gram_newton_schulz(x[i, j], "polar_express", compute_dtype=dtype)
                assert float((batched[i, j] - single).abs().max()) <= tol


def test_special_inputs():
    assert torch.equal(gram_newton_schulz(torch.zeros(8, 40)), torch.zeros(8, 40))
    stack = torch.stack([torch.zeros(8, 40), _gauss(8, 40).float()])
    out = gram_newton_schulz(stack)
    assert torch.equal(out[0], torch.zeros(8, 40))
    assert out.dtype == torch.float32
    assert gram_newton_schulz(torch.zeros(0, 4)).shape == (0, 4)
    with pytest.raises(ValueError, match=r"shape \(7,\)"):
        gram_newton_schulz(torch.ones(7))
    with pytest.raises(TypeError, match="floating dtype"):
        gram_newton_schulz(torch.ones(3, 9, dtype=torch.int32))
    bad = torch.ones(3, 9)
    bad[0, 0] = math.nan
    with pytest.raises(ValueError, match="NaN or Inf"):
        gram_newton_schulz(bad)
    with pytest.raises(ValueError, match="restart_after"):
        gram_newton_schulz(torch.ones(3, 9), restart_after=(0,))
    with pytest.raises(ValueError, match="min_aspect_ratio"):
        gram_newton_schulz(torch.ones(3, 9), min_aspect_ratio=0.5)
    with pytest.raises(ValueError, match="valid names"):
        gram_newton_schulz(torch.ones(3, 9), coefficients="nope")


# ---------------------------------------------------------------- FLOP model


def _measured_flops(fn):
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


@pytest.mark.parametrize("shape", [(64, 256), (256, 64), (48, 200), (60, 60)])
@pytest.mark.parametrize("steps", [1, 2, 3, 5, 7])
def test_flop_model_equals_counted_gemm_flops(shape, steps):
    x = _gauss(*shape)
    assert newton_schulz_flops(*shape, steps) == _measured_flops(
        lambda: newton_schulz(x, steps=steps, compute_dtype=F64))
    for restart_after in ((2,), (), (1, 3), (1, 2, 3, 4)):
        counted = _measured_flops(lambda: gram_newton_schulz(
            x, steps=steps, compute_dtype=F64, restart_after=restart_after, min_aspect_ratio=1.0))
        model = newton_schulz_flops(*shape, steps, "gram", restart_after=restart_after, min_aspect_ratio=1.0)
        assert model == counted
    # default arguments mirror gram_newton_schulz's defaults (restart after 2, fallback below 2)
    counted = _measured_flops(lambda: gram_newton_schulz(x, steps=steps, compute_dtype=F64))
    assert newton_schulz_flops(*shape, steps, "gram") == counted


def test_flop_formulas_of_facts():
    n, T = 128, 5
    for alpha in (1, 2, 4, 8):
        m = alpha * n
        assert newton_schulz_flops(m, n, T) == 2 * T * (2 * alpha + 1) * n**3
        assert newton_schulz_flops(n, m, T, symmetric=True) == T * (3 * alpha + 1) * n**3
        assert newton_schulz_flops(m, n, T, "gram", symmetric=True, restarts=1, min_aspect_ratio=1.0) == (
            4 * T + 6 * alpha - 6) * n**3
    # Gram pays off with the aspect ratio: 4x fewer FLOPs than standard at alpha = 8 (sym. kernels)
    assert newton_schulz_flops(8 * n, n, T, "gram", symmetric=True) < newton_schulz_flops(
        8 * n, n, T, symmetric=True) / 2


def test_flop_argument_errors():
    with pytest.raises(ValueError, match="standard, gram"):
        newton_schulz_flops(4, 4, 5, method="svd")
    with pytest.raises(ValueError, match="rows"):
        newton_schulz_flops(0, 4, 5)
    with pytest.raises(ValueError, match="restarts"):
        newton_schulz_flops(4, 40, 5, "gram", restarts=-1)


def test_sharded_gram_with_one_shard_equals_gram_newton_schulz():
    from megatron_dmuon.algorithms.gram_newton_schulz import gram_newton_schulz_sharded, gram_space_polynomial

    x = torch.randn(3, 16, 80, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    local = gram_newton_schulz_sharded(x, lambda t: t, gram_space_polynomial, compute_dtype=torch.float64)
    full = gram_newton_schulz(x, compute_dtype=torch.float64)
    assert float((local - full).abs().max()) <= 1e-12


@pytest.mark.parametrize("normalisation", ["frobenius", "quartic"])
def test_sharded_gram_over_column_blocks_equals_the_whole_matrix(normalisation):
    # t = 4 "ranks" simulated in one process with one segment (no restart): the collectives are
    # sums over the column blocks of the normalised matrix; the quartic rescale runs where Q is made
    from megatron_dmuon.algorithms.gram_newton_schulz import gram_newton_schulz_sharded, gram_space_polynomial

    x = torch.randn(2, 24, 96, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    blocks = list(x.chunk(4, dim=-1))
    norm2 = sum(b.square().sum(dim=(-2, -1), keepdim=True) for b in blocks)
    gram = sum(b @ b.mT for b in blocks) / norm2

    out = [gram_newton_schulz_sharded(b, lambda t: norm2.clone(), lambda partial, seg, normalise: gram_space_polynomial(gram.clone(), seg, normalise),
                                      compute_dtype=torch.float64, restart_after=(), normalisation=normalisation)
           for b in blocks]
    full = gram_newton_schulz(x, compute_dtype=torch.float64, restart_after=(), min_aspect_ratio=1.0,
                              normalisation=normalisation)
    assert float((torch.cat(out, dim=-1) - full).abs().max()) <= 1e-12
