"""Process-wide counters of the kernels' numerical safety net.

``NONFINITE_METRICS`` counts, over the life of the process:

* ``outputs_checked``   – matrices whose fast-path result was checked for NaN/Inf,
* ``nonfinite_outputs`` – matrices whose fast-path result held NaN/Inf,
* ``fp32_retries``      – matrices recomputed by the float32 torch path because of that,
* ``kernel_fallbacks``  – NS calls that ran the torch path because their cached kernel choice
  failed (does not compile or launch with this GPU/software; warned once per shape).

Read it directly or through ``nonfinite_metrics()``; ``reset_nonfinite_metrics()`` zeroes it.
"""

from __future__ import annotations

from typing import Callable

import torch

NONFINITE_METRICS: dict[str, int] = {"outputs_checked": 0, "nonfinite_outputs": 0, "fp32_retries": 0,
                                     "kernel_fallbacks": 0}


def nonfinite_metrics() -> dict[str, int]:
    """A copy of the counters."""
    return dict(NONFINITE_METRICS)


def reset_nonfinite_metrics() -> None:
    for key in NONFINITE_METRICS:
        NONFINITE_METRICS[key] = 0


def matrices_finite(stack: torch.Tensor) -> torch.Tensor:
    """Per matrix of ``stack`` [B, m, n]: whether it holds no NaN/Inf, from its float32 sum (one
    reduction pass instead of isfinite's four; NaN/Inf anywhere makes the sum non-finite). A
    finite matrix whose sum overflows (entries near 1e38 / (m n)) is reported non-finite: for NS
    outputs (entries of magnitude about 1) that means a diverged result, which deserves the retry."""
    return torch.isfinite(stack.sum(dim=(-2, -1), dtype=torch.float32))


def retry_nonfinite(result: torch.Tensor, inputs, recompute: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Replace every matrix of ``result`` ([..., m, n]) that holds NaN/Inf by ``recompute`` (the
    caller's float32 path) of the matching input matrices, counting both (one host sync).

    ``inputs`` is the input stack (same leading dims as ``result``) or a callable that returns the
    input matrices for a list of flat matrix indices (so a caller need not keep the stack alive)."""
    return retry_nonfinite_stacks([result], [inputs], recompute)[0]


def retry_nonfinite_stacks(results: list, inputs: list, recompute: Callable[[torch.Tensor], torch.Tensor]) -> list:
    """``retry_nonfinite`` of every (result, input) pair with one host sync for all of them (the
    per-matrix finiteness flags of every stack read back together), not one per stack."""
    if not results:
        return results
    flats = [r.reshape(-1, r.size(-2), r.size(-1)) for r in results]
    flags = torch.cat([matrices_finite(f) for f in flats]).tolist()
    out, start = [], 0
    for result, flat, x in zip(results, flats, inputs):
        finite = flags[start:start + flat.size(0)]
        start += flat.size(0)
        out.append(_retry_matrices(result, [i for i, ok in enumerate(finite) if not ok], x, recompute))
    return out


def _retry_matrices(result: torch.Tensor, bad: list, inputs, recompute) -> torch.Tensor:
    flat = result.reshape(-1, result.size(-2), result.size(-1))
    NONFINITE_METRICS["outputs_checked"] += flat.size(0)
    if not bad:
        return result
    NONFINITE_METRICS["nonfinite_outputs"] += len(bad)
    if callable(inputs):
        sub = inputs(bad)
    else:
        sub = inputs.reshape(-1, inputs.size(-2), inputs.size(-1))[torch.tensor(bad, device=inputs.device)]
    fixed = recompute(sub).to(result.dtype)
    NONFINITE_METRICS["fp32_retries"] += len(bad)
    flat = flat.clone()
    flat[torch.tensor(bad, device=result.device)] = fixed
    return flat.reshape(result.shape)
