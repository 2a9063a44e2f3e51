"""Per-tensor FP8 quantization of a weight for publishing (pure tensor math, torch's float8 dtypes).

The owner of a matrix quantizes its fp32 master with one scale from the amax of the whole tensor
(Transformer Engine's delayed-free "current scaling": scale = fp8_max / amax). What travels is the
FP8 bytes plus ``scale_inv = 1 / scale`` (float32); every rank, the owner included, decodes
``q.float() * scale_inv`` into the model's dtype, so the forward sees exactly the owner's quantized
values everywhere and no rank ever computes an amax of its own.
"""
from __future__ import annotations

from typing import Tuple

import torch

# the FP8 publish dtypes' names (DMuonConfig.publish_dtype) -> torch dtypes (e4m3: more mantissa, TE's weight format; e5m2: range)
FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def fp8_dtype(name: str) -> torch.dtype:
    if name not in FP8_DTYPES:
        raise ValueError(f"FP8 format {name!r} unknown; valid: {', '.join(FP8_DTYPES)}")
    return FP8_DTYPES[name]


@torch.no_grad()
def quantize_per_tensor(master: torch.Tensor, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale_inv)``: ``q`` = master·scale cast (saturating) to ``dtype``, one float32
    ``scale_inv`` (0-dim) for the whole tensor. An all-zero (or empty) tensor gets scale 1; a
    non-finite amax propagates NaN into ``scale_inv`` so the forward shows it instead of hiding it."""
    fmax = torch.finfo(dtype).max
    x = master.float()
    amax = x.abs().amax() if x.numel() else torch.zeros((), device=x.device)
    scale = torch.where(amax > 0, fmax / amax, torch.ones_like(amax))
    # the cast of an out-of-range value is NaN on CUDA (saturating on CPU): clamp first
    q = (x * scale).clamp_(-fmax, fmax).to(dtype)
    return q, (1.0 / scale).float().reshape(())


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values every rank's forward uses: ``q·scale_inv`` in float32, then the model's dtype."""
    return (q.float() * scale_inv.float()).to(dtype)
