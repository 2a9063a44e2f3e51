"""Muon update rule as pure functions over tensors (no optimizer object, no process groups).

One step for a matrix ``W`` with gradient ``G`` and momentum ``M`` (torch.optim.Muon's order):

1. ``M <- β M + (1−β) G``                                  (``muon_momentum_``; a lerp)
2. ``U = G + β(M − G)`` if Nesterov, else ``U = M``        (torch: ``grad.lerp(M, β)``)
3. ``O = NS(U)``                                           (``orthogonalize``)
4. ``D, scale = muon_direction(O)``                         (lr scale; split pieces reassembled)
5. ``W <- W (1 − lr·wd)``;  ``W <- W − lr·scale·D``          (``muon_apply_``)

These functions are THE rule: ``muon_step_`` (checked bitwise against torch.optim.Muon), the
distributed owner step and the single-process reference all call them, and only the NS call in
between differs (batched by shape on owners, one matrix at a time in the reference).

``scale`` comes from ``muon_lr_scale``, whose mode names are Megatron-core's / Emerging-Optimizers'
(Megatron-LM's ``muon_scale_mode``) where they exist: ``'spectral'`` = sqrt(max(rows, cols)),
``'shape_scaling'`` = sqrt(max(1, rows/cols)) (Keller; torch's ``adjust_lr_fn='original'``),
``'unit_rms_norm'`` = sqrt(rows/cols); plus torch's ``'match_rms_adamw'`` = 0.2·sqrt(max(rows,
cols)) (Moonlight) and ``'none'`` = 1. Weight decay is decoupled and uses the *base* lr.

Everything works on a single matrix or on a stack ``[..., rows, cols]`` (rows/cols = last two
dims), so same-shape matrices can be stepped as one batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, get_args

import torch
from torch import Tensor

from .ns_dispatch import orthogonalize

__all__ = [
    "muon_momentum_",
    "muon_lr_scale",
    "muon_apply_",
    "muon_direction",
    "muon_direction_scale",
    "muon_step_",
    "LR_SCALE_MODES",
]

# The first three are Megatron's muon_scale_mode choices with Megatron's meaning (rows = fan-out).
LRScaleMode = Literal["spectral", "shape_scaling", "unit_rms_norm", "match_rms_adamw", "none"]
LR_SCALE_MODES: tuple[str, ...] = get_args(LRScaleMode)
# the dtypes the Muon momentum may be kept in, by name (bf16 halves the Muon state; the update runs in fp32)
MOMENTUM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# torch.optim.Muon's name for 'shape_scaling'
_LR_SCALE_ALIASES = {"original": "shape_scaling"}


def muon_momentum_(momentum: Tensor, grad: Tensor, beta: float, nesterov: bool, out: Tensor | None = None) -> Tensor:
    """Update ``momentum`` in place (``momentum.lerp_(grad, 1−beta)``) and return the update
    direction: ``grad.lerp(momentum, beta)`` (a new tensor) if ``nesterov`` else ``momentum``
    itself (the buffer — do not modify it in place). With ``out`` (grad's shape) the direction is
    written there instead (the same values) and ``out`` returned."""
    if momentum.shape != grad.shape:
        raise ValueError(
            f"momentum shape {tuple(momentum.shape)} != grad shape {tuple(grad.shape)}"
        )
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta (momentum) must be in [0, 1], got {beta!r}")
    momentum.lerp_(grad, 1 - beta)
    if out is None:
        return grad.lerp(momentum, beta) if nesterov else momentum
    return torch.lerp(grad, momentum, beta, out=out) if nesterov else out.copy_(momentum)


def muon_lr_scale(rows: int, cols: int, mode: str = "shape_scaling", extra: float = 1.0) -> float:
    """Per-matrix multiplier of the lr for the orthogonalized update (times ``extra``).

    Modes: ``'spectral'`` sqrt(max(rows, cols)); ``'shape_scaling'`` (alias ``'original'``)
    sqrt(max(1, rows/cols)); ``'unit_rms_norm'`` sqrt(rows/cols); ``'match_rms_adamw'``
    0.2·sqrt(max(rows, cols)); ``'none'`` 1.
    """
    mode = _LR_SCALE_ALIASES.get(mode, mode)
    if mode == "spectral":
        ratio = math.sqrt(max(rows, cols))
    elif mode == "shape_scaling":
        ratio = math.sqrt(max(1, rows / cols))
    elif mode == "unit_rms_norm":
        ratio = math.sqrt(rows / cols)
    elif mode == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    elif mode == "none":
        ratio = 1.0
    else:
        raise ValueError(
            f"unknown Muon lr scale mode {mode!r}; valid: {', '.join(LR_SCALE_MODES)} "
            "('original' is accepted as torch.optim.Muon's name for 'shape_scaling')"
        )
    return ratio * extra


def muon_direction_scale(split, shape: Sequence[int], scale_mode: str = "shape_scaling",
                         extra_scale: float = 1.0) -> float:
    """The lr multiplier ``muon_direction`` returns, from the shape alone (ranks that only
    receive a direction, e.g. the other TP ranks of a matrix, need it too)."""
    if split is None or split.kind == "none":
        return muon_lr_scale(int(shape[-2]), int(shape[-1]), scale_mode, extra_scale)
    return 1.0


def muon_direction(
    orthogonalized: Sequence[Tensor],
    split=None,
    *,
    shape: Sequence[int],
    scale_mode: str = "shape_scaling",
    extra_scale: float = 1.0,
    dtype: torch.dtype | None = None,
) -> tuple[Tensor, float]:
    """The step direction of one matrix of ``shape`` and the lr multiplier that goes with it.

    ``orthogonalized`` holds the NS outputs in the order of ``split.pieces`` (one entry, the
    whole matrix, when ``split`` is None or kind 'none'); each is cast to ``dtype`` first.
    Whole matrix: ``(O, muon_lr_scale(shape))``, so the lr multiplies once, as torch does.
    Split (QKV / heads / GLU): every piece is its own matrix with its own lr scale
    (per head for stacks), reassembled: ``(assemble(scale_i · O_i), 1.0)``.
    """
    cast = [o if dtype is None else o.to(dtype) for o in orthogonalized]
    scale = muon_direction_scale(split, shape, scale_mode, extra_scale)
    if split is None or split.kind == "none":
        if len(cast) != 1:
            raise ValueError(f"a whole-matrix direction takes one NS output, got {len(cast)}")
        return cast[0], scale
    scaled = [o * muon_lr_scale(o.size(-2), o.size(-1), scale_mode, extra_scale) for o in cast]
    like = torch.empty(tuple(shape), device="meta")
    return split.assemble(scaled, like=like), 1.0


def muon_apply_(param: Tensor, update: Tensor, lr: float, weight_decay: float, scale: float) -> None:
    """``param <- param·(1 − lr·wd) − lr·scale·update`` in torch.optim.Muon's op order.

    ``update`` may be any view-compatible shape of ``param`` (e.g. the [rows, cols] view of a
    flat shard); it is added through ``param``'s shape."""
    if update.numel() != param.numel():
        raise ValueError(
            f"update shape {tuple(update.shape)} does not fit param shape {tuple(param.shape)}"
        )
    param.mul_(1 - lr * weight_decay)
    param.add_(update.reshape(param.shape), alpha=-lr * scale)


def muon_step_(
    param: Tensor,
    grad: Tensor,
    momentum: Tensor,
    *,
    lr: float,
    beta: float = 0.95,
    nesterov: bool = True,
    weight_decay: float = 0.0,
    scale_mode: str = "shape_scaling",
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
    (``scale_mode='shape_scaling'`` ↔ ``adjust_lr_fn='original'``).
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
    muon_lr_scale(param.size(-2), param.size(-1), scale_mode, extra_scale)  # validates the mode
    if ns_kwargs.get("check_finite", True) and not bool(torch.isfinite(grad).all()):
        raise ValueError(
            f"grad (shape {tuple(grad.shape)}) contains NaN or Inf; Muon step skipped with "
            "param and momentum unchanged"
        )
    update = muon_momentum_(momentum, grad, beta, nesterov)
    ortho = orthogonalize(update, method=ns_method, **ns_kwargs)
    direction, scale = muon_direction([ortho], shape=param.shape, scale_mode=scale_mode, extra_scale=extra_scale)
    muon_apply_(param, direction, lr, weight_decay, scale)
