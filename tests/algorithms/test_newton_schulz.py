"""Standard Newton–Schulz: coefficient schedules, torch.optim.Muon parity, accuracy bounds,
batching and bad inputs."""
import math

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz as torch_zeropower

from megatron_dmuon.algorithms.coefficients import (
    COEFFICIENT_SETS,
    KELLER,
    POLAR_EXPRESS,
    YOU,
    get_coefficients,
)
from megatron_dmuon.algorithms.newton_schulz import (
    msgn_svd,
    newton_schulz,
    newton_schulz_reference,
)
from megatron_dmuon.algorithms.ns_dispatch import orthogonalize
from megatron_dmuon.algorithms.ns_metrics import (
    documented_bound,
    ill_conditioned_matrix,
    orthogonalization_errors,
)

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


def _gauss(*shape, seed=0):
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def test_matrices():
    g = torch.Generator().manual_seed(0)
    return {
        "gauss": [_gauss(96, 160), _gauss(160, 96, seed=1)],
        "cond": [ill_conditioned_matrix(96, 192, 1e4, g), ill_conditioned_matrix(192, 96, 1e4, g)],
    }


# ---------------------------------------------------------------- coefficient schedules


def test_keller_is_repeated():
    assert get_coefficients("keller", 4) == [(3.4445, -4.7750, 2.0315)] * 4


def test_polar_express_safety_on_all_but_last_published_set():
    s = 1.05
    sched = get_coefficients("polar_express", 7, safety=s)
    for (a, b, c), (a0, b0, c0) in zip(sched[:4], POLAR_EXPRESS[:4]):
        assert (a, b, c) == (a0 / s, b0 / s**3, c0 / s**5)
    assert sched[4:] == [POLAR_EXPRESS[4]] * 3  # the 5th set, undamped, repeats
    assert get_coefficients("polar_express", 3, safety=s) == sched[:3]
    assert get_coefficients("polar_express", 5, safety=1.0) == list(POLAR_EXPRESS)


def test_you_set_and_truncation():
    assert get_coefficients("you", 5) == list(YOU)
    assert get_coefficients("you", 2) == list(YOU[:2])
    assert get_coefficients("you", 6)[5] == YOU[4]


def test_explicit_coefficients():
    assert get_coefficients((1.5, -0.5, 0.0), 3) == [(1.5, -0.5, 0.0)] * 3
    assert get_coefficients([(2.0, -1.0, 0.1), (1.5, -0.5, 0.0)], 4) == [
        (2.0, -1.0, 0.1), (1.5, -0.5, 0.0), (1.5, -0.5, 0.0), (1.5, -0.5, 0.0)]
    with pytest.raises(ValueError, match="has 3 entries but steps=2"):
        get_coefficients([KELLER] * 3, 2)
    with pytest.raises(ValueError, match="exactly 3 numbers"):
        get_coefficients([(1.0, 2.0)], 2)


def test_coefficient_errors_name_the_fix():
    with pytest.raises(ValueError) as e:
        get_coefficients("kellr", 5)
    for name in COEFFICIENT_SETS:
        assert name in str(e.value)
    with pytest.raises(ValueError, match="steps must be an int >= 1"):
        get_coefficients("keller", 0)
    with pytest.raises(ValueError, match="safety"):
        get_coefficients("polar_express", 5, safety=0.9)


# ---------------------------------------------------------------- torch.optim.Muon parity


@pytest.mark.parametrize("shape", [(96, 160), (160, 96), (128, 128), (7, 300)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bitwise_equal_to_torch_muon_zeropower(shape, dtype):
    x = _gauss(*shape).to(dtype)
    # torch normalises a bf16 input in place (grad.bfloat16() is the input itself): pass a copy
    expected = torch_zeropower(x.clone(), KELLER, 5, 1e-7)
    got = newton_schulz(x)
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got, expected.to(dtype))


def test_explicit_torch_style_coefficients_and_steps_match_torch():
    x = _gauss(40, 90).float()
    coeffs = (3.0, -3.2, 1.2)
    assert torch.equal(newton_schulz(x, coeffs, steps=3), torch_zeropower(x, coeffs, 3, 1e-7).float())


# ---------------------------------------------------------------- accuracy


@pytest.mark.parametrize("coefficients", COEFFICIENT_SETS)
def test_float64_equals_exact_polynomial_schedule(coefficients, test_matrices):
    for x in test_matrices["gauss"] + test_matrices["cond"]:
        y = newton_schulz(x, coefficients, compute_dtype=torch.float64)
        ref = newton_schulz_reference(x, coefficients)
        assert float((y - ref).norm() / ref.norm()) < 1e-12


@pytest.mark.parametrize("coefficients", COEFFICIENT_SETS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_error_within_documented_bounds(coefficients, dtype, test_matrices):
    """wc <= band + rounding allowance; rounding error <= documented bound (see ns_metrics)."""
    fro_bound = {"keller": 0.25, "polar_express": 0.2, "you": 0.12}[coefficients]
    for kind, mats in test_matrices.items():
        for x in mats:
            e = orthogonalization_errors(x, newton_schulz(x, coefficients, compute_dtype=dtype), coefficients)
            assert e["wc"] <= e["band"] + documented_bound("standard", dtype, "wc_excess"), e
            assert e["round"] <= documented_bound("standard", dtype, f"round_{kind}"), e
            if kind == "gauss":
                assert e["fro"] <= fro_bound, e


def test_bands_of_the_named_sets():
    """The exact-arithmetic band each schedule reaches on s >= 0.01·‖x‖_F (documented)."""
    x = _gauss(96, 160)
    bands = {cs: orthogonalization_errors(x, newton_schulz_reference(x, cs), cs)["band"]
             for cs in COEFFICIENT_SETS}
    assert 0.30 < bands["keller"] < 0.32
    assert 0.11 < bands["polar_express"] < 0.13
    assert 0.02 < bands["you"] < 0.04


def test_msgn_svd_is_orthogonal_and_drops_null_space():
    x = _gauss(30, 50)
    q = msgn_svd(x)
    assert q.dtype == torch.float64
    assert torch.allclose(q @ q.T, torch.eye(30, dtype=torch.float64), atol=1e-12)
    low_rank = _gauss(30, 4) @ _gauss(4, 50, seed=2)
    q = msgn_svd(low_rank)
    assert abs(float(torch.linalg.matrix_norm(q)) - 2.0) < 1e-10  # ‖·‖_F² = rank = 4
    assert torch.equal(msgn_svd(torch.zeros(3, 5)), torch.zeros(3, 5, dtype=torch.float64))
    stack = torch.stack([x, 2 * x])
    assert torch.allclose(msgn_svd(stack)[1], msgn_svd(x), atol=1e-12)


# ---------------------------------------------------------------- shapes and batching


def test_batched_equals_per_matrix():
    x = _gauss(3, 2, 40, 72)
    for dtype, tol in ((torch.float64, 1e-13), (torch.bfloat16, 0.0)):
        batched = newton_schulz(x, "polar_express", compute_dtype=dtype)
        assert batched.shape == x.shape
        for i in range(3):
            for j in range(2):
                single = newton_schulz(x[i, j], "polar_express", compute_dtype=dtype)
                assert float((batched[i, j] - single).abs().max()) <= tol


def test_tall_is_the_transpose_of_wide():
    x = _gauss(50, 20).float()
    assert torch.equal(newton_schulz(x), newton_schulz(x.T.contiguous()).T)


def test_input_is_not_modified():
    x = _gauss(20, 30).bfloat16()
    before = x.clone()
    newton_schulz(x)
    assert torch.equal(x, before)


# ---------------------------------------------------------------- bad inputs / special results


@pytest.mark.parametrize("fn", [newton_schulz, msgn_svd])
def test_vectors_and_scalars_are_rejected_with_shape(fn):
    for bad in (torch.ones(5), torch.tensor(1.0)):
        with pytest.raises(ValueError, match=rf"shape {re_shape(bad)}"):
            fn(bad)


def re_shape(t):
    return str(tuple(t.shape)).replace("(", r"\(").replace(")", r"\)")


def test_integer_dtype_is_rejected():
    with pytest.raises(TypeError, match="floating dtype"):
        newton_schulz(torch.ones(3, 4, dtype=torch.int64))
    with pytest.raises(TypeError, match="compute_dtype"):
        newton_schulz(torch.ones(3, 4), compute_dtype=torch.int32)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_input_is_rejected(value):
    x = torch.ones(4, 6)
    x[1, 2] = value
    with pytest.raises(ValueError, match="NaN or Inf"):
        newton_schulz(x)
    assert torch.isnan(newton_schulz(x, check_finite=False)).any()  # the check is what stops it


def test_zero_matrix_gives_zeros_and_zero_slice_stays_zero():
    assert torch.equal(newton_schulz(torch.zeros(8, 5)), torch.zeros(8, 5))
    stack = torch.stack([torch.zeros(8, 5), _gauss(8, 5).float()])
    out = newton_schulz(stack)
    assert torch.equal(out[0], torch.zeros(8, 5))
    assert torch.equal(out[1], newton_schulz(stack[1]))


def test_empty_and_bad_eps():
    assert newton_schulz(torch.zeros(0, 5)).shape == (0, 5)
    with pytest.raises(ValueError, match="eps"):
        newton_schulz(torch.ones(2, 2), eps=0.0)


def test_fp16_normalises_before_the_cast():
    """Entries far beyond fp16's range (65504) still give the right answer."""
    x = _gauss(32, 64) * 1e6
    y = newton_schulz(x, "you", compute_dtype=torch.float16)
    e = orthogonalization_errors(x, y, "you")
    assert e["round"] <= documented_bound("standard", torch.float16, "round_gauss")


def test_orthogonalize_dispatch():
    x = _gauss(24, 80)
    assert torch.equal(orthogonalize(x, "standard", compute_dtype=torch.float64),
                       newton_schulz(x, compute_dtype=torch.float64))
    from megatron_dmuon.algorithms.gram_newton_schulz import gram_newton_schulz

    assert torch.equal(orthogonalize(x, "gram"), gram_newton_schulz(x))
    with pytest.raises(ValueError, match="standard, gram"):
        orthogonalize(x, "svd")


# ---------------------------------------------------------------- scale invariance


@pytest.mark.parametrize("scale", [1e-30, 1e-20, 1e-12, 1e12, 1e20, 1e30])
@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_scale_the_input_holds_gives_the_same_update(scale, compute_dtype):
    # fp32 norms overflow (entries 1e20: ||x||^2 = inf) or underflow (1e-20: squares < 1e-38), and
    # an eps of 1e-7 zeroed every small norm: all of them gave an exact zero update before
    from megatron_dmuon.algorithms.gram_newton_schulz import gram_newton_schulz

    x = _gauss(48, 112).float()
    for ns in (newton_schulz, gram_newton_schulz):
        unit = ns(x, compute_dtype=compute_dtype)
        scaled = ns(x * scale, compute_dtype=compute_dtype)
        assert torch.isfinite(scaled).all() and float(scaled.norm()) > 0.5 * float(unit.norm())
        rel = float((scaled - unit).norm() / unit.norm())
        assert rel <= (1e-5 if compute_dtype == torch.float32 else 5e-2), (ns.__name__, scale, rel)  # bf16: rounding noise


def test_sharded_gram_norm_is_scale_invariant():
    from megatron_dmuon.algorithms.gram_newton_schulz import gram_newton_schulz_sharded, gram_space_polynomial

    x = _gauss(24, 96).float()
    unit = gram_newton_schulz_sharded(x, lambda t: t, gram_space_polynomial, compute_dtype=torch.float32)
    for scaled_norm in (None, lambda t: t):  # float64 squares, or the max-scaled fp32 sum (what TP runs)
        for scale in (1e-30, 1e-20, 1e20, 1e30):
            got = gram_newton_schulz_sharded(x * scale, lambda t: t, gram_space_polynomial, compute_dtype=torch.float32,
                                             max_over_shards=scaled_norm)
            assert float((got - unit).norm() / unit.norm()) <= 1e-5, (scale, scaled_norm)
    # two shards: the global max scales both partial sums (a shard whose own max is far smaller)
    halves = [x[:, :48] * 1e25, x[:, 48:] * 1e-5]
    whole = torch.cat(halves, dim=1)
    shards = torch.stack(halves)  # [2, m, n/2]: each "rank" reduces its own block
    got = gram_newton_schulz_sharded(
        shards, lambda t: t.sum(0, keepdim=True).expand_as(t).clone(),
        lambda partial, seg, normalise: gram_space_polynomial(partial.sum(0, keepdim=True).expand_as(partial).clone(),
                                                              seg, normalise),
        compute_dtype=torch.float32, max_over_shards=lambda t: t.amax(0, keepdim=True).expand_as(t).clone())
    ref = gram_newton_schulz_sharded(whole, lambda t: t, gram_space_polynomial, compute_dtype=torch.float32)
    assert float((torch.cat([got[0], got[1]], dim=1) - ref).norm() / ref.norm()) <= 1e-5


def test_frobenius_norm_keeps_torch_bits_in_range_and_is_exact_outside():
    from megatron_dmuon.algorithms.newton_schulz import frobenius_norm

    x = _gauss(40, 70).float()
    assert torch.equal(frobenius_norm(x), x.norm())
    assert torch.equal(frobenius_norm(x.unsqueeze(0)), x.unsqueeze(0).norm(dim=(-2, -1), keepdim=True))
    exact = float(x.double().norm())
    for scale in (1e-25, 1e25):
        assert (x * scale).norm().item() in (0.0, float("inf"))  # what fp32 gives on its own
        assert abs(float(frobenius_norm(x * scale)) / (exact * scale) - 1) <= 1e-6


def test_quartic_rescale_bounds_the_top_singular_value_tightly():
    from megatron_dmuon.algorithms.newton_schulz import quartic_rescale

    x = torch.randn(4, 64, 256, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    x = x / torch.linalg.matrix_norm(x, keepdim=True)
    R, R2, gamma = quartic_rescale(x @ x.mT)
    top = torch.linalg.matrix_norm(x, ord=2)
    scaled_top = top * gamma.flatten()
    assert bool((scaled_top <= 1 + 1e-12).all()) and bool((scaled_top > 0.4).all())  # ‖X‖_F put it at ~0.1
    y = x * gamma
    assert torch.allclose(R, y @ y.mT, atol=1e-12) and torch.allclose(R2, R @ R, atol=1e-12)
    zero = quartic_rescale(torch.zeros(2, 8, 8, dtype=torch.float16))
    assert all(t.abs().max() == 0 for t in zero)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quartic_normalisation_is_scale_free(dtype):
    from megatron_dmuon.algorithms.gram_newton_schulz import gram_newton_schulz
    from megatron_dmuon.algorithms.schedules import QUARTIC_WIDE_4

    x = torch.randn(24, 80, generator=torch.Generator().manual_seed(5))
    kw = dict(coefficients=QUARTIC_WIDE_4, steps=4, normalisation="quartic", compute_dtype=dtype)
    base = newton_schulz(x, **kw)
    exact = newton_schulz_reference(x, QUARTIC_WIDE_4, steps=4, normalisation="quartic")
    assert float((base.double() - exact).norm() / exact.norm()) < (1e-5 if dtype == torch.float32 else 0.05)
    for scale in (1e-20, 1e20):
        for fn in (newton_schulz, gram_newton_schulz):
            out = fn(x * scale, **kw)
            assert float((out.double() - exact).norm() / exact.norm()) < (1e-5 if dtype == torch.float32 else 0.05)


def test_unknown_normalisation_is_refused():
    with pytest.raises(ValueError, match="normalisation must be one of frobenius, quartic"):
        newton_schulz(torch.randn(4, 4), normalisation="spectral")
