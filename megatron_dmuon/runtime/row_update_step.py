"""The owner step of the row rules (update rule ``normuon`` or ``dion3``, algorithms/dion3.py).

Called by ``OwnerMuonAdamW._muon_step`` in place of Muon's path: every owned matrix is cut into
its split pieces, the rows each piece selects (all of them for NorMuon, the top ``⌈f·rows⌉`` by
L1 norm for Dion3) are orthogonalized in ONE batched NS call per distinct selected shape (the
owner step's own batching, launch modes and fp32 retry), then normalized per row and applied.
Momentum and the row second moments live on the owner only. Row selection needs whole rows, so
the rules run without tensor parallelism (refused at start-up under TP > 1).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ..algorithms.dion3 import piece_rows, row_direction, select_rows_
from ..algorithms.muon import muon_apply_


@dataclasses.dataclass(frozen=True)
class _NSJob:
    """One piece's NS input as ``OwnerMuonAdamW.orthogonalize_owned`` takes it (already cut)."""

    name: str
    split: Optional[object] = None


def row_update_step(opt, entries) -> None:
    """Select, orthogonalize (batched by shape), normalize and apply on every (param, group,
    info) of ``entries`` (this rank owns them whole)."""
    s = opt.muon
    rows_cache = opt.__dict__.setdefault("_piece_rows", {})
    jobs, pending = [], []
    for p, group, info in entries:
        state = opt.state[p]
        momentum = state.setdefault("momentum_buffer", torch.zeros_like(p)).view(info.shape)
        variance = state.setdefault("row_variance", p.new_zeros(info.shape[0]))
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        key = (info.name, p.device)
        if key not in rows_cache:
            rows_cache[key] = piece_rows(info.split, info.shape[0], p.device)
        selections = select_rows_(momentum, grad.view(info.shape), rows_cache[key], rule=s.update,
                                  beta=s.momentum, nesterov=s.nesterov, fraction=s.fraction)
        jobs += [(_NSJob(f"{info.name}#{i}"), sel.values) for i, sel in enumerate(selections)]
        pending.append((p, group, info, variance, selections))
    outputs = opt.orthogonalize_owned(jobs)
    for p, group, info, variance, selections in pending:
        orthogonalized = [outputs[f"{info.name}#{i}"][0] for i in range(len(selections))]
        direction, scale = row_direction(orthogonalized, selections, variance, shape=info.shape, beta2=s.row_beta2,
                                         scale_mode=s.scale_mode, extra_scale=s.extra_scale, fraction=s.fraction,
                                         fraction_lr=s.fraction_lr, dtype=p.dtype)
        muon_apply_(p, direction, group["lr"], group["weight_decay"], scale)
    opt.stats["ns_matrices"] = len(pending)
    opt.stats["ns_matrices_total"] += len(pending)
    opt.stats["tp_bytes"] = 0
