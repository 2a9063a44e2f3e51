"""NorMuon and Dion3 (= microsoft/dion's NorDion2) as pure functions over tensors.

Both orthogonalize *rows of the momentum as stored* (Megatron weights are ``[fan_out, fan_in]``,
so a row is one output neuron, whatever the aspect ratio) and keep one second moment per row.
One step of a matrix ``W`` (gradient ``G``, momentum ``M``, row second moments ``v``), in three
stages so the owner step can batch the middle one by shape:

1. select (``select_rows_``), per split piece (Q/K/V, head, gate/up: all are row subsets):
   * NorMuon: ``M <- β M + (1−β) G`` (Muon's momentum, ``muon_momentum_``); every row.
   * Dion3: ``M <- M + G``; the ``k = ⌈f·rows⌉`` rows of largest L1 norm; their values are the
     NS input, then those rows of ``M`` decay by ``μ`` (error feedback: what was not applied stays
     in ``M``; the other rows keep accumulating).
2. ``O = NS(selected rows)`` (``orthogonalize``; batched by shape on owners).
3. ``row_direction``: NorMuon normalization of ``O``'s rows (``v <- lerp(v, mean_j O², 1−β2)``,
   ``O / (sqrt(v) + eps)``, rescaled to ``O``'s Frobenius norm), scattered into a zero matrix
   (unselected rows get no update) with Muon's lr scale of the piece's full shape times the
   fraction factor (``fraction_lr_scale``); then ``muon_apply_`` (decoupled weight decay on
   every row).

At ``f = 1`` Dion3 selects every row and its momentum ``U_t = μ U_{t−1} + G_t`` is NorMuon's
non-Nesterov momentum divided by ``1−μ``; NS is scale invariant, so the two updates agree up to
rounding (tested in float64).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

from .muon import muon_lr_scale, muon_momentum_
from .update_rule import UPDATE_RULES, UpdateRule

__all__ = [
    "ROW_UPDATE_RULES",
    "FRACTION_LR_MODES",
    "RowSelection",
    "selected_row_count",
    "fraction_lr_scale",
    "piece_rows",
    "select_rows_",
    "normuon_normalize",
    "row_direction",
]

# the row rules of this module ('muon' is algorithms/muon.py's rule; algorithms/update_rule.py says which is which)
ROW_UPDATE_RULES: tuple[str, ...] = tuple(r for r in UPDATE_RULES if UpdateRule(r).by_rows)
# 'none': Muon's lr scale of the full shape (microsoft/dion's NorDion2); 'inverse_sqrt': times
# 1/sqrt(f), so the update's Frobenius norm matches the full-fraction update's
FractionLR = Literal["none", "inverse_sqrt"]
FRACTION_LR_MODES: tuple[str, ...] = get_args(FractionLR)
NORMALIZE_EPS = 1e-8


@dataclass
class RowSelection:
    """One split piece of one matrix: the matrix rows it feeds to NS (``rows``, int64
    ``[..., k]``, ascending; a per-head piece has a leading head dim), the NS input
    (``values`` ``[..., k, cols]``, a copy) and the piece's full shape (lr scale)."""

    rows: Tensor
    values: Tensor
    piece_shape: tuple


def selected_row_count(rows: int, fraction: float) -> int:
    """``⌈f·rows⌉`` (at least 1) rows of a ``rows``-row piece are orthogonalized per step."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"Dion3 fraction must be in (0, 1], got {fraction!r}")
    return min(rows, max(1, math.ceil(fraction * rows)))


def fraction_lr_scale(fraction: float, mode: str = "none") -> float:
    if mode == "none":
        return 1.0
    if mode == "inverse_sqrt":
        return 1.0 / math.sqrt(fraction)
    raise ValueError(f"unknown fraction lr mode {mode!r}; valid: {', '.join(FRACTION_LR_MODES)}")


def piece_rows(split, rows: int, device=None) -> list[Tensor]:
    """Matrix row indices of every split piece (``[r]``, or ``[heads, hd]`` for a per-head
    stack), in ``split.pieces`` order: the split rules only regroup rows, so cutting an index
    column with them says which rows each piece holds."""
    index = torch.arange(rows, device=device).view(rows, 1)
    pieces = split.pieces(index) if split is not None and split.kind != "none" else [index]
    return [p[..., 0] for p in pieces]


def _gather_rows(matrix: Tensor, rows: Tensor) -> Tensor:
    """``matrix[rows]`` for an index of any leading shape: ``[..., k]`` -> ``[..., k, cols]``."""
    return matrix.index_select(0, rows.reshape(-1)).view(*rows.shape, matrix.size(-1))


def select_rows_(momentum: Tensor, grad: Tensor, pieces: Sequence[Tensor], *, rule: str, beta: float,
                 nesterov: bool = False, fraction: float = 1.0) -> list[RowSelection]:
    """Stage 1 on one matrix (in place on ``momentum``): the NS inputs of every piece.

    ``pieces`` from ``piece_rows``. NorMuon: Muon's momentum (Nesterov optional), every row.
    Dion3: accumulate, per piece the top ``⌈f·rows⌉`` rows by L1 norm (ascending order), those
    rows of ``momentum`` then decay by ``beta`` (the error feedback)."""
    if momentum.shape != grad.shape or momentum.dim() != 2:
        raise ValueError(f"momentum {tuple(momentum.shape)} and grad {tuple(grad.shape)} must be one matrix")
    cols = momentum.size(-1)
    if rule not in ROW_UPDATE_RULES:
        raise ValueError(f"unknown row update rule {rule!r}; valid: {', '.join(ROW_UPDATE_RULES)}")
    if not UpdateRule(rule).selects_fraction:  # NorMuon: every row
        update = muon_momentum_(momentum, grad, beta, nesterov)
        return [RowSelection(r, _gather_rows(update, r), (*r.shape, cols)) for r in pieces]
    if nesterov:
        raise ValueError("Dion3 has no Nesterov form (its momentum is M + G with error feedback)")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta (error-feedback decay) must be in [0, 1], got {beta!r}")
    momentum.add_(grad)
    out = []
    for r in pieces:
        norms = _gather_rows(momentum, r).abs().sum(-1)
        k = selected_row_count(r.size(-1), fraction)
        top = torch.topk(norms, k, dim=-1, sorted=False).indices.sort(dim=-1).values
        rows = r.gather(-1, top)
        out.append(RowSelection(rows, _gather_rows(momentum, rows), (*r.shape, cols)))
    chosen = torch.cat([s.rows.reshape(-1) for s in out])
    momentum.index_copy_(0, chosen, momentum.index_select(0, chosen) * beta)
    return out


def normuon_normalize(ortho: Tensor, variance: Tensor, beta2: float, eps: float = NORMALIZE_EPS
                      ) -> tuple[Tensor, Tensor]:
    """NorMuon's row normalization of ``ortho`` ``[..., k, n]`` with row second moments
    ``variance`` ``[..., k]``: returns (normalized, new variance). Computed in ``variance``'s
    dtype; each matrix of a stack keeps its own Frobenius norm."""
    o = ortho.to(variance.dtype)
    norm = o.norm(dim=(-2, -1), keepdim=True)
    new_variance = variance.lerp(o.square().mean(-1), 1 - beta2)
    normalized = o / (new_variance.sqrt() + eps).unsqueeze(-1)
    return normalized * (norm / normalized.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)), new_variance


def row_direction(orthogonalized: Sequence[Tensor], selections: Sequence[RowSelection], variance: Tensor, *,
                  shape: Sequence[int], beta2: float, scale_mode: str = "shape_scaling", extra_scale: float = 1.0,
                  fraction: float = 1.0, fraction_lr: str = "none", dtype=None) -> tuple[Tensor, float]:
    """Stage 3 on one matrix: ``(direction, 1.0)`` for ``muon_apply_`` (the lr scale of each
    piece is inside the direction); updates ``variance`` ``[rows]`` in place on the selected rows."""
    if len(orthogonalized) != len(selections):
        raise ValueError(f"{len(orthogonalized)} NS outputs for {len(selections)} pieces")
    extra = extra_scale * fraction_lr_scale(fraction, fraction_lr)
    direction = torch.zeros(tuple(shape), dtype=variance.dtype, device=variance.device)
    for o, sel in zip(orthogonalized, selections):
        flat = sel.rows.reshape(-1)
        normalized, new_v = normuon_normalize(o, variance.index_select(0, flat).view(sel.rows.shape), beta2)
        variance.index_copy_(0, flat, new_v.reshape(-1))
        scale = muon_lr_scale(sel.piece_shape[-2], sel.piece_shape[-1], scale_mode, extra)
        direction.index_copy_(0, flat, (normalized * scale).reshape(-1, direction.size(-1)))
    return (direction if dtype is None else direction.to(dtype)), 1.0
