"""Triton kernel for batched products whose result is symmetric.

Every m×m product in Gram Newton–Schulz is symmetric: X·Xᵀ, and the products of R, Q and Z',
which are all polynomials in the same Gram matrix and therefore commute. One kernel covers
them all:

    OUT[b] = alpha · A[b] @ B[b] + beta · C[b] + diag · I        (OUT[b] symmetric)

Only output tiles that hold at least one element on or above the diagonal are computed
(about half of the FLOPs of a full product). Each computed tile writes its upper-triangle
elements in place and their mirror images below the diagonal, so every element is written
exactly once and the result is bit-for-bit symmetric and deterministic.

Operands may be fp16 or bf16 (fp32 accumulation, the epilogue in fp32), strided in any way
(a SYRK passes B = Xᵀ as a transposed view, no copy), and batched over one leading dim.
This module needs Triton; the dispatch and torch fallbacks live in ``symmetric_ops``.
"""

from __future__ import annotations

import dataclasses
import os

import torch

import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Tile shape and launch parameters of the symmetric-output kernel."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    group: int = 8  # tile rows that share a column sweep, for L2 reuse

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "KernelConfig":
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - fields
        if unknown:
            raise ValueError(f"KernelConfig: unknown keys {sorted(unknown)}; valid keys: {sorted(fields)}")
        return cls(**{k: int(v) for k, v in data.items()})

    def validate(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"KernelConfig.{name} must be a power of two >= 16, got {value}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"KernelConfig.num_warps must be one of 1,2,4,8,16, got {self.num_warps}")
        if self.num_stages < 1 or self.group < 1:
            raise ValueError(f"KernelConfig: num_stages and group must be >= 1, got {self}")


def interpreter_active() -> bool:
    """True when Triton kernels run through its CPU interpreter (TRITON_INTERPRET=1)."""
    try:
        from triton import knobs  # triton >= 3.3

        return bool(knobs.runtime.interpret)
    except (ImportError, AttributeError):  # older triton reads the variable directly
        return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _sym_mm_kernel(
    A, B, C, OUT, TILES,
    M, K,
    stride_ab, stride_am, stride_ak,
    stride_bb, stride_bk, stride_bn,
    stride_cb, stride_cm, stride_cn,
    stride_ob, stride_om, stride_on,
    alpha, beta, diag,
    HAS_C: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_M: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    tile_row = tl.load(TILES + 2 * tile)
    tile_col = tl.load(TILES + 2 * tile + 1)

    rows = tile_row * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_col * BLOCK_N + tl.arange(0, BLOCK_N)
    if EVEN_M:
        # Plain aranges keep the compiler's contiguity facts: vectorized loads along either dim.
        rows_in = rows
        cols_in = cols
    else:
        # Rows/cols past M read a valid row (their results are never stored): no masks in the loop.
        rows_in = tl.where(rows < M, rows, 0)
        cols_in = tl.where(cols < M, cols, 0)
    ks = tl.arange(0, BLOCK_K)

    a_ptrs = A + batch * stride_ab + rows_in[:, None] * stride_am + ks[None, :] * stride_ak
    b_ptrs = B + batch * stride_bb + ks[:, None] * stride_bk + cols_in[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            a = tl.load(a_ptrs, mask=(ks[None, :] + k0) < K, other=0.0)
            b = tl.load(b_ptrs, mask=(ks[:, None] + k0) < K, other=0.0)
        if UPCAST_DOT:  # Triton's CPU interpreter mis-computes bf16 dots; products are exact in fp32
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    result = alpha * acc
    if HAS_C:
        c_ptrs = C + batch * stride_cb + rows[:, None] * stride_cm + cols[None, :] * stride_cn
        if EVEN_M:
            result += beta * tl.load(c_ptrs).to(tl.float32)
        else:
            c_mask = (rows[:, None] < M) & (cols[None, :] < M)
            result += beta * tl.load(c_ptrs, mask=c_mask, other=0.0).to(tl.float32)
    result += tl.where(rows[:, None] == cols[None, :], diag, 0.0)
    out = result.to(OUT.dtype.element_ty)
    # The mirror image (c, r) of element (r, c) is stored from the transposed tile, so both
    # stores run along the output's contiguous dim.
    out_t = tl.trans(out)
    out_base = OUT + batch * stride_ob
    direct_ptrs = out_base + rows[:, None] * stride_om + cols[None, :] * stride_on
    mirror_ptrs = out_base + cols[:, None] * stride_om + rows[None, :] * stride_on
    # A tile whose last row is <= its first column has no element below the diagonal.
    above_diagonal = tile_row * BLOCK_M + BLOCK_M - 1 <= tile_col * BLOCK_N
    if EVEN_M and above_diagonal:
        tl.store(direct_ptrs, out)
        tl.store(mirror_ptrs, out_t)
    else:
        inside = (rows[:, None] < M) & (cols[None, :] < M)
        tl.store(direct_ptrs, out, mask=inside & (rows[:, None] <= cols[None, :]))
        inside_t = (cols[:, None] < M) & (rows[None, :] < M)
        tl.store(mirror_ptrs, out_t, mask=inside_t & (rows[None, :] < cols[:, None]))


def upper_tile_list(m: int, block_m: int, block_n: int, group: int) -> list[tuple[int, int]]:
    """Output tiles holding at least one element with row <= col, in L2-friendly order.

    Tile rows are taken ``group`` at a time; within a group the sweep goes column by
    column, so the A rows of the group stay in L2 while B columns stream past.
    """
    tile_rows = triton.cdiv(m, block_m)
    tile_cols = triton.cdiv(m, block_n)
    tiles = []
    for first in range(0, tile_rows, group):
        for j in range(tile_cols):
            for i in range(first, min(first + group, tile_rows)):
                if i * block_m <= (j + 1) * block_n - 1:
                    tiles.append((i, j))
    return tiles


_TILE_TENSORS: dict = {}


def _tile_tensor(m: int, config: KernelConfig, device: torch.device) -> torch.Tensor:
    key = (m, config.block_m, config.block_n, config.group, str(device))
    tiles = _TILE_TENSORS.get(key)
    if tiles is None:
        pairs = upper_tile_list(m, config.block_m, config.block_n, config.group)
        tiles = torch.tensor(pairs, dtype=torch.int32).reshape(-1).to(device)
        _TILE_TENSORS[key] = tiles
    return tiles


def _as_batched(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 3 else t.unsqueeze(0)


def sym_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    out: torch.Tensor,
    c: torch.Tensor | None = None,
    alpha: float = 1.0,
    beta: float = 0.0,
    diag: float = 0.0,
    config: KernelConfig = KernelConfig(),
) -> torch.Tensor:
    """``out = alpha·a@b + beta·c + diag·I`` for products known to be symmetric.

    Args:
        a: [B, M, K] or [M, K]; b: [B, K, M] or [K, M] (any strides; pass ``x.mT`` for X·Xᵀ).
        out: [B, M, M] or [M, M] of the operands' dtype; must not share memory with a, b or c.
        c: optional [B, M, M] addend (read on and above the diagonal only).
        alpha, beta, diag: scalars of the epilogue, applied in fp32.
        config: tile shape and launch parameters.
    The caller guarantees the exact product is symmetric; the lower triangle of the result is
    the mirror of the computed upper triangle.
    """
    a3, b3, out3 = _as_batched(a), _as_batched(b), _as_batched(out)
    batch, m, k = a3.shape
    if b3.shape != (batch, k, m):
        raise ValueError(f"sym_matmul: b must have shape {(batch, k, m)} to match a {tuple(a3.shape)}, got {tuple(b3.shape)}")
    if out3.shape != (batch, m, m):
        raise ValueError(f"sym_matmul: out must have shape {(batch, m, m)}, got {tuple(out3.shape)}")
    if a.dtype not in SUPPORTED_DTYPES or b.dtype != a.dtype or out.dtype != a.dtype:
        raise ValueError(
            f"sym_matmul: a, b and out must share one dtype of {SUPPORTED_DTYPES}; got "
            f"{a.dtype}, {b.dtype}, {out.dtype} (use the torch fallback for float32)"
        )
    for name, t in (("a", a), ("b", b), ("c", c)):
        if t is not None and t.data_ptr() == out.data_ptr():
            raise ValueError(f"sym_matmul: out must not alias {name}; pass a separate buffer")
    if c is not None:
        c3 = _as_batched(c)
        if c3.shape != (batch, m, m):
            raise ValueError(f"sym_matmul: c must have shape {(batch, m, m)}, got {tuple(c3.shape)}")
    else:
        c3 = out3  # never read (HAS_C is False); any valid pointer
    config.validate()
    if m == 0 or batch == 0:
        return out
    tiles = _tile_tensor(m, config, a.device)
    grid = (tiles.numel() // 2, batch)
    _sym_mm_kernel[grid](
        a3, b3, c3, out3, tiles,
        m, k,
        a3.stride(0), a3.stride(1), a3.stride(2),
        b3.stride(0), b3.stride(1), b3.stride(2),
        c3.stride(0), c3.stride(1), c3.stride(2),
        out3.stride(0), out3.stride(1), out3.stride(2),
        float(alpha), float(beta), float(diag),
        HAS_C=c is not None,
        EVEN_K=(k % config.block_k == 0),
        EVEN_M=(m % config.block_m == 0 and m % config.block_n == 0),
        UPCAST_DOT=(a.dtype == torch.bfloat16 and interpreter_active()),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out
