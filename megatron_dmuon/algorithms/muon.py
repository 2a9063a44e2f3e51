"""Muon update rule as pure functions over tensors (no optimizer object, no process groups).

One step for a matrix ``W`` with gradient ``G`` and momentum ``M`` (torch.optim.Muon's order):

1. ``M <- β M + (1−β) G``                                  (``muon_momentum_``; a lerp)
2. ``U = G + β(M − G)`` if Nesterov, else ``U = M``        (torch: ``grad.lerp(M, β)``)
3. ``O = NS(U)``                                           (``orthogonalize``)
4. ``W <- W (1 − lr·wd)``;  ``W <- W − lr·scale·O``          (``muon_apply_``)

``scale`` comes from ``muon_lr_scale``: ``'spectral'`` = sqrt(max(1, rows/cols)) (Keller;
torch's ``adjust_lr_fn='original'``), ``'match_rms_adamw'`` = 0.2·sqrt(max(rows, cols))
(Moonlight), ``'none'`` = 1. Weight decay is decoupled and uses the *base* lr.

Everything works on a single matrix or on a stack ``[..., rows, cols]`` (rows/cols = last two
dims), so same-shape matrices can be stepped as one batch.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .newton_schulz import orthogonalize

__all__ = [
    "muon_momentum_",
    "muon_lr_scale",
    "muon_apply_",
    "muon_step_",
    "LR_SCALE_MODES",
]

LR_SCALE_MODES: tuple[str, ...] = ("spectral", "match_rms_adamw", "none")
# torch.optim.Muon's name for 'spectral'
_LR_SCALE_ALIASES = {"original": "spectral"}


def muon_momentum_(momentum: Tensor, grad: Tensor, beta: float, nesterov: bool) -> Tensor:
    """Update ``momentum`` in place (``momentum.lerp_(grad, 1−beta)``) and return the update
    direction: ``grad.lerp(momentum, beta)`` (a new tensor) if ``nesterov`` else ``momentum``
    itself (the buffer — do not modify it in place)."""
    if momentum.shape != grad.shape:
        raise ValueError(
            f"momentum shape {tuple(momentum.shape)} != grad shape {tuple(grad.shape)}"
        )
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta (momentum) must be in [0, 1], got {beta!r}")
    momentum.lerp_(grad, 1 - beta)
    return grad.lerp(momentum, beta) if nesterov else momentum


def muon_lr_scale(rows: int, cols: int, mode: str = "spectral", extra: float = 1.0) -> float:
    """Per-matrix multiplier of the lr for the orthogonalized update (times ``extra``).

    Modes: ``'spectral'`` (alias ``'original'``) sqrt(max(1, rows/cols));
    ``'match_rms_adamw'`` 0.2·sqrt(max(rows, cols)); ``'none'`` 1.
    """
    mode = _LR_SCALE_ALIASES.get(mode, mode)
    if mode == "spectral":
        ratio = math.sqrt(max(1, rows / cols))
    elif mode == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    elif mode == "none":
        ratio = 1.0
    else:
        raise ValueError(
            f"unknown Muon lr scale mode {mode!r}; valid: {', '.join(LR_SCALE_MODES)} "
            "('original' is accepted as torch.optim.Muon's name for 'spectral')"
        )
    return ratio * extra


def muon_apply_(param: Tensor, update: Tensor, lr: float, weight_decay: float, scale: float) -> None:
    """``param <- param·(1 − lr·wd) − lr·scale·update`` in torch.optim.Muon's op order."""
    if update.shape != param.shape:
        raise ValueError(
            f"update shape {tuple(update.shape)} != param shape {tuple(param.shape)}"
        )
    param.mul_(1 - lr * weight_decay)
    param.add_(update, alpha=-lr * scale)


def muon_step_(
    param: Tensor,
    grad: Tensor,
    momentum: Tensor,
    *,
    lr: float,
    beta: float = 0.95,
    nesterov: bool = True,
    weight_decay: float = 0.0,
    scale_mode: str = "spectral",
    extra_scale: float = 1.0,
    ns_method: str = "standard",
    **ns_kwargs,
) -> None:
    """One full Muon step, in place on ``param`` and ``momentum``.

    ``param``, ``grad`` and ``momentum`` are one matrix or a stack ``[..., rows, cols]``.
    ``ns_kwargs`` go to ``orthogonalize`` (e.g. ``coefficients``, ``steps``,
    ``compute_dtype``). All input checks run before any tensor is modified; with the
    default ``check_finite=True`` a NaN/Inf gradient raises and leaves the state untouched.
    With ``ns_method='standard'`` and defaults this equals torch.optim.Muon's step
    (``scale_mode='spectral'`` ↔ ``adjust_lr_fn='original'``).
    """
    if param.ndim < 2:
        raise ValueError(
            f"Muon needs a matrix or a stack of matrices; param has shape {tuple(param.shape)} "
            "(use AdamW for vectors/scalars)"
        )
    for name, t in (("grad", grad), ("momentum", momentum)):
        if t.shape != param.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != param shape {tuple(param.shape)}")
    if lr < 0 or weight_decay < 0:
        raise ValueError(f"lr and weight_decay must be >= 0, got lr={lr!r}, weight_decay={weight_decay!r}")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta (momentum) must be in [0, 1], got {beta!r}")
    scale = muon_lr_scale(param.size(-2), param.size(-1), scale_mode, extra_scale)
    if ns_kwargs.get("check_finite", True) and not bool(torch.isfinite(grad).all()):
        raise ValueError(
            f"grad (shape {tuple(grad.shape)}) contains NaN or Inf; Muon step skipped with "
            "param and momentum unchanged"
        )
    update = muon_momentum_(momentum, grad, beta, nesterov)
    ortho = orthogonalize(update, method=ns_method, **ns_kwargs)
    muon_apply_(param, ortho, lr, weight_decay, scale)
