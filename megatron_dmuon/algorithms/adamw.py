"""AdamW as a pure in-place function (for the non-matrix parameters of a Muon model).

Same arithmetic, in the same order, as torch.optim.AdamW's single-tensor path (torch 2.13,
``amsgrad=False``, ``maximize=False``):

    W <- W (1 − lr·wd)
    m <- lerp(m, g, 1 − β1)
    v <- β2 v + (1 − β2) g²
    W <- W − (lr / (1 − β1^t)) · m / (sqrt(v) / sqrt(1 − β2^t) + eps)
"""

from __future__ import annotations

from torch import Tensor

__all__ = ["adamw_step_"]


def adamw_step_(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    step: int,
    *,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> None:
    """One AdamW update of ``param``, ``exp_avg``, ``exp_avg_sq`` in place.

    Args:
        step: the 1-based number of this update (torch's ``state['step']`` after its
            increment), used for bias correction. The caller keeps the counter.
    """
    for name, t in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.shape != param.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != param shape {tuple(param.shape)}")
    if isinstance(step, bool) or int(step) != step or step < 1:
        raise ValueError(f"step must be the 1-based update count (int >= 1), got {step!r}")
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        raise ValueError(f"beta1 and beta2 must be in [0, 1), got {beta1!r}, {beta2!r}")
    if lr < 0 or eps < 0 or weight_decay < 0:
        raise ValueError(
            f"lr, eps and weight_decay must be >= 0, got {lr!r}, {eps!r}, {weight_decay!r}"
        )
    step = float(step)  # torch reads its float32 step tensor with .item()
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
