"""Muon's element-wise passes fused for CUDA: the momentum step and the apply step.

``algorithms.muon`` writes each as torch ops: the momentum step as ``m.lerp_(g, 1−β)`` then
``g.lerp(m, β)`` (two passes over m and g), the apply step as ``p.mul_(1 − lr·wd)`` then
``p.add_(o, alpha=−lr·scale)`` (two passes over the master weights). Each Triton kernel here
reads every operand once and writes every result once, with torch's CUDA roundings:

* lerp as ATen computes it in float32: ``self + w·(end − self)`` for |w| < 0.5, else
  ``end − (end − self)·(1 − w)``, each product-and-sum one fma (as nvcc contracts them);
* ``p·(1 − lr·wd)`` rounded to p's dtype, then ``fma(−lr·scale, o, ·)`` rounded once; the piece's
  lr multiplier of a split matrix (``muon_direction`` scales the piece first) rounds before.

Off CUDA, without Triton, or for other layouts/dtypes they *are* the torch ops (tested bitwise on
the GPU against them).
"""
from __future__ import annotations

import functools
import importlib.util
from typing import Optional

import torch
from torch import Tensor

from ..algorithms.muon import muon_apply_, muon_momentum_

__all__ = ["muon_apply_fast_", "muon_momentum_fast_"]

BLOCK = 4096


@functools.lru_cache(maxsize=None)
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def lerp(start, end, w, one_minus_w, W_SMALL: tl.constexpr):
        if W_SMALL:
            return tl.fma(end - start, w, start)
        return tl.fma(start - end, one_minus_w, end)

    @triton.jit
    def momentum_kernel(M, G, OUT, N, w1, c1, w2, c2, grad_scale, W1_SMALL: tl.constexpr, W2_SMALL: tl.constexpr,
                        NESTEROV: tl.constexpr, SCALED: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < N
        m = tl.load(M + offs, mask=mask, other=0.0)
        g = tl.load(G + offs, mask=mask, other=0.0)
        if SCALED:  # gradient clipping's grad.mul_(coefficient), rounded on its own (no fma: see launch)
            g = g * grad_scale
        m = lerp(m, g, w1, c1, W1_SMALL)  # momentum.lerp_(grad, 1 - beta)
        tl.store(M + offs, m, mask=mask)
        out = lerp(g, m, w2, c2, W2_SMALL) if NESTEROV else m  # grad.lerp(momentum, beta)
        tl.store(OUT + offs, out, mask=mask)

    @triton.jit
    def apply_kernel(P, O, N, piece_scale, decay, alpha, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < N
        p = tl.load(P + offs, mask=mask, other=0.0)
        o = tl.load(O + offs, mask=mask, other=0.0).to(tl.float32) * piece_scale
        decayed = (p.to(tl.float32) * decay).to(P.dtype.element_ty).to(tl.float32)
        tl.store(P + offs, tl.fma(o, alpha, decayed).to(P.dtype.element_ty), mask=mask)

    return momentum_kernel, apply_kernel, triton.cdiv


def _fusable(*tensors: Tensor) -> bool:
    return (all(t.is_cuda and t.is_contiguous() for t in tensors) and len({t.numel() for t in tensors}) == 1
            and importlib.util.find_spec("triton") is not None)


def _f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def muon_momentum_fast_(momentum: Tensor, grad: Tensor, beta: float, nesterov: bool, out: Optional[Tensor] = None,
                        grad_scale: Optional[float] = None) -> Tensor:
    """``muon_momentum_(momentum, grad, beta, nesterov, out=out)`` in one pass where it can run
    (float32 momentum, grad and out of one size, contiguous, on CUDA). ``grad_scale``: the
    gradient-clipping coefficient, as if ``grad.mul_(grad_scale)`` ran first (the fused pass
    leaves ``grad`` itself unscaled; the torch path scales it in place, as Megatron's clip does)."""
    if not (out is not None and _fusable(momentum, grad, out)
            and momentum.dtype == grad.dtype == out.dtype == torch.float32 and 0.0 <= beta <= 1.0):
        if grad_scale is not None:
            grad.mul_(grad_scale)
        return muon_momentum_(momentum, grad, beta, nesterov, out=out)
    momentum_kernel, _, cdiv = _kernels()
    w1, w2 = _f32(1 - beta), _f32(beta)  # ATen's scalar weights, in float32
    n = momentum.numel()
    with torch.cuda.device(momentum.device):
        # enable_fp_fusion=False: g·scale must round before the lerp (torch scales in a pass of
        # its own); the lerps' fmas are explicit (tl.fma) and stay fused
        momentum_kernel[(cdiv(n, BLOCK),)](
            momentum, grad, out, n, w1, _f32(1.0 - w1), w2, _f32(1.0 - w2),
            _f32(1.0 if grad_scale is None else grad_scale), W1_SMALL=abs(w1) < 0.5, W2_SMALL=abs(w2) < 0.5,
            NESTEROV=bool(nesterov), SCALED=grad_scale is not None, BLOCK=BLOCK, num_warps=8,
            enable_fp_fusion=False)
    return out


def muon_apply_fast_(param: Tensor, update: Tensor, lr: float, weight_decay: float, scale: float,
                     piece_scale: float = 1.0) -> None:
    """``muon_apply_(param, piece_scale·update, lr, weight_decay, scale)`` in one fused pass where
    it can run (``update`` in float32 or narrower)."""
    if not _fusable(param, update):
        if piece_scale != 1.0:
            update = update * piece_scale
        return muon_apply_(param, update, lr, weight_decay, scale)
    _, apply_kernel, cdiv = _kernels()
    n = param.numel()
    with torch.cuda.device(param.device):
        apply_kernel[(cdiv(n, BLOCK),)](param, update, n, float(piece_scale), 1 - lr * weight_decay, -lr * scale,
                                        BLOCK=BLOCK, num_warps=8)
