"""Triton kernels for the NS input pass: the per-matrix Frobenius norm at every scale
(``scaled_norm_reciprocal``), then scale, cast to the compute dtype and (for tall matrices)
transpose to the wide layout, in one read of the input and one write (``scale_cast``).

torch's ``torch.div(x.mT, norm, out=wide)`` does the same arithmetic but walks the output's
layout and reads the transposed input with a large stride (uncoalesced); here each program
loads a tile along the input's contiguous dim and Triton converts the layout on chip before
the coalesced store.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl

from .triton_symmetric import interpreter_active


@triton.jit
def _scale_cast_kernel(
    X, SCALE, OUT,
    R, C,
    stride_xb, stride_xr, stride_xc,
    stride_ob, stride_or, stride_oc,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    batch = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    x = tl.load(X + batch * stride_xb + rows[:, None] * stride_xr + cols[None, :] * stride_xc, mask=mask, other=0.0)
    scale = tl.load(SCALE + batch)
    y = (x.to(tl.float32) * scale).to(OUT.dtype.element_ty)
    tl.store(OUT + batch * stride_ob + rows[:, None] * stride_or + cols[None, :] * stride_oc, y, mask=mask)


def scale_cast(x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, block: int = 64) -> torch.Tensor:
    """``out[b] = (x[b].float() * scale[b]).to(out.dtype)`` for x, out [B, R, C] of any strides
    (x may be a transposed view); scale is float32 [B]."""
    if x.dim() != 3 or out.shape != x.shape:
        raise ValueError(f"scale_cast: x and out must be [B, R, C] of one shape, got {tuple(x.shape)} and {tuple(out.shape)}")
    if scale.shape != (x.shape[0],) or scale.dtype != torch.float32:
        raise ValueError(f"scale_cast: scale must be float32 of shape ({x.shape[0]},), got {scale.dtype} {tuple(scale.shape)}")
    batch, rows, cols = x.shape
    if x.numel() == 0:
        return out
    if batch > 65535:
        raise ValueError(f"scale_cast: at most 65535 matrices per call, got {batch}")
    block_r = block if x.is_cuda or not interpreter_active() else 16
    grid = (triton.cdiv(rows, block_r), triton.cdiv(cols, block_r), batch)
    _scale_cast_kernel[grid](
        x, scale, out, rows, cols,
        x.stride(0), x.stride(1), x.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        BLOCK_R=block_r, BLOCK_C=block_r,
        num_warps=4,
    )
    return out


@triton.jit
def _norm_partials_kernel(
    X, MAXES, SUMS,
    R, C,
    stride_xb, stride_xr, stride_xc,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # one tile: m = max |x| and s = sum (x / m)^2, so no square over- or underflows
    batch = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    x = tl.load(X + batch * stride_xb + rows[:, None] * stride_xr + cols[None, :] * stride_xc, mask=mask, other=0.0)
    a = tl.abs(x.to(tl.float32))
    m = tl.max(tl.max(a, axis=1), axis=0)
    inv = tl.where(m > 0, 1.0 / m, 0.0)
    s = tl.sum(tl.sum((a * inv) * (a * inv), axis=1), axis=0)
    tile = batch * tl.num_programs(0) * tl.num_programs(1) + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    tl.store(MAXES + tile, m)
    tl.store(SUMS + tile, s)


def scaled_norm_reciprocal(x: torch.Tensor, eps: float, block: int = 128) -> torch.Tensor:
    """``1 / max(‖x[b]‖_F, eps)`` (float32 [B]) of a [B, R, C] stack of any strides, finite at
    every scale of finite entries whose largest magnitude is a normal float32 (1e-30 .. 1e30
    and beyond): one read of x, each tile reducing its max |x| and its sum of squares scaled by
    it (LAPACK's nrm2 idea), the tiles combined in float32. A plain float32 norm overflows for
    entries ~1e20 and loses its squares below ~1e-20."""
    if x.dim() != 3:
        raise ValueError(f"scaled_norm_reciprocal: x must be [B, R, C], got {tuple(x.shape)}")
    batch, rows, cols = x.shape
    if x.numel() == 0:
        return torch.full((batch,), 1.0 / eps, dtype=torch.float32, device=x.device)
    if batch > 65535:
        raise ValueError(f"scaled_norm_reciprocal: at most 65535 matrices per call, got {batch}")
    block_r = block if x.is_cuda or not interpreter_active() else 16
    grid = (triton.cdiv(rows, block_r), triton.cdiv(cols, block_r), batch)
    tiles = grid[0] * grid[1]
    maxes = torch.empty((batch, tiles), dtype=torch.float32, device=x.device)
    sums = torch.empty((batch, tiles), dtype=torch.float32, device=x.device)
    _norm_partials_kernel[grid](
        x, maxes, sums, rows, cols, x.stride(0), x.stride(1), x.stride(2),
        BLOCK_R=block_r, BLOCK_C=block_r, num_warps=4,
    )
    top = maxes.amax(dim=1)
    weight = torch.where(top[:, None] > 0, maxes / top.clamp(min=torch.finfo(torch.float32).tiny)[:, None], 0.0)
    scaled = (sums * weight * weight).sum(dim=1)  # >= 1 where top > 0: sum (x / top)^2
    # a norm >= eps (top >= eps suffices): 1/top/sqrt(scaled), no overflow on the way; else 1/eps
    # (top * sqrt(scaled) cannot overflow there)
    # (clamp, not a tensor made from eps: no host-to-device copy, which a CUDA graph capture forbids)
    below = (top * scaled.sqrt()).clamp(min=eps)
    return torch.where(top >= eps, top.reciprocal() * scaled.rsqrt(), below.reciprocal())


@triton.jit
def _quartic_first_step_kernel(
    R, S, R_SCALE, S_SCALE, N,
    b, c,
    BLOCK: tl.constexpr,
):
    batch = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    r = tl.load(R + batch * N + offs, mask=mask, other=0.0).to(tl.float32) * tl.load(R_SCALE + batch)
    s = tl.load(S + batch * N + offs, mask=mask, other=0.0).to(tl.float32) * tl.load(S_SCALE + batch)
    tl.store(R + batch * N + offs, r.to(R.dtype.element_ty), mask=mask)
    tl.store(S + batch * N + offs, (b * r + c * s).to(S.dtype.element_ty), mask=mask)


def quartic_first_step_(R: torch.Tensor, S: torch.Tensor, r_scale: torch.Tensor, s_scale: torch.Tensor,
                        b: float, c: float, block: int = 2048) -> None:
    """In place, per matrix of the contiguous [B, m, m] stacks: ``R <- R·r_scale``, then
    ``S <- b R + c S·s_scale`` (the first NS step's ``b R + c R²`` after the quartic rescale), in
    one read of each and one write; scales float32 [B]."""
    if R.shape != S.shape or R.dim() != 3 or not (R.is_contiguous() and S.is_contiguous()):
        raise ValueError(f"quartic_first_step_: R and S must be contiguous [B, m, m] of one shape, got "
                         f"{tuple(R.shape)} and {tuple(S.shape)}")
    batch, n = R.shape[0], R.shape[1] * R.shape[2]
    if R.numel() == 0:
        return
    block = block if R.is_cuda or not interpreter_active() else 64
    _quartic_first_step_kernel[(triton.cdiv(n, block), batch)](R, S, r_scale, s_scale, n, float(b), float(c),
                                                              BLOCK=block, num_warps=4)
