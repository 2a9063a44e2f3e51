"""What watches a DMuon step: the non-finite gradient check (a skipped step changes nothing) and
the report of the online NS check (runtime/ns_check.py), logged once for all ranks by rank 0."""
from __future__ import annotations

import logging
import math
from typing import List, Optional

import torch

from ..runtime.owner_step import OwnerMuonAdamW

logger = logging.getLogger(__name__)
_warned = False  # the NS check's warning: once per process


@torch.no_grad()
def found_nonfinite(grads: List[torch.Tensor], group) -> bool:
    """Whether any gradient on any rank of ``group`` holds NaN/Inf (the same answer everywhere)."""
    from .gpt import on_gpu

    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu() else torch.device("cpu")
    flag = torch.zeros(1, dtype=torch.float32, device=device)
    by_dtype = {}
    for g in grads:
        if g is not None and g.numel():
            by_dtype.setdefault((g.dtype, g.device), []).append(g)
    for (_, dev), gs in by_dtype.items():
        local = torch.zeros(1, dtype=torch.float32, device=dev)
        # Megatron's own check (multiplying by exactly 1.0 leaves the grads unchanged)
        torch._amp_foreach_non_finite_check_and_unscale_(gs, local, torch.ones(1, device=dev))
        flag += local.to(device)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=group)
    return bool(flag.item() > 0)


def report_ns_check(chained, reported_at: Optional[int] = None) -> Optional[int]:
    """After a step of the online NS check (runtime/ns_check.py): every rank's findings are
    gathered (the same steps on every rank) and rank 0 logs the worst output and the repairs,
    with a warning the first time an output was recomputed. Once per step: ``reported_at`` is the
    step reported last; returns the step reported now (else ``reported_at``)."""
    checks = [o.optimizer.ns_check for o in chained.chained_optimizers
              if isinstance(getattr(o, "optimizer", None), OwnerMuonAdamW)]
    if not checks or not checks[0].due() or reported_at == checks[0].steps:
        return reported_at
    _report_ns_check(chained, checks)
    return checks[0].steps


def _report_ns_check(chained, checks) -> None:
    for o in chained.chained_optimizers:  # --dmuon-overlap-step on: this step's checks run when its groups finish
        if isinstance(getattr(o, "optimizer", None), OwnerMuonAdamW):
            o.optimizer.finish_overlapped()
    found = [c.last for c in checks if c.last]
    local = {"worst": max((f["worst"] for f in found), default=None),
             "checked": sum(f["checked"] for f in found), "recomputed": sum(f["recomputed"] for f in found),
             "recomputed_total": sum(c.recomputed_total for c in checks)}
    if local["worst"] is not None:
        top = max(found, key=lambda f: f["worst"])
        local.update(name=top["worst_name"], limit=top["worst_limit"])
    everyone = [local]
    if torch.distributed.is_initialized():
        everyone = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(everyone, local)
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    ranked = [(r, f) for r, f in enumerate(everyone) if f["worst"] is not None]
    if not ranked:
        return
    rank, top = max(ranked, key=lambda rf: rf[1]["worst"])
    recomputed = sum(f["recomputed"] for f in everyone)
    total = sum(f["recomputed_total"] for f in everyone)
    sigma = math.sqrt(max(top["worst"] + 1.0, 0.0))
    logger.info(f"> DMuon NS check at step {checks[0].steps}: {sum(f['checked'] for f in everyone)} NS outputs; the "
                f"worst has top-eig(O^T O - I) {top['worst']:.4f} (largest singular value {sigma:.4f}; bound "
                f"{top['limit']:.4f}), {top['name']} on rank {rank}; recomputed by the exact fp32 NS: {recomputed} "
                f"({total} in all)")
    global _warned
    if recomputed and not _warned:
        _warned = True
        logger.warning("> WARNING: DMuon's NS check found NS outputs out of bounds and recomputed them exactly; the "
                       "fast NS path is not safe on this run's matrices (checked only every --dmuon-ns-check-interval "
                       "steps): pass --dmuon-ns-method standard, or --muon-fp32-matmul-prec high")
