"""Running NS on a stack as the owner step does: the kernels on CUDA, the torch path elsewhere
(``run_ns``), with a stack's own ``NSChoice``; the float32 retry and the settings' default
orthogonalizer for NS outside an owner step."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..algorithms.ns_dispatch import orthogonalize
from ..kernels import orthogonalize_batched
from ..planning.ns_choice import NSChoice, torch_path_method
from .muon_settings import MuonSettings

__all__ = ["run_ns", "fp32_orthogonalizer", "default_orthogonalizer"]


def fp32_orthogonalizer(settings: MuonSettings, method: Optional[str] = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """The float32 torch path of the same NS schedule: with the settings' method (the retry for
    non-finite outputs), or ``method`` ('standard': the online check's exact repair)."""
    method = method or torch_path_method(settings.ns_method)

    def orth(stack: torch.Tensor) -> torch.Tensor:
        kw = settings.ns_schedule(stack.size(-2), stack.size(-1))
        return orthogonalize(stack.float(), method=method, compute_dtype=torch.float32, check_finite=False, **kw)

    return orth


def default_orthogonalizer(settings: MuonSettings) -> Callable[[torch.Tensor], torch.Tensor]:
    """The NS of any [B, m, n] stack under ``settings`` (their ``NSResolver`` on the stack's
    device), run by ``run_ns``: for timing and checking NS outside an owner step."""

    def orth(stack: torch.Tensor) -> torch.Tensor:
        batch = stack.numel() // max(stack.size(-2) * stack.size(-1), 1)
        return run_ns(stack, settings.ns_resolver(stack.device).choice(stack.size(-2), stack.size(-1), batch))

    return orth


def run_ns(stack: torch.Tensor, choice: NSChoice) -> torch.Tensor:
    """Batched NS over a [B, m, n] stack as ``choice`` says: the kernels' fast path on CUDA, else
    the torch path (which returns the input's dtype, as the reference does)."""
    kw = choice.kwargs()
    if stack.is_cuda:
        return orthogonalize_batched(stack, method=choice.method, **kw)
    kw.pop("out_dtype")
    return orthogonalize(stack, method=choice.method, check_finite=False, **kw)
