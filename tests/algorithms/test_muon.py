"""Muon and AdamW update rules: parity with torch.optim.Muon / torch.optim.AdamW, batching,
lr scaling, and errors raised before any state changes."""
import math

import pytest
import torch

from megatron_dmuon.algorithms.adamw import adamw_step_
from megatron_dmuon.algorithms.muon import (
    LR_SCALE_MODES,
    muon_apply_,
    muon_lr_scale,
    muon_momentum_,
    muon_step_,
)


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("shape", [(64, 32), (32, 64), (48, 48)])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("adjust_lr_fn", ["original", "match_rms_adamw"])
def test_muon_step_equals_torch_optim_muon_over_10_steps(shape, nesterov, weight_decay, adjust_lr_fn):
    start = _rand(*shape)
    reference = start.clone().requires_grad_(True)
    opt = torch.optim.Muon([reference], lr=0.02, weight_decay=weight_decay, momentum=0.9,
                           nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    param, momentum = start.clone(), torch.zeros(shape)
    for step in range(10):
        grad = _rand(*shape, seed=100 + step)
        reference.grad = grad.clone()
        opt.step()
        muon_step_(param, grad, momentum, lr=0.02, beta=0.9, nesterov=nesterov,
                   weight_decay=weight_decay, scale_mode=adjust_lr_fn)
    assert float((param - reference.detach()).abs().max()) <= 1e-6
    assert float((momentum - opt.state[reference]["momentum_buffer"]).abs().max()) <= 1e-6
    assert float((param - start).abs().max()) > 1e-2  # the steps really moved the parameter


def test_batched_muon_step_equals_per_matrix_steps():
    shape = (3, 40, 24)
    stack, mom = _rand(*shape), torch.zeros(shape)
    singles = [stack[i].clone() for i in range(3)]
    moms = [torch.zeros(shape[1:]) for _ in range(3)]
    for step in range(3):
        grad = _rand(*shape, seed=7 + step)
        muon_step_(stack, grad, mom, lr=0.01, weight_decay=0.05, coefficients="polar_express")
        for i in range(3):
            muon_step_(singles[i], grad[i], moms[i], lr=0.01, weight_decay=0.05, coefficients="polar_express")
    for i in range(3):
        assert float((stack[i] - singles[i]).abs().max()) <= 1e-6


def test_gram_and_standard_muon_steps_agree_in_float64():
    shape = (32, 128)
    p1, p2 = _rand(*shape).double(), _rand(*shape).double()
    m1, m2 = torch.zeros(shape, dtype=torch.float64), torch.zeros(shape, dtype=torch.float64)
    for step in range(3):
        g = _rand(*shape, seed=step).double()
        muon_step_(p1, g, m1, lr=0.02, compute_dtype=torch.float64)
        muon_step_(p2, g, m2, lr=0.02, ns_method="gram", compute_dtype=torch.float64)
    assert float((p1 - p2).abs().max()) <= 1e-12


def test_momentum_rule():
    mom, grad = torch.full((2, 3), 2.0), torch.ones(2, 3)
    update = muon_momentum_(mom, grad, beta=0.75, nesterov=True)
    assert torch.allclose(mom, torch.full((2, 3), 1.75))  # 0.75*2 + 0.25*1
    assert torch.allclose(update, torch.full((2, 3), 1 + 0.75 * 0.75))  # g + β(m − g)
    assert update.data_ptr() != mom.data_ptr()
    assert muon_momentum_(mom, grad, beta=0.75, nesterov=False) is mom


def test_lr_scale_modes():
    assert muon_lr_scale(256, 64) == 2.0  # default: shape_scaling, as torch.optim.Muon's default
    assert muon_lr_scale(64, 256) == 1.0
    assert muon_lr_scale(64, 256, "original") == 1.0
    assert muon_lr_scale(100, 400, "match_rms_adamw") == pytest.approx(0.2 * 20)
    assert muon_lr_scale(100, 400, "none", extra=3.0) == 3.0
    assert muon_lr_scale(256, 64, "shape_scaling", extra=0.5) == 1.0
    # Megatron-core / Emerging-Optimizers get_muon_scale_factor(size_out, size_in, mode), written out:
    # spectral = sqrt(max(out, in)), shape_scaling = sqrt(max(1, out/in)), unit_rms_norm = sqrt(out/in)
    for rows, cols in ((256, 64), (64, 256), (96, 96)):
        assert muon_lr_scale(rows, cols, "spectral") == pytest.approx(max(rows, cols) ** 0.5)
        assert muon_lr_scale(rows, cols, "shape_scaling") == pytest.approx(max(1, rows / cols) ** 0.5)
        assert muon_lr_scale(rows, cols, "unit_rms_norm", extra=2.0) == pytest.approx(2.0 * (rows / cols) ** 0.5)
    assert muon_lr_scale(64, 256, "unit_rms_norm") == 0.5  # below 1 for wide matrices, unlike shape_scaling
    # torch's match_rms_adamw is Megatron's spectral with --muon-extra-scale-factor 0.2
    assert muon_lr_scale(300, 700, "match_rms_adamw") == pytest.approx(muon_lr_scale(300, 700, "spectral", extra=0.2))
    with pytest.raises(ValueError) as e:
        muon_lr_scale(4, 4, "rms")
    assert all(mode in str(e.value) for mode in LR_SCALE_MODES)


def test_apply_is_decoupled_weight_decay_then_scaled_step():
    p = torch.full((2, 2), 10.0)
    muon_apply_(p, torch.ones(2, 2), lr=0.1, weight_decay=0.5, scale=2.0)
    assert torch.allclose(p, torch.full((2, 2), 10.0 * (1 - 0.05) - 0.2))


def test_bad_inputs_leave_state_untouched():
    param, momentum = _rand(8, 6), _rand(8, 6, seed=1)
    p0, m0 = param.clone(), momentum.clone()
    grad = _rand(8, 6, seed=2)
    grad[3, 3] = math.inf
    with pytest.raises(ValueError, match="NaN or Inf"):
        muon_step_(param, grad, momentum, lr=0.1)
    with pytest.raises(ValueError, match="grad shape"):
        muon_step_(param, _rand(6, 8), momentum, lr=0.1)
    with pytest.raises(ValueError, match="unknown Muon lr scale mode"):
        muon_step_(param, _rand(8, 6), momentum, lr=0.1, scale_mode="bogus")
    with pytest.raises(ValueError, match="beta"):
        muon_step_(param, _rand(8, 6), momentum, lr=0.1, beta=1.5)
    assert torch.equal(param, p0) and torch.equal(momentum, m0)
    with pytest.raises(ValueError, match="AdamW"):
        muon_step_(torch.ones(5), torch.ones(5), torch.zeros(5), lr=0.1)


@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.8, 0.95)])
def test_adamw_equals_torch_optim_adamw(weight_decay, betas):
    start = _rand(10, 7)
    reference = start.clone().requires_grad_(True)
    opt = torch.optim.AdamW([reference], lr=1e-2, betas=betas, eps=1e-6, weight_decay=weight_decay,
                            foreach=False)
    param, exp_avg, exp_avg_sq = start.clone(), torch.zeros(10, 7), torch.zeros(10, 7)
    for step in range(1, 11):
        grad = _rand(10, 7, seed=step)
        reference.grad = grad.clone()
        opt.step()
        adamw_step_(param, grad, exp_avg, exp_avg_sq, step, lr=1e-2, beta1=betas[0], beta2=betas[1],
                    eps=1e-6, weight_decay=weight_decay)
    state = opt.state[reference]
    assert torch.equal(param, reference.detach())
    assert torch.equal(exp_avg, state["exp_avg"]) and torch.equal(exp_avg_sq, state["exp_avg_sq"])


def test_adamw_errors():
    p = torch.zeros(3)
    with pytest.raises(ValueError, match="1-based"):
        adamw_step_(p, p.clone(), p.clone(), p.clone(), 0, lr=1e-3)
    with pytest.raises(ValueError, match="exp_avg shape"):
        adamw_step_(p, p.clone(), torch.zeros(4), p.clone(), 1, lr=1e-3)
